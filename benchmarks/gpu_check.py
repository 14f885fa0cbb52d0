"""Every GPU-only check of the project in one run of at most ten minutes on one H100/H200, results in one folder.

Steps (``steps()``: train first, then the speed anchors, then the kernels), each a subprocess with a time limit,
its output in ``<out>/<step>.log`` and its outcome in ``summary.json`` / ``summary.md`` (with the train and speed
steps' own results merged in); a failed step is recorded and the run goes on; a step the budget no longer covers is
recorded as skipped. ``--wheels DIR`` installs wheels first (pip ``--no-index``): the device image has torch and
transformers but not omegaconf, which ``bash benchmarks/gpu_wheels.sh`` downloads into ``.whl``. Without CUDA (or
with ``--dry-run``) each step only checks that it is wired and reads "skipped: no CUDA"; ``NOT WIRED`` is a bug of
this script.

    bash benchmarks/gpu_wheels.sh                                   # here, once: .whl/ (git-ignored)
    bash benchmarks/gpu_check.sh --wheels .whl --out /tmp/gpu && tar czf "$OUT/gpu.tgz" -C /tmp gpu   # there
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import io
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    """One check: a benchmark script (``script`` with ``args``) or a pytest file (``tests`` with ``args``)."""

    name: str
    about: str
    script: str = ""
    tests: str = ""
    args: list[str] = field(default_factory=list)
    limit_s: int = 120
    needs: tuple[str, ...] = ()  # modules that must be installed, else the step is skipped

    def command(self) -> list[str]:
        if self.script:
            return [sys.executable, self.script, *self.args]
        return [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-s", self.tests, *self.args]

    def wiring(self) -> str:
        """In-process, seconds: the script's parser takes ``args``; the test file parses and defines tests."""
        if self.script:
            spec = importlib.util.spec_from_file_location(f"gpu_check_{self.name}", ROOT / self.script)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # a script's dataclasses resolve their annotations through sys.modules
            spec.loader.exec_module(module)
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    module.parser().parse_args(self.args)
                except SystemExit as exc:
                    raise ValueError(f"{self.script} refuses {self.args}: {err.getvalue().strip()}") from exc
            return f"{self.script} takes its arguments"
        tree = ast.parse((ROOT / self.tests).read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        if not names:
            raise ValueError(f"{self.tests} defines no tests")
        return f"{self.tests} defines {len(names)} tests"


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed (rc N) | timed out | skipped: why
    wall_s: float = 0.0
    log: str = ""
    tail: list[str] = field(default_factory=list)


def steps(out: Path) -> list[Step]:
    return [
        Step("train", "dcmdp train on one GPU: stress config vs the CPU, Qwen3-8B full depth and Qwen3-30B-A3B (6 of 48 "
             "layers, R3) at random init, per-phase time, tokens/s, MFU, peak memory",
             script="benchmarks/gpu_train.py", limit_s=310,
             args=["--out", str(out), "--work", "/tmp/dcmdp_gpu_train", "--budget-s", "300"]),
        Step("device", "checkpoints across devices: written on CUDA, resumed on the CPU and back (bf16 optimiser state)",
             tests="tests/test_device.py", limit_s=60, needs=("pytest",),
             args=["-m", "gpu", "--junitxml", str(out / "device.xml")]),
        Step("speed", "speed anchors: bf16 AdamW vs torch fused, padded vs unpadded scoring, Qwen3-8B (8 of 36 layers) "
             "and Qwen3-30B-A3B (4 of 48, R3) step MFU, decode vs the bandwidth bound, controller share of a step",
             script="benchmarks/gpu_speed.py", limit_s=210, args=["--out", str(out), "--budget-s", "170"]),
        Step("lm_head", "LM head accuracy vs float64, peak memory, fwd+bwd time (bf16, fp32, chunked, bf16x3)",
             script="benchmarks/lm_head.py", limit_s=120,
             args=["--device", "cuda", "--tokens", "4096", "--hidden", "2048", "--memory-tokens", "16384",
                   "--memory-hidden", "2048", "--out", str(out / "lm_head.md")]),
        Step("mfu", "training-step MFU, Qwen3-0.6B / 1.7B shapes, LM head bf16 / fp32 / bf16x3",
             script="benchmarks/mfu_gpu.py", limit_s=270,
             args=["--heads", "bf16", "fp32", "bf16x3", "--out", str(out / "mfu_gpu.md")]),
        Step("fp8_gemm", "fp8 emulation against the hardware fp8 GEMM", tests="tests/test_fp8_gemm.py", limit_s=90,
             needs=("pytest",), args=["--junitxml", str(out / "fp8_gemm.xml")]),
        Step("vllm", "vLLM engine on the GPU: logprobs vs the scorer, R3 routes returned by vLLM",
             tests="tests/test_vllm_engine.py", limit_s=150, needs=("pytest", "vllm"),
             args=["-m", "not slow", "--junitxml", str(out / "vllm.xml")]),
    ]


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return getattr(__import__(module), "__version__", "unknown version")
    except Exception as exc:  # an installed package that fails to import is reported, not fatal
        return f"fails to import: {type(exc).__name__}: {exc}"


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"python": f"{platform.python_version()} ({sys.executable})", "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
            "transformers": _version("transformers"), "vllm": _version("vllm"), "pytest": _version("pytest"),
            "machine": platform.node()}


def run_step(cmd: list[str], log: Path, limit_s: float) -> tuple[str, float, list[str]]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s).returncode
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
    tail = log.read_text(errors="replace").splitlines()[-8:]
    return status, time.perf_counter() - t0, tail


def install_wheels(wheels: Path, out: Path) -> Outcome:
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        return Outcome("wheels", f"skipped: no wheels in {wheels}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *found]
    status, wall, tail = run_step(cmd, out / "wheels.log", 240)
    return Outcome("wheels", status, wall, "wheels.log", tail)


def main(argv: list[str] | None = None) -> list[Outcome]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "gpu"))
    ap.add_argument("--dry-run", action="store_true", help="check the wiring only, record every step as skipped")
    ap.add_argument("--only", nargs="+", default=None, help="run these steps only")
    ap.add_argument("--budget-s", type=float, default=590.0, help="deadline of the whole run")
    ap.add_argument("--wheels", default=None, help="a folder of wheels to install first (no index, no network)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    if args.wheels:
        outcomes.append(install_wheels(Path(args.wheels), out))
    env = environment()
    (out / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    print(json.dumps(env), flush=True)
    if env["vllm"] == "not installed":
        print("vllm is not installed: the vllm step is skipped", flush=True)
    dry = args.dry_run or env["device"] == "no CUDA device"
    why_dry = "no CUDA" if env["device"] == "no CUDA device" else "dry run"
    for step in steps(out):
        if args.only and step.name not in args.only:
            continue
        log = f"{step.name}.log"
        missing = [m for m in step.needs if importlib.util.find_spec(m) is None]
        if missing:
            outcome = Outcome(step.name, f"skipped: {', '.join(missing)} not installed")
        elif dry:
            t0 = time.perf_counter()
            try:
                wired = step.wiring()
            except (ValueError, OSError, SyntaxError, ImportError, AttributeError) as exc:
                wired = f"NOT WIRED: {exc}"
            (out / log).write_text(f"$ {' '.join(step.command())}\n{wired}\n")
            outcome = Outcome(step.name, f"skipped: {why_dry} ({wired})", time.perf_counter() - t0, log)
        else:
            left = args.budget_s - (time.perf_counter() - start)
            if left < 20:
                outcome = Outcome(step.name, f"skipped: the run's {args.budget_s:.0f} s budget is spent")
            else:
                status, wall, tail = run_step(step.command(), out / log, min(step.limit_s, left - 10))
                outcome = Outcome(step.name, status, wall, log, tail)
        outcomes.append(outcome)
        print(f"{step.name}: {outcome.status} ({outcome.wall_s:.1f} s)", flush=True)
    write_summary(out, env, outcomes, steps(out), time.perf_counter() - start, argv)
    return outcomes


def write_summary(out: Path, env: dict, outcomes: list[Outcome], all_steps: list[Step], wall_s: float,
                  argv: list[str] | None) -> None:
    about = {s.name: s.about for s in all_steps}
    cmd = "benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"command": cmd, "env": env, "wall_s": wall_s, "steps": [asdict(o) for o in outcomes]}
    for name in ("train", "speed"):  # the steps' own results, merged: one file holds the whole check
        path = out / f"{name}.json"
        if path.is_file():
            result = json.loads(path.read_text())
            doc[name] = result
            if name == "speed":
                doc.update({k: v for k, v in result.items() if not isinstance(v, (dict, list))})
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = ["# GPU check", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; command: `{cmd}`; "
             f"{wall_s:.0f} s in all",
             f"- {env['device']}; python {env['python']}; torch {env['torch']}, CUDA {env['cuda']}; "
             f"transformers {env['transformers']}; vllm {env['vllm']}", "",
             "| step | what | outcome | s | log |", "|---|---|---|---:|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | {about.get(o.name, 'install the given wheels')} | {o.status} | {o.wall_s:.0f} | "
                     f"{o.log} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
