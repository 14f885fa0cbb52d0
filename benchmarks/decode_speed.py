"""Time of a torch-engine rollout per KV-cache variant on the CPU: the dynamic cache, the static cache, and the
static cache with the compiled decode step (``rollout.torch.decode_graphs``, forced on: inductor without a CUDA
graph). The variants take turns after a warm-up each (the compiled one's is its compilation); medians and ratios to
the dynamic cache into ``--out`` (JSON).

    .venv/bin/python benchmarks/decode_speed.py --precision fp32 --out benchmarks/results/decode_cpu_fp32.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainers.config import ModelConfig, RolloutConfig, TorchEngineConfig  # noqa: E402
from trainers.engines.torch_engine import TorchEngine  # noqa: E402
from trainers.models import build_model  # noqa: E402

VARIANTS = {"dynamic": {}, "static": dict(kv_cache="static"), "static_compiled": dict(kv_cache="static",
                                                                                    decode_graphs=True)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-dense")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = 101
    model = build_model(ModelConfig(preset=args.preset), vocab, seed=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(2, 7))] for _ in range(args.prompts)]
    engines, first = {}, {}
    for name, knobs in VARIANTS.items():
        cfg = RolloutConfig(max_new_tokens=args.new_tokens, precision=args.precision, torch=TorchEngineConfig(**knobs))
        engine = TorchEngine(cfg, model, eos_id=-1, pad_id=0)  # eos -1: every row decodes every step
        if name == "static_compiled":
            engine._decode_graphs = lambda: True
        t0 = time.perf_counter()
        engine.generate(prompts, seed=0)
        first[name] = time.perf_counter() - t0
        engines[name] = engine
    walls: dict[str, list[float]] = {k: [] for k in engines}
    for rep in range(args.repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.generate(prompts, seed=1 + rep)
            walls[name].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in walls.items()}
    record = {"preset": args.preset, "precision": args.precision, "prompts": args.prompts,
              "new_tokens": args.new_tokens, "threads": args.threads, "torch": torch.__version__,
              "first_call_s": first, "median_s": median,
              "over_dynamic": {k: v / median["dynamic"] for k, v in median.items()},
              "command": "benchmarks/decode_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
