"""The dual controller: one multiplier lambda_i per discrepancy constraint D_i <= c_i (docs/design.md §"Dual rules").

Once per rollout batch, from D_hat_C measured before the primal updates (pi_old vs mu, averaged over the
global batch), ``dual_step`` moves lambda_C; the new multipliers apply from the next rollout batch, to
every mini-batch alike. The state is a tiny explicit object (``DualState``), float64 on the CPU, that
round-trips through ``state_dict`` for checkpoints.

Rules (``DUAL_RULES``: name -> ``DualRule``, each owning its state, see ``DualRule``):

- ``projected`` (default; DCMDP, Liu et al. arXiv 2606.08779):
  lambda <- Pi(lambda + eta_i (D_hat_i - c_i)), eta_i = constraints[i].lr.
- ``pid``: PID Lagrangian (Stooke, Achiam, Abbeel, ICML 2020, arXiv 2007.03964), see ``pid_step``.
- ``signed``: the projected rule with a sign test on the measured response of D_hat to lambda, see ``signed_step``:
  it does not raise lambda where raising lambda raised D_hat (the right side of the U that D_hat(lambda) traces,
  docs/design.md §"The U-shaped response"); there it lowers lambda toward the bottom of the U instead.
- ``chance`` (configs/default.yaml): the chance constraint P(D_hat > c) <= alpha by stochastic dual ascent,
  lambda <- Pi(lambda + eta (1[D_hat > c] - alpha)), with a sign test that never raises lambda where raising it
  raised D_hat, see ``chance_step``.
- ``fixed``: lambda held at lambda_init (the fixed-coefficient penalty); ``off``: lambda = 0, no penalty.

A new rule is one ``DualRule(init, step)`` and one registry line; the checkpoint stores its state as the
plain dict it returns.

Scale of the step: with ``cfg.relative`` the rules see the violation in units of the tolerance,
(D_hat - c) / c, so eta = 1 moves lambda by 1 per tolerance exceeded whatever the measure's magnitude
(abs_prob_diff ~1e-3, kl_k3 ~1e-4); in absolute units lambda moves by ~1e-3 per step and is nearly constant
over a run (docs/design.md §"The scale of the dual step").

Measurement point (``cfg.measure_at``): ``rollout`` (pi_old vs mu), ``updates`` (pi_theta at each token's update vs
mu: the engines' part plus the drift) or ``drift`` (pi_theta at each token's update vs pi_old: the part the update
controls). Under ``drift`` the penalty's anchor is pi_old instead of mu (``penalty_spec``), so the hinge pulls the
update back toward the policy that scored the batch and never toward the engine's rounding; derivation in
docs/tolerances.md.

Automatic tolerance (``constraints[i].floor_slack = s``): c_k = F_{k-1} (1 + s) (c_1 = F_1 (1 + s): the first
batch's floor sets its own tolerance, never the configured one), F an EMA of the measure
between pi_old and mu before the updates, which in a synchronous run is taken on identical weights (the
numerical floor of the two engines at the current policy); it is re-measured every batch at no cost, so the
tolerance tracks the floor as it drifts with the policy. Under ``measure_at: drift`` F is the EMA of the drift itself
(the loop passes D_hat as the floor): the same quantity at the same point, so c = (1 + s) x the run's own drift, held
after ``floor_steps`` batches, which bounds the growth of the update's drift whatever its scale on the task.
Under asynchronous rollouts only the batches sampled
by the trainer's current weights measure the floor (the first, and the first after each drain, e.g. at a
checkpoint): a stale batch's pi_old vs mu also holds the policy's drift since its weights, which is part of
what the constraint bounds, not of the floor; the loop passes NaN for it and F stays as it was.

Anchored tolerance (``constraints[i].anchor = xi``): c_k = F_k + g, F the floor EMA above and g measured by the run
itself: on ``anchor_batches`` batches from ``anchor_start`` on, the loop probes the batch's updates twice from the same
weights and moments, without the penalty (D_0) and at lambda_max (D_max), and g puts c at position xi between the two
levels that a batch exceeds with probability miss_rate (``anchor_gap``): the strongest penalty can hold it and without
the penalty D-hat exceeds it too often, so lambda has to act from the interior. c follows the floor additively, and a new window is probed when F leaves a band around the floor of
the last anchoring or every ``anchor_every`` steps (``anchor_due``, ``record_anchor``; the probes: dcmdp.probe).

Averaged multiplier (``cfg.average``): the rule moves lambda_k as always, and the penalty carries the running mean
lambda_bar_k = (lambda_0 + ... + lambda_k) / (k + 1), the averaged dual iterate of primal-dual methods, instead of
lambda_k. lambda_bar settles at the level of penalty the run's drift has asked for on average, and does not let go
when D_hat falls inside c late in a run (measured in benchmarks/results/LOG.md, the entry on the
averaged multiplier).

Staleness bound (``async_rollout.max_staleness: auto``): a second multiplier nu on "D_hat of the
batches trained <= c_s", whose action is the rollout worker's staleness bound instead of a penalty; see
``staleness_step``. Its state ({"nu"}) lives in ``DualState.staleness`` and is checkpointed with the rest.

Per-context multipliers (``cfg.context``): one multiplier per constraint and context of the batch (staleness
bucket, rollout precision, task digits), see ``enter_context``; the loop switches the state to the batch's context
before the penalty and the dual step.

Pi is the Euclidean projection onto the box [lambda_min_i, lambda_max_i], intersected with the coupled
limits A lambda <= b when ``cfg.coupling`` has rows (a small QP solved with cvxpy). A non-finite
measurement never moves its multiplier: that lambda and its PID state stay as they were (also under
the coupling projection, which then treats it as fixed) and the entry is counted in ``skipped``.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from constraints.penalties import constraint_names
from dcmdp.async_config import StalenessAutoConfig
from dcmdp.dual_config import DualConfig
from trainers.learner import PenaltySpec

_F64 = torch.float64
_FEASIBILITY_TOL = 1e-9  # slack on A lambda <= b when deciding whether the box projection is already feasible
_RELATIVE_MIN_C = 1e-12  # smallest tolerance a relative violation (D_hat - c) / c divides by


@dataclass
class DualState:
    # (C,) multipliers lambda_i used by the penalty of the next rollout batch.
    lambda_C: Tensor
    # The rule's own state (``DualRule.init`` / ``DualRule.step``), JSON-safe plain python; the checkpoint
    # stores it without knowing its fields.
    rule: dict[str, Any] = field(default_factory=dict)
    # Dual steps taken (calls of dual_step).
    steps: int = 0
    # Non-finite measurements skipped so far (entries, summed over constraints).
    skipped: int = 0
    # (C,) EMA F of the floor measurement (pi_old vs mu before the updates) behind an automatic tolerance
    # (constraints[i].floor_slack); NaN until the first finite measurement, and for fixed tolerances.
    floor_C: Optional[Tensor] = None
    # (C,) running mean of the multipliers over the run, lambda_bar_k = mean(lambda_0, ..., lambda_k) (k = steps);
    # the penalty carries it under ``cfg.average``. None in states written before it existed: lambda_C stands in.
    lambda_avg_C: Optional[Tensor] = None
    # State of the staleness controller (``staleness_step``, async_rollout.max_staleness: auto): {"nu": float};
    # None without the controller, and in states written before it existed (the controller then starts afresh).
    staleness: Optional[dict[str, Any]] = None
    # Per-context multipliers (``dual.context``, ``enter_context``): the multipliers, rule state and running mean of
    # every context seen except the active one (whose values lambda_C / rule / lambda_avg_C hold), by context key;
    # None without contexts.
    contexts: Optional[dict[str, dict[str, Any]]] = None
    # The active context's key; None before the first batch and without contexts.
    context: Optional[str] = None
    # One floor per rollout precision (``dual.floor_by``, ``enter_floor``): the floor F of every precision seen
    # except the active one (whose floor floor_C holds), by precision, NaN as None; None without it.
    floors: Optional[dict[str, list]] = None
    # The precision whose floor floor_C holds; None before the first batch and without dual.floor_by.
    floor_key: Optional[str] = None
    # (C,) the lowest F so far, behind a ratcheted tolerance (constraints[i].floor_ratchet); NaN until the first
    # finite floor and for the other constraints. None in states written before it existed: F stands in.
    floor_low_C: Optional[Tensor] = None
    # The anchored tolerances (constraints[i].anchor, ``anchor_due`` / ``record_anchor``), JSON-safe, per constraint:
    # "gap_C" g (None until anchored), "floor_C" F_a at the last anchoring, "step_C" the step it ended at, and
    # "probes_C" the (D_0, D_max, F) triples of the window being collected. None without anchored constraints.
    anchor: Optional[dict[str, Any]] = None

    def lambda_avg(self) -> Tensor:
        """(C,) lambda_bar_k, the running mean of lambda_0..lambda_k (lambda_C for a state without one)."""
        return self.lambda_C if self.lambda_avg_C is None else self.lambda_avg_C

    def state_dict(self) -> dict[str, Any]:
        """Plain python (JSON-safe) copy of the state."""
        # NaN (no floor yet) as None: JSON-safe, and equal to itself when two states are compared
        floor = [] if self.floor_C is None else _floor_list(self.floor_C)
        return {"lambda_C": self.lambda_C.tolist(), "rule": copy.deepcopy(self.rule), "steps": int(self.steps),
                "skipped": int(self.skipped), "floor_C": floor, "lambda_avg_C": self.lambda_avg().tolist(),
                "staleness": copy.deepcopy(self.staleness), "contexts": copy.deepcopy(self.contexts),
                "context": self.context, "floors": copy.deepcopy(self.floors), "floor_key": self.floor_key,
                "floor_low_C": [] if self.floor_low_C is None else _floor_list(self.floor_low_C),
                "anchor": copy.deepcopy(self.anchor)}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "DualState":
        lam = _vec(d["lambda_C"])
        # checkpoints written before automatic tolerances existed carry no floor
        floor = _floor_vec(d["floor_C"]) if d.get("floor_C") else torch.full_like(lam, float("nan"))
        # checkpoints written before rules owned their state kept the PID terms at the top level
        rule = d["rule"] if "rule" in d else {k: d[k] for k in _PID_KEYS if k in d}
        # states written before the running mean existed: it restarts from the current lambda
        avg = _vec(d["lambda_avg_C"]) if d.get("lambda_avg_C") else lam.clone()
        return cls(lambda_C=lam, rule=copy.deepcopy(rule), steps=int(d["steps"]), skipped=int(d["skipped"]),
                   floor_C=floor, lambda_avg_C=avg, staleness=copy.deepcopy(d.get("staleness")),
                   contexts=copy.deepcopy(d.get("contexts")), context=d.get("context"),
                   floors=copy.deepcopy(d.get("floors")), floor_key=d.get("floor_key"),
                   floor_low_C=_floor_vec(d["floor_low_C"]) if d.get("floor_low_C") else None,
                   anchor=copy.deepcopy(d.get("anchor")))


def _floor_list(floor_C: Tensor) -> list:
    """A floor as plain python, NaN (no floor yet) as None: JSON-safe, and equal to itself in comparisons."""
    return [x if math.isfinite(x) else None for x in floor_C.tolist()]


def _floor_vec(values: list) -> Tensor:
    """The inverse of ``_floor_list``: None (no floor yet) as NaN."""
    return _vec([float("nan") if x is None else x for x in values])


def _vec(v: Any) -> Tensor:
    return torch.as_tensor(v, dtype=_F64).detach().cpu().clone().reshape(-1)


def _per_constraint(cfg: DualConfig, field: str) -> Tensor:
    """(C,) float64 of one field of every constraint (None as NaN); shared between calls, never written in place."""
    return _vector(tuple(math.nan if getattr(c, field) is None else float(getattr(c, field)) for c in cfg.constraints))


@functools.lru_cache(maxsize=256)
def _vector(values: tuple[float, ...]) -> Tensor:
    # one dual step reads five per-constraint fields: building each tensor anew cost more than the step's arithmetic
    return torch.tensor(values, dtype=_F64)


def _finite(x: Tensor) -> Tensor:
    """torch.isfinite for float tensors: x - x is 0 exactly where x is finite (NaN for inf and NaN). Two kernels
    where torch.isfinite dispatches several, which counts on the dual's (C,) vectors."""
    return (x - x) == 0


def _has_auto_tolerance(cfg: DualConfig) -> bool:
    """Whether any constraint has an automatic tolerance (floor_slack): without one the floor stays NaN."""
    return any(c.floor_slack is not None for c in cfg.constraints)


def _coupling(cfg: DualConfig) -> Optional[tuple[np.ndarray, np.ndarray]]:
    if not cfg.coupling.A:
        return None
    A = np.asarray(cfg.coupling.A, dtype=np.float64)
    b = np.asarray(cfg.coupling.b, dtype=np.float64)
    if A.ndim != 2 or A.shape != (b.shape[0], len(cfg.constraints)):
        raise ValueError(f"dual.coupling: A must be len(b) x {len(cfg.constraints)} (one column per constraint), "
                         f"got A {A.shape} and b {b.shape}")
    return A, b


def init_state(cfg: DualConfig) -> DualState:
    """lambda_C = the rule's initial multipliers (lambda_init; 0 for ``off``), the rule's initial state."""
    n = len(cfg.constraints)
    rule = get_rule(cfg)
    lam = torch.where(_gated(cfg), torch.zeros((), dtype=_F64), rule.initial_lambda(cfg))
    coupling = _coupling(cfg)
    if coupling is not None and rule.projects:
        A, b = coupling
        if np.any(A @ lam.numpy() > b + _FEASIBILITY_TOL):
            raise ValueError(f"dual: lambda_init {lam.tolist()} violates the coupled limits A lambda <= b "
                             f"(A lambda = {(A @ lam.numpy()).tolist()}, b = {b.tolist()})")
    return DualState(lambda_C=lam, rule=rule.init(cfg), floor_C=torch.full((n,), float("nan"), dtype=_F64),
                     lambda_avg_C=lam.clone(), anchor=anchor_init(cfg))


def enter_context(state: DualState, key: str, cfg: DualConfig) -> DualState:
    """The state with context ``key``'s multipliers in force (``dual.context``, per-context multipliers).

    The constraint D <= c is split by the batch's context b (its staleness bucket, rollout precision or task
    digits): D_b <= c for every b, with the Lagrangian J - sum_b lambda_b (D_b - c). A batch of context b estimates
    the b-th term only, so the penalty carries lambda_b and the dual step moves lambda_b alone, by the rule's own
    step on that batch's D-hat. A single multiplier has to re-learn its level each time the mismatch changes regime
    (its lag is the change of lambda over eta times the violation, in steps); lambda_b keeps the level its
    regime asked for, e.g. across a precision switch int4 -> fp8 -> int4 or staleness phases 0 -> 8 -> 2.

    The active context's lambda, rule state and running mean are stored, key's loaded: a context not seen before
    starts from ``init_state`` (lambda_init, a fresh rule state); the first batch's context takes the state as it
    is. The floor of automatic tolerances, the step counts and the staleness controller are shared by all contexts.
    """
    if state.context == key:
        return state
    table = copy.deepcopy(state.contexts) if state.contexts else {}
    if state.context is not None:
        table[state.context] = {"lambda_C": state.lambda_C.tolist(), "rule": copy.deepcopy(state.rule),
                                "lambda_avg_C": state.lambda_avg().tolist()}
    saved = table.pop(key, None)
    if saved is None and state.context is None:
        return replace(state, contexts=table, context=key)
    if saved is None:
        fresh = init_state(cfg)
        lam, rule, avg = fresh.lambda_C, fresh.rule, fresh.lambda_avg()
    else:
        lam, rule, avg = _vec(saved["lambda_C"]), saved["rule"], _vec(saved["lambda_avg_C"])
    return replace(state, lambda_C=lam, rule=rule, lambda_avg_C=avg, contexts=table, context=key)


def enter_floor(state: DualState, key: str) -> DualState:
    """The state with the floor of rollout precision ``key`` in force (``dual.floor_by: precision``).

    An automatic tolerance is c = F (1 + floor_slack), F the EMA of the engines' discrepancy on identical weights,
    and that floor is a property of the rollout precision: fp32 rollouts sit orders of magnitude under int4 ones.
    One F for the run carries the first precision's floor into the next (an fp32 warm-up's ~1e-7 holds c far under
    an int4 batch's D-hat until fresh batches move the EMA), so each precision keeps its own F: the active one's
    is stored, ``key``'s loaded, NaN for a precision not seen yet, which the next fresh batch seeds
    (``dual_step``). The first batch's precision takes the state as it is. Multipliers are untouched.
    """
    if state.floor_key == key:
        return state
    table = copy.deepcopy(state.floors) if state.floors else {}
    if state.floor_key is not None and state.floor_C is not None:
        table[state.floor_key] = _floor_list(state.floor_C)
    saved = table.pop(key, None)
    if saved is None and state.floor_key is None:
        return replace(state, floors=table, floor_key=key)
    floor_C = _floor_vec([None] * state.lambda_C.numel() if saved is None else saved)
    return replace(state, floor_C=floor_C, floors=table, floor_key=key)


def needs_floor(state: DualState, cfg: DualConfig) -> bool:
    """Whether an automatic tolerance has no floor yet (NaN): the next batch should be sampled by the trainer's
    current weights so that it measures one."""
    if not _has_auto_tolerance(cfg):
        return False
    if state.floor_C is None:
        return True
    auto_C = _per_constraint(cfg, "floor_slack") >= 0  # NaN (no automatic tolerance) compares False
    return bool((auto_C & torch.isnan(state.floor_C)).any())


def tolerances(state: DualState, cfg: DualConfig) -> Tensor:
    """(C,) the tolerance c_i in force: F_i + g_i for an anchored tolerance with a measured gap g_i, F_i (1 +
    floor_slack_i) for an automatic tolerance with a measured floor F_i (the lowest F_i so far under
    ``floor_ratchet``), else constraints[i].tolerance."""
    fixed_C = _per_constraint(cfg, "tolerance")
    if state.floor_C is None or not _has_auto_tolerance(cfg):
        return fixed_C
    floor_C = state.floor_C
    if state.floor_low_C is not None:
        ratchet_C = _per_constraint(cfg, "floor_ratchet") > 0
        floor_C = torch.where(ratchet_C & _finite(state.floor_low_C), state.floor_low_C, floor_C)
    auto_C = floor_C * (1 + _per_constraint(cfg, "floor_slack"))
    if state.anchor is not None:  # an anchored c = F + g once its gap is measured
        gap_C = _floor_vec(state.anchor["gap_C"])
        auto_C = torch.where(_finite(gap_C), floor_C + gap_C, auto_C)
    return torch.where(_finite(auto_C), auto_C, fixed_C)


def constraints_in_force(state: DualState, cfg: DualConfig) -> list:
    """``cfg.constraints`` with each tolerance replaced by the one in force (``tolerances``), for the penalty."""
    return [replace(c, tolerance=float(t)) for c, t in zip(cfg.constraints, tolerances(state, cfg).tolist())]


def applied_lambda(state: DualState, cfg: DualConfig, stand_down: bool = True) -> Tensor:
    """(C,) float64, the multipliers the penalty carries: lambda_C, or its running mean lambda_bar under
    ``cfg.average``; under the chance rule dithered by one step (``dithered_lambda``); 0 for a constraint whose dual
    stands down (``stood_down``) unless ``stand_down`` is false (the anchor's probes measure the penalty as it would
    act)."""
    lam_C = state.lambda_avg() if cfg.average else state.lambda_C
    lam_C = dithered_lambda(lam_C, state.rule, cfg) if cfg.rule == "chance" else lam_C
    return torch.where(stood_down(state, cfg), torch.zeros((), dtype=_F64), lam_C) if stand_down else lam_C


def penalty_spec(state: DualState, cfg: DualConfig, stand_down: bool = True) -> PenaltySpec:
    """The penalty the updates of the next rollout batch carry: ``applied_lambda`` (float32), the constraints with
    the tolerances in force and the penalty form, anchored at pi_old under ``measure_at: drift`` (else at mu); none
    under a rule that does not penalise (``off``). ``stand_down`` as in ``applied_lambda``."""
    if not get_rule(cfg).penalizes:
        return PenaltySpec()
    return PenaltySpec(applied_lambda(state, cfg, stand_down).float(), tuple(constraints_in_force(state, cfg)),
                       cfg.penalty, anchor="old" if cfg.measure_at == "drift" else "rollout")


def _gated(cfg: DualConfig) -> Tensor:
    """(C,) bool: the constraints whose dual acts only with authority (``authority`` set, an anchored c, a rule that
    moves lambda); the placebo arms (``fixed``, ``off``) hold their lambda whatever the reach."""
    moves = get_rule(cfg).moves
    return torch.tensor([moves and c.anchor is not None and getattr(c, "authority", None) is not None
                         for c in cfg.constraints], dtype=torch.bool)


def _keep_rows(new: dict[str, Any], old: dict[str, Any], rows: Sequence[bool]) -> dict[str, Any]:
    """The rule state ``new`` with the per-constraint entries (lists of one entry per constraint) of the ``rows``
    taken from ``old``; shared entries (the dither's sign) from ``new``."""
    out = dict(new)
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, list) and isinstance(before, list) and len(value) == len(before) == len(rows):
            out[key] = [copy.deepcopy(b) if keep else v for v, b, keep in zip(value, before, rows)]
    return out


def stood_down(state: DualState, cfg: DualConfig) -> Tensor:
    """(C,) bool: the constraints whose dual stands down now: gated (``_gated``) and without authority from the last
    anchor window (the penalty's reach under ``authority`` x the batch spread), or before the first window closed."""
    gated = _gated(cfg)
    if not bool(gated.any()):
        return gated
    auth = (state.anchor or {}).get("authority_C") or [None] * len(cfg.constraints)
    return gated & torch.tensor([a is not True for a in auth], dtype=torch.bool)


def _seed_floor(state: DualState, floor_measured_C: Tensor, cfg: DualConfig) -> DualState:
    """F_i <- D_floor_i for the automatic tolerances that have no floor yet (NaN) and a finite measurement."""
    if state.floor_C is None or not _has_auto_tolerance(cfg) or not torch.isnan(state.floor_C).any():
        return state
    seeded_C = update_floor(state, floor_measured_C, cfg).floor_C
    return replace(state, floor_C=torch.where(torch.isnan(state.floor_C), seeded_C, state.floor_C))


def update_floor(state: DualState, floor_measured_C: Tensor, cfg: DualConfig) -> DualState:
    """F_i <- a_i F_i + (1 - a_i) D_floor_i for the constraints with an automatic tolerance (F_i <- D_floor_i at
    the first finite measurement; a non-finite one leaves F_i as it was), a_i = constraints[i].floor_ema. A
    constraint with ``floor_steps`` K holds a finite F_i once ``state.steps`` (dual steps taken, this one
    included) exceeds K: only the measurements of steps 1..K enter it. A ratcheted constraint (``floor_ratchet``)
    keeps F moving and keeps its lowest value in ``floor_low_C``. With ``floor_steps`` K its F restarts at step
    K + 1 (F <- D_floor: the warm-up's measurements leave it), and the minimum is taken once F spans its window,
    from step K + ceil(1 / (1 - a)) on (K = 0 without floor_steps): an EMA of a few noisy batches, or one that
    still carries a learning-rate warm-up's near-zero drift, would set a minimum the run never returns to."""
    n = len(cfg.constraints)
    old_C = state.floor_C if state.floor_C is not None else torch.full((n,), float("nan"), dtype=_F64)
    if not _has_auto_tolerance(cfg):  # every F_i stays NaN
        return state if state.floor_C is not None else replace(state, floor_C=old_C)
    x_C = torch.as_tensor(floor_measured_C, dtype=_F64).detach().cpu().reshape(-1)
    old_finite_C = _finite(old_C)
    auto_C = _per_constraint(cfg, "floor_slack") >= 0  # NaN (no automatic tolerance) compares False
    passed_C = _vector(tuple(float(c.floor_steps is not None and state.steps > c.floor_steps)
                             for c in cfg.constraints)) > 0
    a_C = _per_constraint(cfg, "floor_ema")
    ratchet_C = _per_constraint(cfg, "floor_ratchet") > 0
    restart_C = ratchet_C & (_vector(tuple(float(c.floor_steps is not None and state.steps == c.floor_steps + 1)
                                           for c in cfg.constraints)) > 0)
    ema_C = torch.where(old_finite_C & ~restart_C, a_C * old_C + (1 - a_C) * x_C, x_C)
    # a ratcheted floor is never held: floor_steps only delays its running minimum
    new_C = torch.where(auto_C & ~(passed_C & old_finite_C & ~ratchet_C) & _finite(x_C), ema_C, old_C)
    if not bool(ratchet_C.any()):
        return replace(state, floor_C=new_C)
    low_C = state.floor_low_C if state.floor_low_C is not None else torch.full_like(new_C, float("nan"))
    started_C = _vector(tuple(float(state.steps >= (c.floor_steps or 0) + math.ceil(1 / (1 - c.floor_ema) - 1e-9))
                              for c in cfg.constraints)) > 0
    # the lowest F so far: fmin ignores a NaN on either side (no floor yet, or none before this state existed)
    low_C = torch.where(ratchet_C & started_C, torch.fmin(low_C, new_C), low_C)
    return replace(state, floor_C=new_C, floor_low_C=torch.where(ratchet_C, low_C, torch.full_like(new_C, float("nan"))))


# ------------------------------------------------------------------------------------------------------------------
# The anchored tolerance (constraints[i].anchor; docs/tolerances.md, "A tolerance the run finds for itself")


def _anchored(cfg: DualConfig) -> list[bool]:
    return [c.anchor is not None for c in cfg.constraints]


def anchor_init(cfg: DualConfig) -> Optional[dict[str, Any]]:
    """The empty anchor state: no gap, no probes (None without anchored constraints)."""
    n = len(cfg.constraints)
    if not any(_anchored(cfg)):
        return None
    return {"gap_C": [None] * n, "floor_C": [None] * n, "step_C": [None] * n, "probes_C": [[] for _ in range(n)],
            "recent_C": [[] for _ in range(n)], "stuck_C": [0] * n}


# Steps of (lambda carried, D_hat) the anchor keeps for the level and spread of D_hat under the run's own penalty, and
# the least it reads them from (fewer: the probes' own values stand in).
ANCHOR_RECENT = 50
_ANCHOR_MIN_RECENT = 8
# Consecutive steps with lambda at its floor or its cap after which the anchor is probed again: a c that the dual
# cannot hold (at the cap) or never has to act for (at the floor) was set from a noisy window.
ANCHOR_STUCK = 25


def note_anchor_step(state: DualState, cfg: DualConfig, carried_C: Tensor, measured_C: Tensor) -> DualState:
    """Keep this step's (lambda carried, D_hat) in each anchored constraint's recent window (``ANCHOR_RECENT``) and
    count the consecutive steps its new lambda sits at lambda_min or lambda_max (``ANCHOR_STUCK``), under a rule
    whose lambda moves only: a lambda held at 0 or lambda_max (``fixed``, ``off``: the placebo arms) is at an edge
    by design, and re-anchoring every ``ANCHOR_STUCK`` steps would give the placebo another c schedule."""
    if state.anchor is None:
        return state
    moves = get_rule(cfg).moves
    down = stood_down(state, cfg)  # lambda held at 0 by the stand-down, not by the rule: no reason to re-anchor
    a = copy.deepcopy(state.anchor)
    a.setdefault("recent_C", [[] for _ in cfg.constraints])
    a.setdefault("stuck_C", [0] * len(cfg.constraints))
    for i, c in enumerate(cfg.constraints):
        d, lam = float(measured_C[i]), float(state.lambda_C[i])
        if c.anchor is None:
            continue
        if math.isfinite(d) and d > 0:
            a["recent_C"][i] = (a["recent_C"][i] + [[float(carried_C[i]), d]])[-ANCHOR_RECENT:]
        at_edge = moves and not bool(down[i]) and (lam <= c.lambda_min + 1e-12 or lam >= c.lambda_max - 1e-12)
        a["stuck_C"][i] = a["stuck_C"][i] + 1 if at_edge else 0
    return replace(state, anchor=a)


def anchor_due(state: DualState, cfg: DualConfig, step: int) -> list[bool]:
    """Per constraint, whether this step's batch is probed for its anchor: an anchored constraint from
    ``anchor_start`` on while it has no gap yet or a window is being collected, ``anchor_every`` steps after its last
    anchoring, and when the floor F has left [F_a / anchor_ratio, F_a x anchor_ratio] (the floor moved: a precision
    switch, a staleness change)."""
    a = state.anchor if state.anchor is not None else anchor_init(cfg)
    if a is None:
        return [False] * len(cfg.constraints)
    floor = _floor_list(state.floor_C) if state.floor_C is not None else [None] * len(cfg.constraints)
    due = []
    for i, c in enumerate(cfg.constraints):
        if c.anchor is None or step < c.anchor_start:
            due.append(False)
            continue
        gap, last, f_a, f = a["gap_C"][i], a["step_C"][i], a["floor_C"][i], floor[i]
        moved = f is not None and f_a is not None and f_a > 0 and not f_a / c.anchor_ratio <= f <= f_a * c.anchor_ratio
        stuck = a.get("stuck_C", [0] * len(cfg.constraints))[i] >= ANCHOR_STUCK
        due.append(gap is None or bool(a["probes_C"][i]) or moved or stuck
                   or (c.anchor_every > 0 and last is not None and step - last >= c.anchor_every))
    return due


def anchor_gap(at_zero: Sequence[float], at_max: Sequence[float], floor: Sequence[float], recent: Sequence[Sequence[float]],
               lambda_max: float, position: float, miss_rate: float) -> float:
    """g = c - median(F), at least 0, with c between the levels a batch's D-hat exceeds with probability alpha
    (= miss_rate) without the penalty and at lambda_max, at position xi (0: lambda_max's, 1: no penalty's).

    On the log scale (the batch-to-batch noise of D-hat is multiplicative): the probes' paired difference
    Delta = median_k(log D_0,k - log D_max,k) is the response of a batch's updates from lambda = 0 to lambda_max, clean of
    sampling noise; the run's recent D-hat (``recent``: (lambda carried, D-hat) pairs) gives the level m = median log
    D-hat at their mean lambda-bar and the spread sigma = 1.4826 MAD(log D-hat). With log D-hat linear in lambda over
    [0, lambda_max], log m_0 = m + Delta lambda-bar / lambda_max, log m_max = log m_0 - Delta, and

        log c = log m_max + xi Delta + z sigma,   z = Phi^-1(1 - alpha).

    Medians and MAD: one odd batch (D-hat several times the rest) must not move c. Fewer than 8 recent pairs: the
    probes' own D_0 give m (at lambda-bar = 0) and sigma. Where lambda_max does not lower D-hat (Delta <= 0) there is no
    band: c = exp(log m_0 + z sigma), which the dual rests under."""
    z = statistics.NormalDist().inv_cdf(1.0 - miss_rate)
    d0, dmax = np.asarray(at_zero, dtype=np.float64), np.asarray(at_max, dtype=np.float64)
    ok = (d0 > 0) & (dmax > 0)
    if not ok.any():
        return 0.0
    delta = penalty_reach(d0[ok], dmax[ok])
    pairs = np.asarray([p for p in recent if p[1] > 0], dtype=np.float64).reshape(-1, 2)
    if len(pairs) >= _ANCHOR_MIN_RECENT:
        logs, lam_bar = np.log(pairs[:, 1]), float(pairs[:, 0].mean())
    else:
        logs, lam_bar = np.log(d0[ok]), 0.0
    m = float(np.median(logs))
    sigma = 1.4826 * float(np.median(np.abs(logs - m)))
    if delta > 0:
        log_m0 = m + delta * lam_bar / lambda_max
        log_c = log_m0 - delta + position * delta + z * sigma
    else:
        log_c = m + z * sigma
    return max(math.exp(log_c) - float(np.median(floor)), 0.0)


def penalty_reach(at_zero: Sequence[float], at_max: Sequence[float]) -> Optional[float]:
    """Delta = median_k(log D_0,k - log D_max,k): how far the strongest penalty moves a batch's D-hat, from the paired
    probes of the same batches without the penalty (``at_zero``) and at lambda_max (``at_max``) (dcmdp.probe), on the
    log scale of ``batch_spread``. Pairs with a value <= 0 or non-finite are left out; None without a pair (not
    measured). ``anchor_gap`` places c with it; the run's summary sets it against the spread."""
    d0, dmax = np.asarray(at_zero, dtype=np.float64).reshape(-1), np.asarray(at_max, dtype=np.float64).reshape(-1)
    ok = np.isfinite(d0) & np.isfinite(dmax) & (d0 > 0) & (dmax > 0)
    return float(np.median(np.log(d0[ok]) - np.log(dmax[ok]))) if ok.any() else None


def batch_spread(measured: Sequence[float]) -> Optional[float]:
    """sigma = the standard deviation (ddof 1) of log D-hat over a run's batches (``measured``: D-hat per step as the
    dual step saw it); values <= 0 or non-finite are left out; None with fewer than 2 (not measured).

    The spread counts the batch-to-batch noise and the run's slow drift of D-hat alike: both move D-hat across a c
    that no lambda moves it across when the penalty's reach (``penalty_reach``) is smaller."""
    logs = np.log([x for x in np.asarray(measured, dtype=np.float64).reshape(-1) if np.isfinite(x) and x > 0])
    return float(np.std(logs, ddof=1)) if logs.size >= 2 else None


def record_anchor(state: DualState, cfg: DualConfig, step: int, due: Sequence[bool], at_zero_C: Tensor,
                  at_max_C: Tensor, floor_C: Tensor) -> tuple[DualState, dict[str, float]]:
    """Add one probed batch (D-hat without the penalty, at lambda_max, and the floor F) to each due constraint's window;
    a window of ``anchor_batches`` finite probes sets the gap from them (``anchor_gap``) and closes. Non-finite
    probes are not counted. Metrics: 'dual/anchor_zero/n', 'dual/anchor_max/n' (this batch's probes) and, when a window
    closes, 'dual/anchor_gap/n'; for a constraint with ``authority`` also the window's decision 'dual/authority/n' (1:
    the reach is at least authority x the spread, the dual acts, from lambda_init if it stood down; 0: it stands down,
    lambda 0) with 'dual/authority_reach/n' and 'dual/authority_spread/n' (the recent steps' D-hat, the probes' D_0
    while fewer than 8)."""
    a = copy.deepcopy(state.anchor) if state.anchor is not None else anchor_init(cfg)
    if a is None:
        return state, {}
    metrics: dict[str, float] = {}
    names = constraint_names(cfg.constraints)
    gated, lam_C = _gated(cfg), state.lambda_C.clone()
    for i, c in enumerate(cfg.constraints):
        if not due[i]:
            continue
        d0, dmax, f = float(at_zero_C[i]), float(at_max_C[i]), float(floor_C[i])
        metrics[f"dual/anchor_zero/{names[i]}"], metrics[f"dual/anchor_max/{names[i]}"] = d0, dmax
        if not all(math.isfinite(x) for x in (d0, dmax, f)):
            continue
        a["probes_C"][i].append([d0, dmax, f])
        if len(a["probes_C"][i]) >= c.anchor_batches:
            d0s, dmaxs, fs = zip(*a["probes_C"][i])
            gap = anchor_gap(d0s, dmaxs, fs, a.get("recent_C", [[]] * len(cfg.constraints))[i], c.lambda_max,
                             c.anchor, c.miss_rate)
            a["gap_C"][i], a["floor_C"][i], a["step_C"][i] = gap, float(np.median(fs)), step
            if getattr(c, "authority", None) is not None and bool(gated[i]):
                recent = [d for _, d in a.get("recent_C", [[]] * len(cfg.constraints))[i]]
                reach = penalty_reach(d0s, dmaxs)
                spread = batch_spread(recent if len(recent) >= _ANCHOR_MIN_RECENT else d0s)
                now = reach is not None and spread is not None and reach >= c.authority * spread
                auth = a.setdefault("authority_C", [None] * len(cfg.constraints))
                if now and auth[i] is not True:  # the dual takes over from lambda_init
                    lam_C[i] = c.lambda_init
                elif not now:  # it stands down: lambda held at 0 until a window shows the reach
                    lam_C[i] = 0.0
                auth[i] = bool(now)
                metrics[f"dual/authority/{names[i]}"] = float(now)
                metrics[f"dual/authority_reach/{names[i]}"] = math.nan if reach is None else reach
                metrics[f"dual/authority_spread/{names[i]}"] = math.nan if spread is None else spread
            a["probes_C"][i] = []
            if "stuck_C" in a:
                a["stuck_C"][i] = 0
            metrics[f"dual/anchor_gap/{names[i]}"] = a["gap_C"][i]
    return replace(state, anchor=a, lambda_C=lam_C), metrics


def _solve_projection_qp(target: np.ndarray, lo: np.ndarray, hi: np.ndarray, A: np.ndarray, b: np.ndarray,
                         fixed: np.ndarray) -> np.ndarray:
    """argmin_x ||x - target||^2 s.t. lo <= x <= hi, A x <= b, x[fixed] = target[fixed] (cvxpy)."""
    import cvxpy as cp  # imported here: ~1 s, and only coupled limits need it

    x = cp.Variable(target.shape[0])
    cons = [x >= lo, x <= hi, A @ x <= b]
    if fixed.any():
        idx = np.flatnonzero(fixed)
        cons.append(x[idx] == target[idx])
    problem = cp.Problem(cp.Minimize(cp.sum_squares(x - target)), cons)
    solver = cp.CLARABEL if cp.CLARABEL in cp.installed_solvers() else None
    problem.solve(solver=solver)
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or x.value is None:
        raise ValueError(f"dual: projection onto lambda_min <= lambda <= lambda_max, A lambda <= b failed "
                         f"(cvxpy status {problem.status}); are the coupled limits feasible?")
    return np.clip(np.asarray(x.value, dtype=np.float64), lo, hi)


def _project(lambda_C: Tensor, cfg: DualConfig, fixed_C: Optional[Tensor] = None) -> Tensor:
    """Pi(lambda_C), keeping the entries marked in fixed_C at their given (already feasible) value."""
    lam = torch.as_tensor(lambda_C, dtype=_F64).detach().cpu().reshape(-1)
    lo, hi = _per_constraint(cfg, "lambda_min"), _per_constraint(cfg, "lambda_max")
    boxed = torch.minimum(torch.maximum(lam, lo), hi)
    if fixed_C is not None and bool(fixed_C.any()):
        boxed = torch.where(fixed_C.bool().cpu(), lam, boxed)
    coupling = _coupling(cfg)
    if coupling is None:
        return boxed
    fixed = torch.zeros_like(lam, dtype=torch.bool) if fixed_C is None else fixed_C.bool().cpu()
    A, b = coupling
    # the box projection is the projection onto the larger set: if it is feasible it is the answer
    if np.all(A @ boxed.numpy() <= b + _FEASIBILITY_TOL):
        return boxed
    out = _solve_projection_qp(lam.numpy(), lo.numpy(), hi.numpy(), A, b, fixed.numpy())
    return torch.as_tensor(out, dtype=_F64)


def project(lambda_C: Tensor, cfg: DualConfig) -> Tensor:
    """Euclidean projection onto {lambda_min_i <= lambda_i <= lambda_max_i} ∩ {A lambda <= b} (float64, (C,)).

    Without coupling rows this is a clip per constraint. With them it is the QP
    min ||x - lambda||^2 over the box and the polytope, solved with cvxpy (skipped when the clipped point
    already satisfies A x <= b, which is then the exact answer).
    """
    return _project(lambda_C, cfg)


def projected_step(lambda_C: Tensor, rule_state: dict[str, Any], measured_C: Tensor, tolerance_C: Tensor,
                   cfg: DualConfig) -> tuple[Tensor, dict[str, Any]]:
    """lambda <- Pi(lambda + eta_i (D_hat_i - c_i)), eta_i = constraints[i].lr (DCMDP's projected dual ascent).

    Non-finite D_hat_i: lambda_i unchanged (held fixed in the projection). No state of its own.
    """
    finite_C = _finite(measured_C)
    eta_C = _per_constraint(cfg, "lr")
    step_C = torch.where(finite_C, eta_C * (measured_C - tolerance_C), 0.0)
    return _project(lambda_C + step_C, cfg, fixed_C=~finite_C), rule_state


# Steps of (lambda applied, D_hat) pairs behind the sign test of the ``signed`` rule: enough differences for a slope
# through per-batch noise of ~20% (tests/test_dual.py drives it on scripted U-shaped responses), few enough to follow
# the policy as it sharpens over a run.
SIGN_WINDOW = 10
_SIGN_MIN_DIFFS = 3
# Least step down on the right side of the U, as a share of c (eta * SIGN_MIN_STEP in relative units): the step
# eta |D_hat - c| alone would shrink to nothing at the right root D_hat(lambda) = c and settle there, on the stronger
# of the two multipliers that meet c.
SIGN_MIN_STEP = 0.1


def signed_init(cfg: DualConfig) -> dict[str, Any]:
    """No (lambda, D_hat) pairs yet; slope unknown, direction +1 (ascent)."""
    n = len(cfg.constraints)
    return {"hist": [[] for _ in range(n)], "slope_C": [math.nan] * n, "direction_C": [1.0] * n}


def response_slope(pairs: Sequence[Sequence[float]], with_error: bool = False):
    """b of the least-squares fit dD_k = a + b dlambda_k over consecutive differences of (lambda applied, D_hat) pairs.

    Differences, not levels: in closed loop lambda rises *because* D_hat is high, so the levels correlate whatever
    the response; a step's change of D_hat against the change of the lambda its updates carried is the response
    (the intercept a takes the slow drift of D_hat as the policy sharpens). None with fewer than 3 differences or
    when lambda did not vary. ``with_error``: (b, its standard error) instead, the error from the fit's residuals
    (inf with only 3 differences), (None, inf) where b is None.
    """
    if len(pairs) < _SIGN_MIN_DIFFS + 1:
        return (None, math.inf) if with_error else None
    a = np.asarray(pairs, dtype=np.float64)
    x, y = np.diff(a[:, 0]), np.diff(a[:, 1])
    var = float(x.var())
    if not var > 1e-18:
        return (None, math.inf) if with_error else None
    b = float(((x - x.mean()) * (y - y.mean())).mean() / var)
    if not with_error:
        return b
    n = x.size
    resid = (y - y.mean()) - b * (x - x.mean())
    se = math.sqrt(float((resid ** 2).sum()) / (n - 2) / (var * n)) if n > 2 else math.inf
    return b, se


def signed_step(lambda_C: Tensor, rule_state: dict[str, Any], measured_C: Tensor, tolerance_C: Tensor,
                cfg: DualConfig) -> tuple[Tensor, dict[str, Any]]:
    """lambda <- Pi(lambda + eta_i (D_hat_i - c_i)) where raising lambda lowers D_hat, else
    lambda <- Pi(lambda - eta_i (|D_hat_i - c_i| + SIGN_MIN_STEP c_i)).

    D_hat(lambda) is not monotone: it falls as lambda rises up to some lambda*, then rises again
    with the policy's entropy. Projected ascent (s = +1) is negative feedback left of lambda* and positive feedback
    right of it, held only by the cap. The sign test keeps the last ``SIGN_WINDOW`` + 1 pairs (lambda the batch's
    updates carried, D_hat) and fits the response slope b (``response_slope``). With b > 0 (right of lambda*) the rule
    steps lambda *down*, by at least eta SIGN_MIN_STEP c: where c is feasible lambda crosses to the left branch and
    settles at its root D_hat(lambda) = c (the weaker of the two multipliers that meet c), where it is not it settles
    near lambda* (the least D_hat any lambda gives) instead of the cap. With lambda pinned at lambda_max over the whole
    window (no variation, b unknown) and D_hat still outside, the cap does not hold D_hat: the rule steps down as
    well, which probes the response. With b <= 0 or unknown (and not pinned) this is exactly ``projected_step``.
    Non-finite D_hat_i: lambda_i and its pairs unchanged.
    State: the pairs ("hist"), the last slope ("slope_C", NaN when unknown) and direction ("direction_C").
    """
    eta_C, hi_C = _per_constraint(cfg, "lr"), _per_constraint(cfg, "lambda_max")

    def one(i: int, hist: list, lam: float, d: float, c: float) -> tuple[list, Optional[float], bool, float]:
        hist, b, pinned = _sign_test(hist, lam, d, float(hi_C[i]))
        down = (b is not None and b > 0) or (pinned and b is None and d > c)
        return hist, b, down, -float(eta_C[i]) * (abs(d - c) + SIGN_MIN_STEP * c) if down else float(eta_C[i]) * (d - c)

    return _signed_steps(lambda_C, rule_state, measured_C, tolerance_C, cfg, one)


def _signed_steps(lambda_C: Tensor, rule_state: dict[str, Any], measured_C: Tensor, tolerance_C: Tensor,
                  cfg: DualConfig, one: Callable[..., tuple[list, Optional[float], bool, float]]
                  ) -> tuple[Tensor, dict[str, Any]]:
    """The loop the sign-tested rules share: ``one(i, pairs_i, lambda_i, D_hat_i, c_i)`` gives constraint i's new pairs,
    response slope, direction (down or not) and step, for each finite D_hat_i; a non-finite one leaves lambda_i and
    its pairs unchanged. Returns the projected multipliers and the state ("hist", "slope_C", "direction_C")."""
    finite_C = _finite(measured_C)
    hist = [list(h) for h in rule_state["hist"]]
    slopes, directions = list(rule_state["slope_C"]), list(rule_state["direction_C"])
    step = []
    for i, (lam, d, c, ok) in enumerate(zip(lambda_C.tolist(), measured_C.tolist(), tolerance_C.tolist(),
                                            finite_C.tolist())):
        if not ok:
            step.append(0.0)
            continue
        hist[i], b, down, s_i = one(i, hist[i], lam, d, c)
        slopes[i], directions[i] = (math.nan if b is None else b), (-1.0 if down else 1.0)
        step.append(s_i)
    new_C = _project(lambda_C + torch.tensor(step, dtype=_F64), cfg, fixed_C=~finite_C)
    return new_C, {"hist": hist, "slope_C": slopes, "direction_C": directions}


def _sign_test(hist: list, lam: float, d: float, hi: float) -> tuple[list, Optional[float], bool]:
    """The pairs (lambda applied, D_hat) with this step's appended (the last ``SIGN_WINDOW`` + 1), their response
    slope (``response_slope``) and whether lambda sat at its cap over the whole window."""
    hist = (hist + [[lam, d]])[-(SIGN_WINDOW + 1):]
    pinned = len(hist) == SIGN_WINDOW + 1 and all(l >= hi - 1e-12 for l, _ in hist)
    return hist, response_slope(hist), pinned


def chance_init(cfg: DualConfig) -> dict[str, Any]:
    """The signed rule's state (no pairs yet) and the dither's sign, +1 on the first batch."""
    return {**signed_init(cfg), "dither": 1.0}


def dithered_lambda(lambda_C: Tensor, rule_state: dict[str, Any], cfg: DualConfig) -> Tensor:
    """(C,) the multipliers a batch's updates carry under the chance rule: Pi(lambda + s eta), s = +1, -1, +1, ...
    alternating from batch to batch (a square-wave dither of one step's size), so that consecutive batches differ in
    lambda and the response slope of D_hat is measured from the applied values even while lambda itself holds still."""
    eta_C = _per_constraint(cfg, "lr")
    return _project(lambda_C + float(rule_state.get("dither", 0.0)) * eta_C, cfg)


def chance_step(lambda_C: Tensor, rule_state: dict[str, Any], measured_C: Tensor, tolerance_C: Tensor,
                cfg: DualConfig) -> tuple[Tensor, dict[str, Any]]:
    """lambda <- Pi(lambda + eta_i (1[D_hat_i > c_i] - alpha_i)), alpha_i = constraints[i].miss_rate, with the sign test.

    Stochastic dual ascent on the chance constraint P(D_hat > c) <= alpha: the cost is the indicator of a step outside
    the tolerance region, so an interior lambda sits where D_hat is inside c on 1 - alpha of the steps (the mean-based
    rules hold E[D_hat] = c, inside on about half of them when D_hat is noisy). The step is bounded (eta per step at
    most) and scale-free: the same eta serves every measure and needs no relative units.

    Sign test: D_hat(lambda) is U-shaped over a run. Where the response slope b of D_hat to lambda
    (``response_slope`` over the last ``SIGN_WINDOW`` + 1 steps) is significantly positive (b > 2 standard errors) or
    lambda sat at its cap over the whole window with D_hat still outside (anti-windup), raising lambda would raise D_hat:
    an outside step then lowers lambda by eta (1 - alpha) instead. A slope within its noise leaves the ascent as it is
    (a noisy sign would cancel the integral action). Non-finite D_hat_i: lambda_i and its pairs unchanged.
    State: the pairs ("hist"), the last slope ("slope_C", NaN when unknown) and direction ("direction_C").
    """
    eta_C, hi_C, alpha_C = (_per_constraint(cfg, k) for k in ("lr", "lambda_max", "miss_rate"))
    applied_C = dithered_lambda(lambda_C, rule_state, cfg).tolist()

    def one(i: int, hist: list, lam: float, d: float, c: float) -> tuple[list, Optional[float], bool, float]:
        hi, eta, alpha = float(hi_C[i]), float(eta_C[i]), float(alpha_C[i])
        hist, _, pinned = _sign_test(hist, applied_C[i], d, hi)
        pinned = pinned or (len(hist) == SIGN_WINDOW + 1 and lam >= hi - 1e-12
                            and all(l >= hi - eta - 1e-12 for l, _ in hist))
        b, se = response_slope(hist, with_error=True)
        outside = d > c
        down = outside and ((b is not None and b > 2.0 * se) or pinned)
        return hist, b, down, -eta * (1.0 - alpha) if down else eta * (float(outside) - alpha)

    new_C, state = _signed_steps(lambda_C, rule_state, measured_C, tolerance_C, cfg, one)
    return new_C, {**state, "dither": -float(rule_state.get("dither", 1.0))}


_PID_KEYS = ("integral_C", "p_C", "cost_ema_C", "cost_hist")


def pid_init(cfg: DualConfig) -> dict[str, Any]:
    """I_0 = lambda_init, P_0 = 0, C_bar_0 = 0 and no cost history (see ``pid_step``)."""
    n = len(cfg.constraints)
    return {"integral_C": _per_constraint(cfg, "lambda_init").tolist(), "p_C": [0.0] * n, "cost_ema_C": [0.0] * n,
            "cost_hist": [[] for _ in range(n)]}


def pid_step(lambda_C: Tensor, rule_state: dict[str, Any], measured_C: Tensor, tolerance_C: Tensor,
             cfg: DualConfig) -> tuple[Tensor, dict[str, Any]]:
    """PID Lagrangian (Stooke, Achiam, Abbeel, ICML 2020, arXiv 2007.03964), per constraint i, step k:

        Delta_k = J_C - d                                 (J_C = D_hat_i, d = c_i)
        I_k     = Pi(I_{k-1} + K_I Delta_k)               K_I = constraints[i].lr
        P_k     = alpha_p P_{k-1} + (1 - alpha_p) Delta_k
        C_bar_k = alpha_d C_bar_{k-1} + (1 - alpha_d) J_C
        D_k     = max(0, C_bar_k - C_bar_{k-delay})       derivative on increases only
        lambda_k = Pi(max(0, K_P P_k + I_k + K_D D_k))

    The paper writes I_k = max(0, I_{k-1} + K_I Delta_k); we project the integral like lambda, which is
    that same formula when lambda_min = 0 and lambda_max = inf, and otherwise stops integral wind-up
    beyond lambda_max (the integral would have to unwind for many steps before lambda could come down).
    With K_P = K_D = 0 the rule is then exactly the projected rule with eta = K_I.

    Initial values: I_0 = lambda_init and P_0 = 0, as in the authors' reference code (rlpyt's CppoPID).
    Their code starts C_bar and its history at 0, so the first step sees a derivative kick
    K_D (1 - alpha_d) J_C that only reflects the initialisation; here C_bar_0 is the first finite
    measurement and C_bar_{k-delay} is the oldest value recorded so far (D_1 = 0). K_P, K_D, alpha_p,
    alpha_d, delay come from ``cfg.pid``; the reference code's defaults are K_P = 0, K_I = 1, K_D = 0,
    delay = 10, alpha_p = alpha_d = 0.95 (smoothing for noisy per-batch costs), and the paper's
    experiments sweep K_P and K_D.
    Non-finite D_hat_i: lambda_i and all of its PID state (I, P, C_bar, history) stay unchanged.
    """
    pid = cfg.pid
    integral_prev, p_prev = _vec(rule_state["integral_C"]), _vec(rule_state["p_C"])
    cost_ema_prev, hist = _vec(rule_state["cost_ema_C"]), rule_state["cost_hist"]
    finite_C = torch.isfinite(measured_C)
    delta_C = torch.where(finite_C, measured_C - tolerance_C, torch.zeros_like(measured_C))
    ki_C = _per_constraint(cfg, "lr")
    integral_C = _project(integral_prev + ki_C * delta_C, cfg, fixed_C=~finite_C)
    p_C = torch.where(finite_C, pid.alpha_p * p_prev + (1 - pid.alpha_p) * delta_C, p_prev)
    cost_C = torch.nan_to_num(measured_C)
    started_C = torch.tensor([len(h) > 0 for h in hist], dtype=torch.bool)
    previous_C = torch.where(started_C, cost_ema_prev, cost_C)  # C_bar_0 = first measurement
    cost_ema_C = torch.where(finite_C, pid.alpha_d * previous_C + (1 - pid.alpha_d) * cost_C, cost_ema_prev)
    oldest_C = torch.tensor([h[0] if h else 0.0 for h in hist], dtype=_F64)
    deriv_C = torch.where(started_C, (cost_ema_C - oldest_C).clamp_min(0), torch.zeros_like(cost_ema_C))
    raw_C = (pid.kp * p_C + integral_C + pid.kd * deriv_C).clamp_min(0)
    new_lambda_C = _project(torch.where(finite_C, raw_C, lambda_C), cfg, fixed_C=~finite_C)
    delay = max(int(pid.delay), 1)
    cost_hist = [(list(h) + [float(c)])[-delay:] if ok else list(h)
                 for h, c, ok in zip(hist, cost_ema_C.tolist(), finite_C.tolist())]
    return new_lambda_C, {"integral_C": integral_C.tolist(), "p_C": p_C.tolist(), "cost_ema_C": cost_ema_C.tolist(),
                          "cost_hist": cost_hist}


def _no_state(cfg: DualConfig) -> dict[str, Any]:
    return {}


def _keep(lambda_C: Tensor, rule_state: dict[str, Any], measured_C: Tensor, tolerance_C: Tensor,
          cfg: DualConfig) -> tuple[Tensor, dict[str, Any]]:
    return lambda_C, rule_state


def _lambda_init(cfg: DualConfig) -> Tensor:
    return _per_constraint(cfg, "lambda_init")


def _zeros(cfg: DualConfig) -> Tensor:
    return torch.zeros(len(cfg.constraints), dtype=_F64)


@dataclass(frozen=True)
class DualRule:
    """A dual update rule and the state it owns.

    ``init(cfg)`` returns the rule's initial state (JSON-safe plain python); ``step(lambda_C, rule_state,
    measured_C, tolerance_C, cfg)`` returns the new multipliers and state from D_hat_C against c_C (both
    float64 (C,), already in relative units under ``cfg.relative``); ``initial_lambda(cfg)`` gives lambda_0.
    """

    init: Callable[[DualConfig], dict[str, Any]]
    step: Callable[[Tensor, dict[str, Any], Tensor, Tensor, DualConfig], tuple[Tensor, dict[str, Any]]]
    initial_lambda: Callable[[DualConfig], Tensor] = _lambda_init
    # whether lambda lives in the projection set [lambda_min, lambda_max] ∩ {A lambda <= b} (checked at init)
    projects: bool = True
    # whether the primal loss carries the penalty (false: the constraints are measured and logged only)
    penalizes: bool = True
    # whether lambda responds to D-hat (false: lambda is set, not controlled; its sitting at an edge is no reason to
    # re-anchor c, so a placebo arm keeps the anchored c's schedule of the controlled run)
    moves: bool = True


DUAL_RULES: dict[str, DualRule] = {
    "projected": DualRule(_no_state, projected_step),
    "pid": DualRule(pid_init, pid_step),
    "signed": DualRule(signed_init, signed_step),
    # the chance constraint P(D_hat > c) <= miss_rate, with the sign test (the configs/default.yaml rule)
    "chance": DualRule(chance_init, chance_step),
    # lambda held at lambda_init: the fixed-coefficient penalty baseline
    "fixed": DualRule(_no_state, _keep, moves=False),
    # no penalty and no controller: lambda stays 0 (the measurements are still logged)
    "off": DualRule(_no_state, _keep, initial_lambda=_zeros, projects=False, penalizes=False, moves=False),
}


def get_rule(cfg: DualConfig) -> DualRule:
    """The registered rule ``cfg.rule`` names."""
    if cfg.rule not in DUAL_RULES:
        raise ValueError(f"unknown dual rule {cfg.rule!r}; known: {', '.join(DUAL_RULES)}")
    return DUAL_RULES[cfg.rule]


def dual_step(state: DualState, measured_C: Tensor, cfg: DualConfig,
              floor_C: Optional[Tensor] = None) -> tuple[DualState, dict[str, float]]:
    """One dual update from D_hat_C (the batch measures, already averaged over the global batch).

    The rule is ``get_rule(cfg)`` (``fixed`` and ``off`` still log the measurements); an anchored constraint whose
    first window has not closed keeps its lambda (there is no tolerance to hold yet). Non-finite entries of measured_C leave their lambda
    unchanged and are counted. The tolerance is the one in force for this batch (``tolerances``); with
    ``cfg.relative`` the rule sees D_hat / c against 1, i.e. the violation (D_hat - c) / c. ``floor_C`` (pi_old
    vs mu before the updates, default measured_C) then updates the floor of the automatic tolerances, which
    applies from the next batch, like lambda. Metrics per constraint name n: 'dual/lambda/n' (after the step),
    'dual/measured/n', 'dual/tolerance/n', 'dual/violation/n' (D_hat - c); 'dual/skipped' (entries skipped
    in this step); under ``cfg.average`` also 'dual/lambda_avg/n' (lambda_bar, the multiplier the penalty carries);
    for a constraint with ``authority``, 'dual/stood_down/n' (1: this batch's updates carried no penalty, the dual
    standing down; its lambda is held at 0).
    """
    rule = get_rule(cfg)
    measured_C = torch.as_tensor(measured_C, dtype=_F64).detach().cpu().reshape(-1)
    n = len(cfg.constraints)
    if measured_C.numel() != n or state.lambda_C.numel() != n:
        raise ValueError(f"dual_step: {n} constraints, but {measured_C.numel()} measurements and "
                         f"{state.lambda_C.numel()} multipliers")
    floor_now_C = measured_C if floor_C is None else torch.as_tensor(floor_C, dtype=_F64).detach().cpu().reshape(-1)
    # an automatic tolerance without a floor yet takes this batch's: with the configured tolerance far below the
    # floor (e.g. 0.005 against 0.047 under noisy rollouts) one relative step would throw lambda to ~4
    state = _seed_floor(state, floor_now_C, cfg)
    tolerance_C = tolerances(state, cfg)
    n_skipped = sum(not math.isfinite(x) for x in measured_C.tolist())
    if cfg.relative:
        # an automatic tolerance can reach 0 (e.g. routing_mismatch under R3): any excess then counts fully
        scale_C = tolerance_C.clamp_min(_RELATIVE_MIN_C)
        lambda_C, rule_state = rule.step(state.lambda_C, state.rule, measured_C / scale_C, tolerance_C / scale_C, cfg)
    else:
        lambda_C, rule_state = rule.step(state.lambda_C, state.rule, measured_C, tolerance_C, cfg)
    down_C = stood_down(state, cfg)
    if state.anchor is not None:  # an anchored constraint has no tolerance to hold until its first window closes
        waiting_C = torch.tensor([c.anchor is not None and g is None for c, g in zip(cfg.constraints,
                                                                                   state.anchor["gap_C"])])
        lambda_C = torch.where(waiting_C, state.lambda_C, lambda_C)
        # a dual that stands down holds lambda at 0 (``stood_down``); the anchor's next window decides again
        lambda_C = torch.where(down_C, torch.zeros((), dtype=_F64), lambda_C)
        if bool(down_C.any()):  # nor does its rule learn from batches that carried no penalty (the sign test's pairs)
            rule_state = _keep_rows(rule_state, state.rule, down_C.tolist())
    steps = state.steps + 1
    avg_prev_C = state.lambda_avg()
    # lambda_bar_k = lambda_bar_{k-1} + (lambda_k - lambda_bar_{k-1}) / (k + 1): the mean of lambda_0..lambda_k
    lambda_avg_C = avg_prev_C + (lambda_C - avg_prev_C) / (steps + 1)
    new = replace(state, lambda_C=lambda_C, rule=rule_state, steps=steps, skipped=state.skipped + n_skipped,
                  lambda_avg_C=lambda_avg_C)
    new = update_floor(new, floor_now_C, cfg)
    if new.anchor is not None:
        new = note_anchor_step(new, cfg, applied_lambda(state, cfg), measured_C)

    metrics: dict[str, float] = {"dual/skipped": float(n_skipped)}
    for name, lam, avg, d, c in zip(constraint_names(cfg.constraints), new.lambda_C.tolist(), new.lambda_avg().tolist(),
                                    measured_C.tolist(), tolerance_C.tolist()):
        metrics[f"dual/lambda/{name}"] = lam
        if cfg.average:
            metrics[f"dual/lambda_avg/{name}"] = avg
        metrics[f"dual/measured/{name}"] = d
        metrics[f"dual/tolerance/{name}"] = c
        metrics[f"dual/violation/{name}"] = d - c
    for name, gated, down in zip(constraint_names(cfg.constraints), _gated(cfg).tolist(), down_C.tolist()):
        if gated:  # whether this batch's updates carried no penalty because the dual stood down
            metrics[f"dual/stood_down/{name}"] = float(down)
    for key, label in (("slope_C", "slope"), ("direction_C", "direction")):  # the signed rule's sign test
        for name, v in zip(constraint_names(cfg.constraints), rule_state.get(key, ())):
            metrics[f"dual/{label}/{name}"] = float(v)
    return new, metrics


# ------------------------------------------------------------------------------------------------------------------
# The staleness bound, the dual's second action (docs/design.md §"The staleness bound"; max_staleness: auto)


def staleness_bound(nu: float, auto: StalenessAutoConfig) -> int:
    """s = round(s_max - (s_max - s_min) nu / nu_max): the bound the controller sets for multiplier ``nu``.

    The best response of the system's Lagrangian to nu. With u = (s - s_min) / (s_max - s_min) in [0, 1] the share of
    the allowed asynchrony used, the throughput gain is taken as u - u^2 / 2 (concave: overlap saturates once the
    rollouts hide behind the updates) and the drift of the stale batches as linear in u, priced at nu / nu_max.
    argmax_u [u - u^2 / 2 - (nu / nu_max) u] = 1 - nu / nu_max, inside [0, 1] for nu in [0, nu_max]; the bound is
    that u rounded half up to an integer staleness. nu = 0 (no drift pressure): s_max; nu = nu_max: s_min.
    """
    u = 1.0 - float(nu) / float(auto.nu_max)
    return auto.min + int(math.floor((auto.max - auto.min) * u + 0.5))


def staleness_nu_step(nu: float, measured: float, tolerance: float, auto: StalenessAutoConfig) -> float:
    """nu <- Pi_[0, nu_max](nu + eta_s (D_hat - c_s) / c_s), eta_s = auto.lr: projected ascent on the multiplier of
    the staleness constraint D_hat_stale <= c_s, in units of c_s (as under ``dual.relative``, so one eta_s
    serves every measure). A non-finite D_hat leaves nu unchanged."""
    if not math.isfinite(measured):
        return float(nu)
    c = max(float(tolerance), _RELATIVE_MIN_C)
    return min(max(float(nu) + auto.lr * (float(measured) - c) / c, 0.0), float(auto.nu_max))


def staleness_init(auto: StalenessAutoConfig) -> dict[str, Any]:
    """nu_0 = auto.nu_init, or nu_max (the run starts at the bound s_min) when unset."""
    return {"nu": float(auto.nu_max if auto.nu_init is None else auto.nu_init)}


def with_staleness(state: DualState, auto: StalenessAutoConfig) -> DualState:
    """``state`` with the staleness controller's state, initialised when it has none (a fresh run, or a checkpoint
    written without the controller)."""
    return state if state.staleness is not None else replace(state, staleness=staleness_init(auto))


def bound_in_force(state: DualState, auto: StalenessAutoConfig) -> int:
    """The staleness bound that ``state``'s nu sets (``staleness_bound``)."""
    return staleness_bound(with_staleness(state, auto).staleness["nu"], auto)


def batch_tolerances(state: DualState, floor_C: Tensor, cfg: DualConfig) -> Tensor:
    """(C,) the tolerances ``dual_step(state, ..., floor_C=floor_C)`` holds this batch to (an automatic tolerance
    without a floor yet takes this batch's floor first)."""
    floor_C = torch.as_tensor(floor_C, dtype=_F64).detach().cpu().reshape(-1)
    return tolerances(_seed_floor(state, floor_C, cfg), cfg)


def staleness_step(state: DualState, measured_C: Tensor, tolerance_C: Tensor,
                   auto: StalenessAutoConfig) -> tuple[DualState, dict[str, float]]:
    """One step of the staleness controller from this batch's D_hat (the dual step's input: under
    ``dual.measure_at: updates`` pi_theta against mu, i.e. the engines' floor plus the drift since the weights that
    sampled the batch) of constraint ``auto.constraint``, against c_s = auto.tolerance or that constraint's tolerance
    in force (``tolerance_C``).

    The constraint is "D_hat of the batches trained <= c_s", its multiplier nu moves by ``staleness_nu_step`` and its
    action is the bound ``staleness_bound(nu)``: the bound rises while D_hat stays inside c_s and falls when it
    exceeds it. A batch at staleness 0 measures the floor and the updates' drift only; if that alone exceeds c_s, nu
    climbs to nu_max and the bound stays at s_min (no asynchrony can help). The lambda rule is untouched. The new
    bound applies to the batches that the weights of the next version sample, and to every batch the trainer takes
    from then on. Metrics: async/nu (after the step), async/bound_next (the bound it sets), async/staleness_tolerance.
    """
    state = with_staleness(state, auto)
    i = auto.constraint
    d = float(torch.as_tensor(measured_C, dtype=_F64).reshape(-1)[i])
    c = float(auto.tolerance) if auto.tolerance is not None else float(torch.as_tensor(tolerance_C).reshape(-1)[i])
    nu = staleness_nu_step(state.staleness["nu"], d, c, auto)
    new = replace(state, staleness={**state.staleness, "nu": nu})
    return new, {"async/nu": nu, "async/bound_next": float(staleness_bound(nu, auto)),
                 "async/staleness_tolerance": c}
