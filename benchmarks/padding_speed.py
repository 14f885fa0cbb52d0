"""Forward + backward of the learner's scoring on a padded batch, left-justified and masked, against the same real
tokens without padding; the three take turns, so a load change on the machine hits all alike. Medians and ratios to
the unpadded batch into ``--out`` (JSON).

    .venv/bin/python benchmarks/padding_speed.py --out benchmarks/results/padding_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_speed import _configs, _rollout, _train_step, padded_prompt_lengths  # noqa: E402
from benchmarks.gpu_speed import parser as speed_parser  # noqa: E402
from trainers import learner  # noqa: E402
from trainers.models import model_from_config  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=512, help="real tokens per row")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, _ = _configs(speed_parser().parse_args(["--tiny"]))
    B, S = args.rows, args.seq
    prompt_len = padded_prompt_lengths(B, S)
    padded = _rollout(B, prompt_len, [S - p for p in prompt_len], cfg.vocab_size, torch.device("cpu"))
    unpadded = _rollout(B, [S // 4] * B, [S - S // 4] * B, cfg.vocab_size, torch.device("cpu"))
    model = model_from_config(cfg, seed=0, dtype="float32")
    fns = {"unpadded": _train_step(model, None, unpadded, learner.ScoringSpec()),
           "padded_justified": _train_step(model, None, padded, learner.ScoringSpec()),
           "padded_masked": _train_step(model, None, padded, learner.ScoringSpec(justify=False))}
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(args.repeats):
        # each round starts with another variant: no variant always runs after the same one
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    record = {"model": "tiny-dense (float32)", "rows": B, "real_tokens_per_row": S,
              "width_padded": padded.input_ids_BS.shape[1], "threads": args.threads, "torch": torch.__version__,
              "median_s": median, "over_unpadded": {k: v / median["unpadded"] for k, v in median.items()},
              "command": "benchmarks/padding_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
