"""What every benchmark page carries: the command as a reader types it from the repository root, the date, the
machine and the versions; paths shown relative to the repository."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
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
            f"- machine: {machine_kind()}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}",
            f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}", f"- command: `{cmd}`"]


def git_head() -> str:
    """The commit the benchmark runs, with a note when tracked files differ from it."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        # result pages a benchmark writes as it goes are not code changes
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} + uncommitted changes" if dirty else head


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def machine_kind() -> str:
    """What sets a CPU run's numbers besides its config: the architecture, the kernels torch dispatches to and the
    CPU model (the same config trains to other weights on another kind)."""
    import torch

    return f"{platform.machine()} ({torch.backends.cpu.get_cpu_capability()} kernels, {cpu_model()})"


def md_table(head: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    """A markdown table: the header row, the separator and one row per entry of ``rows``."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def reading_lines(page: Path) -> list[str]:
    """A blank line and the hand-written reading ``<name>_reading.md`` next to ``page``, or nothing without one."""
    path = Path(page).with_name(Path(page).stem + "_reading.md")
    return ["", path.read_text().rstrip()] if path.exists() else []


LOADED_CORES = 0.25
"""Other jobs' mean CPU use (cores) above which a timing is "measured under load" and no headline ratio is drawn."""


class OtherLoad:
    """The CPU the rest of the machine used while the block ran, in cores (``.cores``): machine busy CPU-seconds
    from /proc/stat minus this process's and its finished children's, over the wall time. None off Linux."""

    def __enter__(self) -> "OtherLoad":
        self.cores: Optional[float] = None
        self._start = time.perf_counter(), _machine_busy_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        t0, busy0, own0 = self._start
        busy = _machine_busy_s()
        # wall seconds, this process tree's CPU-seconds and the machine's busy CPU-seconds over the block
        self.wall_s, self.own_s = time.perf_counter() - t0, _own_cpu_s() - own0
        self.busy_s = None if busy is None or busy0 is None else busy - busy0
        if self.busy_s is not None:
            self.cores = max(0.0, (self.busy_s - self.own_s) / max(self.wall_s, 1e-9))


def _machine_busy_s() -> Optional[float]:
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal; guest time is inside user


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


PNG_COLOURS = 128
"""Palette size of a saved figure: line plots need few colours, and a palette PNG is a quarter of an RGBA one."""


def quantize_png(path: Path) -> None:
    """Rewrite the PNG at ``path`` as a ``PNG_COLOURS``-colour palette image (median cut, no dithering)."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=PNG_COLOURS, method=Image.Quantize.MEDIANCUT,
                                           dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as a palette PNG (``quantize_png``) and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    quantize_png(path)
    return path
