"""dcmdp calibrate: the discrepancy floor with identical weights in both engines, and the proposed c.

Real runs on tiny-moe (20-step cold start, 4 prompts x 2 samples, 3 batches): fp32 rollouts have a floor
of ~0, int8 rollouts a positive one; the per-batch values equal a float64 numpy computation from the
kept log-probs; the snippet loads as a config file and holds c = q90 x (1 + slack), q90 the least batch
value with >= 90% of batches at or below it (dcmdp tune's select.min_inside_frac), 3 significant digits.
"""

from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest
import torch

from dcmdp.calibrate import calibrate, floor_stats, proposed_tolerance
from dcmdp.cli import main
from dcmdp.config import load_config
from dcmdp.tracking import local_store_uri

BATCHES = 3
SLACK = 0.25


def _overrides(tmp_path, precision: str) -> list[str]:
    return [f"output_dir={tmp_path / precision}", "model.preset=tiny-moe", "rollout.engine=torch",
            f"rollout.precision={precision}", "cold_start.steps=20", "algo.prompts_per_step=4",
            "algo.samples_per_prompt=2", "threads=1", "progress=false", "seed=3"]


def _direct(old_BT: torch.Tensor, rollout_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """float64 numpy reference of the token-level measures over the valid tokens."""
    m = mask_BT.numpy()
    a, b = old_BT.double().numpy()[m], rollout_BT.double().numpy()[m]
    x = a - b
    rho = np.exp(x)
    return {"discrepancy/abs_prob_diff": float(np.mean(np.abs(np.exp(a) - np.exp(b)))),
            "discrepancy/kl_k1": float(np.mean(-x)),
            "discrepancy/kl_k3": float(np.mean(rho - 1 - x)),
            "discrepancy/chi2": float(np.mean((rho - 1) ** 2)),
            "discrepancy/abs_log_ratio": float(np.mean(np.abs(x))),
            "discrepancy/extreme_rate_2": float(np.mean(np.abs(x) > math.log(2.0)))}


def test_fp32_floor_is_zero_and_values_match_a_direct_computation(tmp_path):
    cfg = load_config(None, _overrides(tmp_path, "fp32"))
    result = calibrate(cfg, batches=BATCHES, slack=SLACK, keep_batches=True)
    apd = result.row("discrepancy/abs_prob_diff")
    assert len(apd.values) == BATCHES
    assert 0 <= apd.mean <= 1e-6 and apd.p99 <= 1e-6
    assert result.row("discrepancy/extreme_rate_2").mean == 0
    assert result.row("routing/mismatch").mean <= 0.01  # MoE routes reported and (nearly) identical
    for n, kept in enumerate(result.kept):
        for key, ref in _direct(*kept).items():
            assert result.row(key).values[n] == pytest.approx(ref, rel=1e-6, abs=1e-12), key
    # the MLflow run is tagged as a calibration, one metric value per batch
    db = sqlite3.connect(tmp_path / "mlflow.db")  # the store beside the run folders
    tags = dict(db.execute("select key, value from tags where run_uuid = ?", (result.run_id,)).fetchall())
    steps = db.execute("select step from metrics where run_uuid = ? and key = 'discrepancy/abs_prob_diff' "
                       "order by step", (result.run_id,)).fetchall()
    db.close()
    assert tags["dcmdp.kind"] == "calibrate"
    assert [s for (s,) in steps] == list(range(1, BATCHES + 1))


def test_int8_floor_is_positive_and_snippet_loads_as_a_config(tmp_path):
    snippet = tmp_path / "tol.yaml"
    argv = ["calibrate", *_overrides(tmp_path, "int8"), "--batches", str(BATCHES), "--slack", str(SLACK),
            "--measures", "abs_prob_diff,kl_k3", "--out", str(snippet)]
    assert main(argv) == 0
    cfg = load_config(None, _overrides(tmp_path, "int8"))
    # the same seeds give the same batches: rerun in-process to read the numbers back
    result = calibrate(cfg, batches=BATCHES, slack=SLACK, measures=["abs_prob_diff", "kl_k3"], keep_batches=True)
    apd = result.row("discrepancy/abs_prob_diff")
    assert apd.mean > 1e-5  # weight-only int8 moves every probability a little
    for n, kept in enumerate(result.kept):
        ref = _direct(*kept)
        assert apd.values[n] == pytest.approx(ref["discrepancy/abs_prob_diff"], rel=1e-6)
    assert apd.mean == pytest.approx(np.mean(apd.values), rel=1e-12)
    loaded = load_config(snippet, [])
    assert [c.measure for c in loaded.dual.constraints] == ["abs_prob_diff", "kl_k3"]
    expected = [max(r.values) * (1 + SLACK) for r in (apd, result.row("discrepancy/kl_k3"))]  # q90 of 3 batches
    for c, want in zip(loaded.dual.constraints, expected):
        assert want <= c.tolerance <= want * 1.01 and c.tolerance == float(f"{c.tolerance:.3g}")
    # the snippet overrides only the constraints of a full config
    merged = load_config("configs/default.yaml", [])
    assert merged.dual.constraints[0].tolerance == 0.005


def test_floor_stats_against_numpy():
    rng = np.random.default_rng(0)
    values = rng.gamma(2.0, 1e-3, size=40)
    st = floor_stats("discrepancy/abs_prob_diff", values, slack=0.5, seed=1)
    assert st.mean == pytest.approx(values.mean(), rel=1e-12)
    assert (st.p50, st.p90, st.p99) == pytest.approx(tuple(np.percentile(values, [50, 90, 99])), rel=1e-12)
    assert st.ci_low < st.mean < st.ci_high
    # the interval of the mean is about +-1.96 standard errors wide
    se = values.std(ddof=1) / math.sqrt(len(values))
    assert (st.ci_high - st.ci_low) == pytest.approx(2 * 1.96 * se, rel=0.25)
    # c = 1.5 x the 36th of 40 sorted values (>= 90% of batches at or below it), rounded up to 3 digits
    q90 = np.sort(values)[35]
    assert np.mean(values <= q90) == 0.9 and 1.5 * q90 <= st.proposed <= 1.5 * q90 * 1.01
    assert st.proposed == float(f"{st.proposed:.3g}")
    assert proposed_tolerance(2.5e-4, 0.0) == 2.5e-4 and proposed_tolerance(1.2341e-3, 0.0) == 1.24e-3
    # a signed estimator with a negative floor proposes c = 0; equal batches give a point interval
    assert proposed_tolerance(-1e-4, 0.25) == 0.0
    flat = floor_stats("discrepancy/kl_k1", [2e-4] * 5, slack=0.25)
    assert (flat.ci_low, flat.ci_high, flat.proposed) == (2e-4, 2e-4, pytest.approx(2.5e-4))
    single = floor_stats("discrepancy/kl_k1", [2e-4], slack=0.25)
    assert math.isnan(single.ci_low) and single.mean == 2e-4


@pytest.mark.slow
def test_at_the_updates_c_lies_between_what_lambda_max_meets_and_d_hat_without_the_penalty(tmp_path):
    """dual.measure_at=drift: each batch's updates run without the penalty (D_0) and at lambda_max (D_max), from the
    same weights; c = (mean(D_max) (1 + slack) + mean(D_0)) / 2 when that lies under mean(D_0) (3 significant digits,
    rounded up), as a fixed tolerance; the snippet carries measure_at. The
    weights are put back after each pass: the floor rows equal those of a run without updates."""
    from dcmdp.calibrate import active_tolerance

    # the 20-step cold start answers nothing right (advantages 0): an entropy bonus moves the weights without a
    # penalty, and the mean penalty at lambda_max = 10 holds them back toward mu
    over = [*_overrides(tmp_path, "int8"), "algo.minibatches=4", "optim.lr=5e-3", "dual.penalty=mean",
            "algo.entropy_coef=0.5", "dual.measure_at=drift",
            "dual.constraints=[{measure: abs_prob_diff, floor_slack: 1.0, lambda_init: 0.1, lambda_max: 10}]"]
    result = calibrate(load_config(None, over), batches=BATCHES, slack=SLACK)
    free = result.row("constraint/0/abs_prob_diff/lambda_0")
    held = result.row("constraint/0/abs_prob_diff/lambda_max")
    floor = result.row("discrepancy/abs_prob_diff")
    # mini-batches 2-4 are scored after an optimiser step: a drift, smaller at lambda_max
    assert all(u > 10 * f for u, f in zip(free.values, floor.values))
    assert np.mean(held.values) < np.mean(free.values)
    (c,) = result.constraints
    low = np.mean(held.values) * (1 + SLACK)
    assert c.tolerance == active_tolerance(free.values, held.values, SLACK)[0]
    assert low < np.mean(free.values)  # the penalty moves D-hat by more than the slack here
    assert c.tolerance == proposed_tolerance((low + np.mean(free.values)) / 2, 0.0)
    assert low < c.tolerance < np.mean(free.values) * 1.01
    # an automatic tolerance on the drift is (1 + s) x the run's own drift, above D_0: the proposal is a fixed c
    assert c.floor_slack is None and "floor_slack set to null" in result.table()
    assert "constraint 0 (abs_prob_diff): c = " in result.table()
    snippet = load_config(tmp_path / "int8" / "calibration.yaml", [])
    assert snippet.dual.measure_at == "drift" and snippet.dual.constraints[0].floor_slack is None
    assert snippet.dual.constraints[0].tolerance == c.tolerance
    plain = calibrate(load_config(None, [*over[:-4], f"output_dir={tmp_path / 'plain'}"]), batches=BATCHES, slack=SLACK)
    assert plain.row("discrepancy/abs_prob_diff").values == floor.values


def test_active_tolerance_by_hand():
    from dcmdp.calibrate import active_tolerance

    # mean D_max 0.0016 x 1.25 = 0.002; halfway to mean(D_0) = 0.004: 0.003
    at_max = [0.001, 0.0012, 0.0011, 0.0013, 0.0015, 0.0014, 0.0016, 0.0018, 0.0021, 0.003]
    c, why = active_tolerance([0.004] * 10, at_max, 0.25)
    assert c == 0.003 and "halfway" in why
    # lambda_max does not bring D-hat under the unconstrained mean: c is what it meets on 90% of batches (the 9th
    # smallest of 10, 0.0021, x 1.25 = 0.002625 -> 0.00263), and the note says so
    c, why = active_tolerance([0.0019] * 10, at_max, 0.25)
    assert c == 0.00263 and "slack most of the time" in why


def test_perplexities_get_no_proposed_c(tmp_path):
    result = calibrate(load_config(None, _overrides(tmp_path, "int8")), batches=2, slack=SLACK)
    for name in ("discrepancy/training_ppl", "discrepancy/rollout_ppl"):
        row = result.row(name)
        assert math.isnan(row.proposed) and row.mean > 1.0  # a perplexity: >= 1, not a discrepancy
        (line,) = [x for x in result.table().splitlines() if x.startswith(name + " ")]
        assert line.rstrip().endswith("-")
    assert result.row("discrepancy/abs_prob_diff").proposed > 0


def test_calibrate_after_a_run_in_its_folder_takes_no_lock_and_keeps_its_checkpoints(tmp_path):
    """Calibrate trains nothing: run right after a training run in the same output_dir it succeeds, leaves the
    run's checkpoints and config.yaml as they were, and suggests deleting nothing. Overrides after an option work."""
    import os
    import subprocess
    import sys

    out = tmp_path / "int8"
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "OMP_NUM_THREADS": "1"}
    assert main(["train", *_overrides(tmp_path, "int8"), "steps=1", "algo.minibatches=1"]) == 0
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    config_yaml = (out / "config.yaml").read_text()
    done = subprocess.run([sys.executable, "-m", "dcmdp.cli", "calibrate", "--batches", "1",
                           *_overrides(tmp_path, "int8"), "--slack", "0.5", "algo.minibatches=1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "overwrite" not in done.stderr + done.stdout and "c = q90 x (1 + 0.5)" in done.stdout
    assert {p.relative_to(out): p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == before
    assert (out / "config.yaml").read_text() == config_yaml
    from mlflow.tracking import MlflowClient

    client = MlflowClient(local_store_uri(out))
    names = {r.info.run_name for r in client.search_runs([client.get_experiment_by_name("dcmdp").experiment_id])}
    folder = str(out).strip("/").replace("/", "-")
    assert names == {f"defaults/{folder}", f"defaults/{folder}/calibrate"}
    bad = subprocess.run([sys.executable, "-m", "dcmdp.cli", "calibrate", "--batches", "1", "--bogus", "x=1"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr


def test_at_the_updates_one_optimiser_carries_its_moments_across_the_batches(tmp_path, monkeypatch):
    """dual.measure_at=drift: a fresh AdamW's first steps move every weight by about lr (m / sqrt(v) = +-1 after bias
    correction), which overstated a run's drift ~2x on the default config; calibrate builds the config's optimiser once, so after
    BATCHES batches of N updates each every trained parameter's AdamW step count is BATCHES x N."""
    import dcmdp.calibrate as calibrate_module

    built, real = [], calibrate_module.build_optimizer

    def keep(params, cfg, *, seed):  # the real optimiser, kept to read its state afterwards
        built.append(real(params, cfg, seed=seed))
        return built[-1]

    monkeypatch.setattr(calibrate_module, "build_optimizer", keep)
    over = [*_overrides(tmp_path, "int8"), "algo.minibatches=2", "optim.lr=5e-3", "dual.penalty=mean",
            "dual.measure_at=drift", "dual.constraints=[{measure: abs_prob_diff, lambda_init: 10}]"]
    calibrate(load_config(None, over), batches=BATCHES, slack=SLACK)
    (optimizer,) = built
    steps = {int(st["step"]) for st in optimizer.state.values()}
    assert steps == {BATCHES * 2}


@pytest.mark.slow
def test_the_proposed_c_applied_to_the_same_config_keeps_the_dual_active_and_is_met(tmp_path, monkeypatch):
    """Calibrate, then train the same config with the proposed c (and floor_slack): lambda neither stays at 0 (the
    dual acted) nor sits at its cap (c is feasible), and D-hat is inside c on a good share of the steps."""
    from dcmdp.loop import SLACK_FRAC, train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    over = [*_overrides(tmp_path, "int8"), "algo.minibatches=4", "optim.lr=5e-3", "dual.penalty=mean",
            "algo.entropy_coef=0.5", "dual.measure_at=drift", "dual.relative=true", "dual.rule=projected",
            "dual.constraints=[{measure: abs_prob_diff, floor_slack: 1.0, lambda_init: 0.1, lambda_max: 10, lr: 1.0}]"]
    (c,) = calibrate(load_config(None, over), batches=4, slack=SLACK).constraints
    summary = train(load_config(None, [*over, f"output_dir={tmp_path / 'run'}", "steps=8",
                                       f"dual.constraints[0].tolerance={c.tolerance}",
                                       "dual.constraints[0].floor_slack=null"]))
    assert c.floor_slack is None
    s = summary.constraints["abs_prob_diff"]
    assert s.slack_frac < SLACK_FRAC and s.lambda_mean > 0.0
    assert s.cap_frac <= 0.5 and s.inside_frac >= 0.25, s
    assert not [w for w in summary.warnings if "infeasible" in w or "sat at its cap" in w]


def _anchored_overrides(tmp_path) -> list[str]:
    return [*_overrides(tmp_path, "int8"), "algo.minibatches=2", "optim.lr=5e-3", "dual.rule=chance",
            "dual.measure_at=updates", "steps=8",
            "dual.constraints=[{measure: abs_prob_diff, floor_slack: 1.0, anchor: 0.5, anchor_start: 2, "
            "anchor_batches: 3, lambda_init: 0.1, lambda_max: 0.3, lr: 0.02}]"]


def test_at_the_updates_calibrate_proposes_the_c_the_anchored_run_sets(tmp_path, monkeypatch):
    """dual.measure_at=updates: calibrate runs the config's first steps as the run does (same seed, batches, updates,
    probes) until the anchor's window closes, and proposes the tolerance the run then puts in force, rounded up to 3
    significant digits, as a fixed c; the training run with the same config holds that c from the next step on."""
    from dcmdp.loop import train
    from tests.runs import metric_history

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    over = _anchored_overrides(tmp_path)
    result = calibrate(load_config(None, over), batches=3, slack=SLACK)
    (c,) = result.constraints
    assert c.anchor is None and c.floor_slack is None
    assert {"constraint/0/abs_prob_diff/lambda_0", "constraint/0/abs_prob_diff/lambda_max"} <= {r.name for r in
                                                                                                 result.rows}
    summary = train(load_config(None, [*over, f"output_dir={tmp_path / 'run'}"]))
    gaps = metric_history(summary, "dual/anchor_gap/abs_prob_diff")
    assert len(gaps) == 1  # one window: steps 3-5 (0-based 2-4)
    in_force = metric_history(summary, "dual/tolerance/abs_prob_diff")[5]  # step 6: the first c after the window
    assert c.tolerance == proposed_tolerance(in_force, 0.0)


@pytest.mark.slow
def test_the_default_trained_with_calibrates_proposal_holds_its_constraint(tmp_path, monkeypatch):
    """configs/default.yaml (its cold start, 2-digit addition, int8 rollouts): calibrate's proposed c, applied as a
    fixed tolerance for 80 RL steps, gets a dual that acts and holds: lambda > 0.01 on >= 50% of the steps, at its
    cap on <= 20%, D-hat inside c on >= 70%."""
    from dcmdp.loop import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    over = [f"output_dir={tmp_path / 'cal'}", "progress=false"]
    (c,) = calibrate(load_config("configs/default.yaml", over), batches=8, slack=SLACK).constraints
    summary = train(load_config("configs/default.yaml", [
        f"output_dir={tmp_path / 'run'}", "progress=false", "steps=80", f"dual.constraints[0].tolerance={c.tolerance}",
        "dual.constraints[0].floor_slack=null", "dual.constraints[0].anchor=null", "dual.constraints[0].authority=null"]))
    s = summary.constraints["abs_prob_diff"]
    assert s.acting_frac >= 0.5 and s.cap_frac <= 0.2 and s.inside_frac >= 0.7, s
