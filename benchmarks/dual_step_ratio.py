"""Time of one ``dcmdp.dual.dual_step`` now against the same file at a git revision, in one process.

Both versions step the same configurations from ``init_state`` with the same measurement, in alternating order,
``--reps`` repetitions of ``--steps`` steps each; the script asserts they end in the same state and metrics and
prints the median time per step of each and their ratio. On a shared machine only the ratio means much.

    .venv/bin/python benchmarks/dual_step_ratio.py --before HEAD~1
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from constraints.config import ConstraintConfig  # noqa: E402
from dcmdp import dual as current  # noqa: E402
from dcmdp.config import DualConfig  # noqa: E402


def configs() -> dict[str, DualConfig]:
    two = [ConstraintConfig(), ConstraintConfig(measure="kl_k3", tolerance=0.001)]
    return {"projected, one fixed tolerance (default)": DualConfig(),
            "pid, two constraints, relative": DualConfig(rule="pid", relative=True, constraints=two),
            "projected, automatic tolerance, average": DualConfig(average=True,
                                                                  constraints=[ConstraintConfig(floor_slack=0.5)])}


def load_at(rev: str):
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:dcmdp/dual.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "dual_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("dcmdp.dual_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run(module, cfg: DualConfig, steps: int):
    state = module.init_state(cfg)
    measured_C = torch.full((len(cfg.constraints),), 0.004, dtype=torch.float64)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = module.dual_step(state, measured_C, cfg, floor_C=measured_C)
    return (time.perf_counter() - t0) / steps, (state.state_dict(), metrics)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="HEAD~1", help="git revision of dcmdp/dual.py to compare with")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    before = load_at(args.before)
    out = {}
    for name, cfg in configs().items():
        times = {"before": [], "now": []}
        ends = {}
        for rep in range(args.reps):
            order = (("before", before), ("now", current)) if rep % 2 else (("now", current), ("before", before))
            for key, module in order:
                dt, ends[key] = run(module, cfg, args.steps)
                times[key].append(dt)
        assert ends["before"] == ends["now"], f"{name}: the two versions end in different states"
        a, b = statistics.median(times["before"]), statistics.median(times["now"])
        out[name] = (a, b)
        print(f"{name}: {args.before} {a * 1e6:.0f} us/step, now {b * 1e6:.0f} us/step, {a / b:.2f}x", flush=True)
    return out


if __name__ == "__main__":
    main()
