"""Which sequences does seq-MIS's geometric band keep? A forward-only probe of the stress testbed's cold start.

seq-MIS (``algo.seq_mask.mode=geo``) drops a sequence whose geometric-mean ratio exp(mean_t log pi_old / mu)
leaves a band; with the published band [0.999, 1.001] it collapsed every run at int4 rollouts
(``benchmarks/results/stress_async8_methods.md``, ``stress_async4_methods.md``) while masking 75-97% of the
sequences. This probe asks which ones survive: the stress config (``configs/stress.yaml`` + the level + the
seq_mis method of ``benchmarks/stress.py``) samples ``--batches`` rollout batches from the shared cold start (no
update; batch n with the loop's own seeds for step n), scores them with the trainer (pi_old), and applies the
learner's own IS mode and mask (``trainers.losses.IS_MODES``) for each band. Per band: the share of sequences
kept, and for the kept and the dropped ones the share answered correctly, the mean length, the share with a
positive / negative GRPO advantage (computed over the whole group, as the loop does) and their advantage sum.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/seq_mask_probe.py

prints the table and writes ``benchmarks/results/seq_mask_probe.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import stress  # noqa: E402  (the stress config: base, levels, constraint, methods)

BANDS = ("0.999,1.001", "0.99,1.01")


def probe(level: str, bands: Sequence[tuple[float, float]], batches: int, overrides: Sequence[str] = ()) -> dict:
    from dataclasses import replace

    from dcmdp.config import load_config
    from dcmdp.loop import reward_phase, rollout_phase, screen_phase, setup
    from trainers import learner
    from trainers.losses import IS_MODES

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(stress.BASE_CONFIG, [*overrides, *stress.LEVELS[level], stress.CONSTRAINT,
                                               *stress.METHODS["seq_mis"], f"output_dir={out}", "threads=1",
                                               "progress=false", "async_rollout.enabled=false"])
        s = setup(cfg)
        rows = []  # per sequence: correct, length, advantage, then kept under each band
        try:
            with torch.no_grad():
                for step in range(1, batches + 1):
                    examples, rollout = rollout_phase(s.policy, cfg, step)
                    rewards_B, _ = reward_phase(s.policy, examples, rollout)
                    rollout, advantages_B, keep_B, _ = screen_phase(cfg.algo, rollout, rewards_B)
                    batch = learner.score_old(s.policy.model, rollout, advantages_B, cfg.algo, s.scoring)
                    mask_BT = rollout.response_mask_BT.bool()
                    kept = []
                    for low, high in bands:
                        geo = replace(cfg.algo.seq_mask.geo, low=low, high=high)
                        algo = replace(cfg.algo, seq_mask=replace(cfg.algo.seq_mask, geo=geo))
                        _, kept_BT, _ = IS_MODES[algo.is_mode](batch.old_logp_BT, rollout.rollout_logp_BT.float(),
                                                               mask_BT, algo)
                        kept.append(kept_BT.any(dim=1))
                    for i in range(len(rollout)):
                        if not keep_B[i]:  # a sample the guards dropped (non-finite values) is in no band's count
                            continue
                        rows.append([float(rewards_B[i] > 0.5), int(mask_BT[i].sum()), float(advantages_B[i]),
                                     *[bool(k[i]) for k in kept]])
        finally:
            s.policy.engine.close()
            s.tracker.finish()
    result = {"level": level, "batches": batches, "sequences": len(rows), "bands": []}
    for j, (low, high) in enumerate(bands):
        entry = {"band": [low, high], "kept_share": sum(r[3 + j] for r in rows) / max(len(rows), 1)}
        for name, side in (("kept", True), ("dropped", False)):
            sel = [r for r in rows if r[3 + j] == side]
            n = max(len(sel), 1)
            entry[name] = {"n": len(sel), "correct": sum(r[0] for r in sel) / n, "length": sum(r[1] for r in sel) / n,
                           "adv_pos": sum(r[2] > 0 for r in sel) / n, "adv_neg": sum(r[2] < 0 for r in sel) / n,
                           "adv_sum": sum(r[2] for r in sel)}
        result["bands"].append(entry)
    return result


def table(result: dict) -> list[str]:
    lines = ["| band | sequences kept | side | n | correct | mean length | advantage > 0 | advantage < 0 | "
             "advantage sum |", "|---|---|---|---|---|---|---|---|---|"]
    for e in result["bands"]:
        for side in ("kept", "dropped"):
            d = e[side]
            lines.append(f"| [{e['band'][0]}, {e['band'][1]}] | {e['kept_share']:.1%} | {side} | {d['n']} | "
                         f"{d['correct']:.1%} | {d['length']:.1f} | {d['adv_pos']:.1%} | {d['adv_neg']:.1%} | "
                         f"{d['adv_sum']:+.2f} |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--level", default="int4", choices=list(stress.LEVELS),
                    help="rollout deployment (synchronous: staleness does not apply to one forward)")
    ap.add_argument("--bands", nargs="+", default=list(BANDS), help="geometric bands as LOW,HIGH")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "seq_mask_probe"))
    ap.add_argument("overrides", nargs="*", help="dotlist overrides on top of the stress config")
    args = ap.parse_args(argv)
    bands = []
    for b in args.bands:
        try:
            low, high = (float(x) for x in b.split(","))
        except ValueError:
            raise SystemExit(f"--bands: expected LOW,HIGH (e.g. 0.999,1.001), got {b!r}") from None
        if not 0 <= low < high:
            raise SystemExit(f"--bands: need 0 <= LOW < HIGH, got {b!r}")
        bands.append((low, high))
    result = probe(args.level, bands, args.batches, args.overrides)
    lines = table(result)
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/seq_mask_probe.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**result, "command": cmd.strip()}, indent=1) + "\n")
    header = ["# Which sequences seq-MIS's geometric band keeps (stress config, cold start, no update)", "",
              f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
              f"{platform.node()} {platform.machine()}; torch {torch.__version__}",
              f"- command: `{cmd.strip()}`",
              f"- level {result['level']} (`{' '.join(stress.LEVELS[result['level']])}`), {result['batches']} rollout "
              f"batches, {result['sequences']} sequences; correct = reward 1; advantage = the loop's GRPO "
              "advantage over the whole group", ""]
    out.with_suffix(".md").write_text("\n".join(header + lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
