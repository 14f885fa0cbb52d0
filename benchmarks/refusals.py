"""How long a refusal takes: the wall time of commands that a user's mistake ends early (each a new process, as a user
runs it) and of checking 5,000 and 10,000 overrides, into ``--out DIR/refusals.json``. The unit tests assert what a
refusal does (exit 2 before anything is built, each distinct override tried once); its time is measured here.

    .venv/bin/python benchmarks/refusals.py --out /tmp/refusals
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._page import environment  # noqa: E402

COMMANDS = {
    "a bad command option": ["calibrate", "--batches", "0"],
    "a config typo": ["train", "stepz=3"],
    "an out-of-range value": ["train", "model.preset=tiny-dense", "seed=4294967296"],
    "device=cuda without CUDA": ["train", str(ROOT / "configs/default.yaml"), "device=cuda"],
}


def command_seconds(argv: list[str], repeats: int) -> dict:
    """The median wall time of ``python -m dcmdp.cli *argv`` in a fresh folder, and its exit codes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    seconds, codes = [], set()
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "dcmdp.cli", *argv, f"output_dir={tmp}/out"], cwd=tmp,
                                  env=env, capture_output=True, timeout=600)
            seconds.append(time.perf_counter() - t0)
            codes.add(done.returncode)
    return {"median_s": statistics.median(seconds), "seconds": seconds, "exit_codes": sorted(codes)}


def overrides_seconds(n: int) -> float:
    """Seconds to check ``n`` distinct overrides and one typo (``dcmdp check``'s composition)."""
    from dcmdp.config import compose_with_problems

    t0 = time.perf_counter()
    compose_with_problems(None, [f"seed={i}" for i in range(n)] + ["algo.minibatchs=4"])
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/dcmdp_refusals", help="folder of refusals.json")
    p.add_argument("--repeats", type=int, default=3, help="runs of each command (the median is reported)")
    args = p.parse_args(argv)
    import torch

    commands = {k: v for k, v in COMMANDS.items() if k != "device=cuda without CUDA" or not torch.cuda.is_available()}
    result: dict = {**environment(), "load_avg": os.getloadavg(),
                    "commands": {name: command_seconds(a, args.repeats) for name, a in commands.items()}}
    overrides_seconds(100)  # the imports of a first call
    small, large = overrides_seconds(5_000), overrides_seconds(10_000)
    result["overrides"] = {"5000_s": small, "10000_s": large, "ratio": large / small}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "refusals.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"commands": {k: v["median_s"] for k, v in result["commands"].items()},
                      "overrides": result["overrides"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
