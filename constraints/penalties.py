"""Penalty forms: how the multipliers lambda_C act on the primal loss (docs/design.md §"Penalty forms").

L(theta, lambda) = J(theta) - sum_i lambda_i (D_i(theta) - c_i): the learner minimises its policy loss plus
a penalty P(theta) = sum_i lambda_i P_i(theta). Three forms (Liu et al., DCMDP, arXiv 2606.08779):

- ``hinge`` (default): P_i = sum_t mask_t relu(d_t(theta) - c_i) / normalizer, with d_t(theta) the per-token
  measure of the CURRENT policy pi_theta against the rollout engine mu. Only tokens outside the
  tolerance region d_t > c_i get a gradient, pushing pi_theta(y_t) back towards mu(y_t).
- ``mean``: P_i = sum_t mask_t d_t(theta) / normalizer, every token is pulled towards mu.
- ``advantage``: no loss term; advantages are shaped, A_t - sum_i lambda_i d_t (d_t detached), so the
  discrepancy acts as a per-token cost in the policy gradient.

Every form (``PENALTIES[name]``, a ``PenaltyForm``) is called with one signature::

    fn(logp_BT, rollout_logp_BT, advantages_BT, mask_BT, lambda_C, constraints, normalizer,
       routing_mismatch_BT=None) -> (penalty_loss 0-dim, advantages_BT, metrics of 0-d tensors)

``normalizer`` is the number of valid tokens of the GLOBAL mini-batch (all ranks, all micro-batches),
given by the caller, so the loss is sum / normalizer and gradient accumulation or data parallelism gives
the same gradient as one big batch. A normalizer below 1 is taken as 1 (a batch without valid tokens
contributes nothing).

Measures without a differentiable per-token form:

- ``routing_mismatch``: acts through advantage shaping, A_t - lambda_i m_t with m_t =
  ``routing_mismatch_BT`` (the share of MoE layers whose expert set differs for token t), under EVERY
  penalty form. The expert choice is a discrete top-k: no gradient path leads from the loss to it, so a
  hinge or mean term on m_t would be a constant. Shaping lowers the probability of tokens whose routes
  disagree between the engines.
- ``seq_log_ratio``, ``chi2_seq``, ``log_ppl_diff``, ``log_ppl_abs_diff``, ``training_ppl``, ``rollout_ppl``,
  ``extreme_rate``, ``ess``: rejected with a ValueError. None has a per-token form that constrains the same
  quantity: the sequence measures' tolerances live on the sequence scale (a token-level hinge against one
  would almost never fire, or fire everywhere), extreme_rate's token form is an indicator (zero gradient
  everywhere), and ess is a batch-level diagnostic where higher is better. The error names the token-level
  measures to constrain instead. They remain measurable (``measure_constraint``, ``dcmdp calibrate``).
- ``max_abs_prob_diff``, ``max_abs_log_ratio``: act through the per-token value they take the max of. The
  hinge is exact for them: max_t d_t <= c iff every d_t <= c, and relu(d_t - c) pushes exactly the tokens
  that break it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from constraints.config import ConstraintConfig
from constraints.measures import MEASURES


def constraint_names(constraints: Sequence[ConstraintConfig]) -> list[str]:
    """Metric names of the constraints: the measure name (with _p90 etc. for a quantile constraint), suffixed
    _1, _2, ... only if that name repeats."""
    base = [c.measure if c.quantile is None else f"{c.measure}_p{100 * c.quantile:g}" for c in constraints]
    counts = Counter(base)
    seen: Counter[str] = Counter()
    names = []
    for name in base:
        if counts[name] > 1:
            seen[name] += 1
            names.append(f"{name}_{seen[name]}")
        else:
            names.append(name)
    return names


def check_penalty_constraints(constraints: Sequence[ConstraintConfig]) -> None:
    """Raise ValueError for a constraint whose measure no penalty form can act on (see the module docstring)."""
    usable = [n for n, m in MEASURES.items() if m.token is not None or m.kind == "routing"]
    for i, c in enumerate(constraints):
        if c.measure not in MEASURES:
            raise ValueError(f"constraint {i}: unknown measure {c.measure!r}; known: {', '.join(MEASURES)}")
        m = MEASURES[c.measure]
        if c.quantile is not None and m.token is None:
            raise ValueError(f"constraint {i}: a quantile constraint needs a measure with a per-token form; "
                             f"{c.measure!r} is {m.kind}-level")
        if m.token is None and m.kind != "routing":
            raise ValueError(
                f"constraint {i}: measure {c.measure!r} has no per-token form a penalty can act on (it is "
                f"{m.kind}-level); constrain one of {', '.join(usable)} instead (abs_log_ratio or kl_k3 are "
                f"the token-level counterparts of seq_log_ratio / extreme_rate, chi2 of ess)")


@dataclass(frozen=True)
class PenaltyForm:
    """How a constraint's per-token measure d_t(theta) enters the primal step: ``term(d_BT, c)`` is the per-token
    value weighted by lambda_i, added to the loss as sum_t mask_t lambda_i term_t / normalizer or, with
    ``shapes_advantages``, subtracted (detached) from the advantages. Calling it runs the penalty with the
    module's one signature (see the module docstring)."""

    term: Callable[[Tensor, float], Tensor]
    shapes_advantages: bool = False

    def __call__(self, logp_BT: Tensor, rollout_logp_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor,
                 lambda_C: Tensor | Sequence[float], constraints: Sequence[ConstraintConfig],
                 normalizer: float | Tensor, routing_mismatch_BT: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return _penalty(self, logp_BT, rollout_logp_BT, advantages_BT, mask_BT, lambda_C, constraints, normalizer,
                        routing_mismatch_BT)


def _penalty(form: PenaltyForm, logp_BT: Tensor, rollout_logp_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor,
             lambda_C: Tensor | Sequence[float], constraints: Sequence[ConstraintConfig], normalizer: float | Tensor,
             routing_mismatch_BT: Optional[Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    check_penalty_constraints(constraints)
    lambda_C = torch.as_tensor(lambda_C).detach().reshape(-1)
    if lambda_C.numel() != len(constraints):
        raise ValueError(f"got {lambda_C.numel()} multipliers for {len(constraints)} constraints")
    valid_BT = mask_BT.bool()
    dtype = torch.promote_types(logp_BT.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp_BT.device)
    # padding may hold -inf / NaN log-probs: replace before any arithmetic so gradients stay finite
    logp_BT = torch.where(valid_BT, logp_BT.to(dtype), zero)
    rollout_logp_BT = torch.where(valid_BT, rollout_logp_BT.detach().to(dtype), zero)
    lambda_C = lambda_C.to(device=logp_BT.device, dtype=dtype)
    # a Python normalizer becomes a device tensor by a fill, not a host-to-device copy (which waits for the device)
    norm = (normalizer.to(device=logp_BT.device, dtype=dtype) if isinstance(normalizer, Tensor)
            else torch.full((), float(normalizer), dtype=dtype, device=logp_BT.device)).clamp_min(1)

    loss = zero.clone()
    shaping_BT = torch.zeros_like(logp_BT)
    outside_C = []
    for i, c in enumerate(constraints):
        measure = MEASURES[c.measure]
        if measure.kind == "routing":
            if routing_mismatch_BT is None:
                raise ValueError(f"constraint {i} ({c.measure}) needs routing_mismatch_BT, the per-token share of "
                                 "MoE layers whose experts differ between the engines; none was given")
            d_BT = routing_mismatch_BT.detach().to(device=logp_BT.device, dtype=dtype)
            shaping_BT = shaping_BT + lambda_C[i] * d_BT
        else:
            d_BT = measure.token(logp_BT, rollout_logp_BT)
            term_BT = form.term(d_BT, c.tolerance)
            if form.shapes_advantages:
                shaping_BT = shaping_BT + lambda_C[i] * term_BT.detach()
            else:
                loss = loss + lambda_C[i] * torch.where(valid_BT, term_BT, zero).sum() / norm
        outside_C.append(((d_BT.detach() > c.tolerance) & valid_BT).sum())

    advantages_out_BT = torch.where(valid_BT, advantages_BT - shaping_BT.to(advantages_BT.dtype), advantages_BT)
    n_valid = valid_BT.sum().clamp_min(1)
    # 0-d tensors: nothing here waits for the device (the learner reads an update's metrics in one host sync)
    metrics = {"penalty/loss": loss.detach().double()}
    for name, outside in zip(constraint_names(constraints), outside_C):
        metrics[f"dual/outside_frac/{name}"] = outside.double() / n_valid
    return loss, advantages_out_BT, metrics


def hinge_term(d_BT: Tensor, tolerance: float) -> Tensor:
    """relu(d_t(theta) - c_i): a gradient only on tokens outside the tolerance region, pushing pi_theta(y_t) back
    towards mu(y_t). Advantages come back unchanged unless a routing_mismatch constraint shapes them."""
    return F.relu(d_BT - tolerance)


def mean_term(d_BT: Tensor, tolerance: float) -> Tensor:
    """d_t(theta): every valid token is pulled towards mu."""
    return d_BT


def advantage_term(d_BT: Tensor, tolerance: float) -> Tensor:
    """Zero loss; advantages A_t - sum_i lambda_i d_t on valid tokens, d_t detached (a per-token cost)."""
    return d_BT


# name -> PenaltyForm; a new form is one term function and one line here
PENALTIES: dict[str, PenaltyForm] = {
    "hinge": PenaltyForm(hinge_term),
    "mean": PenaltyForm(mean_term),
    "advantage": PenaltyForm(advantage_term, shapes_advantages=True),
}
