"""A dcmdp command run as a user runs it (a new process), with the modules it imported, for the tests that a refusal
comes before anything is built: ``python -X importtime`` names each module on stderr when it is first imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_dcmdp(argv: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
              ) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``python -m dcmdp.cli *argv``: the finished process (its stderr without the import lines) and the names of
    the modules it imported. A command still running after ``timeout`` seconds raises ``TimeoutExpired``, which
    names the command."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dcmdp.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stderr.splitlines(keepends=True)
    imports = [line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")]
    modules = set(imports) - {"imported package"}  # the column header
    proc.stderr = "".join(line for line in lines if not line.startswith("import time:"))
    return proc, modules


# Imported only once a run starts being built: the training loop, the cold start, the tracker's MLflow.
RUN_MODULES = frozenset({"dcmdp.loop", "trainers.coldstart", "mlflow"})


def run_modules(modules: set[str]) -> list[str]:
    """Those of ``modules`` that only a run being built imports."""
    return sorted(RUN_MODULES & modules)
