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

The proposal measures what the config constrains. Under ``dual.measure_at: updates`` the dual step's D-hat is
pi_theta at each mini-batch update vs mu: the floor plus the drift of the batch's N updates. Each batch then also
runs the config's N updates (its optimiser at the full learning rate, built once for all batches, lambda at
lambda_init) on a copy of the weights, which are put back before the next batch, and c comes from those values ("at the updates" rows). A
constraint with an automatic tolerance (``floor_slack``) has its c replaced by floor x (1 + floor_slack) from the
first batch on, so the snippet proposes floor_slack = c / mean floor - 1 for it (and c as the first batch's
tolerance). Calibrate writes only calibration.txt / .yaml and a new MLflow run into output_dir: it takes no lock
and leaves a run's checkpoints there as they are.
"""

from __future__ import annotations

import copy
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
from dcmdp.dual import penalty_spec
from dcmdp.loop import Setup, constraint_values, measure_phase, reward_phase, rollout_phase, screen_phase, setup
from dcmdp.policy import Policy, step_seed
from trainers import learner
from trainers.optim import build_optimizer

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
    # dual.measure_at of the config: "updates" proposes c from the values at the updates
    measure_at: str = "rollout"
    # algo.minibatches of the config (the updates per batch behind the "at the updates" values)
    minibatches: int = 1

    def row(self, name: str) -> FloorStats:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def table(self) -> str:
        w = max([28, *(len(r.name) + 2 for r in self.rows)])
        head = f"{'measure':<{w}}{'mean (floor)':>14}{'95% CI of mean':>28}{'p50':>12}{'p90':>12}{'p99':>12}" \
               f"{'proposed c':>14}"
        lines = [f"discrepancy floor over {self.batches} batches (identical weights), {self.rule()}",
                 *(["rows ending /at_updates: pi_theta at the updates vs mu (dual.measure_at: updates), what the dual "
                    "step constrains"] if self.measure_at == "updates" else []),
                 head, "-" * len(head)]
        for r in self.rows:
            ci = f"[{r.ci_low:.3g}, {r.ci_high:.3g}]"
            lines.append(f"{r.name:<{w}}{r.mean:>14.4g}{ci:>28}{r.p50:>12.4g}{r.p90:>12.4g}{r.p99:>12.4g}"
                         f"{r.proposed:>14.3g}")
        return "\n".join(lines)

    def snippet(self) -> str:
        """YAML to paste into a config (or pass as a config file): ``dual: {measure_at, constraints: [...]}`` with c
        (and floor_slack for an automatic tolerance), each keyed as the config keys it."""
        body = {"dual": {"measure_at": self.measure_at,
                         "constraints": [OmegaConf.to_container(OmegaConf.structured(c)) for c in self.constraints]}}
        where = (f"at the updates (dual.measure_at: updates: pi_theta at each of the {self.minibatches} mini-batch "
                 f"updates vs mu, the floor plus the updates' drift)" if self.measure_at == "updates" else
                 "before the updates (dual.measure_at: rollout: pi_old vs mu, identical weights)")
        note = [f"# dcmdp calibrate over {self.batches} batches: c measured {where}, {self.rule()}"]
        if any(c.floor_slack is not None for c in self.constraints):
            note.append("# floor_slack (automatic tolerance): c = floor x (1 + floor_slack) from the first batch on, the "
                        "floor measured before the updates; floor_slack is set so that c = the proposed c at the "
                        "measured floor, tolerance holds the proposed c")
        return "\n".join(note) + "\n" + OmegaConf.to_yaml(OmegaConf.create(body))

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
    """Run ``batches`` rollout batches (no update kept) and summarise every measure's floor.

    The constraints of the snippet are ``measures`` (default settings, tolerance set) when given, else the
    config's ``dual.constraints`` with only their tolerance (and an automatic tolerance's floor_slack) replaced.
    Builds the run with ``dcmdp.loop.setup`` without taking output_dir (``owns_folder=False``; MLflow run tagged
    ``dcmdp.kind=calibrate``) and logs each batch's measures as metrics at step n.
    """
    if batches < 1:
        raise ValueError(f"--batches must be >= 1, got {batches}")
    if not slack >= 0:
        raise ValueError(f"--slack must be >= 0, got {slack}")
    targets = [ConstraintConfig(measure=m) for m in measures] if measures else list(cfg.dual.constraints)
    at_updates = cfg.dual.measure_at == "updates"
    s: Setup = setup(cfg, owns_folder=False)
    try:
        s.tracker.set_tags({"dcmdp.kind": "calibrate"})
        per_key: dict[str, list[float]] = {}
        kept = []
        optimizer = build_optimizer(s.policy.model.parameters(), cfg.optim, seed=cfg.seed) if at_updates else None
        for n in range(batches):
            values, batch, examples = measure_batch(s.policy, s.scoring, cfg, targets, n)
            if at_updates:
                values.update(measure_updates(s, batch, examples, targets, n, optimizer))
            for k, v in values.items():
                per_key.setdefault(k, []).append(v)
            s.tracker.log_metrics(values, step=n + 1)
            if keep_batches:
                r = batch.rollout
                kept.append((batch.old_logp_BT.clone(), r.rollout_logp_BT.float().clone(),
                             r.response_mask_BT.bool().clone()))
        rows = [floor_stats(k, per_key[k], slack, seed=cfg.seed, inside_frac=inside_frac)
                for k in [*FLOOR_MEASURES, *(_updates_key(i, c) for i, c in enumerate(targets))] if k in per_key]
        proposed = []
        for i, c in enumerate(targets):
            source = _updates_key(i, c) if at_updates else _constraint_key(i, c)
            tol = floor_stats(source, per_key[source], slack, inside_frac=inside_frac).proposed
            floor = float(np.mean(per_key[_constraint_key(i, c)]))
            auto = c.floor_slack is not None and floor > 0 and math.isfinite(tol)
            proposed.append(replace(c, tolerance=tol, **({"floor_slack": _round_up(tol / floor - 1.0)} if auto else {})))
        result = Calibration(rows, proposed, slack, batches, s.tracker.run_id, kept, inside_frac, cfg.dual.measure_at,
                             cfg.algo.minibatches)
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


def _round_up(x: float) -> float:
    """max(x, 0) rounded up to 3 significant digits."""
    return proposed_tolerance(x, 0.0) if x > 0 else 0.0


def _updates_key(i: int, c: ConstraintConfig) -> str:
    return _constraint_key(i, c) + "/at_updates"


def measure_updates(s: Setup, batch: learner.ScoredBatch, examples, targets: Sequence[ConstraintConfig], step: int,
                    optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """D-hat at the updates (``dual.measure_at: updates``) of one batch: the config's N mini-batch updates on a copy
    of the weights (``optimizer``: the config's, at the full learning rate, one for all batches; lambda at
    lambda_init), each token's log-prob at the update that trained on it vs mu. The weights are put back afterwards,
    so every batch starts from the same ones; the optimiser's moments carry over, as in a run: a fresh AdamW's first
    steps move every weight by about lr and would overstate the drift a run's updates make."""
    cfg = s.cfg
    model = s.policy.model
    saved = copy.deepcopy(model.state_dict())
    rewards_B, _ = reward_phase(s.policy, examples, batch.rollout)
    rollout, advantages_B, _, _ = screen_phase(cfg.algo, batch.rollout, rewards_B)
    scored = learner.score_old(model, rollout, advantages_B, cfg.algo, s.scoring)
    try:
        result = learner.update(model, learner.OptimStep(optimizer, grad_clip=cfg.optim.grad_clip), scored,
                                scoring=s.scoring, penalty=penalty_spec(s.state.dual, cfg.dual), cfg=cfg.algo,
                                generator=torch.Generator().manual_seed(step_seed(cfg.seed, step, 2)))
        values_C = constraint_values(targets, scored, result.trained_logp_BT)
    finally:
        model.load_state_dict(saved)
        model.eval()
    return {_updates_key(i, c): float(v) for i, (c, v) in enumerate(zip(targets, values_C))}


@torch.no_grad()
def measure_batch(policy: Policy, scoring: learner.ScoringSpec, cfg: RunConfig, targets: Sequence[ConstraintConfig],
                  step: int):
    """One rollout batch with the current weights, pi_old recomputed; every measure's batch value, the scored batch
    and its examples."""
    examples, rollout = rollout_phase(policy, cfg, step)
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
    return values, batch, examples
