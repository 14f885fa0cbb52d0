"""Accuracy and memory of the LM head's log-probs: bf16 logits, float32 logits, and the fused float32 kernels.

N scored tokens of hidden size H through a V-token head, targets sampled from the head's float64 distribution,
operands in float32 and in bfloat16. Each head of ``trainers.scoring`` computes log p and the entropy, then
backpropagates ``sum_n g_n log p_n + e_n H_n``; against the float64 head: max |Δ log p|, max |Δ H|, relative
gradient errors, peak memory of forward + backward (CPU: VmHWM; CUDA: max_memory_allocated) and, on CUDA, time.

    .venv/bin/python benchmarks/lm_head.py          # CPU: N 256, H 1024, V 151936; writes results/lm_head/lm_head.md/json
    .venv/bin/python benchmarks/lm_head.py --smoke  # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._page import environment, machine_kind, md_table, median_time  # noqa: E402

from trainers import lm_head  # noqa: E402
from trainers.lm_head import ROW_CHUNK, VOCAB_CHUNK  # noqa: E402
from trainers.scoring import fused_lm_head_logprobs, lm_head_logits, tempered_logp  # noqa: E402

HEADS = ("bf16 logits", "fp32 logits", "chunked", "bf16x3")
SETTINGS = {"fp32 weights": torch.float32, "bf16 weights": torch.bfloat16}


class _Model(torch.nn.Module):
    """A stand-in with ``get_output_embeddings`` for ``trainers.scoring``'s head functions."""

    def __init__(self, weight_VH: torch.Tensor):
        super().__init__()
        self.head = torch.nn.Linear(weight_VH.shape[1], weight_VH.shape[0], bias=False, device=weight_VH.device,
                                    dtype=weight_VH.dtype)
        with torch.no_grad():
            self.head.weight.copy_(weight_VH)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def make_batch(N: int, H: int, V: int, logit_std: float, seed: int, device: torch.device) -> dict:
    # drawn on the device itself: the float64 softmax of a GPU-sized batch would take minutes on the host
    gen = torch.Generator(device=device).manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64, device=device)
    h = torch.randn(N, H, **f64)
    w = torch.randn(V, H, **f64) * logit_std / H**0.5
    with torch.no_grad():
        y = torch.multinomial(torch.softmax(h @ w.T, dim=-1), 1, generator=gen).squeeze(1)
    g = torch.randn(N, **f64) / N
    e = torch.randn(N, **f64) / N
    return dict(h=h, w=w, y=y, g=g, e=e)


def run_head(name: str, h_NH: torch.Tensor, w_VH: torch.Tensor, y_N: torch.Tensor, g_N, e_N) -> tuple:
    """(logp, entropy, grad hidden, grad weight) of one head on these operands (their dtype kept)."""
    model = _Model(w_VH)
    h = h_NH.detach().clone().requires_grad_()
    h_BTH, y_BT = h[None], y_N[None]
    dev = h.device.type
    if name in ("bf16 logits", "fp32 logits"):
        fp32 = name == "fp32 logits"
        # the bf16 head of float32 weights is the autocast matmul, as in a bfloat16 run
        with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=not fp32 and w_VH.dtype != torch.bfloat16):
            logp_BTV = tempered_logp(lm_head_logits(model, h_BTH, fp32_lm_head=fp32), 1.0)
        logp = logp_BTV.gather(-1, y_BT[..., None]).squeeze(-1)
        ent = -(logp_BTV.exp() * logp_BTV).sum(-1)
        del logp_BTV
    else:
        logp, ent = fused_lm_head_logprobs(model, h_BTH, y_BT, temperature=1.0, kernel=name, with_entropy=True)
    (g_N[None].to(logp.dtype) * logp + e_N[None].to(ent.dtype) * ent).float().sum().backward()
    return logp[0].detach(), ent[0].detach(), h.grad, model.head.weight.grad


def float64_head(h_NH, w_VH, y_N, g_N, e_N) -> tuple:
    h, w = h_NH.double().requires_grad_(), w_VH.double().requires_grad_()
    lp = F.log_softmax(h @ w.T, dim=-1)
    logp, ent = lp.gather(1, y_N[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)
    (g_N * logp + e_N * ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_memory_mib(fn, device: torch.device) -> tuple[float, object]:
    """(peak MiB above the start, fn's result) of ``fn()``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20, out
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    except OSError:
        return float("nan"), fn()
    before = _rss_mib("VmRSS")
    out = fn()
    return _rss_mib("VmHWM") - before, out


def measure(args, device: torch.device) -> list[dict]:
    N, H, V = args.tokens, args.hidden, args.vocab
    batch = make_batch(N, H, V, args.logit_std, args.seed, device)
    rows = []
    for setting, dtype in SETTINGS.items():
        ops = (batch["h"].to(dtype), batch["w"].to(dtype), batch["y"], batch["g"], batch["e"])
        # the reference sees the operands' values exactly
        ref = float64_head(ops[0], ops[1], batch["y"], batch["g"], batch["e"])
        for name in HEADS:
            mib, (logp, ent, gh, gw) = peak_memory_mib(lambda: run_head(name, *ops), device)
            row = {"setting": setting, "head": name, "N": N, "H": H, "V": V,
                   "max_abs_dlogp": float((logp.double() - ref[0]).abs().max()),
                   "max_abs_dentropy": float((ent.double() - ref[1]).abs().max()),
                   "grad_hidden_rel": float((gh.double() - ref[2]).abs().max() / ref[2].abs().max()),
                   "grad_weight_rel": float((gw.double() - ref[3]).abs().max() / ref[3].abs().max()),
                   "peak_mib": mib, "nv_fp32_mib": N * V * 4 / 2**20}
            del logp, ent, gh, gw
            if device.type == "cuda":
                row["fwd_bwd_ms"] = 1e3 * median_time(lambda: run_head(name, *ops), device, args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ref
    return rows


def memory_probe(args, device: torch.device) -> list[dict]:
    """Peak memory of forward + backward at ``--memory-tokens`` tokens (float32 operands, no reference)."""
    N, H, V = args.memory_tokens, args.memory_hidden, args.vocab
    batch = make_batch(N, H, V, args.logit_std, args.seed, device) if N * V <= 2**26 else None
    if batch is None:  # sampling targets from an (N, V) float64 softmax is itself the largest tensor: draw uniformly
        f32 = dict(generator=torch.Generator(device=device).manual_seed(args.seed), device=device)
        batch = {"h": torch.randn(N, H, **f32), "w": torch.randn(V, H, **f32) * args.logit_std / H**0.5,
                 "y": torch.randint(0, V, (N,), **f32), "g": torch.randn(N, **f32) / N, "e": torch.randn(N, **f32) / N}
    ops = (batch["h"].float(), batch["w"].float(), batch["y"], batch["g"].float(), batch["e"].float())
    rows = []
    for name in HEADS:
        mib, _ = peak_memory_mib(lambda: run_head(name, *ops), device)
        rows.append({"head": name, "N": N, "H": H, "V": V, "peak_mib": mib, "nv_fp32_mib": N * V * 4 / 2**20,
                     "vh_fp32_mib": V * H * 4 / 2**20})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def memory_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    r0 = rows[0]
    lines = ["", f"Peak memory of forward + backward at N {r0['N']} tokens, hidden {r0['H']}, float32 operands: one "
                 f"(N, V) float32 tensor is {r0['nv_fp32_mib']:.0f} MiB, the float32 weight gradient "
                 f"{r0['vh_fp32_mib']:.0f} MiB.", "",
             *md_table(("head", "peak MiB", "peak / (N, V) float32 tensor"),
                       [(r["head"], f"{r['peak_mib']:.0f}", f"{r['peak_mib'] / r['nv_fp32_mib']:.2f}") for r in rows])]
    return lines


def table(rows: list[dict]) -> list[str]:
    timed = any("fwd_bwd_ms" in r for r in rows)
    lines = ["| operands | head | max abs Δ log p | max abs Δ entropy | grad hidden (rel) | grad weight (rel) | "
             "peak MiB (fwd + bwd) |" + (" fwd + bwd ms |" if timed else ""),
             "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if timed else "")]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['head']} | {r['max_abs_dlogp']:.2e} | {r['max_abs_dentropy']:.2e} | "
                     f"{r['grad_hidden_rel']:.2e} | {r['grad_weight_rel']:.2e} | {r['peak_mib']:.0f} |"
                     + (f" {r['fwd_bwd_ms']:.2f} |" if timed else ""))
    return lines


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="N scored tokens (B x T)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--logit-std", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="timed forward + backward passes per head (CUDA)")
    ap.add_argument("--memory-tokens", type=int, default=1024, help="N of the memory probe (0: none)")
    ap.add_argument("--memory-hidden", type=int, default=64, help="hidden size of the memory probe")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--smoke", action="store_true", help="N 64, H 64, V 3001: seconds")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_head" / "lm_head.md"))
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.repeats, args.memory_tokens = 64, 64, 3001, 1, 256
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return []
    device = torch.device(args.device)
    rows = measure(args, device)
    memory = memory_probe(args, device) if args.memory_tokens > 0 else []
    lines = table(rows) + memory_table(memory)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    card = env["device"] if device.type == "cuda" else machine_kind()
    cmd = "benchmarks/lm_head.py " + " ".join(argv if argv is not None else sys.argv[1:])
    N, V = args.tokens, args.vocab
    header = [
        "# LM head log-probs: accuracy against float64, peak memory", "",
        f"- date: {env['date']}",
        f"- machine: {env['machine']}, {card}; python {env['python']}, torch {env['torch']}"
        + ("" if device.type == "cpu" else f", TF32 matmul {torch.backends.cuda.matmul.allow_tf32}"),
        f"- command: `{cmd}`",
        f"- batch: N {N} tokens, hidden {args.hidden}, vocabulary {V}; unit-RMS hidden states, logits of std "
        f"{args.logit_std}, targets sampled from the float64 head; loss sum(g log p + e H), g, e ~ N(0, 1/N^2)",
        "- reference: the float64 head on the same operand values (bf16 operands: their bf16 values)",
        f"- fused tiles: {ROW_CHUNK} rows x {VOCAB_CHUNK} vocabulary entries",
        "- peak: " + ("torch.cuda.max_memory_allocated above the allocation before the call" if device.type == "cuda"
                      else "peak resident set (VmHWM) above the resident set before the call, one process, "
                           "heads in table order")
        + f"; one (N, V) float32 tensor is {N * V * 4 / 2**20:.0f} MiB; ``logits`` keeps two for the backward "
          "(logits and log-softmax) and allocates two more in it (bf16 logits: half), the fused kernels one tile",
        ""]
    # on CUDA: whether the bf16 GEMMs with float32 output ran on tensor cores (torch.mm out_dtype) or fell back
    mm_out_f32 = lm_head._CUDA_OUT_DTYPE_MM.get("ok") if device.type == "cuda" else None
    if device.type == "cuda":
        header.insert(-1, f"- bf16x3 GEMMs with float32 output on tensor cores (torch.mm out_dtype): {mm_out_f32}")
    out.write_text("\n".join(header + lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "device": card, "bf16_mm_out_float32": mm_out_f32,
                                                    "rows": rows, "memory": memory}, indent=2))
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
