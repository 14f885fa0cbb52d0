"""dcmdp tune: the selection rule, the pruner and the table on hand-made records; real sweeps on an Optuna
sqlite study against a real MLflow server.

The sweeps run tolerances of one abs_prob_diff constraint on tiny-dense with int8 rollouts, whose
discrepancy is ~1e-6..1e-5 per step: c = 1e-9 is violated on every step (pruned once the inside share can
no longer reach 90%), c >= 1e-2 is never violated. c = -1 is an invalid config, refused before the first trial
(a trial that fails while it runs is the interrupted sweep's, a slow test).
"""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from dcmdp.config import ConfigError, load_config
from dcmdp.tune import (RulePruner, SelectRule, Trial, apply_settings, assess, distributions, grid, live_state,
                        load_tune_config, log_spaced, plot_tune, read_progress, run_tune_file, select, table)

ROOT = Path(__file__).parents[1]

# --------------------------------------------------------------------------------------------------
# The rule on hand-made records.


def _trial(name, acc, inside=1.0, collapsed=False, status="ok", mean_d=1e-3):
    return Trial(name, {"x": name}, status=status, accuracy_before=0.1, accuracy_after=acc, inside_frac=inside,
                 collapsed=collapsed, mean_discrepancy={"abs_prob_diff": mean_d})


def test_collapsed_run_with_the_best_accuracy_is_rejected_and_the_table_says_why():
    trials = [_trial("a", 0.40), _trial("b", 0.90, collapsed=True), _trial("c", 0.55), _trial("d", 0.95, inside=0.89),
              _trial("e", math.nan, status="failed"), _trial("f", math.nan, status="pruned")]
    trials[1].final_window_mean, trials[1].peak_window_mean = 0.2, 0.9
    trials[4].error, trials[5].error = "exit code 1: boom", "non-finite loss"
    best = select(trials, SelectRule(min_inside_frac=0.9, collapse_window=5))
    assert best is trials[2]
    assert [t.eligible for t in trials] == [True, False, True, False, False, False]
    assert [t.selected for t in trials] == [False, False, True, False, False, False]
    assert [t.reason for t in trials] == [
        "eligible, accuracy 40.0% more than 1 standard error(s) under the best (< 55.0%)",
        "collapsed: last 5-step mean 0.2 < 0.5 x peak 0.9",
        "selected: the best held-out accuracy (55.0%) of 2 eligible trial(s); no other within 1 standard error(s) "
        "(>= 55.0%)",
        "inside tolerance on 89% of steps < 90%",
        "failed: exit code 1: boom",
        "pruned: non-finite loss"]
    text = table(trials, ["abs_prob_diff"], SelectRule())
    assert text.startswith("selection: the tightest c within 1 standard error(s) of the best held-out accuracy")
    lines = text.splitlines()
    assert "why (not) selected" in lines[2]
    assert lines[5].startswith("b ") and lines[5].endswith("collapsed: last 5-step mean 0.2 < 0.5 x peak 0.9")
    assert lines[6].split()[0] == "c" and " *  " in lines[6] and "selected: the best held-out accuracy" in lines[6]


def test_min_inside_frac_is_inclusive_and_configurable():
    trials = [_trial("a", 0.5, inside=0.9), _trial("b", 0.6, inside=0.7)]
    assert select(trials, SelectRule(min_inside_frac=0.9)) is trials[0]
    assert select(trials, SelectRule(min_inside_frac=0.7)) is trials[1]
    assert select(trials, SelectRule(min_inside_frac=0.95)) is None
    assert not any(t.selected for t in trials)
    assert trials[0].reason == "inside tolerance on 90% of steps < 95%"


def test_ties_go_to_larger_inside_share_then_smaller_discrepancy_then_earlier_trial():
    trials = [_trial("a", 0.5, inside=0.92), _trial("b", 0.5, inside=0.97)]
    assert select(trials, SelectRule()) is trials[1]
    assert trials[0].reason.startswith("eligible, same c as b, lost the tie")
    trials = [_trial("a", 0.5, mean_d=2e-3), _trial("b", 0.5, mean_d=1e-3), _trial("c", 0.5, mean_d=1e-3)]
    assert select(trials, SelectRule()) is trials[1]


HISTORY = {"dual/measured/m": [0.5, 0.5, 0.005, 0.02, 0.01, 0.0],
           "dual/tolerance/m": [0.01] * 6,
           "dual/lambda/m": [0.1, 0.2, 0.3, 0.25, 0.2, 0.15],
           # 3-step means: 0.4, 0.6, 0.5, 0.3 -> peak 0.6, last 0.3 = 0.5 x peak: not below half, no collapse
           "reward/accuracy": [0.2, 0.4, 0.6, 0.8, 0.1, 0.0],
           "loss/total": [1.0] * 6}


def test_assess_inside_share_after_warmup_and_collapse_window():
    # 6 steps; c = 0.01. D-hat per step: steps 1-2 (warm-up) outside, then in, out, in, in -> 3/4 inside.
    t = assess(Trial("t", {}), HISTORY, ["m"], SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.5))
    assert t.inside_frac == pytest.approx(3 / 4, abs=1e-12)
    assert t.mean_discrepancy["m"] == pytest.approx((0.5 + 0.5 + 0.005 + 0.02 + 0.01) / 6, abs=1e-12)
    assert t.final_lambda == {"m": 0.15} and t.steps == 6
    assert (t.peak_window_mean, t.final_window_mean) == (pytest.approx(0.6), pytest.approx(0.3))
    assert not t.collapsed
    t = assess(Trial("t", {}), HISTORY, ["m"], SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.51))
    assert t.collapsed
    # A non-finite loss is a collapse whatever the accuracy; a NaN D-hat counts as outside.
    nan_hist = dict(HISTORY, **{"loss/total": [1.0, math.nan, 1.0, 1.0, 1.0, 1.0],
                                "dual/measured/m": [0.0, 0.0, math.nan, 0.0, 0.0, 0.0]})
    t = assess(Trial("t", {}), nan_hist, ["m"], SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.0))
    assert t.nonfinite_loss and t.collapsed
    assert t.inside_frac == pytest.approx(3 / 4, abs=1e-12)


def test_pruner_stops_only_trials_the_rule_can_no_longer_pick():
    rule = SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.5, min_inside_frac=0.9)
    # after 4 steps: one post-warm-up step outside (step 4); window means 0.4, 0.6 -> no collapse yet
    state = live_state({k: v[:4] for k, v in HISTORY.items()}, ["m"], rule)
    assert state == {"live/steps": 4, "live/outside": 1, "live/nonfinite": False, "live/collapsed_for": 0}
    pruner = RulePruner(rule, patience=2)
    # 22 steps in all: 20 after warm-up allow 2 steps outside (10%); 42 allow 4
    assert pruner.reason({**state, "steps_total": 22}) == ""
    assert pruner.reason({**state, "live/outside": 3, "steps_total": 22}).startswith(
        "outside tolerance on 3 steps after warm-up, more than the 2 that 90% inside allows")
    assert pruner.reason({**state, "live/outside": 3, "steps_total": 42}) == ""
    # collapse: 3-step means 0.4, 0.6, 0.5, 0.3; 0.3 < 0.55 x 0.6 holds on the last step only
    drop = SelectRule(warmup_steps=2, collapse_window=3, collapse_drop_frac=0.55)
    assert live_state(HISTORY, ["m"], drop)["live/collapsed_for"] == 1
    longer = dict(HISTORY, **{"reward/accuracy": HISTORY["reward/accuracy"] + [0.0]})  # mean 0.033: twice in a row
    collapsed = live_state(longer, ["m"], drop)
    assert collapsed["live/collapsed_for"] == 2
    assert RulePruner(drop, patience=2).reason({**collapsed, "steps_total": 100}).startswith("collapsed")
    assert RulePruner(drop, patience=3).reason({**collapsed, "steps_total": 100}) == ""
    assert pruner.reason({**state, "live/nonfinite": True, "steps_total": 100}) == "non-finite loss"
    assert pruner.reason({}) == ""  # nothing reported yet


def test_read_progress_keeps_the_last_line_of_a_step_and_skips_a_partial_line(tmp_path):
    p = tmp_path / "progress.jsonl"
    lines = [{"step": 1, "run_id": "r1", "a": 1.0}, {"step": 2, "run_id": "r1", "a": 2.0},
             {"step": 2, "run_id": "r1", "a": 5.0, "b": 1.0}]  # step 2 again: a resume from step 1
    p.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "a"')
    history, run_id = read_progress(p)
    assert run_id == "r1"
    assert history["a"] == [1.0, 5.0]
    assert history["b"][0] != history["b"][0] and history["b"][1] == 1.0  # NaN where a step lacks the key
    assert read_progress(tmp_path / "missing.jsonl") == ({}, "")


def test_log_axis_for_log_spaced_values_only():
    dist = distributions({"a": [1e-4, 1e-3, 1e-2], "b": [0.1, 0.2, 0.3], "c": [0.001, 0.002, 0.005, 0.01, 0.02],
                          "d": [1, 50, 100], "e": {"low": 1e-4, "high": 1e-1, "log": True},
                          "f": {"low": 1, "high": 8}})
    assert [log_spaced(dist[k]) for k in "abcdef"] == [True, False, True, False, True, False]
    assert isinstance(dist["f"], optuna.distributions.IntDistribution)


def test_plot_marks_ineligible_and_pruned_trials_on_a_log_axis(tmp_path):
    key = "dual.constraints[0].tolerance"
    trials = [Trial(f"t{i}", {key: c}, accuracy_before=0.2, accuracy_after=acc, inside_frac=inside,
                    mean_discrepancy={"m": 1e-3}, lambda_history={"m": [0.1, 0.2]})
              for i, (c, acc, inside) in enumerate([(1e-4, 0.5, 0.5), (1e-3, 0.4, 1.0), (1e-2, 0.3, 1.0)])]
    trials.append(Trial("t3", {key: 1e-5}, status="pruned", lambda_history={"m": [0.1]}))
    select(trials, SelectRule())
    fig = plot_tune(trials, key, ["m"], tmp_path / "tune.png", log_x=True)
    ax_acc, ax_d, ax_lam = fig.axes
    assert ax_acc.get_xscale() == ax_d.get_xscale() == "log" and ax_lam.get_xscale() == "linear"
    legend = [t.get_text() for t in ax_acc.get_legend().get_texts()]
    assert {"selected", "eligible", "not eligible", "pruned", "before"} <= set(legend)
    assert (tmp_path / "tune.png").stat().st_size > 10_000


def test_calibrate_proposes_c_at_the_share_tune_selects_by():
    from dcmdp.calibrate import INSIDE_FRAC, floor_stats

    # calibrate's c is met on INSIDE_FRAC of the batches, at least the share tune's rule demands
    assert INSIDE_FRAC >= SelectRule().min_inside_frac
    values = [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, 8e-3, 9e-3, 1.2345e-2]
    c = floor_stats("discrepancy/abs_prob_diff", values, slack=0.0).proposed
    assert c == 9e-3  # 9 of 10 batches (90%) at or below it
    history = {"dual/measured/m": values, "dual/tolerance/m": [c] * len(values)}
    assert assess(Trial("t", {}), history, ["m"], SelectRule(min_inside_frac=0.9)).inside_frac == 0.9  # just eligible
    assert floor_stats("d", values, slack=0.1).proposed == 9.9e-3  # 3 significant digits
    assert floor_stats("d", values, slack=0.1, inside_frac=1.0).proposed == 1.36e-2  # 1.35795e-2 rounded up


def test_tune_file_keys_settings_and_overrides(tmp_path):
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

    def load(**spec):
        path = tmp_path / "t.yaml"
        path.write_text(yaml.safe_dump({"base": str(ROOT / "configs/tiny-dense.yaml"), **spec}))
        return load_tune_config(path, ["steps=7"])

    space = {"dual.constraints[0].tolerance": [0.001, 0.01]}
    with pytest.raises(ConfigError, match="tune config error at 'worker'.*Key 'worker' not in 'TuneConfig'"):
        load(space=space, worker=2)
    with pytest.raises(ConfigError, match="tune config error at 'prune.patience'"):
        load(space=space, prune={"patience": 2})
    with pytest.raises(ConfigError, match="'sampler': 'cmaes' is not one of grid, tpe, gp"):
        load(space=space, sampler="cmaes")
    with pytest.raises(ConfigError, match="'trials': the grid sampler runs every combination"):
        load(space=space, trials=4)
    with pytest.raises(ConfigError, match="'trials': sampler tpe needs trials >= 1"):
        load(space=space, sampler="tpe")
    with pytest.raises(ConfigError, match="'space.dual.constraints\\[0\\].lr': must be a non-empty list of values, "):
        load(space={"dual.constraints[0].lr": {"low": 0.1, "high": 1.0}})  # a range needs tpe or gp
    with pytest.raises(ConfigError, match="no key 'dual.constraints\\[0\\].rate'"):
        load(space={"dual.constraints[0].rate": [1.0]})
    cfg = load(space={"dual.constraints[0].lr": {"low": 0.1, "high": 1.0, "log": True}}, sampler="gp", trials=3)
    assert cfg.study == "t" and cfg.overrides == ["steps=7"] and cfg.sampler == "gp"
    # the command line's overrides come after the tune file's, and are checked like dcmdp train's
    cfg = load(space=space, overrides=["steps=3", "algo.minibatches=2"])
    assert cfg.overrides == ["steps=3", "algo.minibatches=2", "steps=7"]
    assert load_config(cfg.base, cfg.overrides).steps == 7
    with pytest.raises(ConfigError, match="stesp"):
        load_tune_config(tmp_path / "t.yaml", ["stesp=3"])


# --------------------------------------------------------------------------------------------------
# Real sweeps.

TOLERANCES = [1e-9, 1e-2]


@pytest.fixture(scope="module")
def cold_start_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cold_start_cache")


def _tune_file(tmp: Path, uri: str, cache: Path, space: list, steps: int, **extra) -> Path:
    spec = {"base": str(ROOT / "configs/tiny-dense.yaml"),
            "overrides": [f"steps={steps}", "cold_start.steps=5", f"cold_start.cache_dir={cache}", "task.eval_size=8",
                          "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "threads=1", f"tracking.uri={uri}",
                          "tracking.experiment=tune-test"],
            "space": {"dual.constraints[0].tolerance": space},
            # c >= 1e-2 is slack on every step: allowed here, where the sweep's plumbing is what is tested
            "select": {"warmup_steps": 1, "collapse_window": 2, "min_inside_frac": 0.9, "max_slack_frac": 1.0},
            "prime_cold_start": False,
            "output_dir": str(tmp / "sweep"), **extra}
    path = tmp / "tune.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _children(client, parent_id: str) -> list:
    exp = client.get_experiment_by_name("tune-test")
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")


def _study(out: Path, name: str = "tune") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}")


def test_sweep_prunes_selects_nests_runs_and_resumes(tmp_path, mlflow_server, monkeypatch, capsys, cold_start_cache):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # 200 steps: a tiny trial's step takes ~0.03 s, so the pruned one (outside on every step, pruned at step 21)
    # must run long enough for the parent's 0.5 s poll and its SIGTERM to stop it early
    # a value the run config refuses (c = -1) stops the sweep before its first trial, naming the key and the value
    (tmp_path / "bad").mkdir()
    bad = _tune_file(tmp_path / "bad", mlflow_server.uri, cold_start_cache, [*TOLERANCES, -1.0], steps=200, workers=2)
    with pytest.raises(ConfigError, match=r"tune config error at 'space.dual.constraints\[0\].tolerance': the value "
                                          r"-1.0 cannot be run: .*must be >= 0"):
        run_tune_file(bad)
    assert not (tmp_path / "bad" / "sweep" / "trials").exists()

    tune_file = _tune_file(tmp_path, mlflow_server.uri, cold_start_cache, TOLERANCES, steps=200, workers=2)
    trials, best = run_tune_file(tune_file, ["eval_every=50"])  # an override of the base config, as on the CLI
    out = tmp_path / "sweep"
    printed = capsys.readouterr().out

    # Optuna: c = 1e-9 pruned, c = 1e-2 complete with held-out accuracy reported every 2 steps
    study = _study(out)
    by_c = {t.params["dual.constraints[0].tolerance"]: t for t in study.trials}
    assert sorted(by_c) == sorted(TOLERANCES) and len(study.trials) == 2
    pruned, done = by_c[1e-9], by_c[1e-2]
    assert (pruned.state, done.state) == (optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.COMPLETE)
    assert sorted(done.intermediate_values) == [50, 100, 150]  # eval_every reached the trial; the final eval is the value
    assert done.value == trials[[t.number for t in trials].index(done.number)].accuracy_after
    assert (done.constraints, pruned.constraints) == ({"eligible": 0.0}, {"eligible": 1.0})  # what tpe and gp model

    # table, CSV, plot, snippet
    assert "selection: the tightest c within 1 standard error(s)" in printed
    assert ">= 90% of steps after warm-up (steps > 1)" in printed and "slack on <= 100% of steps" in printed
    assert "(2 run now, 1 pruned, 0 failed)" in printed
    rows = {float(r["dual.constraints[0].tolerance"]): r for r in csv.DictReader(open(out / "results.csv"))}
    assert rows[1e-9]["status"] == "pruned" and rows[1e-9]["reason"].startswith("pruned: outside tolerance on ")
    assert rows[1e-2]["status"] == "ok" and rows[1e-2]["selected"] == "1"
    assert rows[1e-2]["reason"].startswith("selected: the best held-out accuracy")
    # lambda decays from lambda_0 = 0.1 by eta (D - c) per step, then sits at 0: slack on most steps, which the
    # default max_slack_frac (0.5) would not accept
    assert 0.9 <= float(rows[1e-2]["slack_frac"]) <= 1.0 and int(rows[1e-2]["eval_prompts"]) == 8
    assert float(rows[1e-2]["inside_frac"]) == 1.0 and rows[1e-2]["steps"] == "200"
    assert best is not None and best.trial == rows[1e-2]["trial"]
    import matplotlib.image

    assert matplotlib.image.imread(out / "tune.png").shape[0] > 100
    cfg = load_config(out / "best.yaml", ["model.preset=tiny-dense"])
    assert cfg.dual.constraints[0].tolerance == 1e-2

    # the pruned trial stopped early and left its checkpoint; its run config carries the override
    pruned_dir = out / "trials" / rows[1e-9]["trial"]
    pruned_steps = int(rows[1e-9]["steps"])
    assert 21 <= pruned_steps < 200
    assert sorted(p.name for p in (pruned_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        f"step_{pruned_steps:08d}"]
    assert yaml.safe_load((pruned_dir / "run.yaml").read_text())["eval_every"] == 50

    # MLflow: one parent run; the two trials that ran are its children, the pruned one KILLED and tagged PRUNED
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent_id = study.user_attrs["mlflow_parent"]
    children = {c.info.run_id: c for c in _children(client, parent_id)}
    assert sorted(children) == sorted([rows[1e-2]["run_id"], rows[1e-9]["run_id"]])
    done_run, pruned_run = children[rows[1e-2]["run_id"]], children[rows[1e-9]["run_id"]]
    assert (done_run.info.status, done_run.data.tags["dcmdp.tune.state"]) == ("FINISHED", "COMPLETE")
    assert (pruned_run.info.status, pruned_run.data.tags["dcmdp.tune.state"]) == ("KILLED", "PRUNED")
    assert pruned_run.data.tags["optuna.trial"] == str(pruned.number)
    assert {"table.txt", "results.csv", "tune.png", "best.yaml"} <= {a.path for a in client.list_artifacts(parent_id)}
    # λ per step of a child equals the trial's recorded trajectory
    lam = sorted(client.get_metric_history(rows[1e-2]["run_id"], "dual/lambda/abs_prob_diff"), key=lambda m: m.step)
    assert [m.step for m in lam] == list(range(1, 201))
    assert [m.value for m in lam] == done.user_attrs["record"]["lambda_history"]["abs_prob_diff"]

    # resume: finished and pruned trials stay and run no step again, the parent is reused
    mtime = os.path.getmtime(out / "trials" / rows[1e-2]["trial"] / "summary.json")
    trials2, best2 = run_tune_file(tune_file, ["eval_every=50"])
    assert "(0 run now, 1 pruned, 0 failed)" in capsys.readouterr().out
    study = _study(out)
    assert len(study.trials) == 2 and study.user_attrs["mlflow_parent"] == parent_id
    assert len(_children(client, parent_id)) == 2
    assert os.path.getmtime(out / "trials" / rows[1e-2]["trial"] / "summary.json") == mtime
    assert best2 is not None and best2.trial == best.trial and len(trials2) == 2


@pytest.mark.slow  # the real sweep (prune, select, resume) runs by default in the test above
def test_two_processes_share_one_study_without_running_a_trial_twice(tmp_path, mlflow_server, cold_start_cache):
    tolerances = [1e-2, 2e-2, 5e-2]
    tune_file = _tune_file(tmp_path, mlflow_server.uri, cold_start_cache, tolerances, steps=2, workers=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dcmdp.cli", "tune", str(tune_file), "dual.constraints[0].lambda_init=0.2"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    study = _study(tmp_path / "sweep")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert sorted(t.params["dual.constraints[0].tolerance"] for t in study.trials) == tolerances
    # both processes took trials; the trials' folders are distinct and every run config has the CLI override
    assert len({t.user_attrs["process"] for t in study.trials}) == 2
    dirs = sorted((tmp_path / "sweep" / "trials").iterdir())
    assert [d.name for d in dirs] == ["t000", "t001", "t002"]
    assert all(yaml.safe_load((d / "run.yaml").read_text())["dual"]["constraints"][0]["lambda_init"] == 0.2
               for d in dirs)
    assert sum("3 trials in study 'tune'" in o for o in outputs) == 2


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_its_trial_from_the_checkpoint(tmp_path, mlflow_server, cold_start_cache):
    import signal
    import time

    from mlflow.tracking import MlflowClient

    tune_file = _tune_file(tmp_path, mlflow_server.uri, cold_start_cache, [1e-2], steps=12, workers=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "tune", str(tune_file)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trial_dir = tmp_path / "sweep" / "trials" / "t000"
    deadline = time.monotonic() + 600
    while len(read_progress(trial_dir / "progress.jsonl")[0].get("dual/lambda/abs_prob_diff", [])) < 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # as Ctrl-C: the sweep stops its trial, which writes a checkpoint
    assert proc.wait(timeout=300) != 0
    first = _study(tmp_path / "sweep").trials[0]
    assert first.state == optuna.trial.TrialState.FAIL and first.user_attrs["record"]["error"] == "interrupted"
    stopped_at = int(max(p.name for p in (trial_dir / "checkpoints").iterdir() if p.name.startswith("step_"))[5:])
    assert 3 <= stopped_at < 12
    run_id = read_progress(trial_dir / "progress.jsonl")[1]

    trials, best = run_tune_file(tune_file)
    study = _study(tmp_path / "sweep")
    retry = study.trials[1]
    assert retry.state == optuna.trial.TrialState.COMPLETE
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(retry) == 0
    assert f"first step after resume (step {stopped_at + 1})" in (trial_dir / "train.log").read_text()
    assert best is not None and best.trial == "t000" and best.run_id == run_id  # the same child run, continued
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    lam = client.get_metric_history(run_id, "dual/lambda/abs_prob_diff")
    assert sorted(m.step for m in lam) == list(range(1, 13))  # every step once
    assert len(_children(client, study.user_attrs["mlflow_parent"])) == 1


def test_a_winner_whose_constraint_was_slack_says_so_in_best_yaml():
    from dcmdp.tune import best_snippet

    best = _trial("t002", 0.4)
    best.settings = {"dual.constraints[0].tolerance": 0.01}
    best.warnings = ["constraint abs_prob_diff was slack on 100% of the steps (D-hat < c with lambda at its floor)"]
    text = best_snippet(load_config(None, []), best)
    assert text.splitlines()[1] == f"# warning: {best.warnings[0]}"
    assert load_config(None, []).dual.constraints[0].tolerance != 0.01
    assert yaml.safe_load(text)["dual"]["constraints"][0]["tolerance"] == 0.01


def test_a_pruned_trial_whose_run_is_still_running_is_ended_killed(tmp_path):
    """A trial stopped after its last step leaves its MLflow run RUNNING: tagging it PRUNED ends it KILLED; a run
    that has ended keeps its status."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from dcmdp.tune import _Sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("prune-end")
    running, done = client.create_run(exp).info.run_id, client.create_run(exp).info.run_id
    client.set_terminated(done, "FINISHED")
    for run_id in (running, done):
        _Sweep._tag_child(SimpleNamespace(tracking_uri=uri), run_id, "PRUNED", 3, end="KILLED")
    assert client.get_run(running).info.status == "KILLED" and client.get_run(done).info.status == "FINISHED"
    assert client.get_run(running).data.tags["dcmdp.tune.state"] == "PRUNED"


def test_a_damaged_study_database_is_a_config_error_naming_storage(tmp_path):
    bad = tmp_path / "study.db"
    bad.write_text("not a database")
    spec = {"base": str(ROOT / "configs/tiny-dense.yaml"), "space": {"dual.constraints[0].lr": [0.1, 0.2]},
            "storage": f"sqlite:///{bad}", "output_dir": str(tmp_path / "tune")}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # this tree's code in the subprocess
    proc = subprocess.run([sys.executable, "-m", "dcmdp.cli", "tune", str(tmp_path / "t.yaml")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"tune config error at 'storage': cannot open the study database sqlite:///{bad}: DatabaseError" \
           in proc.stderr and "Traceback" not in proc.stderr
    assert bad.read_text() == "not a database"


def test_a_tune_output_dir_that_is_a_file_or_empty_is_a_config_error(tmp_path):
    (tmp_path / "a_file").write_text("keep me")
    path = tmp_path / "t.yaml"
    space = {"dual.constraints[0].lr": [0.1, 0.2]}
    for out, needle in [(tmp_path / "a_file", "'output_dir': '{f}' is a file, not a folder"),
                        (tmp_path / "a_file" / "sub", "'output_dir': '{f}' is a file, not a folder"),
                        (" ", "'output_dir': empty; name a folder for the study")]:
        path.write_text(yaml.safe_dump({"base": str(ROOT / "configs/tiny-dense.yaml"), "space": space,
                                        "output_dir": str(out)}))
        with pytest.raises(ConfigError) as err:
            load_tune_config(path, [])
        assert needle.format(f=tmp_path / "a_file") in str(err.value)
    assert (tmp_path / "a_file").read_text() == "keep me"


def test_the_rule_does_not_reward_switching_the_dual_off_and_says_why_it_chose():
    """The loosest c wins "best accuracy inside c" with lambda at 0 throughout; here it is not eligible (dual off),
    a pinned lambda is not either (a constant), and among the trials within one standard error of the best accuracy
    the tightest c is selected, with the reason in words."""
    def t(name, acc, c, slack, cap):
        x = _trial(name, acc)
        x.mean_tolerance, x.slack_frac, x.cap_frac, x.eval_prompts = c, slack, cap, 256
        return x

    trials = [t("loose", 0.60, 1e-2, 1.0, 0.0),    # dual off: the old rule's winner
              t("pinned", 0.58, 1e-4, 0.0, 0.9),   # lambda at its cap: a constant
              t("mid", 0.55, 2e-3, 0.2, 0.1),      # the best active trial
              t("tight", 0.53, 1e-3, 0.1, 0.2),    # 2 points lower: within one SE of 55% on 256 prompts (3.1 points)
              t("tighter", 0.50, 5e-4, 0.0, 0.3)]  # 5 points lower: outside
    best = select(trials, SelectRule())
    assert best is trials[3] and [x.eligible for x in trials] == [False, False, True, True, True]
    se = math.sqrt(0.55 * 0.45 / 256)
    assert best.reason == (f"selected: the tightest c (mean 0.001) of the 2 eligible trials within 1 standard error(s) "
                           f"of the best accuracy, >= {0.55 - se:.1%}; its accuracy 53.0% (best: mid, 55.0%)")
    assert trials[0].reason == "dual off: slack (lambda at its floor, D-hat < c) on 100% of steps > 50%"
    assert trials[1].reason == "lambda at its cap on 90% of steps > 50%: a constant, not a controller"
    assert trials[2].reason.startswith("eligible, within 1 standard error(s) of the best accuracy but a looser c")
    assert trials[4].reason.startswith("eligible, accuracy 50.0% more than 1 standard error(s) under the best")
    # with no standard error to allow (tolerance_se 0) the best accuracy wins
    assert select(trials, SelectRule(tolerance_se=0.0)) is trials[2]


# --------------------------------------------------------------------------------------------------
# Eligibility on what the dual controls: the penalty's reach against the batch spread, and the placebos.

NAN = math.nan


def _anchored_history(lo, hi, ratio, c, lam, n=14, warm=4):
    """n steps of one anchored constraint m: D-hat 1e-3 in warm-up, then lo, hi, lo, ... (10 steps); c fixed;
    probes on steps 1-4 with D_0 / D_max = ratio (reach ln ratio), the anchor window closing at step 4."""
    return {"dual/measured/m": [1e-3] * warm + [lo if i % 2 == 0 else hi for i in range(n - warm)],
            "dual/tolerance/m": [c] * n, "dual/lambda/m": list(lam),
            "dual/anchor_zero/m": [1e-3 * ratio] * warm + [NAN] * (n - warm),
            "dual/anchor_max/m": [1e-3] * warm + [NAN] * (n - warm),
            "dual/anchor_gap/m": [NAN] * (warm - 1) + [1e-4] + [NAN] * (n - warm),
            "reward/accuracy": [0.5] * n, "loss/total": [1.0] * n}


MOVING = [0.1 + 0.01 * (i % 3) for i in range(14)]
RULE = SelectRule(warmup_steps=4, collapse_window=3)
# sd (ddof 1) of 10 logs alternating ln lo, ln hi: ln(hi / lo) / 2 x sqrt(10 / 9)
SPREAD_SMALL = math.log(1.2) / 2 * math.sqrt(10 / 9)  # lo 1e-3, hi 1.2e-3: 0.0961
SPREAD_LARGE = math.log(2.0) / 2 * math.sqrt(10 / 9)  # lo 1e-3, hi 2e-3: 0.365


def _assessed(name, acc, history, anchored=None):
    t = assess(Trial(name, {"x": name}), history, ["m"], RULE, anchored)
    t.accuracy_before, t.accuracy_after, t.mean_tolerance = 0.1, acc, history["dual/tolerance/m"][0]
    return t


def test_inside_share_is_judged_only_where_the_reach_is_at_least_the_spread():
    # reach ln 2 = 0.693 >= spread 0.0961: the constraint clause applies; c = 1.1e-3 holds 5 of the 10 steps
    held = _assessed("held", 0.40, _anchored_history(1e-3, 1.2e-3, 2.0, 1.3e-3, MOVING))
    missed = _assessed("missed", 0.45, _anchored_history(1e-3, 1.2e-3, 2.0, 1.1e-3, MOVING))
    assert held.reach["m"] == pytest.approx(math.log(2.0)) and held.spread["m"] == pytest.approx(SPREAD_SMALL)
    assert (held.unjudged, held.inside_frac, missed.inside_frac) == ({}, 1.0, 0.5)
    # reach ln 1.07 = 0.0677 < spread 0.365: inside c (5 of 10 steps) is not judged, the accuracy clause decides
    free = _assessed("free", 0.42, _anchored_history(1e-3, 2e-3, 1.07, 1.5e-3, MOVING))
    assert free.spread["m"] == pytest.approx(SPREAD_LARGE) and free.inside_frac == 0.5
    assert free.unjudged == {"m": "inside c not judged: reach 0.0677 under spread 0.365"}
    trials = [held, missed, free]
    best = select(trials, RULE)
    assert [t.eligible for t in trials] == [True, False, True] and best is free  # eval_prompts 0: no SE, best acc
    assert missed.reason == "inside tolerance on 50% of steps < 70%"
    assert best.reason == ("selected: the best held-out accuracy (42.0%) of 2 eligible trial(s); no other within 1 "
                           "standard error(s) (>= 42.0%); eligible on the accuracy clause alone (inside c not judged: "
                           "reach 0.0677 under spread 0.365)")
    assert select([held], RULE).reason.endswith("; inside c judged: reach 0.693 >= spread 0.0961, inside on 100% >= 70%")
    text = table(trials, ["m"], RULE)
    assert "constraint clause" in text and "inside c not judged: reach 0.0677 under spread 0.365" in text
    assert "where lambda has authority" in text.splitlines()[0]
    # a fixed c (never probed) is a bound the user set: judged whatever the spread
    fixed = {k: v for k, v in _anchored_history(1e-3, 2e-3, 1.07, 1.5e-3, MOVING).items() if "anchor" not in k}
    assert not select([_assessed("fixed", 0.4, fixed)], RULE) and _assessed("f", 0.4, fixed).unjudged == {}
    # an anchored c whose reach was never measured is not judged
    assert _assessed("u", 0.4, fixed, anchored=[True]).unjudged == {"m": "inside c not judged: reach not measured"}


def test_fixed_lambda_placebos_are_never_eligible():
    """dual.rule=fixed with lambda at 0 or at lambda_max, on the no-authority branch where inside c is not judged:
    slack_frac and cap_frac as summary.json has them (dcmdp.loop.constraint_summaries). lambda = 0 with D-hat
    outside c on half the steps is slack on fewer than half: the slack clause alone would pass it; a lambda that
    holds one value is what tells a placebo from a dual."""
    from dcmdp.loop import constraint_summaries

    base = load_config(str(ROOT / "configs/default.yaml"), ["dual.rule=fixed"])
    cap = base.dual.constraints[0].lambda_max
    out = []
    for name, lam, c in [("zero-tight", [0.0] * 14, 1.5e-3), ("zero-loose", [0.0] * 14, 3e-3),
                         ("at-cap", [cap] * 14, 1.5e-3), ("dual", MOVING, 1.5e-3)]:
        h = _anchored_history(1e-3, 2e-3, 1.07, c, lam)
        t = _assessed(name, 0.5, h)
        steps = [{k: v[i] for k, v in h.items() if math.isfinite(v[i])} for i in range(14)]
        s = constraint_summaries(steps, ["m"], base.dual.constraints, warmup=4)["m"]
        t.slack_frac, t.cap_frac = s.slack_frac, s.cap_frac
        out.append(t)
    assert [t.unjudged != {} for t in out] == [True] * 4  # reach 0.0677 under spread 0.365 for all
    assert [(t.slack_frac, t.cap_frac) for t in out[:3]] == [(0.5, 0.0), (1.0, 0.0), (0.0, 1.0)]
    best = select(out, RULE)
    assert best is out[3] and [t.eligible for t in out] == [False, False, False, True]
    assert out[0].reason == "lambda fixed at 0 (m) on every step after warm-up: a constant, not a controller"
    assert out[1].reason == "dual off: slack (lambda at its floor, D-hat < c) on 100% of steps > 50%"
    assert out[2].reason == "lambda at its cap on 100% of steps > 50%: a constant, not a controller"


def test_a_dual_that_stood_down_is_judged_on_accuracy_while_its_lambda_zero_placebo_is_not_eligible():
    """The same steps (reach 0.0677 under spread 0.365, lambda 0 throughout): a dual with ``authority`` logs that it
    stood down on every step (its own decision at each anchor window), the placebo (dual.rule=fixed) logs nothing.
    summary.json's slack and cap shares of the stood-down dual are NaN (no step in force), as
    dcmdp.loop.constraint_summaries gives them with the authority config; the placebo's are counted."""
    from dcmdp.loop import constraint_summaries

    base = load_config(str(ROOT / "configs/default.yaml"), ["dual.constraints[0].authority=1.0"])
    out = []
    for name, extra in (("stood-down", {"dual/stood_down/m": [1.0] * 14}), ("placebo", {})):
        h = {**_anchored_history(1e-3, 2e-3, 1.07, 1.5e-3, [0.0] * 14), **extra}
        t = _assessed(name, 0.5, h)
        steps = [{k: v[i] for k, v in h.items() if math.isfinite(v[i])} for i in range(14)]
        s = constraint_summaries(steps, ["m"], base.dual.constraints, warmup=4)["m"]
        t.slack_frac, t.cap_frac = s.slack_frac, s.cap_frac
        out.append(t)
    assert math.isnan(out[0].slack_frac) and out[1].slack_frac == 0.5
    assert select(out, RULE) is out[0] and [t.eligible for t in out] == [True, False]
    assert out[1].reason == "lambda fixed at 0 (m) on every step after warm-up: a constant, not a controller"
    # a dual in force on some steps after warm-up with one lambda there is a constant again
    part = {**_anchored_history(1e-3, 2e-3, 1.07, 1.5e-3, [0.0] * 14), "dual/stood_down/m": [1.0] * 10 + [0.0] * 4}
    assert not select([_assessed("part", 0.5, part)], RULE)


def test_pruner_prunes_for_the_inside_share_only_where_the_reach_reaches_the_running_spread():
    rule = SelectRule(warmup_steps=4, collapse_window=3, min_inside_frac=0.9)
    pruner = RulePruner(rule, patience=2)
    # 5 post-warm-up steps outside c = 1.1e-3 (steps 6, 8, ..., 14), more than the 0.1 x 20 = 2 that 24 steps allow
    authority_h = _anchored_history(1e-3, 1.2e-3, 2.0, 1.1e-3, MOVING)
    state = live_state(authority_h, ["m"], rule, [True])
    assert state["live/outside"] == 5
    assert pruner.reason({**state, "steps_total": 24}).startswith(
        "outside tolerance on 5 steps after warm-up, more than the 2 that 90% inside allows")
    # the same steps outside, reach 0.0677 under the running spread 0.365: never pruned for the inside share
    free_h = _anchored_history(1e-3, 2e-3, 1.07, 1.5e-3, MOVING)
    state = live_state(free_h, ["m"], rule, [True])
    assert state["live/outside"] == 0 and pruner.reason({**state, "steps_total": 24}) == ""
    # before the first anchor window closes, the reach does not count yet: not pruned either
    early = dict(authority_h, **{"dual/anchor_gap/m": [NAN] * 14})
    assert live_state(early, ["m"], rule, [True])["live/outside"] == 0
    # a collapse still prunes: accuracy 0.5 then 0 on the last 4 steps (3-step means fall below half the peak)
    collapsing = dict(free_h, **{"reward/accuracy": [0.5] * 10 + [0.0] * 4})
    state = live_state(collapsing, ["m"], rule, [True])
    assert state["live/outside"] == 0 and pruner.reason({**state, "steps_total": 24}).startswith("collapsed")
