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


def fmt(v, spec: str = ".3g") -> str:
    """``v`` formatted, or '-' where it is None or NaN (not measured, or not recorded)."""
    return "-" if v is None or v != v else format(v, spec)


def md_table(head: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    """A markdown table: the header row, the separator and one row per entry of ``rows``."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


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


# ------------------------------------------------------------------------------------------------ timing


def sync(device) -> None:
    """Wait for the device's queued work (a CUDA timing without it measures the launch, not the kernels)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    """Seconds of one call of ``fn``, synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def interleaved(fns: dict, device, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of ``repeats`` calls of each function after ``warmup`` each, the functions taking turns and each round
    starting with another, so that a change of load or clock hits all of them alike."""
    names = list(fns)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(timed(fns[name], device))
    return times


def median_time(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up call."""
    import statistics

    return statistics.median(interleaved({"fn": fn}, device, repeats)["fn"])


def peak_tflops(device, n: int, repeats: int) -> float:
    """Best TFLOP/s of an n x n x n bf16 matmul (2 n^3 FLOPs) over ``repeats`` calls: the MFU denominator."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / min(interleaved({"mm": lambda: a @ b}, device, repeats, warmup=3)["mm"]) / 1e12


def environment() -> dict:
    """Versions and the device of this process, for the page."""
    import importlib.util

    import torch

    def version(module: str) -> str:
        try:
            if importlib.util.find_spec(module) is None:
                return "not installed"
            return getattr(__import__(module), "__version__", "unknown version")
        except Exception as exc:  # a package that fails to import is reported, not fatal
            return f"fails to import: {type(exc).__name__}: {exc}"

    cuda = torch.cuda.is_available()
    return {"python": f"{platform.python_version()} ({sys.executable})", "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
            "transformers": version("transformers"), "vllm": version("vllm"), "pytest": version("pytest"),
            "machine": platform.node(), "git": git_head(),
            "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"}
