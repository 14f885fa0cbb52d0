"""What every benchmark page carries: the command as a reader types it from the repository root, the date, the
machine and the versions; paths shown relative to the repository."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


def rel(path: str | Path) -> str:
    """``path`` relative to the repository (or from its ``.dcmdp_cache`` on), never an absolute machine path."""
    parts = Path(path).parts
    if ".dcmdp_cache" in parts:
        return str(Path(*parts[parts.index(".dcmdp_cache"):]))
    return str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else str(path)


def command(script: str, argv: Optional[Sequence[str]] = None, python: str = ".venv/bin/python") -> str:
    """The command that ran ``benchmarks/<script>`` with ``argv`` (default: this process's arguments)."""
    args = " ".join(argv if argv is not None else sys.argv[1:]).replace(f"{ROOT}/", "")
    threads = os.environ.get("OMP_NUM_THREADS", "<unset>")
    return f"OMP_NUM_THREADS={threads} {python} benchmarks/{script} {args}".rstrip()


def env_lines(cmd: str) -> list[str]:
    """The date, machine, versions and command lines of a results page."""
    import torch
    import transformers

    return [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
            f"- machine: {platform.machine()} ({torch.backends.cpu.get_cpu_capability()} kernels), "
            f"{os.cpu_count()} logical CPUs (shared with other jobs), torch threads {torch.get_num_threads()}",
            f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}", f"- command: `{cmd}`"]


def git_head() -> str:
    """The commit the benchmark runs, with a note when tracked files differ from it."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} + uncommitted changes" if dirty else head


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def reading_lines(page: Path) -> list[str]:
    """A blank line and the hand-written reading ``<name>_reading.md`` next to ``page``, or nothing without one."""
    path = Path(page).with_name(Path(page).stem + "_reading.md")
    return ["", path.read_text().rstrip()] if path.exists() else []
