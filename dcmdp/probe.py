"""The dual's probes: D-hat of every constraint, and a batch's updates re-run at other multipliers.

``probe_updates`` runs a scored batch's N mini-batch updates once per multiplier vector, each pass from the same
weights, optimiser moments, learning-rate schedule and mini-batch permutation, and puts all of them back afterwards:
the passes differ only in lambda, so the difference of their D-hat is the response of this batch's updates to the
penalty, with no sampling noise between them (docs/design.md §"Paired probes"). The run's
anchored tolerance (``constraints[i].anchor``, dcmdp.dual) and ``dcmdp calibrate`` both measure through it.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional, Sequence

import torch

from constraints.config import ConstraintConfig
from constraints.measures import measure_constraint
from dcmdp.dual import DualState, penalty_spec
from trainers import learner


def constraint_values(constraints: Sequence[ConstraintConfig], batch: learner.ScoredBatch, train_logp_BT: torch.Tensor,
                      anchor_logp_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """D-hat of every constraint: the training engine's log-probs ``train_logp_BT`` vs mu, or vs ``anchor_logp_BT``
    when given (pi_old under ``dual.measure_at: drift``) (float64, [C])."""
    r = batch.rollout
    if not constraints:
        return torch.zeros(0, dtype=torch.float64)
    anchor_BT = r.rollout_logp_BT.float() if anchor_logp_BT is None else anchor_logp_BT.float()
    # reduced where the batch lives, then to the host: the dual's state is float64 on the CPU (one sync)
    return torch.stack([measure_constraint(c, train_logp_BT, anchor_BT, r.response_mask_BT.bool(),
                                           **batch.routes()).double() for c in constraints]).cpu()


def probe_updates(model: torch.nn.Module, optim: learner.OptimStep, batch: learner.ScoredBatch, *,
                  scoring: learner.ScoringSpec, algo, dual_state: DualState, dual_cfg, lambdas: Sequence[torch.Tensor],
                  seed: int, targets: Optional[Sequence[ConstraintConfig]] = None,
                  keep_moments: bool = False) -> list[torch.Tensor]:
    """D-hat at the measurement point (``dual_cfg.measure_at`` updates: vs mu; drift: vs pi_old) of ``batch`` after its
    N mini-batch updates at each multiplier vector of ``lambdas`` ((C,) float64 each), with the penalty and
    tolerances of ``dual_state`` otherwise; one (C,) float64 tensor per pass.

    Every pass starts from the same weights, optimiser moments, schedule position and loss scale, and draws the same
    mini-batches (generator seeded with ``seed``); all of them are put back after each pass, so the caller's model
    and optimiser are as they were. The copies are taken on the host: a probe costs one copy of the weights and
    moments in host memory and N updates per pass, on the device no more than an update. ``targets``: the
    constraints measured (default ``dual_cfg.constraints``). ``keep_moments``: the optimiser keeps the moments and
    schedule of the last pass (the weights are still put back), as ``dcmdp calibrate`` carries them across batches."""
    targets = list(dual_cfg.constraints if targets is None else targets)
    probe_cfg = replace(dual_cfg, constraints=targets)
    weights = {k: _local(v).detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    moments = _to_host(optim.optimizer.state_dict())
    schedule = copy.deepcopy(optim.scheduler.state_dict()) if optim.scheduler is not None else None
    scale = copy.deepcopy(optim.scaler.state_dict()) if optim.scaler is not None else None
    anchor = batch.old_logp_BT if dual_cfg.measure_at == "drift" else None
    out = []
    try:
        for k, lam_C in enumerate(lambdas):
            lam_C = torch.as_tensor(lam_C, dtype=torch.float64).reshape(-1)
            # the multipliers as given: no averaging, no dither, no stand-down (dcmdp.dual.applied_lambda)
            state = replace(dual_state, lambda_C=lam_C, lambda_avg_C=lam_C, rule={**dual_state.rule, "dither": 0.0})
            result = learner.update(model, optim, batch, scoring=scoring,
                                    penalty=penalty_spec(state, probe_cfg, stand_down=False),
                                    cfg=algo, generator=torch.Generator().manual_seed(seed))
            out.append(constraint_values(targets, batch, result.trained_logp_BT, anchor))
            if keep_moments and k == len(lambdas) - 1:
                moments = _to_host(optim.optimizer.state_dict())
                schedule = copy.deepcopy(optim.scheduler.state_dict()) if optim.scheduler is not None else None
                scale = copy.deepcopy(optim.scaler.state_dict()) if optim.scaler is not None else None
            _restore(model, optim, weights, moments, schedule, scale)
    finally:
        _restore(model, optim, weights, moments, schedule, scale)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of an FSDP2 parameter (a DTensor), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _to_host(obj):
    """A deep copy of an optimiser state dict with its tensors on the host (sharded DTensor state stays where it is)."""
    if hasattr(obj, "to_local"):
        return copy.deepcopy(obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _restore(model, optim: learner.OptimStep, weights, moments, schedule, scale) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            _local(v).copy_(weights[k])
    # load_state_dict casts the moments to each parameter's device (and dtype, for floating state)
    optim.optimizer.load_state_dict(_to_host(moments))
    if schedule is not None:
        optim.scheduler.load_state_dict(copy.deepcopy(schedule))
    if scale is not None:
        optim.scaler.load_state_dict(copy.deepcopy(scale))
    optim.optimizer.zero_grad(set_to_none=True)
