"""Training throughput: ``dcmdp train`` vs TRL's ``GRPOTrainer`` on the same model, task, batch and CPU.

Per workload (``WORKLOADS``) both sides start from one model directory, see the same prompts in the same order,
sample at temperature 1, score with the same ``Task.reward`` and take one AdamW step per rollout batch. dcmdp
runs ``python -m dcmdp.cli train`` (step times from its MLflow store); TRL runs ``benchmarks/_trl_runner.py`` in
``.venv-trl`` (``bash benchmarks/setup_trl.sh``). ``--variant NAME=KEY=VALUE,...`` adds a dcmdp side with
overrides. Throughput = response tokens of the timed steps / their summed step periods (first ``--warmup``
steps untimed); sides alternate for ``--repeats`` repetitions, medians reported. ``measure_limits`` gives the
fp32 matmul rate and copy bandwidth the achieved FLOP/s (6 N_active tokens) and decode bytes/s are set against.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trl_throughput.py            # full, writes results/
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trl_throughput.py --smoke    # seconds, dcmdp side only
    .venv/bin/python benchmarks/trl_throughput.py --render benchmarks/results/trl_throughput.json  # md only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks._page import LOADED_CORES, OtherLoad, cpu_model, git_head, reading_lines  # noqa: E402
from dcmdp.config import load_config  # noqa: E402
from dcmdp.policy import encode_prompt  # noqa: E402
from dcmdp.policy import step_seed  # noqa: E402
from trainers.coldstart import cold_start  # noqa: E402
from trainers.models import build_model, save_model_dir  # noqa: E402
from trainers.tasks import TASKS  # noqa: E402
from trainers.tokenizer import build_char_tokenizer  # noqa: E402

TRL_VENV = ROOT / ".venv-trl"
DCMDP_PHASES = ("time/rollout", "time/old_logp", "time/measure", "time/update", "time/dual", "time/sync")
TRL_PHASES = ("time/generate", "time/score", "time/loss_forward", "time/backward", "time/optimizer")


@dataclass(frozen=True)
class Workload:
    """One row of the comparison: a dcmdp config and the batch both sides run."""

    # dcmdp config file the runs start from (its task, cold start and DCMDP constraint)
    config: str
    # model preset (the shared model's architecture)
    preset: str
    prompts: int
    samples: int
    max_new_tokens: int
    # optimizer steps per run
    steps: int
    # held-out prompts of dcmdp's before/after eval (outside the timed steps)
    eval_size: int
    # overrides of the cold start that makes the shared model
    coldstart: tuple[str, ...] = ()
    # one line for the results
    describe: str = ""


WORKLOADS = {
    "long-small-moe": Workload("configs/stress.yaml", "small-moe", 16, 8, 96, 6, 32, (),
                               "long_addition 3-8 digits (responses 29-91 tokens), small-moe"),
    "long-tiny-moe": Workload("configs/stress.yaml", "tiny-moe", 16, 8, 96, 6, 32, ("model.preset=tiny-moe",),
                              "long_addition 3-8 digits (responses 29-91 tokens), tiny-moe"),
    "short-tiny-moe": Workload("configs/default.yaml", "tiny-moe", 32, 16, 8, 10, 64, ("cold_start.steps=1150",),
                               "2-digit addition (responses <= 8 tokens), tiny-moe"),
}
SMOKE = Workload("configs/default.yaml", "tiny-moe", 4, 2, 4, 3, 8, ("cold_start.steps=0",), "smoke")


def run_config(w: Workload, args, model_dir: str, output_dir: str) -> list[str]:
    """dcmdp overrides of the workload's config for this benchmark (also the TRL side's settings)."""
    return [f"output_dir={output_dir}", f"steps={w.steps}", f"threads={args.threads}", "progress=false",
            f"seed={args.seed}", f"model.preset={w.preset}", f"model.path={model_dir}", "cold_start.steps=0",
            "rollout.engine=torch", "rollout.precision=fp32", "rollout.temperature=1.0",
            f"rollout.max_new_tokens={w.max_new_tokens}", "algo.minibatches=1", f"algo.prompts_per_step={w.prompts}",
            f"algo.samples_per_prompt={w.samples}", "optim.warmup_steps=0", f"task.eval_size={w.eval_size}"]


def prepare_model(w: Workload, args, work: Path) -> tuple[str, dict]:
    """The shared model directory: the workload's cold start (cached in .dcmdp_cache), random init at 0 steps."""
    cfg = load_config(str(ROOT / w.config), [*w.coldstart, f"seed={args.seed}", f"threads={args.threads}"])
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    task = TASKS[cfg.task.name](cfg.task, cfg.seed)
    model = build_model(cfg.model, len(tokenizer), seed=cfg.seed)
    if cfg.cold_start.steps > 0:
        _, info = cold_start(model, tokenizer, task, cfg.cold_start, cfg.model, seed=cfg.seed,
                             eos_id=tokenizer.eos_token_id, progress=False)
        return str(info.pop("model_dir")), {k: float(v) for k, v in info.items()}
    model_dir = str(work / "model")
    save_model_dir(model, tokenizer, model_dir)
    return model_dir, {}


def step_prompts(w: Workload, args) -> list[list[str]]:
    """[prompt, answer] rows in step order: step s's prompts drawn as dcmdp.loop.rollout_phase draws them."""
    cfg = load_config(str(ROOT / w.config), [f"seed={args.seed}", f"task.eval_size={w.eval_size}"])
    task = TASKS[cfg.task.name](cfg.task, cfg.seed)
    rows = []
    for step in range(w.steps):
        rng = random.Random(step_seed(args.seed, step, 0))
        rows += [[ex.prompt, ex.answer] for ex in task.sample(rng, w.prompts)]
    return rows


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)  # the run's own sqlite store under its output_dir
    return env


def run_dcmdp(w: Workload, args, model_dir: str, work: Path, tag: str, overrides: tuple[str, ...] = ()) -> dict:
    out = work / tag
    cmd = [sys.executable, "-m", "dcmdp.cli", "train", w.config, *run_config(w, args, model_dir, str(out)),
           *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(args.threads), check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return {"steps": read_dcmdp_steps(out, w), "wall": wall, "command": cmd}


def read_dcmdp_steps(out: Path, w: Workload) -> list[dict]:
    """Per-step records from the run's local MLflow store: phases, tokens and the step's end time (s).

    Read with sqlite3 from MLflow's ``metrics`` table (run_uuid, key, value, timestamp in ms, step) rather
    than through the mlflow client, whose import alone costs seconds of CPU.
    """
    run_id = json.loads((out / "summary.json").read_text())["run_id"]
    keys = DCMDP_PHASES + ("time/step", "response/length_mean")
    with sqlite3.connect(out / "mlflow.db") as db:
        rows = db.execute(f"SELECT key, value, timestamp, step FROM metrics WHERE run_uuid = ? AND key IN "
                          f"({','.join('?' * len(keys))})", (run_id, *keys)).fetchall()
    by_step: dict[int, dict] = {}
    for key, value, timestamp, step in rows:
        rec = by_step.setdefault(step, {})
        rec[key] = value
        if key == "time/step":
            rec["end"] = timestamp / 1000.0
    steps = []
    for step in sorted(by_step):
        rec = by_step[step]
        rec["tokens"] = rec.pop("response/length_mean") * w.prompts * w.samples
        steps.append(rec)
    return steps


def run_trl(w: Workload, args, model_dir: str, work: Path, tag: str, prompts: list[list[str]]) -> dict:
    cfg = load_config(str(ROOT / w.config), run_config(w, args, model_dir, str(work)))
    task_fields = ("name", "digits", "min_digits", "items", "eval_size")
    spec = {"model_dir": model_dir, "task": {k: getattr(cfg.task, k) for k in task_fields},
            "prompts": prompts, "prompts_per_step": w.prompts, "samples_per_prompt": w.samples,
            "max_new_tokens": w.max_new_tokens, "steps": w.steps, "lr": cfg.optim.lr,
            "betas": list(cfg.optim.betas), "weight_decay": cfg.optim.weight_decay, "grad_clip": cfg.optim.grad_clip,
            "clip_low": cfg.algo.ppo_clip.low, "clip_high": cfg.algo.ppo_clip.high,
            "std_normalize": cfg.algo.std_normalize,
            "temperature": cfg.rollout.temperature, "threads": args.threads, "seed": args.seed}
    spec_path, out_path = work / f"{tag}.spec.json", work / f"{tag}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(TRL_VENV / "bin" / "python"), "benchmarks/_trl_runner.py", "--spec", str(spec_path),
           "--out", str(out_path)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(args.threads), check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out_path.read_text())
    expected = [sorted({p for p, _ in prompts[i * w.prompts:(i + 1) * w.prompts]}) for i in range(w.steps)]
    if result["prompts_seen"] != expected:
        raise RuntimeError("TRL did not see the dcmdp run's prompts in the dcmdp run's order")
    result["wall_outer"] = time.perf_counter() - t0
    result["command"] = cmd
    return result


def summarize(steps: list[dict], phases: tuple[str, ...], warmup: int) -> dict:
    """Throughput over the timed steps; per-phase medians; 'other' = period minus the phases."""
    if len(steps) < warmup + 2:
        raise ValueError(f"need at least warmup + 2 = {warmup + 2} steps to time a period, got {len(steps)}")
    timed = steps[warmup + 1:]
    periods = [b["end"] - a["end"] for a, b in zip(steps[warmup:], timed)]
    tokens = sum(s["tokens"] for s in timed)
    out = {"tokens_per_s": tokens / sum(periods), "steps_per_s": len(periods) / sum(periods),
           "tokens_per_step": tokens / len(timed), "period_median": statistics.median(periods)}
    for p in phases:
        out[p] = statistics.median(s[p] for s in timed)
    out["time/other"] = statistics.median(per - sum(s[p] for p in phases) for per, s in zip(periods, timed))
    return out


def measure_limits(threads: int, n: int = 1024, mib: int = 256, repeats: int = 10) -> dict:
    """This CPU's fp32 matmul peak (best of ``repeats`` n^3 products, 2 n^3 FLOPs) and memory bandwidth (best
    copy of a ``mib`` MiB float32 tensor, 2 x its bytes moved) at ``threads`` torch threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    src.uniform_()
    a @ b
    dst.copy_(src)
    best_mm, best_copy = float("inf"), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best_mm = min(best_mm, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t0)
    return {"threads": threads, "matmul_gflops": 2 * n**3 / best_mm / 1e9, "matmul_n": n,
            "copy_gb_s": 2 * src.numel() * 4 / best_copy / 1e9, "copy_mib": mib}


def model_costs(model_dir: str, w: Workload, prompts: list[list[str]]) -> dict:
    """What the limit columns need of the shared model: active and non-embedding parameters, KV bytes per
    position, and the mean prompt length in tokens."""
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    experts = getattr(config, "num_experts", 0) or 0
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - embed - expert_params + (expert_params * config.num_experts_per_tok // experts if experts else 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokenizer = build_char_tokenizer()
    prompt_len = statistics.mean(len(encode_prompt(tokenizer, p)) for p, _ in prompts)
    return {"params_total": total, "params_active": active, "params_body": total - embed,
            "kv_bytes_per_position": 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4,
            "prompt_tokens_mean": prompt_len}


def best_limits(*measured: dict) -> dict:
    """The best of several ``measure_limits`` results (on a shared machine a single one can be far below the
    hardware's rate), with how many were taken."""
    best = dict(measured[0])
    for m in measured[1:]:
        best["matmul_gflops"] = max(best["matmul_gflops"], m["matmul_gflops"])
        best["copy_gb_s"] = max(best["copy_gb_s"], m["copy_gb_s"])
    best["measurements"] = sum(m.get("measurements", 1) for m in measured)
    return best


def relimit(result: dict, limits: dict) -> None:
    """Recompute every workload's limit columns against ``limits`` (in place)."""
    result["limits"] = limits
    for r in result["workloads"].values():
        w = Workload(**{**r["workload"], "coldstart": tuple(r["workload"]["coldstart"])})
        for side, summ in r["summary"].items():
            if side in r["limits"]:
                row = r["limits"][side]
                train_s = (summ["time/loss_forward"] + summ["time/backward"] + summ["time/optimizer"] if side == "trl"
                           else summ["time/old_logp"] + summ["time/update"])
                decode_s = summ["time/generate"] if side == "trl" else summ["time/rollout"]
                row.update(limit_columns(r["costs"], limits, w, summ, train_s, decode_s))


def limit_columns(costs: dict, limits: dict, w: Workload, summ: dict, train_s: float, decode_s: float) -> dict:
    """Achieved train FLOP/s and decode bytes/s of one side's medians, and their shares of the measured limits."""
    responses = w.prompts * w.samples
    response_len = summ["tokens_per_step"] / responses
    tokens = responses * (costs["prompt_tokens_mean"] + response_len)
    train_flops = 6 * costs["params_active"] * tokens
    # decode: max_new_tokens forwards read every non-embedding weight; each response token reads its row's cache
    decode_bytes = (w.max_new_tokens * costs["params_body"] * 4 + summ["tokens_per_step"]
                    * (costs["prompt_tokens_mean"] + response_len / 2) * costs["kv_bytes_per_position"])
    out = {"train_gflops": train_flops / train_s / 1e9, "decode_gb_s": decode_bytes / decode_s / 1e9}
    out["train_share_of_peak"] = out["train_gflops"] / limits["matmul_gflops"]
    out["decode_share_of_bandwidth"] = out["decode_gb_s"] / limits["copy_gb_s"]
    return out


def parse_variants(specs: list[str]) -> dict[str, tuple[str, ...]]:
    """``NAME=KEY=VALUE,KEY=VALUE`` -> {NAME: (KEY=VALUE, ...)}."""
    variants = {}
    for spec in specs:
        name, _, overrides = spec.partition("=")
        if not name or not overrides or name in ("dcmdp", "trl"):
            raise SystemExit(f"--variant {spec!r}: expected NAME=KEY=VALUE[,KEY=VALUE...], NAME not dcmdp/trl")
        variants[name] = tuple(o for o in overrides.split(",") if o)
    return variants


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the workload's)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps of every run (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="alternated repetitions per side (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both sides (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="an extra dcmdp side with comma-separated config overrides, e.g. "
                         "no-drop=rollout.torch.drop_finished=false (repeatable)")
    ap.add_argument("--skip-trl", action="store_true", help="run the dcmdp side(s) only")
    ap.add_argument("--smoke", action="store_true", help="seconds: 3 steps, 4 x 2 samples, random-init model, "
                    "1 repetition, dcmdp side only, results to --out-dir (a temporary folder by default)")
    ap.add_argument("--out-dir", default=None, help="where trl_throughput.{md,json} go (default "
                    "benchmarks/results, or a temporary folder with --smoke)")
    ap.add_argument("--render", default=None, metavar="JSON", help="only rewrite the markdown next to a saved "
                    "trl_throughput.json from it (no runs)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="with --render: take these saved results' "
                    "workloads into it (a later file's row replaces an earlier one's), each row keeping its own "
                    "invocation (date, code, command)")
    ap.add_argument("--remeasure-limits", type=int, default=0, metavar="K", help="with --render: measure the limits K "
                    "more times (one a minute) at the saved thread count and keep the best, then recompute the columns")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        for other in map(json.loads, (Path(f).read_text() for f in args.merge or ())):
            result["workloads"].update(other["workloads"])
            result["limits"] = best_limits(result["limits"], other["limits"])
            relimit(result, result["limits"])
            Path(args.render).write_text(json.dumps(result, indent=1))
        if args.remeasure_limits:
            extra = []
            for i in range(args.remeasure_limits):
                if i:
                    time.sleep(60)
                extra.append(measure_limits(result["limits"]["threads"]))
            relimit(result, best_limits(result["limits"], *extra))
            Path(args.render).write_text(json.dumps(result, indent=1))
        Path(args.render).with_suffix(".md").write_text(
            markdown(result, Path(args.render).with_name("trl_throughput.md")))
        return result
    workloads = {"smoke": SMOKE} if args.smoke else {n: WORKLOADS[n] for n in args.workloads.split(",")}
    if args.steps is not None:
        workloads = {n: Workload(**{**asdict(w), "steps": args.steps}) for n, w in workloads.items()}
    if args.smoke:
        args.warmup, args.repeats, args.skip_trl = 1, 1, True
    variants = parse_variants(args.variant)
    run_trl_side = not args.skip_trl and (TRL_VENV / "bin" / "python").exists()
    if not args.skip_trl and not run_trl_side:
        print(f"{TRL_VENV} not found (bash benchmarks/setup_trl.sh): dcmdp side only", file=sys.stderr)
    sides = ["dcmdp", *(["trl"] if run_trl_side else []), *variants]
    limits = measure_limits(args.threads)

    with tempfile.TemporaryDirectory(prefix="trl-throughput-") as tmp:
        work = Path(tmp)
        default_out = work / "results" if args.smoke else ROOT / "benchmarks" / "results"
        out_dir = Path(args.out_dir) if args.out_dir else default_out
        per_workload = {}
        for name, w in workloads.items():
            model_dir, coldstart_info = prepare_model(w, args, work / name)
            prompts = step_prompts(w, args)
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for rep in range(args.repeats):
                for side in (sides if rep % 2 == 0 else sides[::-1]):
                    tag = f"{name}-{side}-{rep}"
                    with OtherLoad() as load:
                        if side == "trl":
                            runs[side].append(run_trl(w, args, model_dir, work, tag, prompts))
                        else:
                            runs[side].append(run_dcmdp(w, args, model_dir, work, tag, variants.get(side, ())))
                    runs[side][-1]["other_cores"] = load.cores
                    print(f"{name} repetition {rep + 1}/{args.repeats}: {side} done", file=sys.stderr, flush=True)
            costs = model_costs(model_dir, w, prompts)
            limits = best_limits(limits, measure_limits(args.threads))
            per_workload[name] = report(w, args, runs, coldstart_info, model_dir, costs, limits)
            per_workload[name]["invocation"] = {
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "git": git_head(), "command": benchmark_command(args, variants)}
            for done in per_workload.values():
                relimit({"limits": limits, "workloads": {"w": done}}, limits)
            # written after every workload, so that an interrupted invocation keeps the finished rows
            result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                      "machine": f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} logical CPUs",
                      "args": vars(args), "variants": {k: list(v) for k, v in variants.items()},
                      "versions": {"dcmdp_env": {"python": platform.python_version(), "torch": torch.__version__,
                                                 "transformers": transformers.__version__},
                                   "trl_env": next((r["trl_versions"] for r in per_workload.values()
                                                    if r["trl_versions"]), None)},
                      "git": git_head(), "limits": limits, "workloads": per_workload}
            write_results(result, out_dir)
        print(json.dumps({n: r["summary"].get("ratio", r["summary"]["dcmdp"]) for n, r in per_workload.items()},
                         indent=2))
    return result


def report(w: Workload, args, runs: dict[str, list[dict]], coldstart_info: dict, model_dir: str, costs: dict,
           limits: dict) -> dict:
    per_run = {side: [summarize(r["steps"], TRL_PHASES if side == "trl" else DCMDP_PHASES, args.warmup)
                      for r in rs] for side, rs in runs.items()}
    summary = {side: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
               for side, rows in per_run.items() if rows}
    for side, rows in per_run.items():
        if side == "trl" or "trl" not in per_run:
            continue
        pairs = list(zip(rows, per_run["trl"]))
        key = "ratio" if side == "dcmdp" else f"ratio/{side}"
        summary[key] = {
            "tokens_per_s": statistics.median(d["tokens_per_s"] / t["tokens_per_s"] for d, t in pairs),
            "steps_per_s": statistics.median(d["steps_per_s"] / t["steps_per_s"] for d, t in pairs),
            "per_repetition_tokens_per_s": [d["tokens_per_s"] / t["tokens_per_s"] for d, t in pairs]}
    for side, rows in per_run.items():
        if side in ("dcmdp", "trl"):
            continue
        pairs = list(zip(per_run["dcmdp"], rows))
        summary[f"speedup_over/{side}"] = {
            "tokens_per_s": statistics.median(d["tokens_per_s"] / v["tokens_per_s"] for d, v in pairs),
            "per_repetition_tokens_per_s": [d["tokens_per_s"] / v["tokens_per_s"] for d, v in pairs]}
    limit_rows = {}
    for side, summ in summary.items():
        if side == "trl":
            train_s = summ["time/loss_forward"] + summ["time/backward"] + summ["time/optimizer"]
            limit_rows[side] = limit_columns(costs, limits, w, summ, train_s, summ["time/generate"])
        elif "/" not in side and side != "ratio":
            limit_rows[side] = limit_columns(costs, limits, w, summ, summ["time/old_logp"] + summ["time/update"],
                                             summ["time/rollout"])
    return {"workload": asdict(w), "coldstart": coldstart_info, "model_dir": model_dir, "costs": costs,
            "commands": {side: " ".join(rs[0]["command"]) for side, rs in runs.items() if rs},
            "trl_versions": runs["trl"][0]["versions"] if runs.get("trl") else None,
            "summary": summary, "limits": limit_rows, "per_run": per_run,
            "other_cores": {side: [r.get("other_cores") for r in rs] for side, rs in runs.items()},
            "steps": {side: [r["steps"] for r in rs] for side, rs in runs.items()}}


def benchmark_command(args, variants: dict[str, tuple[str, ...]]) -> str:
    extra = "".join(f" --variant {k}={','.join(o)}" for k, o in variants.items())
    return (f"OMP_NUM_THREADS={args.threads} .venv/bin/python benchmarks/trl_throughput.py --workloads "
            f"{args.workloads} --repeats {args.repeats} --threads {args.threads}{extra}")


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def _range(ratio: dict) -> str:
    reps = ratio["per_repetition_tokens_per_s"]
    return f"{ratio['tokens_per_s']:.2f} ({min(reps):.2f} to {max(reps):.2f})"


def write_results(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trl_throughput.json").write_text(json.dumps(result, indent=1))
    (out_dir / "trl_throughput.md").write_text(markdown(result, out_dir / "trl_throughput.md"))


TARGETS = {"long-small-moe": 2.0, "short-tiny-moe": 1.5}


def markdown(result: dict, page: Optional[Path] = None) -> str:
    """The results page; the hand-written reading next to ``page`` (``trl_throughput_reading.md``), when present,
    goes after the summary table."""
    args, v, lim = result["args"], result["versions"], result["limits"]
    trl_v = v["trl_env"] or {}
    variants = "".join(f" --variant {k}={','.join(o)}" for k, o in result["variants"].items())
    lines = [
        "# Training throughput: dcmdp vs TRL GRPOTrainer (CPU)", "",
        f"- date: {result['date']}; code: {result['git']}",
        f"- machine: {result['machine']}; torch threads {args['threads']} on both sides, one process each",
        f"- dcmdp env: python {v['dcmdp_env']['python']}, torch {v['dcmdp_env']['torch']}, "
        f"transformers {v['dcmdp_env']['transformers']}",
        f"- TRL env (.venv-trl): python {trl_v.get('python', '-')}, torch {trl_v.get('torch', '-')}, "
        f"transformers {trl_v.get('transformers', '-')}, trl {trl_v.get('trl', '-')}",
        f"- benchmark: `OMP_NUM_THREADS={args['threads']} .venv/bin/python benchmarks/trl_throughput.py "
        f"--workloads {args['workloads']} --repeats {args['repeats']} --threads {args['threads']}{variants}`",
        f"- limits measured at {lim['threads']} thread(s), best of {lim.get('measurements', 1)} measurements: fp32 "
        f"matmul ({lim['matmul_n']}^3) {lim['matmul_gflops']:.1f} GFLOP/s, copy of {lim['copy_mib']} MiB "
        f"{lim['copy_gb_s']:.1f} GB/s (read + write)", "",
        "| workload | dcmdp tokens/s | TRL tokens/s | dcmdp / TRL tokens/s, median (range) | "
        "dcmdp / TRL steps/s | target |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["workloads"].items():
        s = r["summary"]
        ratio = s.get("ratio")
        target = TARGETS.get(name)
        loaded = other_load(r)
        verdict = "-" if target is None or not ratio else \
            f">= {target}: {'met' if ratio['tokens_per_s'] >= target else 'not met'}"
        if loaded is None or loaded > LOADED_CORES:
            ratio, verdict = None, "not quoted: measured under load" if loaded is not None else "load not measured"
        lines.append(f"| {name} | {_fmt(s['dcmdp']['tokens_per_s'])} | {_fmt(s.get('trl', {}).get('tokens_per_s'))} | "
                     f"{_range(ratio) if ratio else '-'} | {_fmt(ratio and ratio['steps_per_s'])} | {verdict} |")
    lines += ["", f"Load: other jobs used {'; '.join(_load_text(n, r) for n, r in result['workloads'].items())} cores "
              f"during the runs (mean per run, max over the runs of a workload; /proc/stat less the benchmark's own "
              f"processes). A ratio measured with more than {LOADED_CORES} cores in use elsewhere is not quoted: "
              "load slows the two sides unequally."]
    if page is not None:
        lines += reading_lines(page)
    for name, r in result["workloads"].items():
        lines += ["", *workload_section(name, r)]
    settings = ROOT / "benchmarks" / "results" / "trl_throughput_settings.md"
    lines += ["", settings.read_text().rstrip()]
    return "\n".join(lines) + "\n"


def other_load(r: dict) -> Optional[float]:
    """The largest mean CPU use by other jobs (cores) over a workload's runs; None when it was not measured."""
    cores = [c for side in r.get("other_cores", {}).values() for c in side]
    return None if not cores or None in cores else max(cores)


def _load_text(name: str, r: dict) -> str:
    load = other_load(r)
    return f"{name} {'not measured' if load is None else f'at most {load:.2f}'}"


def workload_section(name: str, r: dict) -> list[str]:
    w, s = r["workload"], r["summary"]
    d, t = s["dcmdp"], s.get("trl", {})
    sides = [k for k in s if "/" not in k and k != "ratio"]
    lines = [f"## {name}: {w['describe']}", "",
             f"- workload: `{w['config']}`, model.preset={w['preset']}, {w['prompts']} prompts x {w['samples']} "
             f"samples per step, max {w['max_new_tokens']} new tokens, temperature 1, one AdamW step per rollout "
             f"batch; {w['steps']} steps per run, the first untimed",
             *([f"- measured {r['invocation']['date']} at code {r['invocation']['git']}: "
                f"`{r['invocation']['command']}`"] if "invocation" in r else []),
             f"- shared model: {r['model_dir']} (cold start: "
             f"{', '.join(f'{k} {v:.3g}' for k, v in r['coldstart'].items()) or 'none, random init'})",
             f"- dcmdp command: `{r['commands']['dcmdp']}`"]
    if "trl" in r["commands"]:
        lines.append(f"- TRL command: `{r['commands']['trl']}`")
    lines += ["", "| | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides),
              "| response tokens / s (median) | " + " | ".join(_fmt(s[k]["tokens_per_s"]) for k in sides) + " |",
              "| steps / s (median) | " + " | ".join(_fmt(s[k]["steps_per_s"]) for k in sides) + " |",
              "| response tokens / step | " + " | ".join(_fmt(s[k]["tokens_per_step"]) for k in sides) + " |",
              "| step period, s (median) | " + " | ".join(_fmt(s[k]["period_median"]) for k in sides) + " |",
              "| train step GFLOP/s (share of matmul peak) | " + " | ".join(
                  f"{r['limits'][k]['train_gflops']:.2f} ({r['limits'][k]['train_share_of_peak']:.1%})"
                  for k in sides) + " |",
              "| decode GB/s, upper bound (share of copy bandwidth) | " + " | ".join(
                  f"{r['limits'][k]['decode_gb_s']:.2f} ({r['limits'][k]['decode_share_of_bandwidth']:.1%})"
                  for k in sides) + " |", ""]
    for k, ratio in s.items():
        if k == "ratio":
            lines.append(f"dcmdp / TRL tokens/s: median {_range(ratio)} over the repetitions.")
        elif k.startswith("ratio/"):
            lines.append(f"{k[6:]} / TRL tokens/s: median {_range(ratio)}.")
        elif k.startswith("speedup_over/"):
            lines.append(f"dcmdp / {k[13:]} tokens/s (what the switch pays): median {_range(ratio)}.")
    load = r.get("other_cores", {})
    lines += ["", "| repetition (order) | " + " | ".join(f"{k} tokens/s (other jobs, cores)" for k in sides) + " |",
              "|---|" + "---|" * len(sides)]
    for i in range(len(r["per_run"]["dcmdp"])):
        order = sides if i % 2 == 0 else sides[::-1]
        cells = [f"{_fmt(r['per_run'][k][i]['tokens_per_s'])} ({_fmt(load[k][i] if i < len(load.get(k, ())) else None, 2)})"
                 if i < len(r["per_run"][k]) else "-" for k in sides]
        lines.append(f"| {i + 1} ({', '.join(order)}) | " + " | ".join(cells) + " |")
    lines += ["", "Where a step's time goes (median seconds per step over timed steps, then over repetitions; "
              "rows side by side are the closest counterparts):", "",
              "| dcmdp phase | s | TRL phase | s |", "|---|---|---|---|"]
    # at N = 1 dcmdp's training forward runs in time/old_logp (it gives pi_old and the update back-propagates it,
    # learner.score_on_policy), so its counterpart there is TRL's scoring plus its loss forward
    pairs = [("time/rollout (sample prompts, generate)", "time/rollout", "time/generate (_generate)", "time/generate"),
             ("time/old_logp (decode, reward, advantages, the training forward that gives pi_old)", "time/old_logp",
              "time/score + time/loss_forward (decode, reward, advantages, training forward)", "_score_forward"),
             ("time/measure (discrepancy measures)", "time/measure", "-", None),
             ("time/update (backward, clip, AdamW)", "time/update", "time/backward + time/optimizer", "_update"),
             ("time/dual (dual step)", "time/dual", "-", None),
             ("time/sync (weights to the rollout engine)", "time/sync", "- (generates with the trained model)", None),
             ("other (logging, between steps)", "time/other", "other (dataloader, logging, between steps)",
              "time/other")]
    derived = {"_score_forward": _trl_sum(t, "time/score", "time/loss_forward"),
               "_update": _trl_sum(t, "time/backward", "time/optimizer")}
    for dl, dk, tl, tk in pairs:
        tv = derived[tk] if tk in derived else (t.get(tk) if tk else None)
        lines.append(f"| {dl} | {_fmt(d.get(dk))} | {tl} | {_fmt(tv)} |")
    if t:
        lines += ["", "TRL update split: " + ", ".join(f"{k} {_fmt(t[k])} s" for k in
                                                        ("time/loss_forward", "time/backward", "time/optimizer"))]
    return lines


def _trl_sum(t: Optional[dict], *keys: str) -> Optional[float]:
    return sum(t.get(k, 0.0) for k in keys) if t else None


if __name__ == "__main__":
    main()
