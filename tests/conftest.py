"""Shared fixtures: a real MLflow tracking server process that tests may kill, pause and restart."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a sqlite store and proxied artifacts under ``root``.

    ``stop`` kills the process group with SIGKILL (no graceful shutdown: a crash); ``start`` brings
    it back on the same port and store; ``pause``/``resume`` freeze it (SIGSTOP/SIGCONT), so
    connections are accepted but never answered, like a hung server.
    """

    def __init__(self, root: Path):
        self.root = root
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = root / "server.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 180.0) -> None:
        """Launch (unless already launched) and wait until /health answers."""
        if not self.running:
            self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health within {timeout} s:\n{self._log_tail()}")

    def launch(self) -> None:
        """Start the process without waiting for it."""
        mlflow_bin = Path(sys.executable).parent / "mlflow"
        cmd = [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        # The background job runner is a second process the tests do not need.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


# The server takes several seconds to boot: it is launched right after collection when any selected
# test asks for it, so the tests that run before the first such test overlap with the boot.
_server: Optional[MlflowServer] = None


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    global _server
    if _server is None and any("mlflow_server" in getattr(item, "fixturenames", ()) for item in items):
        _server = MlflowServer(Path(tempfile.mkdtemp(prefix="dcmdp_mlflow_server_")))
        _server.launch()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _server is not None:
        _server.stop()
        shutil.rmtree(_server.root, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server() -> Iterator[MlflowServer]:
    """One real server for the session; a test that stops or pauses it must bring it back."""
    global _server
    if _server is None:  # the fixture was requested dynamically
        _server = MlflowServer(Path(tempfile.mkdtemp(prefix="dcmdp_mlflow_server_")))
    _server.start()
    yield _server
    if _server.proc is not None:
        _server.resume()
