"""Time of one optimiser step on bfloat16 parameters: ``BF16AdamW`` (eager and compiled) against torch's AdamW
(foreach and fused), torchao's stochastic-rounding AdamW where importable, and the per-chunk loop it replaced.

Every optimiser gets its own copy of the same parameters (a Qwen3-like mix: embedding, attention and MLP matrices,
norm vectors) and gradients; the timed steps go round-robin over the optimisers, so a load change on the machine
hits all of them alike, and the result is each one's median step time and its ratio to torch's fused AdamW
(``foreach`` where fused is unavailable). A compiled optimiser's first step (compilation) is timed apart.

    .venv/bin/python benchmarks/optim_speed.py --params 50e6 --out benchmarks/results/optim_cpu.json
    .venv/bin/python benchmarks/optim_speed.py --device cuda --params 2e9    # on a GPU

``--baseline REF`` loads ``trainers/optim.py`` as of git ``REF`` (the per-chunk loop) as the method ``loop``;
``--torchao-path DIR`` puts a torchao install on the path for ``torchao`` (``torchao.optim._AdamW`` with
``bf16_stochastic_round=True``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainers.optim import BF16AdamW  # noqa: E402

LR, BETAS, WD = 1e-5, (0.9, 0.95), 0.01


def param_shapes(total: float, hidden: int = 1024, vocab: int = 16384) -> list[tuple[int, ...]]:
    """Shapes of a Qwen3-like stack of about ``total`` parameters: an embedding, then layers of q, k, v, o, gate, up,
    down matrices and two norm vectors until the total is reached."""
    inter = int(2.75 * hidden)
    layer = [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter), (hidden,), (hidden,)]
    shapes, n = [(vocab, hidden)], vocab * hidden
    while n < total:
        shapes += layer
        n += sum(torch.Size(s).numel() for s in layer)
    return shapes + [(hidden,)]


def _load_baseline(ref: str):
    src = subprocess.run(["git", "show", f"{ref}:trainers/optim.py"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    path = Path(tempfile.mkdtemp()) / "optim_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("optim_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def methods(device: torch.device, baseline: str | None, torchao: bool, compiled: bool) -> dict[str, Callable]:
    """name -> factory(params) of every optimiser to time on ``device``."""
    out: dict[str, Callable] = {
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD, foreach=True),
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD, fused=True),
    }
    for rounding in BF16AdamW.ROUNDINGS:
        out[f"dcmdp_{rounding}"] = (lambda r: lambda ps: BF16AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD,
                                                                   rounding=r, compile=False))(rounding)
        if compiled:
            out[f"dcmdp_{rounding}_compiled"] = (lambda r: lambda ps: BF16AdamW(
                ps, lr=LR, betas=BETAS, weight_decay=WD, rounding=r, compile=True))(rounding)
    if baseline:
        old = _load_baseline(baseline)
        for rounding in old.BF16AdamW.ROUNDINGS:
            out[f"loop_{rounding}"] = (lambda r: lambda ps: old.BF16AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD,
                                                                          rounding=r))(rounding)
    if torchao:
        from torchao.optim import _AdamW

        out["torchao_bf16_sr"] = lambda ps: _AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD,
                                                   bf16_stochastic_round=True)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(shapes: list[tuple[int, ...]], device: torch.device, factories: dict[str, Callable], steps: int,
               log: Callable[[str], None] = print) -> dict[str, dict]:
    """{name: {"first_s", "median_s", "steps_s"}}: the first step apart, then ``steps`` timed steps per optimiser,
    round-robin. Optimisers that fail to build or step are reported with their error."""
    gen = torch.Generator(device=device).manual_seed(0)  # drawn where they live: 1e9 CPU draws take seconds
    base = [torch.randn(s, generator=gen, device=device).mul_(0.02).bfloat16() for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device).mul_(1e-3).bfloat16() for s in shapes]
    state: dict[str, tuple] = {}
    out: dict[str, dict] = {}
    for name, make in factories.items():
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(params, grads):
            p.grad = g
        try:
            opt = make(params)
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            out[name] = {"first_s": time.perf_counter() - t0, "steps_s": []}
            state[name] = (opt, params)
            log(f"{name}: first step {out[name]['first_s']:.3f} s")
        except Exception as exc:  # an optimiser this torch or device lacks is reported, not fatal
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            log(f"{name}: {out[name]['error']}")
    for _ in range(steps):
        for name, (opt, _params) in state.items():
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            out[name]["steps_s"].append(time.perf_counter() - t0)
    for name in state:
        out[name]["median_s"] = statistics.median(out[name]["steps_s"])
        del state[name][1][:]
    return out


def ratios(result: dict[str, dict]) -> dict[str, float]:
    """Each median over torch's fused AdamW (its foreach one where fused failed)."""
    anchor = next((result[k]["median_s"] for k in ("torch_fused", "torch_foreach") if "median_s" in result.get(k, {})),
                  None)
    return {k: v["median_s"] / anchor for k, v in result.items() if anchor and "median_s" in v}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=50e6, help="parameters to optimise (Qwen3-like shapes)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per optimiser (after the first)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size of the Qwen3-like shapes")
    p.add_argument("--vocab", type=int, default=16384, help="rows of the embedding")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--baseline", default=None, help="git ref whose trainers/optim.py is timed as loop_*")
    p.add_argument("--torchao-path", default=None, help="directory holding a torchao install (prepended to sys.path)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled BF16AdamW")
    p.add_argument("--out", default=None, help="JSON results file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torchao = False
    if args.torchao_path:
        sys.path.insert(0, args.torchao_path)
    try:
        import torchao  # noqa: F401
        torchao = True
    except Exception as exc:  # noqa: BLE001
        print(f"torchao not importable: {exc}")
    device = torch.device(args.device)
    shapes = param_shapes(args.params, hidden=args.hidden, vocab=args.vocab)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"{n / 1e6:.1f} M bfloat16 parameters in {len(shapes)} tensors on {device}, "
          f"{torch.get_num_threads()} threads")
    result = time_steps(shapes, device, methods(device, args.baseline, torchao, not args.no_compile), args.steps)
    rel = ratios(result)
    for k, v in result.items():
        if "median_s" in v:
            print(f"{k:28s} {v['median_s']:8.3f} s   {rel.get(k, float('nan')):6.2f}x torch fused")
    record = {"date": datetime.date.today().isoformat(), "device": str(device), "host": platform.node(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "params": n, "tensors": len(shapes),
              "steps": args.steps, "baseline": args.baseline, "results": result, "over_torch_fused": rel,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
