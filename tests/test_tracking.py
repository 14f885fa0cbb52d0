"""Tracker against a real MLflow server and the default local store: nothing lost, nothing twice."""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import time
import uuid
from pathlib import Path

from mlflow.tracking import MlflowClient

from dcmdp.config import TrackingConfig
from dcmdp.tracking import LOCAL_ID_TAG, NoTracker, Tracker, resolve_tracking_uri, sync_buffer

KEYS = ["dual/lambda/abs_prob_diff", "dual/measured/abs_prob_diff", "reward/mean"]


def value(key: str, step: int) -> float:
    """A distinct, non-round value per (key, step): equality below checks the exact double."""
    return (KEYS.index(key) + 1) * 1000.0 + step / 7.0


def cfg_for(uri: str | None, tmp_path: Path) -> TrackingConfig:
    return TrackingConfig(uri=uri, experiment=f"test-{uuid.uuid4().hex[:8]}", run_name="t",
                          buffer_dir=str(tmp_path / "buffer"))


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def assert_every_step_once(client: MlflowClient, run_id: str, steps: range) -> None:
    for key in KEYS:
        hist = history(client, run_id, key)
        assert [s for s, _, _ in hist] == list(steps), key
        assert [v for _, v, _ in hist] == [value(key, s) for s in steps], key
        # Replays keep the time of the original call: timestamps follow the steps.
        ts = [t for _, _, t in hist]
        assert ts == sorted(ts), key


def log_steps(tracker: Tracker, steps: range) -> None:
    """The producer: one metrics dict per step, like the training loop."""
    for step in steps:
        tracker.log_metrics({k: value(k, step) for k in KEYS}, step)


def store_attempts(tracker: Tracker, monkeypatch) -> list[tuple[str, bool]]:
    """Each time ``tracker`` sends to its store from now on, as (the thread that sends, whether it sends inside the
    back-off window of an earlier failure); the sending itself is unchanged."""
    attempts: list[tuple[str, bool]] = []
    send = tracker._sender.send

    def recorded(records):
        attempts.append((threading.current_thread().name, time.monotonic() < tracker._retry_at))
        return send(records)

    monkeypatch.setattr(tracker._sender, "send", recorded)
    return attempts


def leftover_segments(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "buffer").glob("*.jsonl"))


def test_no_tracker_answers_every_tracker_call(tmp_path):
    """Ranks >= 1 under torchrun hold a NoTracker where rank 0 holds a Tracker: every public call of the one (dcmdp
    calibrate's set_tags included) is a no-op of the other."""
    public = {n for n in dir(Tracker) if not n.startswith("_")}
    assert public <= set(dir(NoTracker)), public - set(dir(NoTracker))
    t = NoTracker()
    t.start({"a": "1"}, run_id=None, tags={})
    t.set_tags({"dcmdp.kind": "calibrate"})
    t.log_metrics({"m": 1.0}, step=1)
    t.log_artifact(tmp_path / "x")
    t.skip_logged(after_step=3)
    t.flush()
    t.finish("FAILED")
    assert t.run_id is None


def test_explicit_uri_wins_over_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example.invalid:1")
    assert resolve_tracking_uri(TrackingConfig(), tmp_path) == "http://example.invalid:1"
    assert resolve_tracking_uri(TrackingConfig(uri="sqlite:///a.db"), tmp_path) == "sqlite:///a.db"


def test_default_local_store_needs_no_server(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = TrackingConfig()
    out = tmp_path / "out"
    assert resolve_tracking_uri(cfg, out) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    tracker = Tracker(cfg, out)
    run_id = tracker.start({"seed": "5"})
    assert not run_id.startswith("local-")
    log_steps(tracker, range(4))
    tracker.log_metrics({"eval/note": "n/a"}, 4)  # not a number: skipped with a warning, no exception
    (tmp_path / "config.yaml").write_text("seed: 5\n")
    tracker.log_artifact(tmp_path / "config.yaml")
    tracker.finish()
    assert tracker.buffered == 0 and not (out / "tracking_buffer").exists()
    client = MlflowClient(tracker.tracking_uri)
    assert_every_step_once(client, run_id, range(4))
    assert client.get_metric_history(run_id, "eval/note") == []
    assert (tmp_path / "mlflow.db").is_file() and not (out / "mlflow.db").exists()
    assert list((tmp_path / "mlartifacts").rglob("config.yaml"))


def test_runs_in_two_folders_share_one_store_and_a_folder_with_its_own_keeps_it(tmp_path, monkeypatch):
    """outputs/a and outputs/b log to outputs/mlflow.db, one experiment holding both runs; a run folder that holds
    a store of its own (made for it, or by an earlier layout) keeps logging there, so its run is continued there."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # relative output folders, as the README's commands give them
    uris, ids = [], []
    for name in ("a", "b"):
        tracker = Tracker(TrackingConfig(run_name=name), f"outputs/{name}")
        ids.append(tracker.start({"seed": "0"}))
        tracker.log_metrics({"dual/lambda/abs_prob_diff": 0.1}, 1)
        tracker.finish()
        uris.append(tracker.tracking_uri)
    assert uris[0] == uris[1] == f"sqlite:///{tmp_path.resolve() / 'outputs' / 'mlflow.db'}"
    client = MlflowClient(uris[0])
    exp = client.get_experiment_by_name("dcmdp")
    assert {r.info.run_id for r in client.search_runs([exp.experiment_id])} == set(ids)
    own = tmp_path / "outputs" / "own"
    own.mkdir()
    MlflowClient(f"sqlite:///{own / 'mlflow.db'}").search_experiments()  # a store made for this folder
    assert resolve_tracking_uri(TrackingConfig(), own) == f"sqlite:///{own / 'mlflow.db'}"


def test_metrics_and_batched_params_read_back_exactly(mlflow_server, tmp_path):
    # 250 params need 3 log_batch requests (100 each); one value is longer than MLflow's 6000 limit.
    params = {f"p.{i:03d}": f"v{i}" for i in range(250)}
    params["model.long"] = "x" * 7000
    tracker = Tracker(cfg_for(mlflow_server.uri, tmp_path), tmp_path)
    run_id = tracker.start(params, tags={"purpose": "test"})
    log_steps(tracker, range(25))
    tracker.log_metrics({"dual/measured/nan_case": float("nan")}, step=25)
    tracker.set_tags({"phase": "done"})
    tracker.finish()

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    assert len(run.data.params) == 251
    assert run.data.params["p.137"] == "v137"
    assert run.data.params["model.long"] == "x" * 6000
    assert run.data.tags["purpose"] == "test" and run.data.tags["phase"] == "done"
    assert_every_step_once(client, run_id, range(25))
    nan_hist = client.get_metric_history(run_id, "dual/measured/nan_case")
    assert len(nan_hist) == 1 and math.isnan(nan_hist[0].value)
    assert tracker.buffered == 0 and not leftover_segments(tmp_path)


def test_resume_appends_to_the_same_run_and_keeps_params(mlflow_server, tmp_path, caplog):
    cfg = cfg_for(mlflow_server.uri, tmp_path)
    first = Tracker(cfg, tmp_path)
    run_id = first.start({"seed": "3", "lr": "1e-6"})
    log_steps(first, range(0, 4))
    first.finish("KILLED")

    caplog.set_level(logging.WARNING, logger="dcmdp.tracking")
    second = Tracker(cfg, tmp_path)
    assert second.start({"seed": "3", "lr": "2e-6", "new": "x"}, run_id=run_id) == run_id
    log_steps(second, range(4, 9))
    second.finish()
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    # MLflow params are immutable: the changed one keeps its first value (with a warning), new keys land.
    assert run.data.params == {"seed": "3", "lr": "1e-6", "new": "x"}
    assert any("lr" in r.getMessage() for r in caplog.records)
    assert_every_step_once(client, run_id, range(9))


def test_sync_replays_leftover_once_even_across_a_crash(mlflow_server, tmp_path):
    """A tracker whose local store cannot be opened buffers everything; sync sends it to a server.

    Replaying the segment again from scratch (a crash before the sent offset was written, and the
    run map lost) adds no run and no metric: the run is found by its tag, the metrics are deduped
    by the server's SQL store because they keep their timestamps.
    """
    (tmp_path / "blocker").write_text("a file where the store's directory should be")
    cfg = cfg_for(f"sqlite:///{tmp_path / 'blocker' / 'mlflow.db'}", tmp_path)
    tracker = Tracker(cfg, tmp_path)
    local_id = tracker.start({"seed": "4"})
    log_steps(tracker, range(5))
    tracker.finish()
    segment = leftover_segments(tmp_path)[0]
    saved = tmp_path / "saved.jsonl"
    shutil.copy(segment, saved)

    assert sync_buffer(tmp_path / "buffer", tracking_uri=mlflow_server.uri) == 5 * len(KEYS)
    assert sync_buffer(tmp_path / "buffer", tracking_uri=mlflow_server.uri) == 0

    shutil.copy(saved, segment)  # no .sent file: everything looks unsent
    (tmp_path / "buffer" / "runs.json").unlink()
    assert sync_buffer(tmp_path / "buffer", tracking_uri=mlflow_server.uri) == 5 * len(KEYS)
    client = MlflowClient(mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id])
    assert len(runs) == 1 and runs[0].data.tags[LOCAL_ID_TAG] == local_id
    assert_every_step_once(client, runs[0].info.run_id, range(5))


def test_hung_server_costs_bounded_time_and_no_duplicates(mlflow_server, tmp_path, monkeypatch):
    # A frozen server accepts connections and never answers; requests time out after 1 s (x2 tries).
    # Requests that timed out on our side are still queued on the server and get stored when it
    # resumes; the replay carries the same timestamps, which the SQL store deduplicates.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    tracker = Tracker(cfg_for(mlflow_server.uri, tmp_path), tmp_path, retry_interval=60.0)
    run_id = tracker.start({"seed": "1"})
    log_steps(tracker, range(0, 3))
    tracker.flush()  # steps 0-2 stored before the server freezes
    attempts = store_attempts(tracker, monkeypatch)
    mlflow_server.pause()
    try:
        log_steps(tracker, range(3, 8))
        tracker.flush()
    finally:
        mlflow_server.resume()
    # The step never waits on the store: log_metrics only queues, the sender thread sends. One timed-out attempt,
    # then the back-off window: no network at all.
    assert attempts == [("dcmdp-tracking", False)], attempts
    assert tracker.buffered == 5 * len(KEYS)
    tracker.finish()
    assert tracker.buffered == 0
    client = MlflowClient(mlflow_server.uri)
    assert_every_step_once(client, run_id, range(8))


def test_synchronous_logging_sends_within_the_call(tmp_path, monkeypatch):
    """tracking.async_log=false: no sender thread; each log_metrics call has stored its metrics when it returns."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(TrackingConfig(async_log=False), tmp_path)
    run_id = tracker.start({"seed": "5"})
    client = MlflowClient(tracker.tracking_uri)
    for step in range(3):
        log_steps(tracker, range(step, step + 1))
        assert [s for s, _, _ in history(client, run_id, KEYS[0])] == list(range(step + 1))
    assert tracker._sender_thread is None
    tracker.finish()
    assert_every_step_once(client, run_id, range(3))


def test_server_outage_mid_run_and_at_start_loses_nothing(mlflow_server, tmp_path, caplog, monkeypatch):
    """One real outage (SIGKILL of the server, then a restart) serves two trackers.

    A is mid-run when the server dies: it keeps logging (fast, no exception), buffers, and sends the
    buffer by itself on the first call after the restart. B starts while the server is down: it gets
    a placeholder run id, ends with everything buffered, and ``sync_buffer`` creates its run later.
    """
    caplog.set_level(logging.WARNING, logger="dcmdp.tracking")
    cfg_a, cfg_b = cfg_for(mlflow_server.uri, tmp_path / "a"), cfg_for(mlflow_server.uri, tmp_path / "b")
    a = Tracker(cfg_a, tmp_path / "a", retry_interval=0.2, max_retry_interval=1.0)
    run_a = a.start({"seed": "0"})
    artifact = tmp_path / "summary.txt"
    log_steps(a, range(0, 10))
    assert a.buffered == 0
    attempts_a = store_attempts(a, monkeypatch)
    mlflow_server.stop()
    try:
        log_steps(a, range(10, 20))
        a.flush()
        # The steps never wait on the store (the sender thread sends), and calls in the back-off window touch no
        # network.
        assert attempts_a and all(attempt == ("dcmdp-tracking", False) for attempt in attempts_a), attempts_a
        artifact.write_text("written while the server was down")
        a.log_artifact(artifact, "summaries")
        artifact.write_text("changed after logging")  # the buffered copy must be what gets sent
        assert a.buffered == 10 * len(KEYS)
        assert len(leftover_segments(tmp_path / "a")) == 1
        warnings = [r.getMessage() for r in caplog.records if "buffered in" in r.getMessage()]
        assert len(warnings) == 1 and str(tmp_path / "a" / "buffer") in warnings[0]

        b = Tracker(cfg_b, tmp_path / "b", retry_interval=0.2)
        attempts_b = store_attempts(b, monkeypatch)
        local_b = b.start({"seed": "2", "lr": "1e-6"}, tags={"purpose": "offline"})
        log_steps(b, range(6))
        b.finish()
        # one try at start and one at finish (each whatever the back-off), the steps' only from the sender thread
        # and outside the back-off window
        main = threading.current_thread().name
        assert attempts_b[0][0] == attempts_b[-1][0] == main and len(attempts_b) >= 2, attempts_b
        assert all(attempt == ("dcmdp-tracking", False) for attempt in attempts_b[1:-1]), attempts_b
        assert local_b.startswith("local-") and b.run_id == local_b
        assert b.buffered == 6 * len(KEYS) and len(leftover_segments(tmp_path / "b")) == 1
    finally:
        mlflow_server.start()

    time.sleep(1.0)  # past A's back-off interval: its next call sends the buffer first
    log_steps(a, range(20, 21))
    assert a.buffered == 0 and not leftover_segments(tmp_path / "a")
    log_steps(a, range(21, 30))
    a.finish()
    client = MlflowClient(mlflow_server.uri)
    assert_every_step_once(client, run_a, range(30))
    assert client.get_run(run_a).info.status == "FINISHED"
    local = client.download_artifacts(run_a, "summaries/summary.txt", str(tmp_path / "dl"))
    assert Path(local).read_text() == "written while the server was down"

    assert sync_buffer(tmp_path / "b" / "buffer") == 6 * len(KEYS)
    assert sync_buffer(tmp_path / "b" / "buffer") == 0
    assert not leftover_segments(tmp_path / "b")
    run_b = json.loads((tmp_path / "b" / "buffer" / "runs.json").read_text())[local_b]
    run = client.get_run(run_b)
    assert run.data.params == {"seed": "2", "lr": "1e-6"}
    assert run.data.tags["purpose"] == "offline" and run.data.tags[LOCAL_ID_TAG] == local_b
    assert run.info.status == "FINISHED"
    assert_every_step_once(client, run_b, range(6))
    assert len(client.search_runs([client.get_experiment_by_name(cfg_b.experiment).experiment_id])) == 1
