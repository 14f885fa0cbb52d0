"""The speed anchors of one GPU, each measured against its anchor in the same run, into ``--out DIR/speed.json``.

- ``optimizer_over_torch_fused``: a ``BF16AdamW`` step (stochastic rounding, compiled) over torch's fused AdamW on
  the same bfloat16 parameters (``benchmarks/optim_speed.py``).
- ``padded_over_unpadded``: forward + backward of the learner's scoring (``learner._forward_logp``, left-justified
  rows) on a batch with left-padded prompts and right-padded responses, over the same real tokens with no padding;
  ``padded_masked_over_unpadded``: the same with the padded layout and its mask (``ScoringSpec(justify=False)``).
- ``dense8b_step_mfu``: one training step (scoring forward, backward, optimiser) of the Qwen3-8B shape at
  ``--layers`` of its 36 layers, FLOPs by PaLM's rule (``benchmarks/mfu_gpu.flops_per_step``, the LM head's on the
  real response tokens it runs on) over the measured bf16 matmul peak (``mfu_gpu.peak_tflops``).
- ``moe_step_active_mfu``: the same for Qwen3-30B-A3B at ``--moe-layers`` of 48 layers, FLOPs of the active
  parameters (8 of 128 experts), with R3 replay of the routes of its own forward.
- ``decode_fraction_of_bound``: the torch engine's decode steps per second at ``--decode-prompts`` prompts against
  the memory-bandwidth bound (weight bytes read once per step at the bandwidth of a measured device copy), best of
  the dynamic cache, the static cache, and the static cache with CUDA-graph decode steps (each in ``decode``).
- ``controller_share_of_step``: every registered discrepancy measure of the batch plus one dual step, over the
  dense training step.

Reduced depths keep the whole script within ~200 s on an H200 (the page and the JSON say which depth ran).
Without CUDA, or with ``--dry-run``, it prints "skipped: no CUDA" and exits 0; ``--device cpu --tiny`` runs the same
code at tiny shapes on the CPU.

    python benchmarks/gpu_speed.py --out /tmp/gpu                      # on one GPU: /tmp/gpu/speed.json
    python benchmarks/gpu_speed.py --device cpu --tiny --out /tmp/speed_cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/dcmdp_gpu_speed", help="folder of speed.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="check the wiring only and exit 0")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU run of the same code)")
    p.add_argument("--layers", type=int, default=8, help="layers of the Qwen3-8B shape (36: full depth)")
    p.add_argument("--moe-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B shape (of 48)")
    p.add_argument("--batch", type=int, default=8, help="rows of a training batch")
    p.add_argument("--seq", type=int, default=2048, help="real tokens per row")
    p.add_argument("--opt-params", type=float, default=1e9, help="parameters of the optimiser comparison")
    p.add_argument("--decode-prompts", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64, help="max_new_tokens of the decode measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (medians)")
    p.add_argument("--budget-s", type=float, default=200.0, help="parts not started within this are skipped")
    p.add_argument("--cpu-graphs", action="store_true", help="compile the decode-graph variant off CUDA too")
    p.add_argument("--parts", default="optimizer,training,decode,decode_graphs", help="comma-separated parts to run")
    return p


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], None], device, repeats: int) -> float:
    fn()  # warm-up (kernels picked, compiled steps compiled)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved(fns: dict[str, Callable[[], None]], device, repeats: int) -> dict[str, float]:
    """Median time of each function, the functions taking turns (after one warm-up call each), so that a change of
    load or clock hits all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(repeats):
        # each round starts with another function: none always runs after the same one
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = fns[name]
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


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


def _rollout(B: int, prompt_len: list[int], response_len: list[int], vocab: int, device):
    """A Rollout in the engines' layout: prompts of ``prompt_len`` left-padded to their max, responses of
    ``response_len`` right-padded to theirs; random token ids."""
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
    """Prompt lengths of the padded batch: spread evenly over S/8 ... 3S/8 and symmetric about S/4, so that with
    responses of S - p_b every row holds S real tokens and the batch as many prompt and response tokens as the
    unpadded one (prompts of S/4); left-padded to 3S/8, responses right-padded to 7S/8."""
    return [S // 4 + round((S / 8) * (2 * b / max(B - 1, 1) - 1)) for b in range(B)]


def _train_step(model, optimizer, rollout, spec, replay=None) -> Callable[[], None]:
    from trainers import learner

    def step():
        logp_BT, _, _ = learner._forward_logp(model, rollout, spec, with_entropy=False, replay_experts_BSLK=replay,
                                              capture=False)
        (-(logp_BT.float() * rollout.response_mask_BT).sum() / rollout.response_mask_BT.sum()).backward()
        if optimizer is not None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True) if optimizer is not None else model.zero_grad(set_to_none=True)
    return step


def _step_flops(config, n_body: int, n_head: int, rollout) -> float:
    """FLOPs of a scoring step (``benchmarks/mfu_gpu.flops_per_step``: PaLM's 6N rule plus attention) with the LM head
    on the real response tokens only, as the justified forward runs it."""
    from benchmarks.mfu_gpu import flops_per_step

    B, S = rollout.input_ids_BS.shape
    return flops_per_step(config, n_body, 0, B, S) + 6 * int(rollout.response_mask_BT.sum()) * n_head


def _active_matmul_params(config) -> tuple[int, int]:
    """(N_body, N_head) per token: attention and active MLP (or MoE: top-k experts + router) weights of the layers,
    and the LM head."""
    H, L = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attn = H * q * 2 + H * kv * 2
    if getattr(config, "num_experts", 0):
        mlp = 3 * H * config.moe_intermediate_size * config.num_experts_per_tok + H * config.num_experts
    else:
        mlp = 3 * H * config.intermediate_size
    return L * (attn + mlp), H * config.vocab_size


def measure_training(args, device, result: dict, log) -> None:
    """padded_over_unpadded, dense8b_step_mfu, moe_step_active_mfu and controller_share_of_step."""
    import torch

    from benchmarks.mfu_gpu import peak_tflops
    from trainers import learner, routing
    from trainers.models import model_from_config
    from trainers.optim import BF16AdamW

    dense_cfg, moe_cfg = _configs(args)
    B, S = args.batch, args.seq
    peak = peak_tflops(device, 256 if args.tiny else 8192, 5) * 1e12
    result["peak_bf16_tflops"] = peak / 1e12
    prompt_len = padded_prompt_lengths(B, S)
    padded = _rollout(B, prompt_len, [S - p for p in prompt_len], dense_cfg.vocab_size, device)
    unpadded = _rollout(B, [S // 4] * B, [S - S // 4] * B, dense_cfg.vocab_size, device)
    result["padded_batch"] = {"rows": B, "real_tokens_per_row": S, "width_padded": padded.input_ids_BS.shape[1]}

    model = model_from_config(dense_cfg, seed=0, dtype="bfloat16", device=device)
    spec = learner.ScoringSpec(fp32_lm_head=True, lm_head_kernel="bf16x3" if device.type == "cuda" else "logits")
    optimizer = BF16AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95))
    masked_spec = learner.ScoringSpec(fp32_lm_head=True, lm_head_kernel=spec.lm_head_kernel, justify=False)
    times = _interleaved({"unpadded": _train_step(model, None, unpadded, spec),
                          "padded": _train_step(model, None, padded, spec),
                          "masked": _train_step(model, None, padded, masked_spec)}, device, args.repeats)
    t_unpadded, t_padded, t_masked = times["unpadded"], times["padded"], times["masked"]
    result.update(padded_over_unpadded=t_padded / t_unpadded, padded_masked_over_unpadded=t_masked / t_unpadded,
                  forward_backward_unpadded_s=t_unpadded)
    log(f"padded {t_padded:.3f} s, masked {t_masked:.3f} s, unpadded {t_unpadded:.3f} s (forward + backward)")
    t_step = _median_time(_train_step(model, optimizer, unpadded, spec), device, args.repeats)
    n_body, n_head = _active_matmul_params(dense_cfg)
    flops = _step_flops(dense_cfg, n_body, n_head, unpadded)
    result.update(dense8b_step_mfu=flops / t_step / peak, dense8b_step_s=t_step,
                  dense8b_layers=dense_cfg.num_hidden_layers)
    log(f"dense step {t_step:.3f} s at {dense_cfg.num_hidden_layers} layers: MFU {flops / t_step / peak:.1%}")

    result["controller_share_of_step"] = _controller_time(padded, device, args.repeats) / t_step
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    moe = model_from_config(moe_cfg, seed=0, dtype="bfloat16", device=device)
    routing.set_fp32_router(moe, True)
    moe_opt = BF16AdamW(moe.parameters(), lr=1e-6, betas=(0.9, 0.95))
    with torch.no_grad():  # R3: replay the routes of a forward of the same batch
        _, _, routes = learner._forward_logp(moe, unpadded, spec, with_entropy=False, replay_experts_BSLK=None,
                                             capture=True)
    t_moe = _median_time(_train_step(moe, moe_opt, unpadded, spec, replay=routes), device, args.repeats)
    n_body, n_head = _active_matmul_params(moe_cfg)
    flops = _step_flops(moe_cfg, n_body, n_head, unpadded)
    result.update(moe_step_active_mfu=flops / t_moe / peak, moe_step_s=t_moe, moe_layers=moe_cfg.num_hidden_layers)
    log(f"MoE step {t_moe:.3f} s at {moe_cfg.num_hidden_layers} layers: active MFU {flops / t_moe / peak:.1%}")


def _controller_time(rollout, device, repeats: int) -> float:
    """Every registered measure of (B, T) log-probs plus one dual step (the controller's work per rollout batch)."""
    import torch

    from constraints.config import ConstraintConfig
    from constraints.measures import MEASURES
    from dcmdp import dual
    from dcmdp.config import DualConfig

    B, T = rollout.response_ids_BT.shape
    g = torch.Generator(device=device).manual_seed(0)
    train = -torch.rand(B, T, generator=g, device=device) * 3
    roll = train + 1e-3 * torch.randn(B, T, generator=g, device=device)
    mask = rollout.response_mask_BT
    cfg = DualConfig(constraints=[ConstraintConfig(measure="abs_prob_diff", tolerance=0.005)])
    token = [m for m in MEASURES.values() if m.kind in ("token", "max", "sequence")]

    def controller():
        values = [float(m.batch(train, roll, mask)) for m in token]
        dual.dual_step(dual.init_state(cfg), torch.tensor(values[:1]), cfg)
    return _median_time(controller, device, repeats)


def measure_optimizer(args, device, result: dict, log) -> None:
    from benchmarks.optim_speed import methods, param_shapes, ratios, time_steps

    shapes = param_shapes(2e6 if args.tiny else args.opt_params, hidden=64 if args.tiny else 4096,
                          vocab=512 if args.tiny else 151936)
    chosen = {k: v for k, v in methods(device, None, False, True).items()
              if k in ("torch_fused", "torch_foreach", "dcmdp_stochastic_compiled")}
    timed = time_steps(shapes, device, chosen, args.repeats, log)
    rel = ratios(timed)
    result["optimizer"] = {"params": sum(int(__import__("math").prod(s)) for s in shapes), "steps": timed,
                           "over_torch_fused": rel}
    if "dcmdp_stochastic_compiled" in rel:
        result["optimizer_over_torch_fused"] = rel["dcmdp_stochastic_compiled"]


DECODE_VARIANTS = {"dynamic": dict(kv_cache="dynamic"), "static": dict(kv_cache="static"),
                   "static_graphs": dict(kv_cache="static", decode_graphs=True)}


def measure_decode(args, device, result: dict, log, variants: tuple[str, ...] = ("dynamic", "static")) -> None:
    """Decode tokens/s of the torch engine per KV-cache variant (``variants`` of ``DECODE_VARIANTS``) against the
    bandwidth bound; the headline ``decode_fraction_of_bound`` is the best variant's so far."""
    import torch

    from trainers.config import RolloutConfig, TorchEngineConfig
    from trainers.engines.torch_engine import TorchEngine
    from trainers.models import model_from_config

    dense_cfg, _ = _configs(args)
    model = model_from_config(dense_cfg, seed=0, dtype="bfloat16", device=device)
    n = args.decode_prompts
    if "copy_bandwidth_gbs" in result:  # one bound for every variant
        bandwidth = result["copy_bandwidth_gbs"] * 1e9
    else:  # a copy of 1 GiB, read + written: the bandwidth a decode step's weight reads can reach
        x = torch.empty(1 << 29 if not args.tiny else 1 << 20, dtype=torch.bfloat16, device=device)
        y = torch.empty_like(x)
        t_copy = _median_time(lambda: y.copy_(x), device, 5)
        bandwidth = 2 * x.numel() * x.element_size() / t_copy
        del x, y
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound_s = weight_bytes / bandwidth
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, dense_cfg.vocab_size, (64,), generator=g).tolist() for _ in range(n)]
    engines, per_variant = {}, {}
    for name, knobs in ((k, DECODE_VARIANTS[k]) for k in variants):
        engine = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=args.decode_tokens,
                                           torch=TorchEngineConfig(share_weights=True, **knobs)),
                             model, eos_id=-1, pad_id=0)
        if name == "static_graphs" and args.cpu_graphs:
            engine._decode_graphs = lambda: True  # the compiled step on the CPU (inductor, no graph capture)
        t0 = time.perf_counter()
        engine.generate(prompts, seed=0)  # warm-up: kernels picked, the graph variant compiled and captured
        _sync(device)
        engines[name] = engine
        per_variant[name] = {"first_call_s": time.perf_counter() - t0, "walls_s": []}
    steps = args.decode_tokens  # eos_id -1: no row stops early
    for rep in range(args.repeats):  # the variants take turns: a load change hits all alike
        for name, engine in engines.items():
            _sync(device)
            t0 = time.perf_counter()
            engine.generate(prompts, seed=1 + rep)
            _sync(device)
            per_variant[name]["walls_s"].append(time.perf_counter() - t0)
    for name, v in per_variant.items():
        wall = statistics.median(v["walls_s"])
        # the prefill is in the wall time: a slight underestimate of the decode rate
        v.update(tokens_per_s=n * steps / wall, step_s=wall / steps, fraction_of_bound=bound_s / (wall / steps))
        log(f"decode {name}: {v['tokens_per_s']:.0f} tokens/s at {n} prompts ({v['fraction_of_bound']:.1%} of the "
            f"bound), first call {v['first_call_s']:.1f} s")
    del engines
    per_variant = {**result.get("decode", {}), **per_variant}
    best = max(per_variant.values(), key=lambda v: v["tokens_per_s"])
    result.update(decode_fraction_of_bound=best["fraction_of_bound"], decode_tokens_per_s=best["tokens_per_s"],
                  decode=per_variant, decode_bound_tokens_per_s=n / bound_s, copy_bandwidth_gbs=bandwidth / 1e9,
                  decode_layers=dense_cfg.num_hidden_layers)
    log(f"bound {n / bound_s:.0f} tokens/s ({bound_s * 1e3:.2f} ms per step at {bandwidth / 1e9:.0f} GB/s)")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch

    if args.dry_run or (args.device.startswith("cuda") and not torch.cuda.is_available()):
        print("skipped: no CUDA" if not args.dry_run else "dry run: wiring checked")
        return 0
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "tiny": args.tiny, "errors": {}}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    # the graph variant last and apart: its compilation is the longest item, and the figures before it are kept
    parts = (("optimizer", measure_optimizer), ("training", measure_training), ("decode", measure_decode),
             ("decode_graphs", lambda *a: measure_decode(*a, variants=("static_graphs",))))
    for name, part in ((n, p) for n, p in parts if n in args.parts.split(",")):
        if time.perf_counter() - start > args.budget_s:
            result["errors"][name] = "skipped: time budget spent"
            continue
        try:
            part(args, device, result, log)
        except Exception as exc:  # one failed part is recorded; the others still run
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["wall_s"] = time.perf_counter() - start
        # written after every part: a run stopped by the check's time limit keeps what it measured
        (out / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
