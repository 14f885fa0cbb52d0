"""``dcmdp calibrate``: measure the discrepancy floor with identical weights in both engines, propose c.

docs/design.md §"Tolerance schemes": c comes from the discrepancy floor measured on the first batches (identical
weights in both engines), plus a slack. With no update between batches the rollout engine mu and the training engine
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

The proposal measures what the config constrains, at the point the dual step measures it. Under ``dual.measure_at:
updates`` D-hat is pi_theta at each mini-batch update vs mu (the floor plus the drift of the batch's N updates),
under ``drift`` pi_theta at each update vs pi_old (the drift alone). Each batch then also runs the config's N updates
twice on a copy of the weights, which are put back before the next batch: once without the penalty (lambda = 0) and
once at lambda_max, with the tolerance the run would put in force. The two give the range the dual can move D-hat
over, D_0 (no penalty) and D_max (the strongest penalty); a tolerance is real only inside it (docs/tolerances.md):

    c = (mean(D_max) (1 + slack) + mean(D_0)) / 2   when mean(D_max) (1 + slack) < mean(D_0),
    c = q(D_max) (1 + slack)                         otherwise (q the ``inside_frac`` quantile of the batches)

so that the strongest penalty holds D-hat under c on average and without the penalty D-hat lies above it: lambda has
to act, from the interior of [0, lambda_max] (the c of a q90 of D_0 itself would leave the dual slack on ~90% of the
steps: lambda at 0, the loosest setting). Means, not quantiles, in the first case: a few batches vary more than the
penalty moves D-hat. When even lambda_max does not bring D-hat under the unconstrained mean the dual cannot hold a c
it has to act for: the table says so. The optimiser (the config's, built once for
all batches, its moments carried over as in a run) advances only on the lambda_max pass. A constraint with an
automatic tolerance (``floor_slack``) has its c replaced by floor x (1 + floor_slack) from the first batch on, so
the snippet proposes floor_slack = c / mean floor - 1 for it, and c as the first batch's tolerance; under drift the
"floor" is the run's own drift, which an active c lies under, so the snippet proposes a fixed c there. ``training_ppl`` and ``rollout_ppl`` are perplexities of one engine, not
discrepancies between the two: their rows show the floor and propose no c. Calibrate writes only calibration.txt /
.yaml and a new MLflow run into output_dir: it takes no lock and leaves a run's checkpoints there as they are.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy import stats

from constraints.config import ConstraintConfig
from constraints.measures import measure_constraint, panel_constraints
from constraints.penalties import constraint_names
from dcmdp.config import RunConfig
from dcmdp.errors import ConfigError
from dcmdp.dual import init_state, penalty_spec, tolerances, update_floor
from dcmdp.loop import Setup, measure_phase, reward_phase, rollout_phase, screen_phase, setup, train_step
from dcmdp.probe import constraint_values, probe_updates
from dcmdp.policy import Policy, step_seed
from trainers import learner
from trainers.optim import build_optimizer

log = logging.getLogger("dcmdp")

# Share of batches at or below the proposed c: dcmdp tune's default select.min_inside_frac (tests keep them equal).
INSIDE_FRAC = 0.9
# Panel measures that are not a discrepancy between the engines (one engine's perplexity): no c is proposed for them.
NOT_A_DISCREPANCY = ("discrepancy/training_ppl", "discrepancy/rollout_ppl")

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
    # per proposed constraint: why its c is what it is (the range the dual can move D-hat over), for the table
    notes: list[str] = field(default_factory=list)

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
                 *([f"rows ending /lambda_0 and /lambda_max: D-hat at the measurement point (dual.measure_at: "
                    f"{self.measure_at}) after the config's updates without the penalty and at lambda_max, what the "
                    f"dual step constrains"] if self.measure_at in _MOVED_POINTS else []),
                 head, "-" * len(head)]
        for r in self.rows:
            ci = f"[{r.ci_low:.3g}, {r.ci_high:.3g}]"
            proposed = "-" if math.isnan(r.proposed) else f"{r.proposed:.3g}"
            lines.append(f"{r.name:<{w}}{r.mean:>14.4g}{ci:>28}{r.p50:>12.4g}{r.p90:>12.4g}{r.p99:>12.4g}"
                         f"{proposed:>14}")
        return "\n".join([*lines, *self.notes])

    def snippet(self) -> str:
        """YAML to paste into a config (or pass as a config file): ``dual: {measure_at, constraints: [...]}`` with c
        (and floor_slack for an automatic tolerance), each keyed as the config keys it."""
        body = {"dual": {"measure_at": self.measure_at,
                         "constraints": [OmegaConf.to_container(OmegaConf.structured(c)) for c in self.constraints]}}
        where = {"updates": f"at the updates (dual.measure_at: updates: pi_theta at each of the {self.minibatches} "
                            f"mini-batch updates vs mu, the floor plus the updates' drift)",
                 "drift": f"at the updates (dual.measure_at: drift: pi_theta at each of the {self.minibatches} "
                          f"mini-batch updates vs pi_old, the updates' drift)"}.get(
            self.measure_at, "before the updates (dual.measure_at: rollout: pi_old vs mu, identical weights)")
        rule = ("c between what lambda_max meets and D-hat without the penalty" if self.measure_at in _MOVED_POINTS
                else self.rule())
        note = [f"# dcmdp calibrate over {self.batches} batches: c measured {where}, {rule}",
                *(f"# {n}" for n in self.notes)]
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


# Measurement points where the updates move D-hat: calibrate runs them without the penalty and at lambda_max.
_MOVED_POINTS = ("updates", "drift")


def active_tolerance(at_zero: Sequence[float], at_max: Sequence[float], slack: float,
                     inside_frac: float = INSIDE_FRAC) -> tuple[float, str]:
    """c that the dual can hold and has to act for, from D-hat per batch without the penalty (``at_zero``) and at
    lambda_max (``at_max``): c = (mean(D_max) (1 + slack) + mean(D_0)) / 2 when mean(D_max) (1 + slack) lies under
    mean(D_0); else the ``inside_frac`` quantile of D_max times (1 + slack), which the dual can meet but will rarely
    need to. Rounded up to 3 significant digits; with why, in words."""
    at_max = np.asarray(at_max, dtype=np.float64)
    low, high = float(at_max.mean()) * (1.0 + slack), float(np.mean(at_zero))
    if low < high:
        c = proposed_tolerance((low + high) / 2.0, 0.0)
        return c, (f"c = {c:.3g}: halfway between the mean D-hat at lambda_max ({low:.3g}, with the slack) and without "
                   f"the penalty ({high:.3g}): feasible, and the dual has to act")
    c = proposed_tolerance(float(np.quantile(at_max, inside_frac, method="inverted_cdf")), slack)
    return c, (f"c = {c:.3g}: lambda_max holds D-hat <= {c:.3g} on {inside_frac:.0%} of batches, but its mean "
               f"({low:.3g}, with the slack) is not under the mean without the penalty ({high:.3g}): the penalty moves "
               f"D-hat less than the slack, so the dual will be slack most of the time; raise lambda_max or measure at "
               f"another point")


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
    if cfg.dual.measure_at == "updates" and not targets:  # the anchored run it replays has nothing to anchor
        raise ConfigError("config error at 'dual.constraints': calibrate under dual.measure_at=updates proposes c by "
                          "running the anchored tolerance of each constraint, and the config has none; give the "
                          "measures with --measures (e.g. --measures kl_k3) or constraints under dual.constraints")
    if cfg.dual.measure_at == "updates":
        return calibrate_anchored(cfg, targets, batches, slack, inside_frac)
    at_updates = cfg.dual.measure_at in _MOVED_POINTS
    with _calibration_run(cfg) as s:
        per_key: dict[str, list[float]] = {}
        kept = []
        optimizer = build_optimizer(s.policy.model.parameters(), cfg.optim, seed=cfg.seed) if at_updates else None
        for n in range(batches):
            values, batch, examples = measure_batch(s.policy, s.scoring, cfg, targets, n)
            if at_updates:
                if n == 0:  # the tolerances a run puts in force after its first batch (its floor)
                    floor_C = torch.tensor([values[_constraint_key(i, c)] for i, c in enumerate(targets)],
                                           dtype=torch.float64)
                    s.state.dual = update_floor(init_state(replace(cfg.dual, constraints=targets)), floor_C,
                                                replace(cfg.dual, constraints=targets))
                values.update(measure_updates(s, batch, examples, targets, n, optimizer))
            for k, v in values.items():
                per_key.setdefault(k, []).append(v)
            s.tracker.log_metrics(values, step=n + 1)
            if keep_batches:
                r = batch.rollout
                kept.append((batch.old_logp_BT.clone(), r.rollout_logp_BT.float().clone(),
                             r.response_mask_BT.bool().clone()))
        moved = [k for i, c in enumerate(targets) for k in (_updates_key(i, c, 0), _updates_key(i, c, 1))]
        rows = [floor_stats(k, per_key[k], slack, seed=cfg.seed, inside_frac=inside_frac)
                for k in [*FLOOR_MEASURES, *moved] if k in per_key]
        for r in rows:
            if r.name in NOT_A_DISCREPANCY:
                r.proposed = math.nan
        proposed, notes = [], []
        for i, c in enumerate(targets):
            if at_updates:
                tol, why = active_tolerance(per_key[_updates_key(i, c, 0)], per_key[_updates_key(i, c, 1)], slack,
                                            inside_frac)
                notes.append(f"constraint {i} ({c.measure}): {why}")
            else:
                tol = floor_stats(_constraint_key(i, c), per_key[_constraint_key(i, c)], slack,
                                  inside_frac=inside_frac).proposed
            floor = float(np.mean(per_key[_constraint_key(i, c)]))
            if cfg.dual.measure_at == "drift":
                if c.floor_slack is not None:
                    notes.append(f"constraint {i} ({c.measure}): floor_slack set to null: an automatic tolerance on "
                                 f"the drift is (1 + floor_slack) x the run's own drift and cannot lie under it; c is "
                                 f"fixed")
                proposed.append(replace(c, tolerance=tol, floor_slack=None, floor_steps=None, floor_ratchet=False))
                continue
            auto = c.floor_slack is not None and floor > 0 and math.isfinite(tol)
            proposed.append(replace(c, tolerance=tol, **({"floor_slack": _round_up(tol / floor - 1.0)} if auto else {})))
        result = Calibration(rows, proposed, slack, batches, s.tracker.run_id, kept, inside_frac, cfg.dual.measure_at,
                             cfg.algo.minibatches, notes)
        _write(s, result)
    return result

# Position of c between D-hat at lambda_max (0) and without the penalty (1) for a constraint the config does not anchor.
ANCHOR_POSITION = 0.5


def anchored_config(cfg: RunConfig, targets: Sequence[ConstraintConfig], batches: int) -> RunConfig:
    """``cfg`` with ``targets`` as its constraints, each anchored (its own position, else ``ANCHOR_POSITION``) over a
    window of ``batches`` probed batches; floor_slack 1 before the window where the config has none."""
    cons = [replace(c, anchor=ANCHOR_POSITION if c.anchor is None else c.anchor, anchor_batches=batches,
                    floor_slack=1.0 if c.floor_slack is None else c.floor_slack, floor_steps=None, floor_ratchet=False)
            for c in targets]
    return replace(cfg, dual=replace(cfg.dual, constraints=cons))


def calibrate_anchored(cfg: RunConfig, targets: Sequence[ConstraintConfig], batches: int, slack: float,
                       inside_frac: float) -> Calibration:
    """``dual.measure_at: updates``: the tolerance the anchored mode (``constraints[i].anchor``) sets in a run of this
    config, by running that run's first steps: from the start the same steps as ``dcmdp train`` (same seed, batches,
    updates, dual) in memory, until every constraint's first window of ``batches`` probed batches has closed; c is then
    the tolerance in force, F + g (dcmdp.dual.record_anchor), proposed as a fixed tolerance. Rows: the floor measures on
    the probed batches (pi_old vs mu before the updates, identical weights in a synchronous run) and D-hat at the updates
    without the penalty (/lambda_0) and at lambda_max (/lambda_max). Nothing is written but calibration.txt / .yaml and
    an MLflow run tagged ``dcmdp.kind=calibrate``."""
    acfg = anchored_config(cfg, targets, batches)
    with _calibration_run(acfg) as s:
        names = constraint_names(acfg.dual.constraints)
        last = max(c.anchor_start for c in acfg.dual.constraints) + batches
        step, probed = 0, []
        # a step that kept no sample is not probed: allow as many again before giving up
        while step < last + batches and not _all_anchored(s):
            train_step(s, step)
            if any(f"dual/anchor_zero/{n}" in s.state.history[-1] for n in names):
                probed.append(s.state.history[-1])
            step += 1
        if not _all_anchored(s):
            raise RuntimeError(f"calibrate: {len(probed)} of {batches} batches could be probed in {step} steps (a "
                               f"step whose samples were all screened out is not probed); raise --batches or check "
                               f"the task's rewards")
        per_key = {k: [h[k] for h in probed if k in h] for k in FLOOR_MEASURES}
        for i, (c, n) in enumerate(zip(targets, names)):
            per_key[_updates_key(i, c, 0)] = [h[f"dual/anchor_zero/{n}"] for h in probed if f"dual/anchor_zero/{n}" in h]
            per_key[_updates_key(i, c, 1)] = [h[f"dual/anchor_max/{n}"] for h in probed if f"dual/anchor_max/{n}" in h]
        rows = [floor_stats(k, v, slack, seed=cfg.seed, inside_frac=inside_frac) for k, v in per_key.items() if v]
        for r in rows:
            if r.name in NOT_A_DISCREPANCY or r.name.endswith(("/lambda_0", "/lambda_max")):
                r.proposed = math.nan
        c_C = tolerances(s.state.dual, acfg.dual).tolist()
        proposed, notes = [], []
        for i, (c, tol) in enumerate(zip(targets, c_C)):
            tol = _round_up(tol)
            at_zero = float(np.mean(per_key[_updates_key(i, c, 0)]))
            at_max = float(np.mean(per_key[_updates_key(i, c, 1)]))
            pos = acfg.dual.constraints[i].anchor
            band = (f"between D-hat at lambda_max ({at_max:.3g}) and without the penalty ({at_zero:.3g}), at position "
                    f"{pos:g}" if at_max < at_zero else
                    f"at D-hat without the penalty ({at_zero:.3g}): lambda_max did not lower D-hat on these batches, "
                    f"so the dual will rest; raise lambda_max or constrain another measure")
            notes.append(f"constraint {i} ({c.measure}): c = {tol:.3g}, the anchored tolerance a run of this config "
                         f"sets at step {step}: the floor F plus the gap to a point {band}; anchor: {pos:g} in the "
                         f"config lets the run re-anchor as the floor and the drift move (configs/default.yaml)")
            proposed.append(replace(c, tolerance=tol, floor_slack=None, floor_steps=None, floor_ratchet=False,
                                    anchor=None, authority=None))
        result = Calibration(rows, proposed, slack, len(probed), s.tracker.run_id, [], inside_frac, "updates",
                             cfg.algo.minibatches, notes)
        _write(s, result)
    return result


@contextlib.contextmanager
def _calibration_run(cfg: RunConfig) -> Iterator[Setup]:
    """The run ``calibrate`` measures with: ``dcmdp.loop.setup`` without taking output_dir (``owns_folder=False``), its
    MLflow run tagged ``dcmdp.kind=calibrate`` and marked FAILED when anything raises, the rollout engine closed."""
    s: Setup = setup(cfg, owns_folder=False)
    try:
        s.tracker.set_tags({"dcmdp.kind": "calibrate"})
        yield s
    except BaseException:
        s.tracker.finish("FAILED")
        raise
    finally:
        s.policy.engine.close()


def _write(s: Setup, result: Calibration) -> None:
    """calibration.txt (the table) and calibration.yaml (the snippet) in output_dir, both logged to the MLflow run,
    which then ends FINISHED."""
    out = Path(s.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.txt").write_text(result.table() + "\n")
    (out / "calibration.yaml").write_text(result.snippet())
    s.tracker.log_artifact(out / "calibration.txt")
    s.tracker.log_artifact(out / "calibration.yaml")
    s.tracker.finish()


def _all_anchored(s: Setup) -> bool:
    a = s.state.dual.anchor
    return a is not None and all(g is not None for g in a["gap_C"])


def _round_up(x: float) -> float:
    """max(x, 0) rounded up to 3 significant digits."""
    return proposed_tolerance(x, 0.0) if x > 0 else 0.0


def _updates_key(i: int, c: ConstraintConfig, at_max: int) -> str:
    return _constraint_key(i, c) + ("/lambda_max" if at_max else "/lambda_0")


def measure_updates(s: Setup, batch: learner.ScoredBatch, examples, targets: Sequence[ConstraintConfig], step: int,
                    optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """D-hat at the measurement point (``dual.measure_at`` drift: vs pi_old) of one batch after the config's N
    mini-batch updates on a copy of the weights, once without the penalty and once at lambda_max (the tolerances in
    force in ``s.state.dual``; ``dcmdp.probe.probe_updates``): each token's log-prob at the update that trained on it.
    Every pass and batch starts from the same weights. ``optimizer`` (the config's, at the full learning rate, one for
    all batches) runs both passes from the same moments and keeps those of the lambda_max pass, which carry over as in
    a run: a fresh AdamW's first steps move every weight by about lr and would overstate the drift a run's updates
    make."""
    cfg = s.cfg
    rewards_B, _ = reward_phase(s.policy, examples, batch.rollout)
    rollout, advantages_B, _, _ = screen_phase(cfg.algo, batch.rollout, rewards_B)
    scored = learner.score_old(s.policy.model, rollout, advantages_B, cfg.algo, s.scoring)
    dual_cfg = replace(cfg.dual, constraints=list(targets))
    optim = learner.OptimStep(optimizer, grad_clip=cfg.optim.grad_clip)
    lam_max_C = torch.tensor([c.lambda_max for c in targets], dtype=torch.float64)
    at_zero_C, at_max_C = probe_updates(s.policy.model, optim, scored, scoring=s.scoring, algo=cfg.algo,
                                        dual_state=s.state.dual, dual_cfg=dual_cfg,
                                        lambdas=[torch.zeros_like(lam_max_C), lam_max_C],
                                        seed=step_seed(cfg.seed, step, 2), keep_moments=True)
    s.policy.model.eval()
    out = {_updates_key(i, c, 0): float(v) for i, (c, v) in enumerate(zip(targets, at_zero_C))}
    out.update({_updates_key(i, c, 1): float(v) for i, (c, v) in enumerate(zip(targets, at_max_C))})
    return out


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


def lambda_response(cfg: RunConfig, lambdas: Sequence[float], batches: int = 4,
                    skip: int = 1) -> list[dict[str, float]]:
    """D-hat(lambda) and entropy(lambda) within one step: for each rollout batch and each lambda, the config's N
    mini-batch updates on a copy of the weights with the penalty at that lambda (anchored as ``dual.measure_at``
    says), from the same weights and optimiser moments; per lambda the means over batches ``skip``.. of D-hat vs mu at
    the updates ("updates"), the drift vs pi_old ("drift"), both with the config's first constraint's measure, and the
    policy entropy at the updates ("entropy"). The moments advance once per batch (on the first lambda's pass), so
    that the later batches see a warmed-up AdamW, as a run does; the first ``skip`` batches are left out for that."""
    target = cfg.dual.constraints[0]
    s: Setup = setup(cfg, owns_folder=False)
    rows: dict[float, dict[str, list[float]]] = {float(lam): {"updates": [], "drift": [], "entropy": []}
                                                 for lam in lambdas}
    try:
        optimizer = build_optimizer(s.policy.model.parameters(), cfg.optim, seed=cfg.seed)
        model = s.policy.model
        for n in range(batches):
            values, batch, examples = measure_batch(s.policy, s.scoring, cfg, [target], n)
            if n == 0:
                floor_C = torch.tensor([values[_constraint_key(0, target)]], dtype=torch.float64)
                one = replace(cfg.dual, constraints=[target])
                s.state.dual = update_floor(init_state(one), floor_C, one)
            saved, moments = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
            rewards_B, _ = reward_phase(s.policy, examples, batch.rollout)
            rollout, advantages_B, _, _ = screen_phase(cfg.algo, batch.rollout, rewards_B)
            scored = learner.score_old(model, rollout, advantages_B, cfg.algo, s.scoring)
            advanced = None
            for k, lam in enumerate(rows):
                optimizer.load_state_dict(copy.deepcopy(moments))
                lam_C = torch.tensor([lam], dtype=torch.float64)
                state = replace(s.state.dual, lambda_C=lam_C, lambda_avg_C=lam_C)
                penalty = penalty_spec(state, replace(cfg.dual, constraints=[target]), stand_down=False)
                result = learner.update(model, learner.OptimStep(optimizer, grad_clip=cfg.optim.grad_clip), scored,
                                        scoring=s.scoring, penalty=penalty, cfg=cfg.algo,
                                        generator=torch.Generator().manual_seed(step_seed(cfg.seed, n, 2)))
                if k == 0:
                    advanced = copy.deepcopy(optimizer.state_dict())
                if n >= skip:
                    rows[lam]["updates"].append(float(constraint_values([target], scored, result.trained_logp_BT)[0]))
                    rows[lam]["drift"].append(float(constraint_values([target], scored, result.trained_logp_BT,
                                                                      scored.old_logp_BT)[0]))
                    rows[lam]["entropy"].append(float(np.mean([m["policy/entropy"] for m in result.steps
                                                               if "policy/entropy" in m])))
                model.load_state_dict(saved)
            optimizer.load_state_dict(advanced)
        s.tracker.finish()
    finally:
        model.eval()
        s.policy.engine.close()
    return [{"lambda": lam, **{k: float(np.mean(v)) for k, v in r.items()}} for lam, r in rows.items()]
