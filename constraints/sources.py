"""The training–inference mismatch of one rollout batch broken down by source (pure torch).

D̂ at the updates, m(π_θ, μ), mixes sources that different knobs act on. With a constraint's measure m (its
``measure_constraint``: m(train, anchor) over the response tokens) and the batch's rows split into fresh (sampled by
the weights π_old is computed with) and stale (sampled by older weights, asynchronous rollouts):

    engine    = m(π_old, μ) over the fresh rows        the engines' numerical floor: identical weights, so only the
                                                       two engines' numerics differ (precision, kernels, routing)
    staleness = m(π_old, μ) over all rows − engine     what the stale rows add: their share of the tokens times
                                                       (m over the stale rows − engine) for a token mean
    drift     = m(π_θ, π_old)                          what the updates add, π_θ as each token's update saw it
    total     = m(π_θ, μ)                              D̂ at the updates (m(π_old, μ) when no update ran)

engine + staleness is m(π_old, μ) of the whole batch, exactly. For a measure that is a mean of a per-token distance
(``abs_prob_diff``, ``abs_log_ratio``) the triangle inequality per token gives total ≤ engine + staleness + drift;
for ``kl_k1``, a mean of log μ − log π, the log-ratios add and the parts sum to total exactly; for the others
(``kl_k3``, ``chi2``, a quantile) the parts are read side by side, not as a sum. A batch without fresh rows measures no floor: ``floor_C`` (the controller's running floor) stands in,
else the two parts are NaN.

Routing flips (MoE, ``routing_flips``): the share of (token, MoE layer) pairs whose top-k expert set differs from the
rollout engine's, for the training router's own choice (without replay) and for the routes the updates train on
(with the run's replay: 0 under R3, which replays the engine's own).

Cost: a few masked means over tensors every step already holds ([B, T] log-probs, [B, S, L, K] routes); no forward.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from torch import Tensor

from constraints.config import ConstraintConfig
from constraints.measures import measure_constraint, routing_mismatch

# Parts of each constraint's measure, in the order they stack.
PARTS = ("engine", "staleness", "drift")
# Measures the log-prob decomposition does not apply to (they compare routes, not probabilities).
ROUTE_MEASURES = ("routing_mismatch",)


def mismatch_sources(constraint: ConstraintConfig, rollout_logp_BT: Tensor, old_logp_BT: Optional[Tensor],
                     mask_BT: Tensor, fresh_B: Tensor, trained_logp_BT: Optional[Tensor] = None,
                     floor: float = math.nan) -> dict[str, float]:
    """{engine, staleness, drift, total} of one constraint's measure for one batch (see the module docstring).

    rollout_logp_BT: (B, T) log μ; old_logp_BT: (B, T) log π_old, None when the run takes π_old := μ
    (``algo.old_logp: rollout``: engine and staleness are then not measured, NaN); mask_BT: (B, T) response tokens;
    fresh_B: (B,) bool, the rows the current weights sampled; trained_logp_BT: (B, T) log π_θ at each token's update,
    None when no update ran (drift 0, total = m(π_old, μ)); floor: the engine part when no row is fresh.
    """
    nan = math.nan
    mask_BT = mask_BT.bool()
    mu_BT = rollout_logp_BT

    def m(train_BT: Tensor, anchor_BT: Tensor, valid_BT: Tensor) -> float:
        if not bool(valid_BT.any()):
            return nan
        return float(measure_constraint(constraint, train_BT, anchor_BT, valid_BT))

    fresh_BT = mask_BT & fresh_B.bool().to(mask_BT.device)[:, None]
    if old_logp_BT is None:
        engine = staleness = nan
        whole = nan
    else:
        whole = m(old_logp_BT, mu_BT, mask_BT)
        engine = m(old_logp_BT, mu_BT, fresh_BT) if bool(fresh_BT.any()) else floor
        staleness = whole - engine
    if trained_logp_BT is None:
        drift, total = 0.0, whole
    else:
        drift = nan if old_logp_BT is None else m(trained_logp_BT, old_logp_BT, mask_BT)
        total = m(trained_logp_BT, mu_BT, mask_BT)
    return {"engine": engine, "staleness": staleness, "drift": drift, "total": total}


def routing_flips(rollout_experts_BSLK: Tensor, router_experts_BSLK: Optional[Tensor],
                  trained_experts_BSLK: Optional[Tensor], mask_BS: Tensor) -> dict[str, float]:
    """{router, replayed}: the share of valid (position, MoE layer) pairs whose top-k set differs from the rollout
    engine's (``routing_mismatch``), for the training router's own routes in the π_old pass (router; NaN when that
    pass replayed instead of choosing, as under R3) and for the routes the updates replay (replayed; without replay
    the router's own). Routes are (B, S, L, K) expert indices, -1 where none was recorded."""
    nan = math.nan
    router = nan if router_experts_BSLK is None else float(routing_mismatch(router_experts_BSLK, rollout_experts_BSLK,
                                                                            mask_BS))
    trained = router if trained_experts_BSLK is None else float(routing_mismatch(trained_experts_BSLK,
                                                                                 rollout_experts_BSLK, mask_BS))
    return {"router": router, "replayed": trained}


def source_names(constraints: Sequence[ConstraintConfig], names: Sequence[str]) -> list[tuple[str, ConstraintConfig]]:
    """(metric name, constraint) of the constraints the log-prob decomposition applies to."""
    return [(n, c) for n, c in zip(names, constraints) if c.measure not in ROUTE_MEASURES]


def stale_token_share(mask_BT: Tensor, fresh_B: Tensor) -> float:
    """Share of the batch's response tokens in stale rows (0 for a batch without tokens)."""
    mask_BT = mask_BT.bool()
    tokens = int(mask_BT.sum())
    stale = int((mask_BT & ~fresh_B.bool().to(mask_BT.device)[:, None]).sum())
    return stale / tokens if tokens else 0.0

