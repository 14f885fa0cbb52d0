"""write_report on two short runs in a local store: numbers worked out by hand."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import pytest

from dcmdp.config import TrackingConfig
from dcmdp.report import write_report
from dcmdp.tracking import Tracker


def log_run(out: Path, name: str, steps: int, constraints: dict[str, float], accuracy: dict[int, float],
            tags: Optional[dict[str, str]] = None, parent: Optional[str] = None) -> str:
    """λ_t = 0.125 t and D_t = 0.25 + 0.0625 t (dyadic, exact in binary) for every constraint."""
    tracker = Tracker(TrackingConfig(experiment="report-test", run_name=name, parent_run_id=parent), out)
    run_id = tracker.start({"steps": str(steps)}, tags=tags)
    for t in range(steps):
        metrics = {}
        for c, tol in constraints.items():
            metrics |= {f"dual/lambda/{c}": 0.125 * t, f"dual/measured/{c}": 0.25 + 0.0625 * t,
                        f"dual/tolerance/{c}": tol}
        if t in accuracy:
            metrics["eval/accuracy"] = accuracy[t]
        tracker.log_metrics(metrics, t)
    tracker.finish("FINISHED" if name == "a" else "FAILED")
    return run_id


def test_report_numbers_from_two_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # two run folders side by side: one store, beside them
    id_a = log_run(tmp_path / "a", "a", 10, {"abs_prob_diff": 0.5}, {0: 0.25, 9: 0.5})
    id_b = log_run(tmp_path / "b", "b", 6, {"abs_prob_diff": 0.375, "kl_k3": 1.0}, {})
    uri = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"

    md = write_report(["report-test"], tmp_path / "rep", tracking_uri=uri)
    rows = list(csv.DictReader(open(tmp_path / "rep" / "report.csv")))
    by = {(r["run_id"], r["constraint"]): r for r in rows}
    assert len(rows) == 3

    # Run a, 10 steps: final λ = 0.125*9 = 1.125; mean λ = 0.125*4.5 = 0.5625;
    # mean D = 0.25 + 0.0625*4.5 = 0.53125; final D = 0.25 + 0.0625*9 = 0.8125;
    # D <= 0.5 for t = 0..4 -> 5 of 10 steps.
    a = by[(id_a, "abs_prob_diff")]
    assert (a["run_name"], a["status"], int(a["steps"])) == ("a", "FINISHED", 10)
    assert float(a["lambda_final"]) == 1.125 and float(a["lambda_mean"]) == 0.5625
    assert float(a["measured_mean"]) == 0.53125 and float(a["measured_final"]) == 0.8125
    assert float(a["tolerance"]) == 0.5 and float(a["within_tolerance_frac"]) == 0.5
    assert float(a["eval_accuracy_final"]) == 0.5

    # Run b, 6 steps: final λ = 0.625, mean λ = 0.3125, mean D = 0.25 + 0.0625*2.5 = 0.40625;
    # abs_prob_diff: D <= 0.375 for t = 0..2 -> 3 of 6; kl_k3 (c = 1): all 6; no accuracy logged.
    b1, b2 = by[(id_b, "abs_prob_diff")], by[(id_b, "kl_k3")]
    assert (b1["status"], int(b1["steps"]), b1["eval_accuracy_final"]) == ("FAILED", 6, "")
    assert float(b1["lambda_final"]) == 0.625 and float(b1["lambda_mean"]) == 0.3125
    assert float(b1["measured_mean"]) == 0.40625
    assert float(b1["within_tolerance_frac"]) == 0.5 and float(b2["within_tolerance_frac"]) == 1.0

    text = md.read_text()
    assert md == tmp_path / "rep" / "report.md"
    assert f"| a | `{id_a}` | FINISHED | 10 | 0.5 |" in text
    assert f"| b | `{id_b}` | FAILED | 6 | – |" in text
    assert "| abs_prob_diff | 0.5 | 1.125 | 0.5625 | 0.5312 | 0.8125 | 50% |" in text
    assert "| kl_k3 | 1 | 0.625 | 0.3125 | 0.4062 | 0.5625 | 100% |" in text
    png = tmp_path / "rep" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

    # A run id selects that run only; an unknown name is an error that says what it expected.
    write_report([id_b], tmp_path / "one", tracking_uri=uri)
    assert {r["run_id"] for r in csv.DictReader(open(tmp_path / "one" / "report.csv"))} == {id_b}
    with pytest.raises(ValueError, match="neither an experiment name nor a run id"):
        write_report(["no-such-experiment"], tmp_path / "bad", tracking_uri=uri)


def test_calibrate_and_tune_runs_are_kept_apart_from_training_runs(tmp_path, monkeypatch):
    """One experiment, the runs of three commands: report lists the training runs, counts the others, and reports
    them when asked; a user's own nesting (a parent that is not a tune study) stays a training run."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    train = log_run(tmp_path / "default", "default", 3, {"abs_prob_diff": 0.5}, {})
    calib = log_run(tmp_path / "default", "default/calibrate", 2, {}, {}, tags={"dcmdp.kind": "calibrate"})
    study = log_run(tmp_path / "tune", "tune-s", 1, {}, {}, tags={"dcmdp.tune": "parent"})
    trial = log_run(tmp_path / "t000", "s-t000", 3, {"abs_prob_diff": 0.5}, {}, parent=study)
    mine = log_run(tmp_path / "nested", "nested", 3, {"abs_prob_diff": 0.5}, {}, parent=train)

    def reported(out: str, **kwargs) -> set[str]:
        write_report(["report-test"], tmp_path / out, tracking_uri=uri, **kwargs)
        return {r["run_id"] for r in csv.DictReader(open(tmp_path / out / "report.csv"))}

    assert reported("train") == {train, mine}
    assert "Left out: 1 calibrate run, 2 tune runs of the experiment" in (tmp_path / "train" / "report.md").read_text()
    assert reported("calibrate", kinds=("calibrate",)) == {calib}
    assert reported("tune", kinds=("tune",)) == {study, trial}
    assert reported("all", kinds=("train", "calibrate", "tune")) == {train, calib, study, trial, mine}
    assert "Left out" not in (tmp_path / "all" / "report.md").read_text()
    write_report([calib], tmp_path / "by-id", tracking_uri=uri)  # named by its id: reported whatever its kind
    assert {r["run_id"] for r in csv.DictReader(open(tmp_path / "by-id" / "report.csv"))} == {calib}


def test_plot_dual_one_row_per_constraint(tmp_path):
    from matplotlib.image import imread

    from dcmdp.plots import plot_dual

    # Tolerance changes at step 2 (drawn as steps); the kl_k3 keys are missing at step 0.
    history = [{"dual/lambda/a": 0.1 * t, "dual/measured/a": 0.01 * t, "dual/tolerance/a": 0.02 if t < 2 else 0.03}
               | ({"dual/lambda/b": 1.0, "dual/measured/b": 0.5, "dual/tolerance/b": 0.4} if t else {})
               for t in range(5)]
    one = imread(plot_dual(history, ["a"], tmp_path / "one.png"))
    two = imread(plot_dual(history, ["a", "b"], tmp_path / "two.png"))
    # Height is (2.6 rows + 0.6) inches at 110 dpi: 352 px for one constraint, 638 px for two.
    assert (one.shape[0], two.shape[0]) == (352, 638) and one.shape[1] == two.shape[1] == 1210
    assert one.std() > 0.05  # something was drawn on the white canvas


def test_dual_png_starts_lambda_at_lambda_init_and_draws_the_cap():
    from dcmdp.plots import dual_figure

    # lambda is logged after each step's dual update, from step 1; the run starts at lambda_init = 0.1
    history = [{"step": t, "dual/lambda/a": 0.0, "dual/measured/a": 0.001, "dual/tolerance/a": 0.002}
               for t in range(1, 4)]
    fig = dual_figure(history, ["a"], lambda_init={"a": 0.1}, lambda_max={"a": 0.3})
    ax_lam = fig.axes[0]
    lam, cap = ax_lam.lines
    assert list(lam.get_xdata()) == [0, 1, 2, 3] and list(lam.get_ydata()) == [0.1, 0.0, 0.0, 0.0]
    assert list(cap.get_ydata()) == [0.3, 0.3] and cap.get_label() == "cap λ_max = 0.3"
    # no cap line for an unbounded lambda, and no invented step 0 without lambda_init
    bare = dual_figure(history, ["a"], lambda_max={"a": float("inf")}).axes[0]
    assert len(bare.lines) == 1 and list(bare.lines[0].get_xdata()) == [1, 2, 3]


def test_report_draws_a_sparse_series_as_points_and_a_dense_one_as_a_line():
    from dcmdp.plots import FEW_POINTS, runs_figure

    dense = [(t, 0.01 * t) for t in range(1, FEW_POINTS + 1)]
    fig = runs_figure({"run": {"eval/accuracy": [(0, 0.25), (650, 0.63)], "dual/lambda/a": dense}},
                      ["eval/accuracy", "dual/lambda/a"])
    (acc,), (lam,) = fig.axes[0].lines, fig.axes[1].lines
    # two evaluations, before and after RL: two markers, no line claiming a trend between them
    assert acc.get_linestyle() == "None" and acc.get_marker() == "o" and list(acc.get_xdata()) == [0, 650]
    assert lam.get_linestyle() == "-" and lam.get_marker() in (None, "None", "")
