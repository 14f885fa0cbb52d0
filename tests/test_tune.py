"""dcmdp tune: the selection rule on hand-made records, and a real sweep against a real MLflow server.

The sweep runs two tolerances of one abs_prob_diff constraint on tiny-dense with int8 rollouts, whose
discrepancy is ~1e-6..1e-5 per step: c = 1e-9 is violated on every step (never eligible), c = 1e-2 is
never violated. A third grid value, c = -1, is an invalid config: a failed trial that must not stop
the sweep.
"""

import csv
import json
import math
import os
from pathlib import Path

import pytest
import yaml

from dcmdp.config import ConfigError, load_config
from dcmdp.tune import (RefineSpec, SelectRule, Trial, apply_settings, assess, grid, load_tune_config, refine,
                        run_tune_file, select)

# --------------------------------------------------------------------------------------------------
# The rule on hand-made records.


def _trial(name, acc, inside=1.0, collapsed=False, status="ok", mean_d=1e-3):
    return Trial(name, {"x": name}, status=status, accuracy_before=0.1, accuracy_after=acc, inside_frac=inside,
                 collapsed=collapsed, mean_discrepancy={"abs_prob_diff": mean_d})


def test_collapsed_run_with_the_best_accuracy_is_rejected():
    trials = [_trial("a", 0.40), _trial("b", 0.90, collapsed=True), _trial("c", 0.55), _trial("d", 0.95, inside=0.89),
              _trial("e", math.nan, status="failed")]
    best = select(trials, SelectRule(min_inside_frac=0.9))
    assert best is trials[2]
    assert [t.eligible for t in trials] == [True, False, True, False, False]
    assert [t.selected for t in trials] == [False, False, True, False, False]


def test_min_inside_frac_is_inclusive_and_configurable():
    trials = [_trial("a", 0.5, inside=0.9), _trial("b", 0.6, inside=0.7)]
    assert select(trials, SelectRule(min_inside_frac=0.9)) is trials[0]
    assert select(trials, SelectRule(min_inside_frac=0.7)) is trials[1]
    assert select(trials, SelectRule(min_inside_frac=0.95)) is None
    assert not any(t.selected for t in trials)


def test_ties_go_to_larger_inside_share_then_smaller_discrepancy_then_earlier_trial():
    trials = [_trial("a", 0.5, inside=0.92), _trial("b", 0.5, inside=0.97)]
    assert select(trials, SelectRule()) is trials[1]
    trials = [_trial("a", 0.5, mean_d=2e-3), _trial("b", 0.5, mean_d=1e-3), _trial("c", 0.5, mean_d=1e-3)]
    assert select(trials, SelectRule()) is trials[1]


def test_assess_inside_share_after_warmup_and_collapse_window():
    # 6 steps; c = 0.01. D-hat per step: steps 1-2 (warm-up) outside, then in, out, in, in -> 3/4 inside.
    history = {"dual/measured/m": [0.5, 0.5, 0.005, 0.02, 0.01, 0.0],
               "dual/tolerance/m": [0.01] * 6,
               "dual/lambda/m": [0.1, 0.2, 0.3, 0.25, 0.2, 0.15],
               # 3-step means: 0.4, 0.6, 0.5, 0.3 -> peak 0.6, last 0.3 = 0.5 x peak: not below half, no collapse
               "reward/accuracy": [0.2, 0.4, 0.6, 0.8, 0.1, 0.0],
               "loss/total": [1.0] * 6}
    t = assess(Trial("t", {}), history, ["m"], SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.5))
    assert t.inside_frac == pytest.approx(3 / 4, abs=1e-12)
    assert t.mean_discrepancy["m"] == pytest.approx((0.5 + 0.5 + 0.005 + 0.02 + 0.01) / 6, abs=1e-12)
    assert t.final_lambda == {"m": 0.15}
    assert (t.peak_window_mean, t.final_window_mean) == (pytest.approx(0.6), pytest.approx(0.3))
    assert not t.collapsed
    t = assess(Trial("t", {}), history, ["m"], SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.51))
    assert t.collapsed
    # A non-finite loss is a collapse whatever the accuracy; a NaN D-hat counts as outside.
    nan_hist = dict(history, **{"loss/total": [1.0, math.nan, 1.0, 1.0, 1.0, 1.0],
                                "dual/measured/m": [0.0, 0.0, math.nan, 0.0, 0.0, 0.0]})
    t = assess(Trial("t", {}), nan_hist, ["m"], SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.0))
    assert t.nonfinite_loss and t.collapsed
    assert t.inside_frac == pytest.approx(3 / 4, abs=1e-12)


def test_grid_keys_and_settings(tmp_path):
    assert grid({"a": [1, 2], "b": [3, 4, 5]}) == [{"a": a, "b": b} for a in (1, 2) for b in (3, 4, 5)]
    base = load_config(None, ["model.preset=tiny-dense"])
    cfg = apply_settings(base, {"dual.constraints[0].tolerance": 0.02, "dual.constraints.0.lr": 0.5,
                                "dual.constraints[0].lambda_init": 0.3})
    c = cfg.dual.constraints[0]
    assert (c.tolerance, c.lr, c.lambda_init) == (0.02, 0.5, 0.3)
    assert base.dual.constraints[0].tolerance == 0.005  # the base is not modified
    with pytest.raises(ConfigError, match="no key 'dual.constraints\\[0\\].tolerence'"):
        apply_settings(base, {"dual.constraints[0].tolerence": 0.1})
    with pytest.raises(ConfigError, match="tolerance"):
        apply_settings(base, {"dual.constraints[0].tolerance": -1.0})
    tune_file = tmp_path / "t.yaml"
    tune_file.write_text(yaml.safe_dump({"base": "x.yaml", "space": {"steps": [1]}, "worker": 2}))
    with pytest.raises(ConfigError, match="unknown tune config key 'worker'"):
        load_tune_config(tune_file)
    tune_file.write_text(yaml.safe_dump({"base": str(Path(__file__).parents[1] / "configs/tiny-dense.yaml"),
                                         "space": {"steps": [1, 2]}, "refine": {"key": "seed"}}))
    with pytest.raises(ConfigError, match="refine.key"):
        load_tune_config(tune_file)


def _curve_trial(trial_id, settings, key="dual.constraints[0].tolerance"):
    """A finished trial whose held-out accuracy is 0.6 - 1000 (c - 0.003)^2, eligible only for c <= 0.0045."""
    c = settings[key]
    return Trial(trial_id, dict(settings), accuracy_before=0.3, accuracy_after=0.6 - 1000 * (c - 0.003) ** 2,
                 inside_frac=1.0 if c <= 0.0045 else 0.5, mean_discrepancy={"m": 1e-3})


def test_refine_finds_the_peak_between_grid_points_within_budget():
    key = "dual.constraints[0].tolerance"
    values = [0.001, 0.002, 0.005, 0.01]
    rule = SelectRule()
    grid_trials = [_curve_trial(f"g{i:03d}", {key: v, "dual.constraints[0].lr": 1.0}) for i, v in enumerate(values)]
    select(grid_trials, rule)
    assert [t.eligible for t in grid_trials] == [True, True, False, False]
    calls = []

    def run_trial(trial_id, settings):
        calls.append((trial_id, settings))
        return _curve_trial(trial_id, settings)

    out = refine(grid_trials, RefineSpec(key=key, budget=6), values, rule, run_trial)
    assert 1 <= len(out) == len(calls) <= 6
    assert [t for t, _ in calls] == [f"r{j:03d}" for j in range(len(calls))]
    xs = [s[key] for _, s in calls]
    # best grid point 0.002 -> searched between its neighbours 0.001 and 0.005, no point twice
    assert all(0.001 <= x <= 0.005 for x in xs) and len(set(xs)) == len(xs)
    assert all(s["dual.constraints[0].lr"] == 1.0 for _, s in calls)
    best = select(grid_trials + out, rule)
    assert best in out and abs(best.settings[key] - 0.003) < 2e-4  # 0.6 - 1000 (2e-4)^2 = 0.59996 > 0.599 at 0.002
    assert [t.selected for t in grid_trials] == [False] * 4


def test_refine_on_an_integer_key_runs_new_integers_only_within_the_budget():
    key = "algo.minibatches"
    grid_trials = [Trial(f"g{i}", {key: v}, accuracy_after=-(v - 6.4) ** 2 / 100, inside_frac=1.0)
                   for i, v in enumerate([1, 4, 10])]
    select(grid_trials, SelectRule())
    calls = []

    def run_trial(trial_id, settings):
        calls.append(settings[key])
        return Trial(trial_id, dict(settings), accuracy_after=-(settings[key] - 6.4) ** 2 / 100, inside_frac=1.0)

    out = refine(grid_trials, RefineSpec(key=key, budget=3), [1, 4, 10], SelectRule(), run_trial)
    # best grid point 4 -> interval [1, 10]; Brent's steps are rounded, and a rounded point already seen is not rerun
    assert 1 <= len(calls) <= 3 and len(set(calls)) == len(calls)
    assert all(isinstance(x, int) and 1 < x < 10 and x != 4 for x in calls)
    assert abs(select(grid_trials + out, SelectRule()).settings[key] - 6.4) < 1


# --------------------------------------------------------------------------------------------------
# A real sweep.

TOLERANCES = [1e-9, 1e-2, -1.0]


def _write_tune_file(tmp: Path, uri: str) -> Path:
    spec = {
        "base": str(Path(__file__).parents[1] / "configs/tiny-dense.yaml"),
        "overrides": ["steps=3", "cold_start.steps=5", f"cold_start.cache_dir={tmp / 'cache'}", "task.eval_size=8",
                      "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "threads=1", f"tracking.uri={uri}",
                      "tracking.experiment=tune-test"],
        "space": {"dual.constraints[0].tolerance": TOLERANCES},
        "select": {"warmup_steps": 1, "collapse_window": 2},
        "workers": 2,
        "prime_cold_start": False,
        "output_dir": str(tmp / "sweep"),
    }
    path = tmp / "tune.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _children(client, parent_id: str) -> list:
    exp = client.get_experiment_by_name("tune-test")
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")


def test_sweep_nested_runs_outputs_selection_and_resume(tmp_path, mlflow_server, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tune_file = _write_tune_file(tmp_path, mlflow_server.uri)
    trials, best = run_tune_file(tune_file)
    out = tmp_path / "sweep"
    printed = capsys.readouterr().out

    # table, CSV, plot, snippet
    assert "selection: highest held-out accuracy" in printed and ">= 90% of steps after warm-up (steps > 1)" in printed
    assert "last 2 steps < 0.5 x its peak" in printed
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [float(r["dual.constraints[0].tolerance"]) for r in rows] == TOLERANCES
    import matplotlib.image

    assert matplotlib.image.imread(out / "tune.png").shape[0] > 100
    failed = rows[2]
    assert failed["status"] == "failed" and "tolerance" in failed["error"] and failed["selected"] == "0"
    ok = rows[:2]
    assert all(r["status"] == "ok" for r in ok)

    # the rule, recomputed from the CSV
    for r in ok:
        collapsed = r["nonfinite_loss"] == "1" or float(r["final_window_mean"]) < 0.5 * float(r["peak_window_mean"])
        assert (r["collapsed"] == "1") == collapsed
    eligible = [i for i, r in enumerate(ok) if r["collapsed"] == "0" and float(r["inside_frac"]) >= 0.9]
    assert float(ok[0]["inside_frac"]) == 0.0 and 0 not in eligible  # c = 1e-9: outside on every step
    assert float(ok[1]["inside_frac"]) == 1.0 and 1 in eligible       # c = 1e-2: inside on every step
    top = max(float(ok[i]["accuracy_after"]) for i in eligible)
    first_top = [i for i in eligible if float(ok[i]["accuracy_after"]) == top]
    selected = [i for i, r in enumerate(rows) if r["selected"] == "1"]
    assert len(selected) == 1 and selected[0] in first_top
    assert best is not None and best.trial == rows[selected[0]]["trial"]

    # the snippet loads as a config with the winning tolerance
    cfg = load_config(out / "best.yaml", ["model.preset=tiny-dense"])
    assert cfg.dual.constraints[0].tolerance == float(rows[selected[0]]["dual.constraints[0].tolerance"])

    # one parent run, the two trials that ran as its children, the outputs as its artifacts
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent_id = json.loads((out / "tune_state.json").read_text())["parent_run_id"]
    children = _children(client, parent_id)
    assert sorted(c.info.run_id for c in children) == sorted(r["run_id"] for r in ok)
    assert all(c.info.status == "FINISHED" for c in children)
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"table.txt", "results.csv", "tune.png", "best.yaml"} <= artifacts
    # λ per step of a child equals the trial's recorded trajectory
    lam = client.get_metric_history(ok[1]["run_id"], "dual/lambda/abs_prob_diff")
    assert [m.step for m in sorted(lam, key=lambda m: m.step)] == [1, 2, 3]
    assert [m.value for m in sorted(lam, key=lambda m: m.step)] == trials[1].lambda_history["abs_prob_diff"]

    # resume: the finished trials are skipped, the parent run is reused, no child is added
    mtimes = {r["trial"]: os.path.getmtime(out / "trials" / r["trial"] / "summary.json") for r in ok}
    trials2, best2 = run_tune_file(tune_file)
    assert "(0 run now, 1 failed)" in capsys.readouterr().out
    assert json.loads((out / "tune_state.json").read_text())["parent_run_id"] == parent_id
    assert len(_children(client, parent_id)) == 2
    assert {r: os.path.getmtime(out / "trials" / r / "summary.json") for r in mtimes} == mtimes
    assert best2 is not None and best2.trial == best.trial
    assert [t.accuracy_after for t in trials2[:2]] == [t.accuracy_after for t in trials[:2]]
