"""The training–inference mismatch of a training step by source, as metrics under one MLflow section, ``mismatch/``.

Per constraint ``<c>`` (its metric name, as ``dual/measured/<c>``): ``mismatch/<c>/engine``, ``.../staleness``,
``.../drift`` and ``.../total`` (``constraints.sources.mismatch_sources``); per step ``mismatch/stale_token_frac``;
for an MoE model whose engine reports its routes, ``mismatch/routing/router`` and ``mismatch/routing/replayed``
(``constraints.sources.routing_flips``). ``dcmdp report`` draws them as one stacked figure (mismatch.png).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from constraints.penalties import constraint_names
from constraints.sources import ROUTE_MEASURES, mismatch_sources, routing_flips, stale_token_share

if TYPE_CHECKING:  # the learner imports the models (transformers): not needed to read the metrics back (report)
    from dcmdp.config import DualConfig
    from trainers.config import AlgoConfig
    from trainers.learner import ScoredBatch, UpdateResult

SECTION = "mismatch"


def mismatch_metrics(dual: DualConfig, algo: AlgoConfig, batch: ScoredBatch, result: Optional[UpdateResult],
                     step: int, floor_C: Optional[torch.Tensor]) -> dict[str, float]:
    """The ``mismatch/`` metrics of the batch of ``step`` (rows of version ``step`` are fresh) after its updates
    (``result``; None when none ran). ``floor_C``: the controller's running floor per constraint (π_old vs μ on
    fresh batches), the engine part of a batch without fresh rows; {} for a batch without response tokens."""
    r = batch.rollout
    mask_BT = r.response_mask_BT.bool()
    if not bool(mask_BT.any()):
        return {}
    fresh_B = (r.version_B.to(mask_BT.device) == step if r.version_B is not None
               else torch.ones(mask_BT.shape[0], dtype=torch.bool, device=mask_BT.device))
    # algo.old_logp=rollout sets pi_old := mu: no engine part to measure
    old_BT = None if algo.old_logp == "rollout" else batch.old_logp_BT
    trained_BT = result.trained_logp_BT if result is not None else None
    # the running floor is pi_old vs mu except where the constraint is the drift itself
    floors = (floor_C.tolist() if floor_C is not None and dual.measure_at != "drift"
              else [math.nan] * len(dual.constraints))
    out: dict[str, float] = {}
    for name, c, floor in zip(constraint_names(dual.constraints), dual.constraints, floors):
        if c.measure in ROUTE_MEASURES:
            continue
        # mu in float32, as D-hat reads it (dcmdp.loop.constraint_values)
        parts = mismatch_sources(c, r.rollout_logp_BT.float(), old_BT, mask_BT, fresh_B, trained_BT, floor)
        # a part that cannot be measured on this batch (no fresh rows and no floor yet, no stale rows) is left out,
        # not logged as NaN: MLflow and the run's history then hold only measured values
        out.update({f"{SECTION}/{name}/{part}": value for part, value in parts.items() if math.isfinite(value)})
    out[f"{SECTION}/stale_token_frac"] = stale_token_share(mask_BT, fresh_B)
    if r.rollout_experts_BSLK is not None and batch.train_experts_BSLK is not None:
        # under R3 the pi_old pass replays the engine's routes: the router's own choice is not recorded. Without
        # replay and under R2 the updates route as the pi_old pass did: the one comparison serves both
        r3 = algo.routing_replay == "r3"
        flips = routing_flips(r.rollout_experts_BSLK, None if r3 else batch.train_experts_BSLK,
                              batch.replay_experts_BSLK if r3 else None, r.attention_mask_BS.bool())
        # a share that was not recorded (the router's own choice under R3) is left out, not logged as NaN
        out.update({f"{SECTION}/routing/{k}": v for k, v in flips.items() if math.isfinite(v)})
    return out
