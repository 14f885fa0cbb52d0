"""λ in one click: the experiment is a training experiment for MLflow 3, the dual's overview is the first chart
section, and the link a run prints opens its charts in the training layout; against the real server the tests start."""

from __future__ import annotations

import logging
import math
import urllib.request
import uuid
from pathlib import Path

from mlflow.tracking import MlflowClient

from dcmdp.config import TrackingConfig
from dcmdp.tracking import EXPERIMENT_TAGS, OVERVIEW, UI_LAYOUT, Tracker, dual_overview, ui_link

# the sections a default run's metrics make (their prefixes), among which the overview must come first
SECTIONS = ["advantage/abs_mean", "clip/frac", "discrepancy/abs_prob_diff", "dual/lambda/abs_prob_diff",
            "eval/accuracy", "guard/bad_step", "is/weight_max", "loss/total", "optim/lr", "policy/entropy",
            "reward/mean", "rollout/precision_bits", "routing/mismatch", "throughput/tokens", "time/step", "Zeta/x"]


def _cfg(uri: str, tmp_path: Path) -> TrackingConfig:
    return TrackingConfig(uri=uri, experiment=f"ui-{uuid.uuid4().hex[:8]}", run_name="ui",
                          buffer_dir=str(tmp_path / "buffer"))


def test_the_overview_is_the_first_section_with_lambda_its_cap_d_hat_and_c(mlflow_server, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dcmdp.tracking")
    tracker = Tracker(_cfg(mlflow_server.uri, tmp_path), tmp_path, dual_caps={"abs_prob_diff": 0.3, "kl_k3": math.inf})
    run_id = tracker.start({"p": "1"})
    for step in (1, 2):
        tracker.log_metrics({"dual/lambda/abs_prob_diff": 0.1 * step, "dual/measured/abs_prob_diff": 0.004,
                             "dual/tolerance/abs_prob_diff": 0.003, "dual/lambda/kl_k3": 0.5,
                             "dual/lambda_avg/abs_prob_diff": 0.05, "reward/mean": 0.5}, step)
    tracker.finish()

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    metrics = run.data.metrics
    assert metrics[f"{OVERVIEW}/abs_prob_diff/lambda"] == 0.2 == metrics["dual/lambda/abs_prob_diff"]
    assert metrics[f"{OVERVIEW}/abs_prob_diff/lambda_max"] == 0.3
    assert metrics[f"{OVERVIEW}/abs_prob_diff/measured"] == 0.004
    assert metrics[f"{OVERVIEW}/abs_prob_diff/tolerance"] == 0.003
    # an unbounded lambda has no cap line; only lambda, the cap, D-hat and c are repeated
    assert f"{OVERVIEW}/kl_k3/lambda" in metrics and f"{OVERVIEW}/kl_k3/lambda_max" not in metrics
    assert sorted(k for k in metrics if k.startswith(OVERVIEW)) == [
        f"{OVERVIEW}/abs_prob_diff/lambda", f"{OVERVIEW}/abs_prob_diff/lambda_max",
        f"{OVERVIEW}/abs_prob_diff/measured", f"{OVERVIEW}/abs_prob_diff/tolerance", f"{OVERVIEW}/kl_k3/lambda"]
    assert [m.step for m in client.get_metric_history(run_id, f"{OVERVIEW}/abs_prob_diff/lambda")] == [1, 2]

    # sections follow the key order: the overview's prefix comes first byte-wise and case-insensitively
    keys = [*SECTIONS, *metrics]
    for order in (sorted(keys), sorted(keys, key=str.casefold)):
        assert order[0].split("/")[0] == OVERVIEW

    # a training experiment for MLflow 3 (the tag the UI reads), and a link that opens the run in that layout
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags.get("mlflow.experimentKind") == EXPERIMENT_TAGS["mlflow.experimentKind"] == \
        "custom_model_development"
    link = tracker.ui_link()
    assert link == (f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run_id}/model-metrics?"
                    f"workflowType=machine_learning")
    assert f"section {OVERVIEW}) at {link}" in caplog.text  # at the start of the run
    assert f"run {run_id} first (section {OVERVIEW}) at {link}" in caplog.text  # and again at its end
    with urllib.request.urlopen(link.split("#")[0], timeout=30) as page:  # the server serves the UI the link opens
        assert page.status == 200 and b"<html" in page.read().lower()


def test_the_installed_ui_reads_the_layout_parameter_of_the_link():
    # MLflow 3.17's UI ignores the experiment tag for its layout and reads its workflow switch, which a link's
    # workflowType parameter sets: if an MLflow upgrade drops that parameter, the printed link loses its point
    import mlflow

    key, value = UI_LAYOUT.split("=")
    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    texts = [p.read_text(errors="replace") for p in bundle.glob("main.*.js")]
    assert texts and any(f'get("{key}")' in t and f'"{value}"' in t for t in texts)


def test_the_link_of_a_local_store_points_at_mlflow_ui_and_drops_credentials():
    assert ui_link("sqlite:////runs/mlflow.db", "3", "abc") == \
        "http://127.0.0.1:5000/#/experiments/3/runs/abc/model-metrics?workflowType=machine_learning"
    assert ui_link("https://me:secret@mlflow.example.org:8443/prefix?x=1", "1", "r").startswith(
        "https://mlflow.example.org:8443/prefix/#/experiments/1/runs/r/")


def test_the_overview_of_a_step_without_dual_metrics_is_empty():
    assert dual_overview({"reward/mean": 1.0, "dual/skipped": 0.0}, {"a": 0.3}) == {}
    assert dual_overview({"dual/measured/a": 0.1}, {"a": 0.3}) == {f"{OVERVIEW}/a/measured": 0.1}


def test_dcmdp_ui_serves_the_store_of_a_configs_runs_and_prints_the_charts_link(tmp_path):
    """``dcmdp ui`` on the store beside the config's output folder: the link it prints opens every run of the
    experiment as charts in the training layout, and the server it becomes answers on the given port."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from dcmdp.tracking import UI_CHARTS

    out = tmp_path / "outputs" / "default"
    tracker = Tracker(TrackingConfig(experiment="ui-test", run_name="a"), out)
    run_id = tracker.start({"p": "1"})
    tracker.finish()
    experiment_id = MlflowClient(tracker.tracking_uri).get_run(run_id).info.experiment_id
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    log = tmp_path / "ui.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "ui", f"output_dir={out}", "tracking.experiment=ui-test",
                                 "--port", str(port)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as page:
                    assert page.status == 200 and b"<html" in page.read().lower()
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    first = log.read_text().splitlines()[0]
    assert first.endswith(f"at http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs?{UI_CHARTS}&{UI_LAYOUT}")
    assert "of experiment 'ui-test' side by side (section 0_dual first)" in first


def test_the_installed_ui_reads_the_charts_parameter_of_the_experiment_link():
    # the experiment page's table/charts switch comes from this query parameter in MLflow 3.17's UI
    import mlflow

    from dcmdp.tracking import UI_CHARTS

    key, value = UI_CHARTS.split("=")
    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    texts = [p.read_text(errors="replace") for p in bundle.glob("*.js")]
    # the parameter's name where the page reads it, and the charts view among the switch's values
    assert any(f'"{key}"' in t and '.get(' in t for t in texts)
    assert any(f'value:"{value}"' in t for t in texts)
