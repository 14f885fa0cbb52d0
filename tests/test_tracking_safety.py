"""Tracking inputs MLflow would reject late (a file store, an empty experiment name), secrets read from the
environment or written into a URI, and buffer lines that are not UTF-8, too deep or too long (a buffer is read in time
linear in its size and bounded memory)."""

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


@pytest.mark.parametrize("name, why", [("", "an empty name is no name"), ("   ", "a blank name"),
                                       ("e" * 501, "501 characters; MLflow keeps at most 500")])
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


def _segment_of(buffer_dir: Path, lines: list[bytes]) -> Path:
    """A leftover segment as a tracker leaves it: a header naming an unreachable server, then ``lines``."""
    buffer_dir.mkdir(parents=True, exist_ok=True)
    segment = buffer_dir / "00000000000000000001-abcdef01.jsonl"
    header = json.dumps({"t": "header", "uri": f"http://{_closed_port()}", "created": 0}).encode() + b"\n"
    with open(segment, "wb") as f:
        f.write(header)
        f.writelines(lines)
    (buffer_dir / "00000000000000000001-abcdef01.sent").write_text(json.dumps({"offset": len(header)}))
    return segment


def _metric_lines(n: int, start: int = 0) -> list[bytes]:
    return [json.dumps({"t": "metric", "run": "r", "key": "m", "value": float(i), "ts": i, "step": i}).encode()
            + b"\n" for i in range(start, start + n)]


class _Store:
    """An MlflowClient stand-in that keeps what it is sent: times the reading of a buffer, not a store."""

    def __init__(self):
        self.values: list[float] = []

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.values += [m.value for m in metrics]


def _sync_to(store: _Store, buffer_dir: Path, monkeypatch):
    import dcmdp.tracking as tracking

    monkeypatch.setattr(tracking._Sender, "_client", lambda self: store)
    return sync_report(buffer_dir)


def test_a_buffer_replays_in_time_linear_in_its_records(tmp_path, monkeypatch):
    """20,000 and 80,000 buffered metrics: the sync reads each line once (4x the records, 4x the lines read; a
    re-read from the start per batch would be 16x), and every value arrives once, in order."""
    import dcmdp.tracking_buffer as tracking_buffer  # the module whose segments read the lines

    lines_read = []
    read_line = tracking_buffer._read_line
    monkeypatch.setattr(tracking_buffer, "_read_line", lambda f: lines_read.append(1) or read_line(f))

    def reads(n: int, name: str) -> int:
        buffer_dir = tmp_path / name
        _segment_of(buffer_dir, _metric_lines(n))
        store = _Store()
        lines_read.clear()
        report = _sync_to(store, buffer_dir, monkeypatch)
        assert report.sent == n and report.remaining == [] and store.values == [float(i) for i in range(n)]
        return len(lines_read)

    small, large = reads(20_000, "small"), reads(80_000, "large")
    assert small >= 20_000 and large - 80_000 == small - 20_000, (small, large)  # the header's reads beside


def test_deep_and_over_long_buffer_lines_are_skipped_naming_their_line_and_the_segment_is_kept(tmp_path, monkeypatch,
                                                                                              caplog):
    """A record nested 1,000 and 100,000 levels deep and a 20 MiB line (over ``MAX_RECORD_BYTES``) between good
    ones: no RecursionError, each skipped with a warning naming its line, the good records sent, and the segment
    kept as ``.unreadable`` for inspection, as for a line that is not JSON."""
    import logging

    from dcmdp.tracking import MAX_RECORD_BYTES, MAX_RECORD_DEPTH

    deep = [b'{"t": "metric", "x": ' + b"[" * n + b"]" * n + b"}\n" for n in (1_000, 100_000)]
    long = b'{"t": "tags", "pad": "' + b"x" * (MAX_RECORD_BYTES + (4 << 20)) + b'"}\n'
    # brackets inside a string do not count as nesting
    brackets = json.dumps({"t": "metric", "run": "r", "key": "[{" * 100, "value": 7.0, "ts": 7, "step": 7})
    lines = [*_metric_lines(2), *deep, long, *_metric_lines(2, start=2), brackets.encode() + b"\n"]
    segment = _segment_of(tmp_path / "buffer", lines)
    store = _Store()
    with caplog.at_level(logging.WARNING):
        report = _sync_to(store, tmp_path / "buffer", monkeypatch)
    assert store.values == [0.0, 1.0, 2.0, 3.0, 7.0] and report.sent == 5
    assert report.remaining == [f"{segment}.unreadable: a segment with unreadable lines, kept for inspection (its "
                                f"readable records were sent); remove it once inspected"]
    header = Path(f"{segment}.unreadable").read_bytes().index(b"\n") + 1
    byte = [header + sum(map(len, lines[:i])) for i in range(len(lines))]  # where each of ``lines`` starts
    too_deep = f"nested more than {MAX_RECORD_DEPTH} levels deep (a record is 2)"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping line")] == [
        f"skipping line 4 of {segment} (byte {byte[2]}): {too_deep}",
        f"skipping line 5 of {segment} (byte {byte[3]}): {too_deep}",
        f"skipping line 6 of {segment} (byte {byte[4]}): longer than {MAX_RECORD_BYTES >> 20} MiB ({len(long)} bytes)"]
    assert "RecursionError" not in caplog.text and not any(r.exc_info for r in caplog.records)


def test_an_over_long_buffer_line_is_read_in_bounded_memory(tmp_path):
    """A 64 MiB line is read in chunks: the reader's peak allocation is about twice ``MAX_RECORD_BYTES`` (16 MiB;
    the buffered reader copies the line once), whatever the line's size."""
    import tracemalloc

    from dcmdp.tracking import MAX_RECORD_BYTES, _Segment

    segment = _segment_of(tmp_path / "buffer", [b"x" * (64 << 20) + b"\n", *_metric_lines(1)])
    seg = _Segment.open_existing(segment)
    try:
        tracemalloc.start()
        records = [record for _, record in seg.pending()]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        seg.close()
    assert [r["value"] for r in records] == [0.0] and seg.unreadable == 1
    assert peak < 3 * MAX_RECORD_BYTES < 64 << 20, peak


@pytest.mark.parametrize("which", ["header", "sent", "runs"])
def test_a_deep_or_huge_bookkeeping_file_of_a_buffer_is_reported_not_a_traceback(tmp_path, monkeypatch, which):
    """The header line and ``runs.json`` nested 100,000 levels deep, the ``.sent`` progress file 500: the header names
    no URI, the progress file is unreadable (the segment is kept), an unreadable run map is a warning; never a
    RecursionError."""
    deep = b"[" * 100_000 + b"]" * 100_000
    segment = _segment_of(tmp_path / "buffer", _metric_lines(1))
    if which == "header":
        data = segment.read_bytes()
        segment.write_bytes(deep + b"\n" + data[data.index(b"\n") + 1:])
    elif which == "sent":
        segment.with_suffix(".sent").write_bytes(b"[" * 500 + b"]" * 500)  # within its 1 KiB
    else:
        (tmp_path / "buffer" / "runs.json").write_bytes(deep)
    store = _Store()
    report = _sync_to(store, tmp_path / "buffer", monkeypatch)
    if which == "header":
        assert report.remaining == [f"{segment}: names no tracking URI; pass one with --tracking-uri"]
    elif which == "sent":
        assert len(report.remaining) == 1
        sent = segment.with_suffix(".sent")
        assert f"its progress file {sent} (ValueError: {sent.name} is nested more than 32 levels deep" \
               in report.remaining[0]
    else:
        assert report.remaining == [] and store.values == [0.0]
