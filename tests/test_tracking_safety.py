"""Tracking inputs MLflow would reject late (a file store, an empty experiment name), secrets read from the
environment or written into a URI, and a buffer line of bytes that are not UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.config import ConfigError, TrackingConfig, flatten, load_config, to_yaml
from dcmdp.redact import public_uri
from dcmdp.tracking import Tracker, check_tracking_config, sync_report

BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=4", "threads=1", "progress=false", "rollout.max_new_tokens=4"]


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)


@pytest.mark.parametrize("uri", ["file:///tmp/mlruns", "/tmp/mlruns", "mlruns"])
def test_a_file_store_uri_is_refused_before_the_run_unless_mlflow_allows_it(tmp_path, monkeypatch, capsys, uri):
    with pytest.raises(ConfigError, match=r"config error at 'tracking.uri': '.*' is a file store, which MLflow "
                                          r"\S+ refuses to open .*MLFLOW_ALLOW_FILE_STORE=true"):
        check_tracking_config(TrackingConfig(uri=uri), tmp_path)
    out = tmp_path / "out"
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=1", f"tracking.uri={uri}"]) == 2
    err = capsys.readouterr().err
    assert "is a file store" in err and "'file'" not in err.split("use one of the schemes")[1] and not out.exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_tracking_config(TrackingConfig(uri=uri), tmp_path)


@pytest.mark.parametrize("name, why", [("", "Invalid experiment name: ''"), ("   ", "a blank name")])
def test_an_empty_experiment_name_is_refused_before_the_run(tmp_path, capsys, name, why):
    with pytest.raises(ConfigError, match=f"config error at 'tracking.experiment': {why}"):
        check_tracking_config(TrackingConfig(experiment=name), tmp_path)
    out = tmp_path / "out"
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=1", f"tracking.experiment={name}"]) == 2
    assert not out.exists()


def test_a_bad_parent_run_id_and_an_overlong_run_name_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="'tracking.parent_run_id': '../x' is not an MLflow run id"):
        check_tracking_config(TrackingConfig(parent_run_id="../x"), tmp_path)
    with pytest.raises(ConfigError, match="'tracking.run_name': 300 characters"):
        check_tracking_config(TrackingConfig(run_name="r" * 300), tmp_path)


def test_values_from_the_environment_and_uri_passwords_are_redacted_in_params_and_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("DCMDP_TEST_TOKEN", "s3cr3t-token-value")
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("tracking:\n  uri: http://me:${oc.env:DCMDP_TEST_TOKEN}@127.0.0.1:5000\n"
                        "  run_name: ${oc.env:DCMDP_TEST_TOKEN}\n")
    cfg = load_config(str(cfg_file), [])
    assert cfg.tracking.uri == "http://me:s3cr3t-token-value@127.0.0.1:5000"  # the client still gets it
    flat = flatten(cfg)
    # recorded as written: the interpolation, never its value
    assert flat["tracking.uri"] == "http://me:${oc.env:DCMDP_TEST_TOKEN}@127.0.0.1:5000"
    assert flat["tracking.run_name"] == "${oc.env:DCMDP_TEST_TOKEN}"
    assert "s3cr3t" not in to_yaml(cfg, public=True) and "s3cr3t" in to_yaml(cfg)
    # a password written into a URI by hand is left out with its userinfo
    assert public_uri("postgresql://bob:hunter22@db:5432/mlflow") == "postgresql://db:5432/mlflow"
    assert public_uri("http://127.0.0.1:5000/path") == "http://127.0.0.1:5000/path"


def test_a_secret_in_the_tracking_uri_reaches_no_file_param_or_console_line(tmp_path, monkeypatch, capsys,
                                                                            mlflow_server):
    secret = "pw-from-the-env-4711"
    monkeypatch.setenv("DCMDP_TEST_PW", secret)
    host = mlflow_server.uri.split("://", 1)[1]
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(f"tracking:\n  uri: http://dcmdp:${{oc.env:DCMDP_TEST_PW}}@{host}\n")
    out = tmp_path / "out"
    assert cli.main(["train", str(cfg_file), *BASE, f"output_dir={out}", "steps=1"]) == 0
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err and f"MLflow run {summary_id(out)} at http://{host}" in captured.out
    assert secret not in (out / "config.yaml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert secret not in json.dumps(summary)
    run = MlflowClient(mlflow_server.uri).get_run(summary["run_id"])
    assert run.data.params["tracking.uri"] == f"http://dcmdp:${{oc.env:DCMDP_TEST_PW}}@{host}"
    assert secret not in json.dumps(run.data.params)
    state = torch.load(next((out / "checkpoints").iterdir()) / "state.pt", weights_only=False)
    assert secret not in json.dumps(state["config"])


def summary_id(out: Path) -> str:
    return json.loads((out / "summary.json").read_text())["run_id"]


def test_a_buffer_line_of_bytes_that_are_not_utf8_is_skipped_and_never_blocks_the_rest(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    buffer_dir = tmp_path / "run" / "buffer"
    tracker = Tracker(TrackingConfig(uri=closed, buffer_dir=str(buffer_dir)), buffer_dir.parent)
    tracker.start({"p": "1"})
    tracker.log_metrics({"m": 1.0}, step=1)
    tracker.flush()
    [segment] = buffer_dir.glob("*.jsonl")
    with open(segment, "ab") as f:
        f.write(b"\xff\xfe\xfa\xfb\n")  # four bytes that are not UTF-8
        f.write(b"[1, 2]\n")  # JSON, but not a record
    tracker.log_metrics({"m": 2.0, "n": 3.0}, step=2)
    tracker.finish()
    store = f"sqlite:///{tmp_path / 'store.db'}"
    report = sync_report(buffer_dir, tracking_uri=store)
    assert report.sent == 3
    assert [line.split(": ", 1)[1] for line in report.remaining] == [
        "a segment with unreadable lines, kept for inspection (its readable records were sent); remove it once "
        "inspected"]
    client = MlflowClient(store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.metrics == {"m": 2.0, "n": 3.0}


def _closed_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_an_unwritable_buffer_during_an_outage_is_one_error_and_a_count_not_one_per_step(tmp_path, caplog):
    """What a full disk does to the tracker: every step's metrics can be neither sent nor buffered. One error when it
    starts and the count at the end, so a checkpoint error that follows is not buried in repeats."""
    import logging

    (tmp_path / "disk").write_text("")  # a buffer folder under a file: every write fails, as on a full disk
    buffer_dir = tmp_path / "disk" / "buffer"
    with caplog.at_level(logging.WARNING):
        tracker = Tracker(TrackingConfig(uri=f"http://{_closed_port()}", buffer_dir=str(buffer_dir),
                                         async_log=False), tmp_path)
        tracker.start({"p": "1"})
        for step in range(1, 6):
            tracker.log_metrics({"m": float(step)}, step=step)
        tracker.finish()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and errors[0].startswith(f"cannot write the tracking buffer in {buffer_dir}")
    assert errors[1].startswith("8 tracking records of run ") and not any(r.exc_info for r in caplog.records)


def test_a_password_in_the_uri_is_not_in_the_outage_warning(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        tracker = Tracker(TrackingConfig(uri=f"http://me:hunter22secret@{_closed_port()}",
                                         buffer_dir=str(tmp_path / "b"), async_log=False), tmp_path)
        tracker.start({"p": "1"})
        tracker.finish()
    assert "MLflow tracking at http://127.0.0.1:" in caplog.text and "hunter22secret" not in caplog.text


def test_a_damaged_segment_header_is_reported_not_a_crash(tmp_path):
    buffer_dir = tmp_path / "buffer"
    tracker = Tracker(TrackingConfig(uri=f"http://{_closed_port()}", buffer_dir=str(buffer_dir), async_log=False),
                      tmp_path)
    tracker.start({"p": "1"})
    tracker.finish()
    [segment] = buffer_dir.glob("*.jsonl")
    data = segment.read_bytes()
    segment.write_bytes(b"\xff\xfe" + data[2:])
    report = sync_report(buffer_dir)
    assert report.remaining == [f"{segment}: names no tracking URI; pass one with --tracking-uri"]
