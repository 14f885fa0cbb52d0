"""Tracking inputs: an unusable URI scheme is refused at start, ``dcmdp sync`` fails loudly when something stays
unsent, the local sqlite store lands in folders named with ``?``, ``#`` and spaces, a deleted store costs one
warning, and every run carries its provenance tags."""

from __future__ import annotations

import http.server
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.config import ConfigError, TrackingConfig
from dcmdp.tracking import Tracker, check_tracking_uri, local_store_uri, store_scheme, tracking_store_schemes

BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=4", "threads=1", "progress=false", "rollout.max_new_tokens=4"]


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.parametrize("where", ["env", "config"])
def test_an_unusable_tracking_uri_scheme_is_refused_at_start(tmp_path, capsys, monkeypatch, where):
    out = tmp_path / "out"
    extra = []
    if where == "env":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://x")
    else:
        extra = ["tracking.uri=foo://x"]
    rc = cli.main(["train", *BASE, f"output_dir={out}", "steps=1", *extra])
    err = capsys.readouterr().err
    key = "MLFLOW_TRACKING_URI" if where == "env" else "tracking.uri"
    assert rc == 2
    assert f"config error at '{key}': MLflow cannot use the tracking URI 'foo://x' (scheme 'foo'); use one of " \
           f"the schemes " in err and "'http'" in err and "'sqlite'" in err
    assert not out.exists()


def _closed_port_uri() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _buffered_run(buffer_dir: Path) -> None:
    """A run whose store never answered: everything (run, params, 3 metrics, end) sits in one segment."""
    tracker = Tracker(TrackingConfig(uri=_closed_port_uri(), buffer_dir=str(buffer_dir)), buffer_dir.parent)
    tracker.start({"p": "1"})
    tracker.log_metrics({"m": 1.0, "n": 2.0, "o": 3.0}, step=1)
    tracker.finish()
    assert len(list(buffer_dir.glob("*.jsonl"))) == 1


class _Answer500(http.server.BaseHTTPRequestHandler):
    def _fail(self) -> None:
        body = b'{"error_code": "INTERNAL_ERROR", "message": "broken"}'
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = _fail

    def log_message(self, *args) -> None:
        pass


def test_sync_exits_non_zero_and_says_what_remains(tmp_path, capsys, mlflow_server):
    # a folder that does not exist, or a file: a mistyped argument exits 2 (1 is for records left unsent)
    assert cli.main(["sync", str(tmp_path / "nope")]) == 2
    assert f"tracking buffer folder {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    assert cli.main(["sync", str(tmp_path / "a_file")]) == 2
    assert f"tracking buffer folder {tmp_path / 'a_file'} is a file, not a folder" in capsys.readouterr().err
    # a server answering 500 to everything: nothing is sent, the segment stays
    buffer_dir = tmp_path / "run" / "buffer"
    _buffered_run(buffer_dir)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc = cli.main(["sync", str(buffer_dir), "--tracking-uri", f"http://127.0.0.1:{server.server_address[1]}"])
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    segment = next(buffer_dir.glob("*.jsonl"))
    assert rc == 1 and "sent 0 buffered metric values" in captured.out
    assert f"still hold records that were not sent:\n  {segment}: stopped at byte " in captured.err
    # a damaged buffer: the readable records reach the real server, the unreadable line is kept and reported
    with open(segment, "ab") as f:
        f.write(b"\x00\x17 not json\n")
    rc = cli.main(["sync", str(buffer_dir), "--tracking-uri", mlflow_server.uri])
    captured = capsys.readouterr()
    assert rc == 1 and "sent 3 buffered metric values" in captured.out
    assert f"{segment}.unreadable: a segment with unreadable lines, kept for inspection" in captured.err
    assert not segment.exists()
    # an unusable URI given to sync is a config error
    assert cli.main(["sync", str(buffer_dir), "--tracking-uri", "foo://x"]) == 2
    # once the kept file is removed, nothing remains
    Path(f"{segment}.unreadable").unlink()
    assert cli.main(["sync", str(buffer_dir), "--tracking-uri", mlflow_server.uri]) == 0


def test_local_store_in_a_folder_named_with_query_fragment_and_spaces(tmp_path, capsys):
    out = tmp_path / "a b?c#d %41" / "run"  # the store goes beside the run folder, into the oddly named one
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=1"]) == 0
    capsys.readouterr()
    assert (out.parent / "mlflow.db").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.parent.name]  # nothing written beside it
    client = MlflowClient(local_store_uri(out))
    run = client.search_runs([client.get_experiment_by_name("dcmdp").experiment_id])[0]
    assert run.info.status == "FINISHED" and "reward/mean" in run.data.metrics
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "summary.json"}
    # provenance: the checkout's commit and dirty flag, the command line, the versions, the run folder
    tags = run.data.tags
    repo = Path(__file__).resolve().parent.parent
    commit = tags["mlflow.source.git.commit"]  # HEAD itself may have moved on since the run started
    assert len(commit) == 40 and subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo).returncode == 0
    assert tags["dcmdp.git_dirty"] in ("true", "false")
    assert tags["dcmdp.command"] and tags["dcmdp.output_dir"] == str(out.resolve())
    assert tags["dcmdp.version.torch"].split("+")[0] == __import__("torch").__version__.split("+")[0]
    assert tags["dcmdp.version.transformers"] == __import__("transformers").__version__
    assert "dcmdp.version.vllm" in tags and "dcmdp.version.dcmdp" in tags


def test_store_deleted_mid_run_gives_one_warning_and_the_run_goes_on(tmp_path):
    out = tmp_path / "out"
    db = tmp_path / "mlflow.db"  # the store beside the run folder
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "train", *BASE, f"output_dir={out}", "steps=15"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, "the run ended before its store could be deleted"
        assert time.monotonic() < deadline
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                if con.execute("SELECT count(*) FROM metrics WHERE step >= 2").fetchone()[0]:
                    break
        except sqlite3.Error:
            pass
        time.sleep(0.05)
    db.unlink()
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "sqlalchemy" not in stderr.lower().replace("sqlite", "")
    assert stderr.count("failed (FileNotFoundError: [Errno 2] the sqlite tracking store was deleted") == 1
    assert "held-out accuracy" in stdout
    segments = list((out / "tracking_buffer").glob("*.jsonl"))
    assert len(segments) == 1 and '"key": "reward/mean", "value"' in segments[0].read_text()


def test_the_project_s_store_schemes_are_the_installed_mlflow_s():
    """The scheme check is the project's own list; this is where an MLflow release that adds or drops a store shows
    up (at a lock refresh), read from MLflow's registry here in the test, never in the package."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry

    served = {scheme for scheme in registry._registry if scheme not in ("", "file")}
    assert served == set(tracking_store_schemes())


@pytest.mark.parametrize("uri", ["postgresql+psycopg2://u@db:5432/mlflow", "mysql+pymysql://u@db/mlflow", "databricks",
                                 "databricks-uc", "https://mlflow.example:443", "sqlite:////tmp/x/mlflow.db"])
def test_a_served_scheme_is_accepted_with_or_without_a_driver(uri):
    assert store_scheme(uri) in tracking_store_schemes()
    check_tracking_uri(uri, "tracking.uri")


@pytest.mark.parametrize("uri, scheme", [("foo+bar://x", "foo+bar"), ("sqlitex:///x.db", "sqlitex"), ("s3://b/k", "s3")])
def test_an_unserved_scheme_is_refused_by_name(uri, scheme):
    with pytest.raises(ConfigError, match=rf"MLflow cannot use the tracking URI '.*' \(scheme '{re.escape(scheme)}'\)"):
        check_tracking_uri(uri, "tracking.uri")
