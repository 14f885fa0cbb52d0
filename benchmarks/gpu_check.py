"""Every GPU-only check of the project: the steps of ``benchmarks/gpu_check.yaml`` in parts that each fit one device
call, each part writing its section of the page (``<out>/part<N>.json``; ``summary.md`` holds every part found in
``<out>``).

A step is a ``dcmdp train`` run (per-step metrics from ``tracking.progress_file``: per-phase seconds, tokens/s, MFU
over the bf16 matmul peak measured first, peak GPU memory beside the memory plan's figure), a benchmark script or a
pytest file, each a subprocess with a time limit and a log in ``<out>``; a failed step is recorded and the part goes
on; a step the part's budget no longer covers is recorded as skipped. The file's ``compare`` blocks set two runs'
first steps side by side with stated tolerances. ``--wheels DIR`` installs wheels first (pip ``--no-index``):
the device image lacks omegaconf (``bash benchmarks/gpu_wheels.sh`` downloads it into ``.whl``). Without CUDA (or
with ``--dry-run``) each step only checks that it is wired ("skipped: no CUDA (...)"; ``NOT WIRED`` is a bug).
The stress runs start from a cold start trained here on the CPU (``--prepare``) and carried to the device.

    python benchmarks/gpu_check.py --prepare                                    # here: .dcmdp_cache/gpu_check
    bash benchmarks/gpu_check.sh --wheels .whl --part 1 --out $OUT              # there; carry .whl and
                                                          # .dcmdp_cache/gpu_check/stress_cold_start
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check              # every part's wiring, in CI
    python benchmarks/gpu_check.py --cpu-smoke --only qwen3_30b_a3b --out DIR  # train steps at tiny sizes, CPU
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._page import environment, fmt, md_table, peak_tflops  # noqa: E402
from benchmarks.speed import HEADS  # noqa: E402

STEPS_FILE = ROOT / "benchmarks" / "gpu_check.yaml"
# git-ignored; the device call carries it
CACHE = Path(os.environ.get("DCMDP_GPU_CHECK_CACHE") or ROOT / ".dcmdp_cache" / "gpu_check")


def _flat(items) -> list[str]:
    """YAML anchors nest lists inside lists: one flat list of strings."""
    return [s for x in items for s in (_flat(x) if isinstance(x, list) else [str(x)])]


@dataclass
class Step:
    name: str
    part: int
    about: str
    limit_s: int
    train: dict = field(default_factory=dict)  # config, device, overrides, cold_start (carried), torchrun
    script: str = ""
    tests: str = ""
    args: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)  # modules that must be installed, else the step is skipped
    smoke: list[str] = field(default_factory=list)
    result: str = ""  # the JSON a script writes, merged into the part's record

    def command(self, out: Path, spec: dict, smoke: bool = False) -> list[str]:
        args = [a.replace("{out}", str(out)) for a in self.args]
        if self.script:
            return [sys.executable, str(ROOT / self.script), *args]
        if self.tests:
            return [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-s", self.tests, *args]
        run_dir = out / "runs" / self.name
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if self.train.get("torchrun") \
            else []
        extra = [*self.smoke, *_flat(spec.get("smoke_sizes", []))] if smoke else []
        carried = [f"model.path={cold_start_dir()}"] if self.train.get("cold_start") == "carried" and not smoke else []
        return [sys.executable, *launch, "-m", "dcmdp.cli", "train", str(ROOT / self.train["config"]),
                *_flat(self.train.get("overrides", [])), *carried, *extra, *_flat(spec.get("train_common", [])),
                f"device={'cpu' if smoke else self.train['device']}", f"output_dir={run_dir}",
                f"tracking.progress_file={run_dir / 'progress.jsonl'}"]

    def config(self, out: Path, spec: dict, smoke: bool = False):
        """The train run's RunConfig as ``dcmdp train`` loads it from this step's command line."""
        from dcmdp.config import load_config

        cmd = self.command(out, spec, smoke)
        at = cmd.index("train") + 1
        return load_config(cmd[at], cmd[at + 1:])

    def wiring(self, out: Path, spec: dict) -> str:
        """In-process, seconds: a train run's config loads and validates; a script's parser takes its arguments; a
        test file defines tests."""
        if self.train:
            cfg = self.config(out, spec)
            carried = ""
            if self.train.get("cold_start") == "carried":
                carried = "; cold start carried" if cold_start_dir().is_dir() else "; no cold start carried (--prepare)"
            return f"{cfg.model.preset}, {cfg.steps} steps, device={cfg.device}{carried}"
        if self.script:
            spec_ = importlib.util.spec_from_file_location(f"gpu_check_{self.name}", ROOT / self.script)
            module = importlib.util.module_from_spec(spec_)
            sys.modules[spec_.name] = module  # a script's dataclasses resolve their annotations through sys.modules
            spec_.loader.exec_module(module)
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    module.parser().parse_args(self.command(out, spec)[2:])
                except SystemExit as exc:
                    raise ValueError(f"{self.script} refuses {self.args}: {err.getvalue().strip()}") from exc
            return f"{self.script} takes its arguments"
        tree = ast.parse((ROOT / self.tests).read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        if not names:
            raise ValueError(f"{self.tests} defines no tests")
        return f"{self.tests} defines {len(names)} tests"


STEP_KEYS = {f.name for f in Step.__dataclass_fields__.values()}


def load_steps(path: Path = STEPS_FILE) -> tuple[list[Step], dict]:
    """The steps of the file in order, and the whole file; a step must name one kind and a declared part."""
    spec = yaml.safe_load(path.read_text())
    steps = []
    for raw in spec["steps"]:
        unknown = set(raw) - STEP_KEYS
        kinds = [k for k in ("train", "script", "tests") if raw.get(k)]
        if unknown or len(kinds) != 1 or raw.get("part") not in spec["parts"]:
            raise ValueError(f"{path.name}: step {raw.get('name')!r}: unknown keys {sorted(unknown)}, kinds {kinds}, "
                             f"part {raw.get('part')!r} (parts: {sorted(spec['parts'])})")
        steps.append(Step(**{**raw, "args": _flat(raw.get("args", [])), "smoke": _flat(raw.get("smoke", []))}))
    return steps, spec


def cold_start_dir() -> Path:
    """The cold-started stress model ``--prepare`` wrote (a Hugging Face folder with its tokenizer)."""
    return CACHE / "stress_cold_start"


def prepare(spec: dict, steps: list[Step], smoke: bool) -> Path:
    """Train the stress runs' cold start here on the CPU (``dcmdp train`` at 0 RL steps, the runs' cold-start
    settings) and keep its model folder as ``cold_start_dir()`` for the device call to carry."""
    import shutil

    step = next(s for s in steps if s.train.get("cold_start") == "carried")
    cache = CACHE / "cache"
    cmd = step.command(CACHE / "prepare", spec, smoke=smoke)
    cmd = [c for c in cmd if not c.startswith(("device=", "model.path="))] + [
        "device=cpu", "steps=0", f"cold_start.cache_dir={cache}"]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    made = max((p for p in cache.iterdir() if (p / "config.json").is_file()), key=lambda p: p.stat().st_mtime)
    shutil.rmtree(cold_start_dir(), ignore_errors=True)
    shutil.copytree(made, cold_start_dir())
    print(f"cold start: {made.name} -> {cold_start_dir()}")
    return cold_start_dir()


# ------------------------------------------------------------------------------------------------ a train step


def planned_peak_gib(cfg) -> Optional[float]:
    """The memory plan's GiB per GPU for this run's config (``dcmdp.memplan.plan_memory``, one GPU), printed beside
    the measured peak so that the first GPU run validates the plan; None in a tree without the plan."""
    try:
        from dcmdp.memplan import plan_memory
    except ImportError:
        return None
    return plan_memory(cfg).total_gib


def summarise(steps_: list[dict], cfg, peak_tflops_: Optional[float]) -> dict:
    """Medians over the steps after the first (the first compiles and warms up): per-phase seconds, tokens/s and
    MFU = model FLOPs / (seconds x peak), with generation 2 N (prompt + response tokens), the pi_old pass 2 N
    (N > 1 mini-batches) and the updates 6 N, N the matmul parameters a token passes through (the active ones for an
    MoE); attention's S^2 terms and the checkpointing recompute are not counted."""
    from benchmarks.speed import active_matmul_params
    from trainers.models import get_preset
    from trainers.tokenizer import build_char_tokenizer

    out: dict = {"steps": len(steps_)}
    peaks = [s["memory/peak_allocated_gib"] for s in steps_ if "memory/peak_allocated_gib" in s]
    out["peak_gib"] = max(peaks) if peaks else None
    out["plan_gib"] = planned_peak_gib(cfg)
    timed_ = steps_[1:] or steps_
    if not timed_:
        return out
    med = lambda key: statistics.median(s.get(key, 0.0) for s in timed_)  # noqa: E731
    out["phases_s"] = {"generate": med("time/rollout"), "reward": med("time/reward"),
                       "pi_old": med("time/old_logp") - med("time/reward"), "update": med("time/update"),
                       "optimizer": med("time/optimizer"), "dual": med("time/measure") + med("time/dual"),
                       "sync": med("time/sync"), "step": med("time/step")}
    out["tokens_per_s"] = med("throughput/tokens") / max(med("time/step"), 1e-9)
    n = sum(active_matmul_params(get_preset(cfg.model.preset).make_config(len(build_char_tokenizer())),
                                 cfg.model.num_layers))
    out["params_active"] = n
    if peak_tflops_:
        peak = peak_tflops_ * 1e12
        old = 2.0 if cfg.algo.minibatches > 1 else 0.0
        out["mfu_step"] = statistics.median((8.0 + old) * n * s["throughput/tokens"] / s["time/step"] / peak
                                            for s in timed_)
        out["mfu_update"] = statistics.median(6.0 * n * s["throughput/tokens"] / s["time/update"] / peak
                                              for s in timed_)
        out["mfu_update_without_optimizer"] = statistics.median(
            6.0 * n * s["throughput/tokens"] / max(s["time/update"] - s.get("time/optimizer", 0.0), 1e-9) / peak
            for s in timed_)
    return out


def compare(block: dict, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per metric (devices) or per step and metric (same) of two runs' first ``steps`` steps."""
    from benchmarks.run import welch_p

    a, b = runs.get(block["a"], [])[:block["steps"]], runs.get(block["b"], [])[:block["steps"]]
    rows = []
    if block["kind"] == "devices":
        for key, kind, tol in block["metrics"]:
            x, y = [s[key] for s in a if key in s], [s[key] for s in b if key in s]
            if not x or not y:
                rows.append({"metric": key, "ok": False, "why": "missing"})
                continue
            ma, mb = statistics.fmean(x), statistics.fmean(y)
            band = tol if kind == "abs" else tol * max(abs(ma), abs(mb))
            with warnings.catch_warnings():  # steps with (nearly) no spread: the band decides
                warnings.simplefilter("ignore", RuntimeWarning)
                p = welch_p(x, y)
            rows.append({"metric": key, "a": ma, "b": mb, "welch_p": p, "band": f"{kind} {tol}",
                         "ok": bool(math.isfinite(ma) and math.isfinite(mb)
                                    and (abs(ma - mb) <= band or p >= block["alpha"]))})
    else:
        for step, (x, y) in enumerate(zip(a, b), start=1):
            for key in block["metrics"]:
                if key in x and key in y:
                    rows.append({"step": step, "metric": key, "a": x[key], "b": y[key],
                                 "ok": bool(abs(x[key] - y[key]) <= block["atol"] + block["rtol"] * abs(x[key]))})
    return rows or [{"metric": "no common step", "ok": False}]


# ------------------------------------------------------------------------------------------------ running


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed (rc N) | timed out | skipped: why
    wall_s: float = 0.0
    log: str = ""
    tail: list[str] = field(default_factory=list)
    train: dict = field(default_factory=dict)


def run_step(cmd: list[str], log: Path, limit_s: float) -> tuple[str, float, list[str]]:
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=limit_s).returncode
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
    return status, time.perf_counter() - t0, log.read_text(errors="replace").splitlines()[-8:]


def install_wheels(wheels: Path, out: Path) -> Outcome:
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        return Outcome("wheels", f"skipped: no wheels in {wheels}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *found]
    status, wall, tail = run_step(cmd, out / "wheels.log", 120)
    return Outcome("wheels", status, wall, "wheels.log", tail)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="where the page goes (default: benchmarks/results/gpu; a new temporary folder for a dry run, "
                         "so that it never overwrites the committed page)")
    ap.add_argument("--part", type=int, nargs="+", default=None, help="these parts (default: all, in order)")
    ap.add_argument("--only", nargs="+", default=None, help="these steps only")
    ap.add_argument("--dry-run", action="store_true", help="check the wiring only, record every step as skipped")
    ap.add_argument("--cpu-smoke", action="store_true", help="the train steps at tiny sizes on the CPU")
    ap.add_argument("--prepare", action="store_true", help="train the stress cold start here, on the CPU")
    ap.add_argument("--wheels", default=None, help="a folder of wheels to install first (no index, no network)")
    ap.add_argument("--steps-file", default=str(STEPS_FILE))
    return ap


def main(argv: Optional[list[str]] = None) -> list[Outcome]:
    args = parser().parse_args(argv)
    steps, spec = load_steps(Path(args.steps_file))
    if args.prepare:
        prepare(spec, steps, smoke=args.cpu_smoke)
        return []
    page = ROOT / "benchmarks" / "results" / "gpu"
    outcomes: list[Outcome] = []
    if args.wheels:  # the device's run: the wheels go in before anything reads the environment
        out = Path(args.out or page)
        out.mkdir(parents=True, exist_ok=True)
        outcomes.append(install_wheels(Path(args.wheels), out))
    env = environment()
    print(json.dumps(env), flush=True)
    dry = args.dry_run or (env["device"] == "no CUDA device" and not args.cpu_smoke)
    if not args.wheels:
        out = Path(args.out or (tempfile.mkdtemp(prefix="gpu_check_dry_") if dry else page))
        out.mkdir(parents=True, exist_ok=True)
        if dry and not args.out:
            print(f"dry run: its page goes to {out}, not to the committed one", flush=True)
    why_dry = "no CUDA" if env["device"] == "no CUDA device" else "dry run"
    import torch

    for part in args.part or sorted(spec["parts"]):
        start, budget = time.perf_counter(), spec["parts"][part]["budget_s"]
        peak = peak_tflops(torch.device("cuda"), 8192, 10) if not dry and torch.cuda.is_available() else None
        part_outcomes, progress = [], {}
        for step in (s for s in steps if s.part == part and (not args.only or s.name in args.only)):
            if args.cpu_smoke and not step.train:
                continue
            log = f"{step.name}.log"
            missing = [m for m in step.needs if importlib.util.find_spec(m) is None]
            left = budget - (time.perf_counter() - start)
            if missing:
                o = Outcome(step.name, f"skipped: {', '.join(missing)} not installed")
            elif dry:
                t0 = time.perf_counter()
                try:
                    wired = step.wiring(out, spec)
                except (ValueError, OSError, SyntaxError, ImportError, AttributeError, KeyError) as exc:
                    wired = f"NOT WIRED: {type(exc).__name__}: {exc}"
                (out / log).write_text(f"$ {' '.join(step.command(out, spec))}\n{wired}\n")
                o = Outcome(step.name, f"skipped: {why_dry} ({wired})", time.perf_counter() - t0, log)
            elif left < 15:
                o = Outcome(step.name, f"skipped: part {part}'s {budget} s budget is spent")
            elif step.train.get("cold_start") == "carried" and not args.cpu_smoke and not cold_start_dir().is_dir():
                o = Outcome(step.name, f"failed: no carried cold start at {cold_start_dir()} (run --prepare here)")
            else:
                status, wall, tail = run_step(step.command(out, spec, args.cpu_smoke), out / log,
                                              min(step.limit_s, left - 5))
                o = Outcome(step.name, status, wall, log, tail)
                if step.train:
                    lines = (out / "runs" / step.name / "progress.jsonl")
                    progress[step.name] = [json.loads(x) for x in lines.read_text().splitlines() if x.strip()] \
                        if lines.is_file() else []
                    o.train = summarise(progress[step.name], step.config(out, spec, args.cpu_smoke),
                                        peak if step.train["device"] == "cuda" and not args.cpu_smoke else None)
            part_outcomes.append(o)
            print(f"part {part} {step.name}: {o.status} ({o.wall_s:.1f} s) {o.train or ''}", flush=True)
        compared = {b["name"]: compare(b, progress) for b in spec.get("compare", [])
                    if b["a"] in progress and b["b"] in progress}
        doc = {"part": part, "about": spec["parts"][part]["about"], "env": env, "peak_bf16_tflops": peak,
               "wall_s": time.perf_counter() - start, "steps": [asdict(o) for o in part_outcomes],
               "compare": compared, "command": "benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:])}
        results = {s.name: Path(s.result.replace("{out}", str(out))) for s in steps if s.part == part and s.result}
        doc["results"] = {k: json.loads(v.read_text()) for k, v in results.items() if v.is_file()}
        (out / f"part{part}.json").write_text(json.dumps(doc, indent=1) + "\n")
        outcomes += part_outcomes
    write_page(out, steps)
    return outcomes


def write_page(out: Path, steps: list[Step]) -> None:
    """``summary.md`` from every ``part<N>.json`` in ``out``: one section per part, its steps, train runs and
    comparisons."""
    about = {s.name: s.about for s in steps}
    lines = ["# GPU check", ""]
    for path in sorted(out.glob("part*.json")):
        doc = json.loads(path.read_text())
        env = doc["env"]
        lines += [f"## Part {doc['part']}: {doc['about']}", "",
                  f"- {env['date']}; `{doc['command']}`; {doc['wall_s']:.0f} s; git {env['git']}",
                  f"- {env['device']}; python {env['python']}; torch {env['torch']}, CUDA {env['cuda']}; "
                  f"transformers {env['transformers']}; vllm {env['vllm']}; bf16 matmul peak "
                  f"{fmt(doc['peak_bf16_tflops'])} TFLOP/s", "",
                  *md_table(("step", "what", "outcome", "s", "log"),
                            [(o["name"], about.get(o["name"], "install the given wheels"), o["status"],
                              f"{o['wall_s']:.0f}", o["log"]) for o in doc["steps"]])]
        trained = [o for o in doc["steps"] if o["train"]]
        if trained:
            p = lambda o, k: fmt(o["train"].get("phases_s", {}).get(k))  # noqa: E731
            lines += ["", *md_table(("run", "steps", "generate", "reward", "pi_old", "update", "optimiser", "dual",
                                     "step s", "tokens/s", "MFU step", "MFU update", "peak GiB", "plan GiB"),
                                    [(o["name"], o["train"]["steps"], *(p(o, k) for k in (
                                        "generate", "reward", "pi_old", "update", "optimizer", "dual", "step")),
                                      fmt(o["train"].get("tokens_per_s"), ".0f"),
                                      fmt(o["train"].get("mfu_step"), ".1%"), fmt(o["train"].get("mfu_update"), ".1%"),
                                      fmt(o["train"]["peak_gib"], ".1f"), fmt(o["train"]["plan_gib"], ".1f"))
                                     for o in trained])]
        for name, rows in doc["compare"].items():
            lines += ["", f"{name} (benchmarks/gpu_check.yaml states the rule):", "",
                      *md_table(("step", "metric", "a", "b", "Welch p", "band", "ok"),
                                [(r.get("step", "means"), r["metric"], fmt(r.get("a"), ".6g"), fmt(r.get("b"), ".6g"),
                                  fmt(r.get("welch_p"), ".3g"), r.get("band", r.get("why", "")), r["ok"])
                                 for r in rows])]
        for name, result in doc.get("results", {}).items():
            headline = {k: v for k, v in result.items() if isinstance(v, float) and k != "wall_s"}
            if headline:
                lines += ["", f"{name}: {about.get(name, '')}", "",
                          *md_table(("measure", "value"), [(k, fmt(v, ".4g")) for k, v in headline.items()])]
            mfu = [(r["shape"], f"{r['batch']} x {r['seq']}", h, fmt(r[h]["step_s"], ".4f"), fmt(r[h]["mfu"], ".1%"),
                    fmt(r[h]["max_memory_gib"], ".1f"), fmt(r["counted_flops"] / r["flops_per_step"], ".4f"))
                   for r in result.get("mfu", []) for h in HEADS if h in r]
            if mfu:
                lines += ["", *md_table(("shape", "B x S", "LM head", "step s", "MFU", "max GiB",
                                         "counted / formula FLOPs"), mfu)]
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))


if __name__ == "__main__":
    outcomes = main()
    sys.exit(0 if all(not o.status.startswith(("failed", "timed out")) for o in outcomes) else 1)
