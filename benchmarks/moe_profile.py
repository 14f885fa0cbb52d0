"""Where the time of one MoE training step goes on the CPU: forward (R3 replay of the routes of a first forward),
backward and the bf16 optimiser step of a ``small-moe`` (or ``--preset``) model, profiled with ``torch.profiler``;
self CPU time per operator and per phase into ``--out`` (markdown).

    .venv/bin/python benchmarks/moe_profile.py --out benchmarks/results/moe_profile_cpu.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.gpu_speed import _rollout  # noqa: E402
from trainers import learner  # noqa: E402
from trainers.config import ModelConfig  # noqa: E402
from trainers.models import build_model  # noqa: E402
from trainers.optim import BF16AdamW  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small-moe")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="real tokens per row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=15, help="operators listed")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = 512
    model = build_model(ModelConfig(preset=args.preset), vocab, seed=0).bfloat16()
    B, S = args.rows, args.seq
    rollout = _rollout(B, [S // 4] * B, [S - S // 4] * B, vocab, torch.device("cpu"))
    spec = learner.ScoringSpec(moe=True)
    opt = BF16AdamW(model.parameters(), lr=1e-5)
    with torch.no_grad():
        _, _, routes = learner._forward_logp(model, rollout, spec, with_entropy=False, replay_experts_BSLK=None,
                                             capture=True)

    def step():
        with record_function("phase: forward (R3 replay)"):
            logp, _, _ = learner._forward_logp(model, rollout, spec, with_entropy=False, replay_experts_BSLK=routes,
                                               capture=False)
            loss = -(logp.float() * rollout.response_mask_BT).sum() / rollout.response_mask_BT.sum()
        with record_function("phase: backward"):
            loss.backward()
        with record_function("phase: optimiser"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # warm-up
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    phases = sorted((e for e in events if e.key.startswith("phase: ")), key=lambda e: -e.cpu_time_total)
    ops = sorted((e for e in events if not e.key.startswith(("phase: ", "ProfilerStep"))),
                 key=lambda e: -e.self_cpu_time_total)[:args.top]
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"# One MoE training step on the CPU: where the time goes ({args.preset})", "",
             f"{B} rows x {S} tokens, bfloat16 parameters, R3 replay, `BF16AdamW`; torch {torch.__version__}, "
             f"{args.threads} threads; {wall:.2f} s profiled (profiler overhead included). Command: "
             f"`benchmarks/moe_profile.py {' '.join(argv if argv is not None else sys.argv[1:])}`.", "",
             "| phase | CPU s (total) |", "|---|---:|"]
    lines += [f"| {e.key[7:]} | {e.cpu_time_total / 1e6:.3f} |" for e in phases]
    lines += ["", "| operator | self CPU s | share | calls |", "|---|---:|---:|---:|"]
    lines += [f"| `{e.key}` | {e.self_cpu_time_total / 1e6:.3f} | {e.self_cpu_time_total / total:.1%} | {e.count} |"
              for e in ops]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
