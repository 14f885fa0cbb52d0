"""``dcmdp calibrate``: measure the discrepancy floor with identical weights in both engines, propose c.

DESIGN.md §4: "Calibrate c from the discrepancy floor measured on the first batches (identical weights in
both engines), plus a slack." With no update between batches the rollout engine mu and the training engine
pi_old hold the same weights, so every measured D is pure numerics (precision, kernels, KV cache, MoE
routing flips): the part of the discrepancy no policy update can remove. A tolerance below it can never be
met, and lambda would only grow.

Per measure m and batch n, D_mn is the batch value (``constraints.measures``, pi_old vs mu, before any
update). Over the N batches we report the mean (the floor), p50 / p90 / p99 of the per-batch values, and a
bootstrap 95% interval of the mean (``scipy.stats.bootstrap``, BCa, fixed seed); the proposed tolerance is

    c_m = max(q_m, 0) * (1 + slack),  rounded up to 3 significant digits

with q_m the ``inside_frac`` quantile of the per-batch values (the smallest value with at least that share of
batches at or below it; default 0.9): the share of steps inside the tolerance that ``dcmdp tune``'s selection
demands (``select.min_inside_frac``), so a proposed c is one tune can select even with matched weights
(kl_k1 is a signed estimator and may have a negative floor; a tolerance is >= 0).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy import stats

from constraints.config import ConstraintConfig
from constraints.measures import measure_constraint, panel_constraints
from dcmdp.config import RunConfig
from dcmdp.loop import Setup, measure_phase, rollout_phase, setup
from dcmdp.policy import Policy
from trainers import learner

log = logging.getLogger("dcmdp")

# Share of batches at or below the proposed c: dcmdp tune's default select.min_inside_frac (tests keep them equal).
INSIDE_FRAC = 0.9

# Table rows: metric key of ``discrepancy_metrics`` -> the ConstraintConfig that measures the same thing; every
# constrainable measure of the registry (``constraints.measures.MEASURES``), in registry order.
FLOOR_MEASURES: dict[str, ConstraintConfig] = panel_constraints()


@dataclass
class FloorStats:
    """Summary of one measure's per-batch values D_n, n = 1..N."""

    name: str
    values: list[float]
    mean: float
    p50: float
    p90: float
    p99: float
    ci_low: float
    ci_high: float
    proposed: float


@dataclass
class Calibration:
    rows: list[FloorStats]
    # proposed constraints (the config's constraints, or the ``measures`` asked for) with c set
    constraints: list[ConstraintConfig]
    slack: float
    batches: int
    run_id: Optional[str]
    # per batch (old_logp_BT, rollout_logp_BT, mask_BT), kept only with ``keep_batches``
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # share of batches at or below the proposed c
    inside_frac: float = INSIDE_FRAC

    def row(self, name: str) -> FloorStats:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def table(self) -> str:
        head = f"{'measure':<28}{'mean (floor)':>14}{'95% CI of mean':>28}{'p50':>12}{'p90':>12}{'p99':>12}" \
               f"{'proposed c':>14}"
        lines = [f"discrepancy floor over {self.batches} batches (identical weights), {self.rule()}",
                 head, "-" * len(head)]
        for r in self.rows:
            ci = f"[{r.ci_low:.3g}, {r.ci_high:.3g}]"
            lines.append(f"{r.name:<28}{r.mean:>14.4g}{ci:>28}{r.p50:>12.4g}{r.p90:>12.4g}{r.p99:>12.4g}"
                         f"{r.proposed:>14.3g}")
        return "\n".join(lines)

    def snippet(self) -> str:
        """YAML to paste into a config (or pass as a config file): ``dual: constraints: [...]`` with c."""
        body = {"dual": {"constraints": [OmegaConf.to_container(OmegaConf.structured(c)) for c in self.constraints]}}
        note = f"# dcmdp calibrate: floor over {self.batches} batches with identical weights, {self.rule()}\n"
        return note + OmegaConf.to_yaml(OmegaConf.create(body))

    def rule(self) -> str:
        q = f"q{100 * self.inside_frac:g}"
        return (f"c = {q} x (1 + {self.slack}), {q} = the least batch value with >= {self.inside_frac:.0%} of batches "
                f"at or below it (dcmdp tune's select.min_inside_frac)")


def proposed_tolerance(level: float, slack: float) -> float:
    """c = max(level, 0) * (1 + slack), rounded up to 3 significant digits."""
    c = max(level, 0.0) * (1.0 + slack)
    if not (math.isfinite(c) and c > 0):
        return c
    unit = 10.0 ** (math.floor(math.log10(c)) - 2)
    return float(f"{math.ceil(round(c / unit, 9)) * unit:.3g}")


def floor_stats(name: str, values: Sequence[float], slack: float, seed: int = 0,
                inside_frac: float = INSIDE_FRAC) -> FloorStats:
    """Mean, percentiles and bootstrap 95% interval of the mean of one measure's per-batch values; the proposed c
    from their ``inside_frac`` quantile (``inverted_cdf``: a value with >= that share of batches at or below it)."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    p50, p90, p99 = (float(x) for x in np.percentile(v, [50, 90, 99]))
    if len(v) < 2 or not np.isfinite(v).all():
        lo = hi = math.nan
    elif np.ptp(v) == 0:
        lo = hi = mean  # every batch equal: the bootstrap distribution is a point
    else:
        res = stats.bootstrap((v,), np.mean, confidence_level=0.95, n_resamples=2000, method="BCa",
                              random_state=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if not (math.isfinite(lo) and math.isfinite(hi)):  # BCa degenerates on near-constant samples
            res = stats.bootstrap((v,), np.mean, confidence_level=0.95, n_resamples=2000, method="percentile",
                                  random_state=np.random.default_rng(seed))
            lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    level = float(np.quantile(v, inside_frac, method="inverted_cdf"))
    return FloorStats(name, [float(x) for x in v], mean, p50, p90, p99, lo, hi, proposed_tolerance(level, slack))


def _constraint_key(i: int, c: ConstraintConfig) -> str:
    return f"constraint/{i}/{c.measure}" + (f"_{c.tau:g}" if c.measure == "extreme_rate" else "")


def calibrate(cfg: RunConfig, batches: int = 8, slack: float = 0.25, measures: Sequence[str] = (),
              keep_batches: bool = False, inside_frac: float = INSIDE_FRAC) -> Calibration:
    """Run ``batches`` rollout batches without updates and summarise every measure's floor.

    The constraints of the snippet are ``measures`` (default settings, tolerance set) when given, else the
    config's ``dual.constraints`` with only their tolerance replaced. Builds the run with
    ``dcmdp.loop.setup`` (``dcmdp.policy.build_policy``, MLflow run tagged ``dcmdp.kind=calibrate``) and logs each
    batch's measures as metrics at step n.
    """
    if batches < 1:
        raise ValueError(f"--batches must be >= 1, got {batches}")
    if not slack >= 0:
        raise ValueError(f"--slack must be >= 0, got {slack}")
    targets = [ConstraintConfig(measure=m) for m in measures] if measures else list(cfg.dual.constraints)
    s: Setup = setup(cfg)
    try:
        s.tracker.set_tags({"dcmdp.kind": "calibrate"})
        per_key: dict[str, list[float]] = {}
        kept = []
        for n in range(batches):
            values, batch = measure_batch(s.policy, s.scoring, cfg, targets, n)
            for k, v in values.items():
                per_key.setdefault(k, []).append(v)
            s.tracker.log_metrics(values, step=n + 1)
            if keep_batches:
                r = batch.rollout
                kept.append((batch.old_logp_BT.clone(), r.rollout_logp_BT.float().clone(),
                             r.response_mask_BT.bool().clone()))
        rows = [floor_stats(k, per_key[k], slack, seed=cfg.seed, inside_frac=inside_frac)
                for k in FLOOR_MEASURES if k in per_key]
        proposed = [replace(c, tolerance=floor_stats(k, per_key[k], slack, inside_frac=inside_frac).proposed)
                    for k, c in ((_constraint_key(i, c), c) for i, c in enumerate(targets))]
        result = Calibration(rows, proposed, slack, batches, s.tracker.run_id, kept, inside_frac)
        out = Path(cfg.output_dir)
        (out / "calibration.txt").write_text(result.table() + "\n")
        (out / "calibration.yaml").write_text(result.snippet())
        s.tracker.log_artifact(out / "calibration.txt")
        s.tracker.log_artifact(out / "calibration.yaml")
        s.tracker.finish()
    except BaseException:
        s.tracker.finish("FAILED")
        raise
    finally:
        s.policy.engine.close()
    return result


@torch.no_grad()
def measure_batch(policy: Policy, scoring: learner.ScoringSpec, cfg: RunConfig, targets: Sequence[ConstraintConfig],
                  step: int):
    """One rollout batch with the current weights, pi_old recomputed; every measure's batch value."""
    _, rollout = rollout_phase(policy, cfg, step)
    advantages_B = torch.zeros(len(rollout))  # no update follows: the advantages are never used
    batch = learner.score_old(policy.model, rollout, advantages_B, cfg.algo, scoring)
    _, metrics = measure_phase(cfg.dual.constraints, batch)
    values = {k: float(v) for k, v in metrics.items() if k in FLOOR_MEASURES}
    r = batch.rollout
    routes = batch.routes()
    for i, c in enumerate(targets):
        if c.measure == "routing_mismatch" and not routes:
            raise ValueError("routing_mismatch needs an MoE model and a rollout engine that reports its routes")
        values[_constraint_key(i, c)] = float(measure_constraint(c, batch.old_logp_BT, r.rollout_logp_BT.float(),
                                                                 r.response_mask_BT.bool(), **routes))
    return values, batch
