"""`dcmdp train` end to end on one GPU: the stress config against the CPU, and the two recipes at random init.

Runs, each a ``python -m dcmdp.cli train`` subprocess with MLflow off and no final checkpoint (its per-step metrics
come from ``tracking.progress_file``):

- ``stress_cuda`` / ``stress_cpu``: configs/stress.yaml (small-moe, long_addition) for ``--stress-steps`` steps on
  the GPU, then its first ``--compare-steps`` steps with the same seed on the CPU, from the same cold start (the
  cache the GPU run filled). The two devices draw different sampling noise, so the rollouts differ sample by
  sample: the comparison is of the step means, within the tolerances of ``COMPARE`` (stated on the page).
- ``stress_nccl``: the stress config's first steps under ``torchrun`` as one process in an nccl process group with
  the model sharded by FSDP2 (``dist.shard_one_process``): the distributed path on a one-GPU machine.
- ``qwen3_8b``: configs/qwen3-8b.yaml at full depth from random weights (``model.init=random``, the character
  tokenizer as a stand-in), rollouts and updates on ONE GPU: the torch engine decodes with the trainer's bf16
  parameters (``rollout.torch.share_weights``), ``optim.precision=bf16_stochastic``, the bf16x3 head.
- ``qwen3_30b_a3b``: configs/qwen3-30b-a3b.yaml at ``--moe-layers`` of its 48 layers, the same way, with R3.

Per run: per-phase seconds (generate, reward, pi_old, update, optimiser, dual), tokens/s, MFU and peak GPU memory,
into ``<out>/train.json`` and ``<out>/train.md``. MFU = model FLOPs / (seconds x the bf16 matmul peak measured in
this process first): generation 2 N (prompt + response tokens), the pi_old pass 2 N tokens (N > 1 mini-batches),
the updates 6 N tokens, with N the matmul parameters a token passes through (the active ones for the MoE: attention,
the router, top-k experts, the LM head); attention's S^2 terms and the checkpointing recompute are not counted.

    python benchmarks/gpu_train.py --out DIR          # on a CUDA machine (benchmarks/gpu_check.sh runs it)
    python benchmarks/gpu_train.py --dry-run          # every run's config built and checked, nothing trained
    python benchmarks/gpu_train.py --cpu-smoke --out DIR   # the same code on a tiny run on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Settings of every run: no MLflow (the device image has no mlflow), no final checkpoint (tens of GB at real size).
COMMON = ("tracking.enabled=false", "progress=false", "checkpoint.every=0", "checkpoint.at_end=false", "log_every=1")
# The recipes at random init on one GPU: the torch engine on the trainer's bf16 weights, a generated task for the
# character tokenizer, short responses, a small eval set.
RECIPE = ("model.init=random", "model.path=null", "rollout.engine=torch", "rollout.precision=bf16",
          "rollout.torch.share_weights=true", "optim.precision=bf16_stochastic", "model.lm_head_kernel=bf16x3",
          "task.name=long_addition", "task.path=null", "task.eval_path=null", "task.digits=6", "task.eval_size=8",
          "eval_every=0")
# Step-mean metrics compared between the GPU and the CPU run of the stress config: (key, kind, tolerance); abs: |a -
# b| <= tol; rel: |a - b| <= tol * max(|a|, |b|). Sampling differs between the devices, so these are the spreads of
# a batch of 64 samples, not float rounding.
COMPARE = (("reward/mean", "abs", 0.15), ("response/length_mean", "rel", 0.25), ("policy/entropy", "rel", 0.5),
           ("discrepancy/abs_prob_diff", "rel", 0.75))


@dataclass
class Run:
    name: str
    config: str
    overrides: list[str]
    device: str
    limit_s: int
    # Launched by torchrun as one process in a process group (dist.shard_one_process: FSDP2 over nccl on CUDA).
    torchrun: bool = False


@dataclass
class RunResult:
    name: str
    status: str
    wall_s: float = 0.0
    steps: list[dict] = field(default_factory=list)
    phases_s: dict[str, float] = field(default_factory=dict)
    tokens_per_s: Optional[float] = None
    mfu_step: Optional[float] = None
    mfu_update: Optional[float] = None
    mfu_update_without_optimizer: Optional[float] = None
    peak_gib: Optional[float] = None
    params_active: Optional[int] = None
    log_tail: list[str] = field(default_factory=list)


def runs(args, work: Path) -> list[Run]:
    cache = f"cold_start.cache_dir={work / 'cache'}"
    stress = ["cold_start.steps=1500", "cold_start.check_every=50", cache, f"seed={args.seed}", "eval_every=0",
              "task.eval_size=64"]
    return [
        Run("qwen3_8b", "configs/qwen3-8b.yaml", [*RECIPE, f"steps={args.recipe_steps}", "algo.prompts_per_step=4",
            "algo.samples_per_prompt=4", f"rollout.max_new_tokens={args.new_tokens}"], "cuda", 150),
        Run("qwen3_30b_a3b", "configs/qwen3-30b-a3b.yaml", [*RECIPE, f"model.num_layers={args.moe_layers}",
            f"steps={args.recipe_steps}", "algo.prompts_per_step=4", "algo.samples_per_prompt=4",
            f"rollout.max_new_tokens={args.new_tokens}", "algo.routing_replay=r3"], "cuda", 100),
        Run("stress_cuda", "configs/stress.yaml", [*stress, f"steps={args.stress_steps}"], "cuda", 90),
        Run("stress_cpu", "configs/stress.yaml", [*stress, f"steps={args.compare_steps}", "threads=auto"], "cpu", 60),
        Run("stress_nccl", "configs/stress.yaml",
            [*stress, f"steps={args.compare_steps}", "dist.shard_one_process=true"], "cuda", 60, torchrun=True),
    ]


# --cpu-smoke: the same runs at the tiny presets' sizes, on the CPU (the recipes' settings otherwise unchanged).
SMOKE = {"qwen3_8b": ("model.preset=tiny-dense", "model.num_layers=2"),
         "qwen3_30b_a3b": ("model.preset=tiny-moe", "model.num_layers=2"),
         "stress_cuda": ("model.preset=tiny-moe", "cold_start.steps=30", "cold_start.target_accuracy=null"),
         "stress_cpu": ("model.preset=tiny-moe", "cold_start.steps=30", "cold_start.target_accuracy=null"),
         "stress_nccl": ("model.preset=tiny-moe", "cold_start.steps=30", "cold_start.target_accuracy=null")}
SMOKE_SIZES = ("algo.prompts_per_step=2", "algo.samples_per_prompt=2", "rollout.max_new_tokens=8", "steps=2",
               "task.eval_size=4", "task.digits=3", "threads=1")


def smoke_runs(todo: list[Run]) -> list[Run]:
    return [Run(r.name, r.config, [*r.overrides, *SMOKE[r.name], *SMOKE_SIZES], "cpu", r.limit_s, r.torchrun)
            for r in todo]


def command(run: Run, work: Path) -> list[str]:
    out = work / run.name
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if run.torchrun else []
    return [sys.executable, *launch, "-m", "dcmdp.cli", "train", str(ROOT / run.config), *run.overrides, *COMMON,
            f"device={run.device}", f"output_dir={out}", f"tracking.progress_file={out / 'progress.jsonl'}"]


def config_of(run: Run, work: Path):
    """The run's RunConfig as ``dcmdp train`` loads it from its command line."""
    from dcmdp.config import load_config

    cmd = command(run, work)
    at = cmd.index("train") + 1
    return load_config(cmd[at], cmd[at + 1:])


def check_config(run: Run, work: Path) -> str:
    """The run's config as ``dcmdp train`` would load it (keys, bounds, cross-checks); raises ConfigError."""
    cfg = config_of(run, work)
    return f"{run.name}: {cfg.model.preset}, {cfg.steps} steps, device={cfg.device}"


# ------------------------------------------------------------------------------------------------ FLOPs


def matmul_params_per_token(preset: str, num_layers: Optional[int], vocab: int) -> int:
    """Matmul parameters one token passes through (weights of the linear layers, the LM head's included): the
    active ones for an MoE (its top-k experts and the router)."""
    from trainers.models import get_preset

    c = get_preset(preset).make_config(vocab)
    layers = num_layers or c.num_hidden_layers
    D, hd = c.hidden_size, c.head_dim
    attn = D * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    if getattr(c, "num_experts", 0):
        mlp = c.num_experts_per_tok * 3 * D * c.moe_intermediate_size + D * c.num_experts
    else:
        mlp = 3 * D * c.intermediate_size
    return layers * (attn + mlp) + c.vocab_size * D


def step_flops(n: int, step: dict, minibatches: int) -> tuple[float, float]:
    """(FLOPs of the step, FLOPs of its updates): generation 2 N (prompt + response), the pi_old pass 2 N and the
    updates 6 N over the batch's real tokens."""
    tokens = step["throughput/tokens"]
    updates = 6.0 * n * tokens
    old = 2.0 * n * tokens if minibatches > 1 else 0.0
    return 2.0 * n * tokens + old + updates, updates


def summarise(result: RunResult, preset: str, num_layers: Optional[int], vocab: int, minibatches: int,
              peak_tflops: Optional[float]) -> None:
    """Fill the result's medians over the steps after the first (the first one compiles and warms up)."""
    steps = result.steps[1:] or result.steps
    if not steps:
        return
    med = lambda key: statistics.median(s.get(key, 0.0) for s in steps)  # noqa: E731
    result.phases_s = {"generate": med("time/rollout"), "reward": med("time/reward"),
                       "pi_old": med("time/old_logp") - med("time/reward"), "update": med("time/update"),
                       "optimizer": med("time/optimizer"), "dual": med("time/measure") + med("time/dual"),
                       "sync": med("time/sync"), "step": med("time/step")}
    result.tokens_per_s = med("throughput/tokens") / max(med("time/step"), 1e-9)
    peaks = [s["memory/peak_allocated_gib"] for s in result.steps if "memory/peak_allocated_gib" in s]
    result.peak_gib = max(peaks) if peaks else None
    n = matmul_params_per_token(preset, num_layers, vocab)
    result.params_active = n
    if peak_tflops:
        flops = [step_flops(n, s, minibatches) for s in steps]
        peak = peak_tflops * 1e12
        result.mfu_step = statistics.median(f / s["time/step"] / peak for (f, _), s in zip(flops, steps))
        result.mfu_update = statistics.median(u / s["time/update"] / peak for (_, u), s in zip(flops, steps))
        result.mfu_update_without_optimizer = statistics.median(
            u / max(s["time/update"] - s.get("time/optimizer", 0.0), 1e-9) / peak for (_, u), s in zip(flops, steps))


def compare(gpu: list[dict], cpu: list[dict], k: int) -> list[dict]:
    """The first ``k`` steps' means of each ``COMPARE`` metric on both devices, and whether they agree."""
    rows = []
    for key, kind, tol in COMPARE:
        a = [s[key] for s in gpu[:k] if key in s]
        b = [s[key] for s in cpu[:k] if key in s]
        if not a or not b:
            rows.append({"metric": key, "ok": False, "why": "missing"})
            continue
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        bound = tol if kind == "abs" else tol * max(abs(ma), abs(mb))
        rows.append({"metric": key, "cuda": ma, "cpu": mb, "tolerance": f"{kind} {tol}",
                     "ok": bool(math.isfinite(ma) and math.isfinite(mb) and abs(ma - mb) <= bound)})
    return rows


# The sharded run against the plain one on the same device and seed (tests/test_distributed.py's tolerance: the same
# quantities in another summation order).
SAME_KEYS = ("loss/total", "discrepancy/abs_prob_diff", "discrepancy/kl_k3", "reward/mean")
SAME_ATOL, SAME_RTOL = 1e-6, 1e-2


def same_run(plain: list[dict], sharded: list[dict], k: int) -> list[dict]:
    rows = []
    for step, (a, b) in enumerate(zip(plain[:k], sharded[:k]), start=1):
        for key in SAME_KEYS:
            if key in a and key in b:
                rows.append({"step": step, "metric": key, "plain": a[key], "nccl": b[key],
                             "ok": bool(abs(a[key] - b[key]) <= SAME_ATOL + SAME_RTOL * abs(a[key]))})
    if not rows:
        rows.append({"step": 0, "metric": "no common step", "ok": False})
    return rows


# ------------------------------------------------------------------------------------------------ running


def run_one(run: Run, work: Path, limit_s: float) -> RunResult:
    out = work / run.name
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train.log"
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as f:
        try:
            rc = subprocess.run(command(run, work), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=limit_s).returncode
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
    progress = out / "progress.jsonl"
    lines = progress.read_text().splitlines() if progress.is_file() else []
    steps = [json.loads(line) for line in lines if line.strip()]
    tail = log.read_text(errors="replace").splitlines()[-12:]
    return RunResult(run.name, status, time.perf_counter() - t0, steps, log_tail=tail)


def write_page(out: Path, results: list[RunResult], comparison: list[dict], peak: Optional[float], wall_s: float,
               meta: dict, sharded: Optional[list[dict]] = None) -> dict:
    sharded = sharded or []
    doc = {"peak_bf16_tflops": peak, "wall_s": wall_s, **meta, "runs": [asdict(r) for r in results],
           "stress_cuda_vs_cpu": comparison,
           "stress_matches_cpu": bool(comparison) and all(row["ok"] for row in comparison),
           "stress_nccl_vs_plain": sharded,
           "nccl_matches_plain": bool(sharded) and all(row["ok"] for row in sharded)}
    (out / "train.json").write_text(json.dumps(doc, indent=2) + "\n")
    fmt = lambda v, spec=".3g": "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["# dcmdp train on one GPU", "", f"- bf16 matmul peak measured here: {fmt(peak)} TFLOP/s; {wall_s:.0f} s",
             f"- {meta.get('device', '')}; torch {meta.get('torch', '')}", "",
             "| run | status | steps | generate | reward | pi_old | update | optimiser | dual | step s | tokens/s | "
             "MFU step | MFU update | MFU update w/o optimiser | peak GiB |", "|---|---|---:|" + "---:|" * 12]
    for r in results:
        p = r.phases_s
        lines.append(f"| {r.name} | {r.status} | {len(r.steps)} | {fmt(p.get('generate'))} | {fmt(p.get('reward'))} | "
                     f"{fmt(p.get('pi_old'))} | {fmt(p.get('update'))} | {fmt(p.get('optimizer'))} | "
                     f"{fmt(p.get('dual'))} | {fmt(p.get('step'))} | {fmt(r.tokens_per_s, '.0f')} | "
                     f"{fmt(r.mfu_step, '.1%')} | {fmt(r.mfu_update, '.1%')} | "
                     f"{fmt(r.mfu_update_without_optimizer, '.1%')} | {fmt(r.peak_gib, '.1f')} |")
    if comparison:
        lines += ["", "Stress config, the first steps' means, CUDA vs CPU at the same seed and cold start:", "",
                  "| metric | CUDA | CPU | tolerance | ok |", "|---|---:|---:|---|---|"]
        for row in comparison:
            lines.append(f"| {row['metric']} | {fmt(row.get('cuda'), '.4g')} | {fmt(row.get('cpu'), '.4g')} | "
                         f"{row.get('tolerance', row.get('why', ''))} | {row['ok']} |")
    if sharded:
        lines += ["", f"The same first steps under torchrun, one process, FSDP2 over nccl, against the plain run (same "
                  f"device and seed: the same rollouts; |a - b| <= {SAME_ATOL:g} + {SAME_RTOL:g} |a|):", "",
                  "| step | metric | plain | nccl | ok |", "|---:|---|---:|---:|---|"]
        for row in sharded:
            lines.append(f"| {row['step']} | {row['metric']} | {fmt(row.get('plain'), '.6g')} | "
                         f"{fmt(row.get('nccl'), '.6g')} | {row['ok']} |")
    (out / "train.md").write_text("\n".join(lines) + "\n")
    return doc


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "gpu"))
    ap.add_argument("--work", default=None, help="run folders and the cold-start cache (default: <out>/train_runs)")
    ap.add_argument("--dry-run", action="store_true", help="build and check every run's config, train nothing")
    ap.add_argument("--cpu-smoke", action="store_true", help="the page's code on one tiny run on the CPU")
    ap.add_argument("--only", nargs="+", default=None, help="these runs only")
    ap.add_argument("--budget-s", type=float, default=300.0, help="deadline of all runs together")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stress-steps", type=int, default=20)
    ap.add_argument("--compare-steps", type=int, default=3)
    ap.add_argument("--recipe-steps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--moe-layers", type=int, default=6)
    return ap


def main(argv: Optional[list[str]] = None) -> dict:
    args = parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "train_runs"
    import torch

    cuda = torch.cuda.is_available()
    todo = [r for r in runs(args, work) if not args.only or r.name in args.only]
    if args.cpu_smoke:
        todo = smoke_runs(todo)
    if args.dry_run or (not cuda and not args.cpu_smoke):
        lines = [check_config(r, work) for r in todo]
        why = "dry run" if args.dry_run else "no CUDA device"
        print(f"{why}: every run's config checked, nothing trained", *lines, sep="\n")
        return {"dry_run": True, "checked": lines}
    from trainers.tokenizer import build_char_tokenizer

    peak = None
    if cuda:
        from benchmarks.mfu_gpu import peak_tflops

        peak = peak_tflops(torch.device("cuda"), 8192, 10)
        print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
    vocab = len(build_char_tokenizer())
    start = time.perf_counter()
    results = []
    for run in todo:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            results.append(RunResult(run.name, f"skipped: the {args.budget_s:.0f} s budget is spent"))
            continue
        result = run_one(run, work, min(run.limit_s, left - 10))
        cfg = config_of(run, work)
        summarise(result, cfg.model.preset, cfg.model.num_layers, vocab, cfg.algo.minibatches,
                  peak if run.device == "cuda" else None)
        results.append(result)
        print(f"{run.name}: {result.status}, {len(result.steps)} steps, {result.wall_s:.0f} s, "
              f"step {result.phases_s.get('step', float('nan')):.2f} s, MFU {result.mfu_step}, "
              f"peak {result.peak_gib} GiB", flush=True)
    by_name = {r.name: r for r in results}
    comparison = []
    if "stress_cuda" in by_name and "stress_cpu" in by_name:
        comparison = compare(by_name["stress_cuda"].steps, by_name["stress_cpu"].steps, args.compare_steps)
    sharded = []
    if "stress_cuda" in by_name and "stress_nccl" in by_name:
        sharded = same_run(by_name["stress_cuda"].steps, by_name["stress_nccl"].steps, args.compare_steps)
    meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
            "command": "benchmarks/gpu_train.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    return write_page(out, results, comparison, peak, time.perf_counter() - start, meta, sharded)


if __name__ == "__main__":
    doc = main()
    runs_ok = all(r["status"] == "ok" for r in doc.get("runs", []))
    sys.exit(0 if doc.get("dry_run") or runs_ok else 1)
