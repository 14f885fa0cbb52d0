"""Config of the dual controller (``dcmdp.dual``): the rule, the penalty, the constraints and the rules' knobs.

Kept apart from ``dcmdp.config`` (which re-exports these names) so that ``dcmdp.dual`` reads its config without
importing the module that imports its registry to validate rule names.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from constraints.config import ConstraintConfig
from trainers.config import PRECISION_BITS
from trainers.errors import require


@dataclass
class PIDConfig:
    # Proportional gain K_P (Stooke et al. 2020).
    kp: float = 0.0
    # Derivative gain K_D, acting on increases of the smoothed cost only.
    kd: float = 0.0
    # EMA factor alpha_p of the proportional term (Stooke et al.'s reference value).
    alpha_p: float = 0.95
    # EMA factor alpha_d of the cost used by the derivative term.
    alpha_d: float = 0.95
    # Delay (in dual steps) of the derivative term.
    delay: int = 10

    def check(self, prefix: str = "dual.pid") -> None:
        for key in ("kp", "kd"):
            require(getattr(self, key) >= 0, f"{prefix}.{key}", f"must be >= 0, got {getattr(self, key)}")
        for key in ("alpha_p", "alpha_d"):
            require(0 <= getattr(self, key) < 1, f"{prefix}.{key}", f"must be in [0, 1), got {getattr(self, key)}")
        require(self.delay >= 1, f"{prefix}.delay", f"must be >= 1, got {self.delay}")


@dataclass
class CouplingConfig:
    # Rows of A in the linear limits A @ lambda <= b across constraints (empty: independent boxes).
    A: list[list[float]] = field(default_factory=list)
    # Right-hand side b of A @ lambda <= b.
    b: list[float] = field(default_factory=list)


# What a batch's context is under per-context multipliers (``dual.context.by``).
CONTEXT_KINDS = ("none", "staleness", "precision", "digits")
# What the floor of an automatic tolerance is kept per (``dual.floor_by``).
FLOOR_KINDS = ("none", "precision")


@dataclass
class ContextConfig:
    # Per-context multipliers: one set of multipliers (and rule state) per context of the batch, each moved only by
    # the batches of its context (dcmdp.dual.enter_context). none | staleness (the batch's mean staleness, bucketed
    # by `edges`) | precision (the rollout precision in force at the step) | digits (the task's digits in force at
    # the step, rollout.precision_schedule / task.curriculum). none: one set for the run (the default).
    by: str = "none"
    # Staleness buckets: context i holds mean staleness s with edges[i-1] <= s < edges[i] (strictly increasing).
    edges: list[float] = field(default_factory=list)

    def check(self, prefix: str = "dual.context") -> None:
        require(self.by in CONTEXT_KINDS, f"{prefix}.by", f"unknown context {self.by!r}; known: "
                f"{', '.join(CONTEXT_KINDS)}")
        require(not self.edges or self.by == "staleness", f"{prefix}.edges",
                f"buckets the staleness; set {prefix}.by=staleness or edges: []")
        require(all(b > a for a, b in zip(self.edges, self.edges[1:])), f"{prefix}.edges",
                f"must be strictly increasing, got {list(self.edges)}")

    def key(self, staleness_mean: float, precision: str, digits: int) -> tuple[str, float]:
        """(context key, its value as a metric) of a batch: the staleness bucket's index, the precision's name
        (metric: its bits) or the digits."""
        if self.by == "staleness":
            i = bisect.bisect_right(list(self.edges), staleness_mean)
            return f"staleness{i}", float(i)
        if self.by == "precision":
            return precision, float(PRECISION_BITS[precision])
        return f"digits{digits}", float(digits)


@dataclass
class DualConfig:
    # Dual update rule: projected | pid | signed (projected, but lambda is not raised where raising it raised D-hat) |
    # chance (P(D-hat > c) <= constraints[i].miss_rate by stochastic dual ascent, dithered, with the sign test) |
    # fixed (lambda held at lambda_init: the fixed-coefficient baseline) | off (lambda = 0, no penalty; the measures
    # are still logged). See dcmdp.dual.DUAL_RULES.
    rule: str = "projected"
    # Penalty form in the primal loss: hinge | mean | advantage (see constraints.penalties.PENALTIES).
    penalty: str = "hinge"
    # Constraints, each with its own multiplier.
    constraints: list[ConstraintConfig] = field(default_factory=lambda: [
        ConstraintConfig(measure="abs_prob_diff", tolerance=0.005, lambda_init=0.1, lambda_max=10.0, lr=1.0)])
    # PID gains (rule: pid).
    pid: PIDConfig = field(default_factory=PIDConfig)
    # Linear limits coupling the multipliers (projection solved as a QP with cvxpy).
    coupling: CouplingConfig = field(default_factory=CouplingConfig)
    # Which policy D-hat (the dual step's input) measures against the rollout engine mu:
    # rollout (pi_old, before the updates: the engines' discrepancy at the weights that sampled the batch) |
    # updates (pi_theta of every token at the mini-batch update that trained on it, before that update's
    # optimiser step: the quantity the hinge penalty acts on, engine discrepancy plus update drift; equal to
    # rollout at N = 1) | drift (pi_theta at the updates against pi_old instead of mu: the part the update controls;
    # the penalty then pulls toward pi_old; docs/tolerances.md).
    measure_at: str = "rollout"
    # Measure the violation in units of the tolerance: the dual step (projected, and the PID terms) uses
    # (D_hat - c) / c instead of D_hat - c, so one eta means "lambda moves by eta per tolerance exceeded" for
    # every measure (abs_prob_diff ~1e-3 and kl_k3 ~1e-4 alike). Needs c > 0.
    relative: bool = False
    # The penalty carries the running mean of the multipliers over the run, lambda_bar_k = mean(lambda_0..lambda_k),
    # instead of the last one (the averaged dual iterate): lambda still moves by the rule; the penalty settles at the
    # level the run's drift asked for and does not let go when D-hat falls inside c late. Logged as dual/lambda_avg/*.
    # Off by default: under very stale rollouts it cost accuracy against lambda itself (stress benchmark, average).
    average: bool = False
    # Per-context multipliers (a batch's staleness bucket, rollout precision or task digits): see ContextConfig.
    context: ContextConfig = field(default_factory=ContextConfig)
    # One floor per rollout precision for the automatic tolerances (floor_slack): none (one floor for the run, the
    # default) | precision (each precision keeps its own EMA of the floor; the first batch of a precision without
    # a floor is sampled with the trainer's current weights, resampled under asynchronous rollouts, so that it
    # measures the new precision's floor at once; see dcmdp.dual.enter_floor).
    floor_by: str = "none"
