"""The speed measurements, each against an anchor measured in the same process, into ``--out DIR/speed.json``:
the parts of ``PARTS`` (``--parts``), each function's docstring says what it measures. ``--tiny`` runs the same
code at tiny shapes (a CPU run: ``--device cpu --tiny``); without CUDA (device cuda) or with ``--dry-run`` it exits.

    python benchmarks/speed.py --out /tmp/gpu                                  # one GPU
    python benchmarks/speed.py --device cpu --tiny --parts training,decode --out /tmp/speed_cpu
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._page import environment, interleaved, median_time, peak_tflops, sync, timed  # noqa: E402

LR, BETAS, WD = 1e-5, (0.9, 0.95), 0.01


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/dcmdp_speed", help="folder of speed.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="check the arguments only and exit 0")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU run of the same code)")
    p.add_argument("--parts", default="optimizer,training,decode,decode_graphs",
                   help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--layers", type=int, default=8, help="layers of the Qwen3-8B shape (36: full depth)")
    p.add_argument("--moe-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B shape (of 48)")
    p.add_argument("--batch", type=int, default=8, help="rows of a training batch")
    p.add_argument("--seq", type=int, default=2048, help="real tokens per row")
    p.add_argument("--opt-params", type=float, default=1e9, help="parameters of the optimiser comparison")
    p.add_argument("--torchao-path", default=None, help="a directory holding a torchao install")
    p.add_argument("--decode-prompts", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64, help="max_new_tokens of the decode measurement")
    p.add_argument("--cpu-graphs", action="store_true", help="compile the decode-graph variant off CUDA too")
    p.add_argument("--heads", nargs="+", default=["bf16", "fp32", "bf16x3"], choices=list(HEADS))
    p.add_argument("--mfu-shapes", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"], choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (medians)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--budget-s", type=float, default=200.0, help="parts not started within this are skipped")
    return p


# ------------------------------------------------------------------------------------------------ shapes and FLOPs


def _qwen3(hidden: int, intermediate: int, layers: int = 28, heads: int = 16, kv_heads: int = 8, head_dim: int = 128,
           vocab: int = 151936):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


# the shapes of the ``mfu`` part, random weights; tiny: the same architecture for a CPU run
SHAPES = {"qwen3-0.6b": lambda: _qwen3(1024, 3072), "qwen3-1.7b": lambda: _qwen3(2048, 6144),
          "tiny": lambda: _qwen3(64, 192, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=512)}
# --heads name -> (fp32_lm_head, lm_head_kernel)
HEADS = {"bf16": (False, "logits"), "fp32": (True, "logits"), "bf16x3": (True, "bf16x3"), "chunked": (True, "chunked")}


def active_matmul_params(config, layers: int | None = None) -> tuple[int, int]:
    """(N_body, N_head): the linear weights a token passes through in the decoder layers (attention, and the MLP or
    the router plus the top-k experts) and in the LM head."""
    H, L = config.hidden_size, layers or config.num_hidden_layers
    attn = H * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    if getattr(config, "num_experts", 0):
        mlp = 3 * H * config.moe_intermediate_size * config.num_experts_per_tok + H * config.num_experts
    else:
        mlp = 3 * H * config.intermediate_size
    return L * (attn + mlp), H * config.vocab_size


def flops_per_step(config, n_body: int, n_head: int, batch: int, seq: int) -> float:
    """F = 6 B (S N_body + (S - 1) N_head) + 12 L H Q B S^2 (PaLM, arXiv 2204.02311 App. B; no causal discount)."""
    attn = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * batch * seq**2
    return float(6 * batch * (seq * n_body + (seq - 1) * n_head) + attn)


def _configs(args):
    from trainers.models import PRESETS

    if args.tiny:
        dense, moe = PRESETS["tiny-dense"].make_config(512), PRESETS["tiny-moe"].make_config(512)
        dense.max_position_embeddings = moe.max_position_embeddings = 4096
        return dense, moe
    dense, moe = PRESETS["qwen3-8b"].make_config(151936), PRESETS["qwen3-30b-a3b"].make_config(151936)
    dense.num_hidden_layers, moe.num_hidden_layers = args.layers, args.moe_layers
    for cfg in (dense, moe):
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
    return dense, moe


def rollout(B: int, prompt_len: list[int], response_len: list[int], vocab: int, device):
    """A Rollout in the engines' layout: prompts left-padded to the longest, responses right-padded; random ids."""
    import torch

    from trainers.batch import Rollout

    g = torch.Generator().manual_seed(0)
    P, T = max(prompt_len), max(response_len)
    ids = torch.randint(2, vocab, (B, P + T), generator=g)
    pm = torch.arange(P) >= P - torch.tensor(prompt_len)[:, None]
    rm = torch.arange(T) < torch.tensor(response_len)[:, None]
    ids[:, :P] = ids[:, :P].masked_fill(~pm, 0)
    ids[:, P:] = ids[:, P:].masked_fill(~rm, 0)
    return Rollout(prompt_ids_BP=ids[:, :P].to(device), prompt_mask_BP=pm.to(device),
                   response_ids_BT=ids[:, P:].to(device), response_mask_BT=rm.to(device),
                   rollout_logp_BT=torch.zeros(B, T, device=device))


def padded_prompt_lengths(B: int, S: int) -> list[int]:
    """Prompt lengths spread evenly over S/8 ... 3S/8, symmetric about S/4: with responses of S - p_b every row holds
    S real tokens and the batch as many prompt and response tokens as the unpadded one (prompts of S/4)."""
    return [S // 4 + round((S / 8) * (2 * b / max(B - 1, 1) - 1)) for b in range(B)]


def _train_step(model, optimizer, batch, spec, replay=None) -> Callable[[], None]:
    from trainers import learner

    def step():
        logp_BT, _, _ = learner._forward_logp(model, batch, spec, with_entropy=False, replay_experts_BSLK=replay,
                                              capture=False)
        (-(logp_BT.float() * batch.response_mask_BT).sum() / batch.response_mask_BT.sum()).backward()
        if optimizer is not None:
            optimizer.step()
        (optimizer or model).zero_grad(set_to_none=True)
    return step


def _step_flops(config, batch) -> float:
    n_body, n_head = active_matmul_params(config)
    B, S = batch.input_ids_BS.shape
    return flops_per_step(config, n_body, 0, B, S) + 6 * int(batch.response_mask_BT.sum()) * n_head


# ------------------------------------------------------------------------------------------------ parts


def param_shapes(total: float, hidden: int = 1024, vocab: int = 16384) -> list[tuple[int, ...]]:
    """A Qwen3-like stack of about ``total`` parameters: an embedding, then layers of q, k, v, o, gate, up, down and
    two norms."""
    inter = int(2.75 * hidden)
    layer = [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter), (hidden,), (hidden,)]
    shapes, n = [(vocab, hidden)], vocab * hidden
    while n < total:
        shapes += layer
        n += sum(math.prod(s) for s in layer)
    return shapes + [(hidden,)]


def optimizers(torchao: bool) -> dict[str, Callable]:
    import torch

    from trainers.optim import BF16AdamW

    out = {"torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD, foreach=True),
           "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD, fused=True)}
    for rounding in BF16AdamW.ROUNDINGS:
        for compiled in (False, True):
            out[f"dcmdp_{rounding}{'_compiled' if compiled else ''}"] = (lambda r, c: lambda ps: BF16AdamW(
                ps, lr=LR, betas=BETAS, weight_decay=WD, rounding=r, compile=c))(rounding, compiled)
    if torchao:
        from torchao.optim import _AdamW

        out["torchao_bf16_sr"] = lambda ps: _AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD, bf16_stochastic_round=True)
    return out


def measure_optimizer(args, device, result: dict, log) -> None:
    """``BF16AdamW`` (eager, compiled), torch's AdamW and torchao's stochastic-rounding AdamW where importable, each
    on its own copy of the same parameters and gradients: the first step (compilation) apart, then
    ``--repeats`` steps round-robin; medians and ratios to torch's fused AdamW (foreach where fused fails)."""
    import torch

    if args.torchao_path:
        sys.path.insert(0, args.torchao_path)
    try:
        import torchao  # noqa: F401
        have_torchao = True
    except Exception as exc:  # noqa: BLE001
        log(f"torchao not importable: {exc}")
        have_torchao = False
    shapes = param_shapes(2e6 if args.tiny else args.opt_params, hidden=64 if args.tiny else 4096,
                          vocab=512 if args.tiny else 151936)
    gen = torch.Generator(device=device).manual_seed(0)  # drawn where they live: 1e9 host draws take seconds
    base = [torch.randn(s, generator=gen, device=device).mul_(0.02).bfloat16() for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device).mul_(1e-3).bfloat16() for s in shapes]
    steps, runs = {}, {}
    for name, make in optimizers(have_torchao).items():
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(params, grads):
            p.grad = g
        try:
            opt = make(params)
            steps[name] = {"first_s": timed(opt.step, device)}
            runs[name] = opt.step
        except Exception as exc:  # an optimiser this torch or device lacks is reported, not fatal
            steps[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        log(f"optimizer {name}: {steps[name]}")
    for name, ts in interleaved(runs, device, args.repeats, warmup=0).items():
        steps[name].update(steps_s=ts, median_s=statistics.median(ts))
    anchor = next((steps[k]["median_s"] for k in ("torch_fused", "torch_foreach") if "median_s" in steps[k]), None)
    rel = {k: v["median_s"] / anchor for k, v in steps.items() if anchor and "median_s" in v}
    result["optimizer"] = {"params": sum(math.prod(s) for s in shapes), "steps": steps, "over_torch_fused": rel}
    if "dcmdp_stochastic_compiled" in rel:
        result["optimizer_over_torch_fused"] = rel["dcmdp_stochastic_compiled"]


def measure_training(args, device, result: dict, log) -> None:
    """Forward + backward of the learner's scoring on left-padded prompts and right-padded responses, left-justified
    and masked, over the same real tokens unpadded (padded_over_unpadded, padded_masked_over_unpadded); a training
    step of Qwen3-8B at ``--layers`` of 36 (dense8b_step_mfu) and of Qwen3-30B-A3B at ``--moe-layers`` of 48 with R3
    on the routes of its own forward (moe_step_active_mfu; r3_over_none: its forward + backward against routing
    anew): PaLM FLOPs, the head on the real response tokens, over the measured bf16 matmul peak; every registered
    measure plus a dual step over the dense step (controller_share_of_step)."""
    import torch

    from trainers import learner, routing
    from trainers.models import model_from_config
    from trainers.optim import BF16AdamW

    dense_cfg, moe_cfg = _configs(args)
    B, S = args.batch, args.seq
    peak = peak_tflops(device, 256 if args.tiny else 8192, 5) * 1e12
    result["peak_bf16_tflops"] = peak / 1e12
    prompt_len = padded_prompt_lengths(B, S)
    padded = rollout(B, prompt_len, [S - p for p in prompt_len], dense_cfg.vocab_size, device)
    unpadded = rollout(B, [S // 4] * B, [S - S // 4] * B, dense_cfg.vocab_size, device)
    result["padded_batch"] = {"rows": B, "real_tokens_per_row": S, "width_padded": padded.input_ids_BS.shape[1]}
    kernel = "bf16x3" if device.type == "cuda" else "logits"
    spec = learner.ScoringSpec(fp32_lm_head=True, lm_head_kernel=kernel)
    masked = learner.ScoringSpec(fp32_lm_head=True, lm_head_kernel=kernel, justify=False)

    model = model_from_config(dense_cfg, seed=0, dtype="bfloat16", device=device)
    t = {k: statistics.median(v) for k, v in interleaved(
        {"unpadded": _train_step(model, None, unpadded, spec), "padded": _train_step(model, None, padded, spec),
         "masked": _train_step(model, None, padded, masked)}, device, args.repeats).items()}
    result.update(padded_over_unpadded=t["padded"] / t["unpadded"],
                  padded_masked_over_unpadded=t["masked"] / t["unpadded"], forward_backward_unpadded_s=t["unpadded"])
    log(f"forward + backward: padded {t['padded']:.3f} s, masked {t['masked']:.3f} s, unpadded {t['unpadded']:.3f} s")
    optimizer = BF16AdamW(model.parameters(), lr=1e-6, betas=BETAS)
    t_step = median_time(_train_step(model, optimizer, unpadded, spec), device, args.repeats)
    mfu = _step_flops(dense_cfg, unpadded) / t_step / peak
    result.update(dense8b_step_mfu=mfu, dense8b_step_s=t_step, dense8b_layers=dense_cfg.num_hidden_layers)
    log(f"dense step {t_step:.3f} s at {dense_cfg.num_hidden_layers} layers: MFU {mfu:.1%}")
    result["controller_share_of_step"] = _controller_time(padded, device, args.repeats) / t_step
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    moe = model_from_config(moe_cfg, seed=0, dtype="bfloat16", device=device)
    routing.set_fp32_router(moe, True)
    with torch.no_grad():  # R3: replay the routes of a forward of the same batch
        _, _, routes = learner._forward_logp(moe, unpadded, spec, with_entropy=False, replay_experts_BSLK=None,
                                             capture=True)
    t = {k: statistics.median(v) for k, v in interleaved(
        {"none": _train_step(moe, None, unpadded, spec), "r3": _train_step(moe, None, unpadded, spec, replay=routes)},
        device, args.repeats).items()}
    result["r3_over_none"] = t["r3"] / t["none"]  # forward + backward with the routes replayed, over the router's own
    opt = BF16AdamW(moe.parameters(), lr=1e-6, betas=BETAS)
    t_moe = median_time(_train_step(moe, opt, unpadded, spec, replay=routes), device, args.repeats)
    mfu = _step_flops(moe_cfg, unpadded) / t_moe / peak
    result.update(moe_step_active_mfu=mfu, moe_step_s=t_moe, moe_layers=moe_cfg.num_hidden_layers)
    log(f"MoE step {t_moe:.3f} s at {moe_cfg.num_hidden_layers} layers: active MFU {mfu:.1%}")


def _controller_time(batch, device, repeats: int) -> float:
    """Every registered measure of (B, T) log-probs plus one dual step (the controller's work per rollout batch)."""
    import torch

    from constraints.config import ConstraintConfig
    from constraints.measures import MEASURES
    from dcmdp import dual
    from dcmdp.dual_config import DualConfig

    B, T = batch.response_ids_BT.shape
    g = torch.Generator(device=device).manual_seed(0)
    train = -torch.rand(B, T, generator=g, device=device) * 3
    roll = train + 1e-3 * torch.randn(B, T, generator=g, device=device)
    mask = batch.response_mask_BT
    cfg = DualConfig(constraints=[ConstraintConfig(measure="abs_prob_diff", tolerance=0.005)])
    token = [m for m in MEASURES.values() if m.kind in ("token", "max", "sequence")]

    def controller():
        values = [float(m.batch(train, roll, mask)) for m in token]
        dual.dual_step(dual.init_state(cfg), torch.tensor(values[:1]), cfg)
    return median_time(controller, device, repeats)


DECODE_VARIANTS = {"dynamic": dict(kv_cache="dynamic"), "static": dict(kv_cache="static"),
                   "static_graphs": dict(kv_cache="static", decode_graphs=True)}


def measure_decode(args, device, result: dict, log, variants: tuple[str, ...] = ("dynamic", "static")) -> None:
    """The torch engine's decode tokens/s per KV-cache variant against the bandwidth bound (the weight bytes read once
    per step at a measured copy's bandwidth); the headline is the best variant's so far."""
    import torch

    from trainers.config import RolloutConfig, TorchEngineConfig
    from trainers.engines.torch_engine import TorchEngine
    from trainers.models import model_from_config

    dense_cfg, _ = _configs(args)
    model = model_from_config(dense_cfg, seed=0, dtype="bfloat16", device=device)
    n, steps = args.decode_prompts, args.decode_tokens  # eos_id -1 below: no row stops early
    if "copy_bandwidth_gbs" in result:  # one bound for every variant
        bandwidth = result["copy_bandwidth_gbs"] * 1e9
    else:  # a copy of 1 GiB, read + written: the bandwidth a decode step's weight reads can reach
        x = torch.empty(1 << 29 if not args.tiny else 1 << 20, dtype=torch.bfloat16, device=device)
        y = torch.empty_like(x)
        bandwidth = 2 * x.numel() * x.element_size() / median_time(lambda: y.copy_(x), device, 5)
        del x, y
    bound_s = sum(p.numel() * p.element_size() for p in model.parameters()) / bandwidth
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, dense_cfg.vocab_size, (64,), generator=g).tolist() for _ in range(n)]
    engines, per_variant = {}, {}
    for name in variants:
        engine = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=steps,
                                           torch=TorchEngineConfig(share_weights=True, **DECODE_VARIANTS[name])),
                             model, eos_id=-1, pad_id=0)
        if name == "static_graphs" and args.cpu_graphs:
            engine._decode_graphs = lambda: True  # the compiled step on the CPU (inductor, no graph capture)
        # warm-up: kernels picked, the graph variant compiled and captured
        per_variant[name] = {"first_call_s": timed(lambda: engine.generate(prompts, seed=0), device)}
        engines[name] = (lambda e: lambda: e.generate(prompts, seed=1))(engine)
    for name, walls in interleaved(engines, device, args.repeats, warmup=0).items():
        wall = statistics.median(walls)
        # the prefill is in the wall time: a slight underestimate of the decode rate
        v = per_variant[name]
        v.update(walls_s=walls, tokens_per_s=n * steps / wall, step_s=wall / steps,
                 fraction_of_bound=bound_s / (wall / steps))
        log(f"decode {name}: {v['tokens_per_s']:.0f} tokens/s at {n} prompts ({v['fraction_of_bound']:.1%} of the "
            f"bound), first call {v['first_call_s']:.1f} s")
    per_variant = {**result.get("decode", {}), **per_variant}
    best = max(per_variant.values(), key=lambda v: v["tokens_per_s"])
    result.update(decode_fraction_of_bound=best["fraction_of_bound"], decode_tokens_per_s=best["tokens_per_s"],
                  decode=per_variant, decode_bound_tokens_per_s=n / bound_s, copy_bandwidth_gbs=bandwidth / 1e9,
                  decode_layers=dense_cfg.num_hidden_layers)


def measure_mfu(args, device, result: dict, log) -> None:
    """Per shape: one step (``response_logprobs`` + backward + AdamW) per LM head of ``--heads``, MFU over the
    measured peak, peak memory per head, and the step's FLOPs as ``FlopCounterMode`` counts them (eager attention: it has no formula for the CPU
    SDPA kernel, and its CUDA formula refuses grouped-query shapes) against ``flops_per_step``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from trainers.models import ATTN_IMPLEMENTATION, model_from_config
    from trainers.scoring import response_logprobs

    B, S = (2, 32) if args.tiny else (4, args.seq)
    peak = peak_tflops(device, 256 if args.tiny else 8192, 20)
    rows = []
    for name in (["tiny"] if args.tiny else args.mfu_shapes):
        config = SHAPES[name]()
        model = model_from_config(config, seed=0, dtype="bfloat16").to(device)
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=BETAS, foreach=True)
        ids_BS = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)).to(device)

        def step(head: str) -> None:
            fp32, kernel = HEADS[head]
            logp_BT, _ = response_logprobs(model, ids_BS, torch.ones_like(ids_BS), 1, temperature=1.0,
                                           fp32_lm_head=fp32, lm_head_kernel=kernel)
            (-logp_BT.float().mean()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        n_body, n_head = active_matmul_params(config)
        flops = flops_per_step(config, n_body, n_head, B, S)
        model.set_attn_implementation("eager")
        with FlopCounterMode(display=False) as counter:
            step("bf16")
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        row = {"shape": name, "params": sum(p.numel() for p in model.parameters()), "n_body": n_body,
               "n_head": n_head, "batch": B, "seq": S, "flops_per_step": flops,
               "counted_flops": counter.get_total_flops(), "peak_tflops": peak}
        for head in args.heads:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t = median_time(lambda: step(head), device, max(args.repeats, 2))
            gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            row[head] = {"step_s": t, "tokens_per_s": B * S / t, "tflops": flops / t / 1e12,
                         "mfu": flops / t / 1e12 / peak, "max_memory_gib": gib}
        log(f"mfu {name}: " + ", ".join(f"{h} {row[h]['mfu']:.1%}" for h in args.heads))
        rows.append(row)
        model = optimizer = None  # freed before the next shape is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["mfu"] = rows


# the graph variant after the plain ones: its compilation is the longest item, and the figures before it are kept
PARTS = {"optimizer": measure_optimizer, "training": measure_training, "decode": measure_decode,
         "decode_graphs": lambda *a: measure_decode(*a, variants=("static_graphs",)), "mfu": measure_mfu}


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser().error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    import torch

    if args.dry_run or (args.device.startswith("cuda") and not torch.cuda.is_available()):
        print("skipped: no CUDA" if not args.dry_run else "dry run: arguments checked")
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict = {**environment(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "tiny": args.tiny, "threads": torch.get_num_threads(), "errors": {},
                    "command": "benchmarks/speed.py " + " ".join(argv if argv is not None else sys.argv[1:])}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    for name in (n for n in PARTS if n in args.parts.split(",")):
        if time.perf_counter() - start > args.budget_s:
            result["errors"][name] = "skipped: time budget spent"
            continue
        try:
            PARTS[name](args, device, result, log)
        except Exception as exc:  # one failed part is recorded; the others still run
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["wall_s"] = time.perf_counter() - start
        # written after every part: a run stopped by the check's time limit keeps the parts it finished
        (out / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))}, indent=1))
    return result


if __name__ == "__main__":
    main()
