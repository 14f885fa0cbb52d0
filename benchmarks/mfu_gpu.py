"""Training-step MFU of a Qwen3-shaped model on one GPU: bf16 weights, LM head in bf16, in fp32, fused fp32.

A random Qwen3 with the 0.6B / 1.7B shapes; one step = ``trainers.scoring.response_logprobs`` + backward + AdamW
per LM head of ``--heads``. FLOPs (PaLM's 6N + attention rule, arXiv 2204.02311 App. B, head at S - 1 positions):
F = 6 B (S N_body + (S - 1) N_head) + 12 L H Q B S^2; ``--check-flops`` compares it with FlopCounterMode.
MFU = (F / median step time) / the best measured bf16 matmul TFLOP/s (``--peak-n``).

    .venv/bin/python benchmarks/mfu_gpu.py                 # on a CUDA machine; writes results/mfu_gpu.md
    .venv/bin/python benchmarks/mfu_gpu.py --cpu-dry-run   # same code on a tiny shape on the CPU

Without a CUDA device (and without ``--cpu-dry-run``) it prints "no CUDA device: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from benchmarks._page import md_table  # noqa: E402

from trainers.models import ATTN_IMPLEMENTATION, model_from_config  # noqa: E402
from trainers.scoring import response_logprobs  # noqa: E402


def _qwen3(hidden: int, intermediate: int, layers: int = 28, heads: int = 16, kv_heads: int = 8, head_dim: int = 128,
           vocab: int = 151936) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


# name -> Qwen3Config of the real shape (random weights)
SHAPES = {
    "qwen3-0.6b": lambda: _qwen3(1024, 3072),
    "qwen3-1.7b": lambda: _qwen3(2048, 6144),
    # the CPU dry run: same architecture, tiny
    "tiny": lambda: _qwen3(64, 192, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=512),
}


def matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """(N_body, N_head): parameters of the linear weights of the decoder layers, and of the LM head."""
    head = model.get_output_embeddings().weight
    seen, n = {id(head)}, 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n += m.weight.numel()
    return n, head.numel()


def flops_per_step(config: Qwen3Config, n_body: int, n_head: int, batch: int, seq: int) -> float:
    """F = 6 B (S N_body + (S - 1) N_head) + 12 L H Q B S^2 (PaLM App. B, no causal discount)."""
    attn = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * batch * seq**2
    return float(6 * batch * (seq * n_body + (seq - 1) * n_head) + attn)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_tflops(device: torch.device, n: int, repeats: int) -> float:
    """Best TFLOP/s of an n x n x n bf16 matmul (2 n^3 FLOPs) over ``repeats`` timed calls."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


# --heads name -> (row key, table label, fp32_lm_head, lm_head_kernel)
HEADS = {"bf16": ("bf16_head", "bf16", False, "logits"), "fp32": ("fp32_head", "fp32", True, "logits"),
         "bf16x3": ("bf16x3_head", "fp32 bf16x3", True, "bf16x3"),
         "chunked": ("chunked_head", "fp32 chunked", True, "chunked")}


def train_step(model, optimizer, ids_BS: torch.Tensor, mask_BS: torch.Tensor, fp32_lm_head: bool,
               lm_head_kernel: str = "logits") -> None:
    """The learner's forward (response_logprobs, 1 prompt position) + backward + AdamW step."""
    logp_BT, _ = response_logprobs(model, ids_BS, mask_BS, 1, temperature=1.0, fp32_lm_head=fp32_lm_head,
                                   lm_head_kernel=lm_head_kernel)
    (-logp_BT.float().mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def counted_flops(model, optimizer, ids_BS, mask_BS, fp32_lm_head: bool) -> int:
    """FLOPs of one step as FlopCounterMode counts them."""
    # The counted step runs eager attention (plain matmuls): FlopCounterMode has no formula for the CPU SDPA
    # kernel, whose attention it would miss, and its CUDA SDPA formula refuses grouped-query shapes (torch 2.11:
    # "query/key/value shapes are incompatible" for 16 query / 8 KV heads). The timed steps keep SDPA.
    model.set_attn_implementation("eager")
    try:
        with FlopCounterMode(display=False) as counter:
            train_step(model, optimizer, ids_BS, mask_BS, fp32_lm_head)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return counter.get_total_flops()


def measure_shape(name: str, args, device: torch.device, peak: float) -> dict:
    config = SHAPES[name]()
    model = model_from_config(config, seed=args.seed, dtype="bfloat16").to(device)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), foreach=True)
    gen = torch.Generator().manual_seed(args.seed)
    ids_BS = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    mask_BS = torch.ones_like(ids_BS)
    n_body, n_head = matmul_params(model)
    flops = flops_per_step(config, n_body, n_head, args.batch, args.seq)
    row = {"shape": name, "params": sum(p.numel() for p in model.parameters()), "n_body": n_body, "n_head": n_head,
           "batch": args.batch, "seq": args.seq, "flops_per_step": flops, "peak_tflops": peak}
    if args.check_flops:
        row["counted_flops"] = counted_flops(model, optimizer, ids_BS, mask_BS, fp32_lm_head=False)
    heads = list(args.heads)
    times = {h: [] for h in heads}
    peak_bytes = {h: 0 for h in heads}
    for i in range(args.warmup + args.steps):
        for head in heads[i % len(heads):] + heads[:i % len(heads)]:
            _, _, fp32_head, kernel = HEADS[head]
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            train_step(model, optimizer, ids_BS, mask_BS, fp32_head, kernel)
            sync(device)
            if i >= args.warmup:
                times[head].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peak_bytes[head] = max(peak_bytes[head], torch.cuda.max_memory_allocated(device))
    for head, ts in times.items():
        t = statistics.median(ts)
        row[HEADS[head][0]] = {"step_s": t, "tokens_per_s": args.batch * args.seq / t, "tflops": flops / t / 1e12,
                               "mfu": flops / t / 1e12 / peak, "max_memory_gib": peak_bytes[head] / 2**30}
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| shape | params | B x S | LM head | step s | tokens/s | TFLOP/s | peak TFLOP/s | MFU | max GiB |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for key, label, _, _ in HEADS.values():
            if key not in r:
                continue
            m = r[key]
            lines.append(f"| {r['shape']} | {r['params'] / 1e6:.0f}M | {r['batch']} x {r['seq']} | {label} | "
                         f"{m['step_s']:.4f} | {m['tokens_per_s']:.0f} | {m['tflops']:.4g} | {r['peak_tflops']:.4g} | "
                         f"{m['mfu']:.1%} | {m['max_memory_gib']:.1f} |")
    checks = [r for r in rows if "counted_flops" in r]
    if checks:
        lines += ["", *md_table(("shape", "formula FLOPs / step", "counted (FlopCounterMode)", "counted / formula"),
                                [(r["shape"], f"{r['flops_per_step']:.4g}", f"{r['counted_flops']:.4g}",
                                  f"{r['counted_flops'] / r['flops_per_step']:.4f}") for r in checks])]
    return lines


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"], choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per LM head setting")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-n", type=int, default=8192, help="size of the bf16 matmul that measures the peak")
    ap.add_argument("--check-flops", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", nargs="+", default=["bf16", "fp32", "bf16x3"], choices=list(HEADS))
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the same code on the CPU with the tiny shape (B 2, S 32, 2 steps)")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/gpu/mfu_gpu.md on a GPU)")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)

    if args.cpu_dry_run:
        device = torch.device("cpu")
        args.shapes, args.batch, args.seq, args.steps, args.warmup, args.peak_n = ["tiny"], 2, 32, 2, 1, 256
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        args.out = args.out or str(ROOT / "benchmarks" / "results" / "gpu" / "mfu_gpu.md")
    else:
        print("no CUDA device: skipped")
        return []

    peak = peak_tflops(device, args.peak_n, repeats=20)
    print(f"peak bf16 matmul ({args.peak_n}^3): {peak:.4g} TFLOP/s", flush=True)
    rows = []
    for name in args.shapes:
        rows.append(measure_shape(name, args, device, peak))
        print(json.dumps(rows[-1]), flush=True)

    lines = table(rows)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        exe = Path(sys.executable)
        python = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else exe.name
        cmd = f"{python} benchmarks/mfu_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        header = [
            "# Training-step MFU, Qwen3 shapes, random weights", "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
            f"- machine: {platform.node()}, {card}, CUDA {torch.version.cuda}, "
            f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}",
            f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}",
            f"- command: `{cmd}`",
            "- step: response_logprobs (1 prompt position, LM head on every other position) + backward + AdamW, "
            f"bf16 weights; median of {args.steps} steps after {args.warmup}, the LM head settings in a rotating order",
            "- FLOPs per step F = 6 B (S N_body + (S - 1) N_head) + 12 L H Q B S^2 (PaLM App. B, causal masking not "
            f"discounted; the LM head runs at the S - 1 scored positions); peak = best {args.peak_n}^3 bf16 matmul "
            "on this card; max GiB: torch.cuda.max_memory_allocated over that head's steps", ""]
        out.write_text("\n".join(header + lines) + "\n")
        out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=2))
    print()
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
