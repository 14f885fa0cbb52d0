"""Non-finite guards: find the samples of a rollout batch that carry NaN / inf, and drop them cleanly.

A broken sample (a NaN log-prob from a low-precision rollout engine, an inf reward from a buggy
verifier) must not reach the loss, the discrepancy measures, the group baselines or the dual
controller. The screening functions here are pure: they take tensors and return a keep mask plus
``guard/`` metrics; the loop applies the mask with ``mask_rows`` (and ``learner.drop_rows``).

Dropping a sample = zeroing its response mask (so it contributes nothing to the loss, the measures or
the token counts) and zeroing its log-probs and advantage (so no NaN is left behind that a later
``0 * NaN`` could turn into a NaN gradient). Group statistics (GRPO mean / std) are computed from the
kept samples of each group only (``screened_advantages``): one NaN reward does not poison the other
G - 1 samples of its prompt.

Shapes: B samples (rows), T response tokens, G samples per prompt. Counts in metrics are numbers of
samples (rows) in this rollout batch.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from trainers.batch import Rollout
from trainers.config import AlgoConfig


class TooManyBadStepsError(RuntimeError):
    """``guard.max_bad_steps`` consecutive steps had every sample dropped or an update skipped."""


def _bad_rows(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """(B,) True where a valid token of the row holds a non-finite value."""
    return (mask_BT.bool() & ~torch.isfinite(values_BT)).any(dim=1)


def screen_rows(rollout_logp_BT: Tensor, mask_BT: Tensor, rewards_B: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Keep mask of the samples whose rollout log-probs (on valid tokens) and reward are all finite.

    keep_b = all_t (mask_bt => isfinite(rollout_logp_bt)) and isfinite(reward_b).
    Non-finite values on padding do not count (padding is never read). A sample with no valid token
    (an empty response) is kept, since its reward still informs its group's baseline, and is counted in
    ``guard/empty_response_samples``; it contributes nothing to the loss or the measures.

    Returns (keep_B bool, metrics): guard/bad_rollout_logp_samples, guard/bad_reward_samples,
    guard/empty_response_samples.
    """
    if rollout_logp_BT.shape != mask_BT.shape or rollout_logp_BT.shape[0] != rewards_B.shape[0]:
        raise ValueError(f"screen_rows: rollout_logp {tuple(rollout_logp_BT.shape)}, mask {tuple(mask_BT.shape)} "
                         f"and rewards {tuple(rewards_B.shape)} do not describe one batch")
    bad_logp_B = _bad_rows(rollout_logp_BT, mask_BT)
    bad_reward_B = ~torch.isfinite(rewards_B)
    keep_B = ~(bad_logp_B | bad_reward_B)
    return keep_B, {"guard/bad_rollout_logp_samples": float(bad_logp_B.sum()),
                    "guard/bad_reward_samples": float(bad_reward_B.sum()),
                    "guard/empty_response_samples": float((~mask_BT.bool().any(dim=1)).sum())}


def screen_old_logp(old_logp_BT: Tensor, mask_BT: Tensor, keep_B: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Drop (further) the kept samples whose training-engine log-probs pi_old are non-finite on a valid token.

    Returns (keep_B, {"guard/bad_old_logp_samples": count among the samples still kept}).
    """
    bad_B = _bad_rows(old_logp_BT, mask_BT) & keep_B
    return keep_B & ~bad_B, {"guard/bad_old_logp_samples": float(bad_B.sum())}


def screen_advantages(advantages_B: Tensor, keep_B: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Drop (further) the kept samples whose advantage is non-finite; (keep_B, {guard/bad_advantage_samples})."""
    bad_B = ~torch.isfinite(advantages_B) & keep_B
    return keep_B & ~bad_B, {"guard/bad_advantage_samples": float(bad_B.sum())}


def screened_advantages(advantage_fn: Callable[[Tensor, int, AlgoConfig], tuple[Tensor, dict[str, float]]],
                        rewards_B: Tensor, keep_B: Tensor, group_size: int,
                        cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """Advantages computed from the kept samples of each group only; 0 at dropped samples.

    Rows are groups of ``group_size`` consecutive samples (``ADVANTAGES``'s layout). With every sample
    kept this is exactly ``advantage_fn(rewards_B, group_size, cfg)``. Otherwise the complete groups go
    through one call and each partial group through its own call with its k kept samples as the group
    (k = 1 gives the lone sample advantage 0 under GRPO); a group with no kept sample gets 0. The
    estimator's metrics are then the row-weighted means over those calls (exact for means over
    samples such as reward/mean, an approximation for spreads such as reward/std).
    """
    B = rewards_B.shape[0]
    if B % group_size:
        raise ValueError(f"group_size={group_size} does not divide the batch of {B} rewards")
    if bool(keep_B.all()):
        return advantage_fn(rewards_B, group_size, cfg)
    out_dtype = rewards_B.dtype if rewards_B.is_floating_point() else torch.float32
    advantages_B = torch.zeros(B, dtype=out_dtype)
    keep_PG = keep_B.reshape(-1, group_size)
    full_P = keep_PG.all(dim=1)
    calls: list[tuple[int, dict[str, float]]] = []
    if bool(full_P.any()):
        rows = torch.nonzero(full_P.repeat_interleave(group_size)).squeeze(1)
        adv, metrics = advantage_fn(rewards_B[rows], group_size, cfg)
        advantages_B[rows] = adv.to(out_dtype)
        calls.append((rows.numel(), metrics))
    for p in torch.nonzero(~full_P & keep_PG.any(dim=1)).squeeze(1).tolist():
        rows = p * group_size + torch.nonzero(keep_PG[p]).squeeze(1)
        adv, metrics = advantage_fn(rewards_B[rows], rows.numel(), cfg)
        advantages_B[rows] = adv.to(out_dtype)
        calls.append((rows.numel(), metrics))
    n = sum(k for k, _ in calls)
    keys = {key for _, m in calls for key in m}
    metrics = {key: sum(k * m.get(key, 0.0) for k, m in calls) / n for key in keys} if n else {}
    return advantages_B, metrics


def mask_rows(rollout: Rollout, keep_B: Tensor) -> Rollout:
    """The rollout with the dropped samples' response mask and rollout log-probs zeroed (shapes unchanged).

    Their recorded MoE routes at response positions become -1 (no route), so that routing replay, which
    requires routes exactly on the real tokens, still lines up.
    """
    if bool(keep_B.all()):
        return rollout
    keep_B1 = keep_B.bool()[:, None]
    changes = dict(response_mask_BT=rollout.response_mask_BT * keep_B1.to(rollout.response_mask_BT.dtype),
                   rollout_logp_BT=torch.where(keep_B1, rollout.rollout_logp_BT,
                                               torch.zeros((), dtype=rollout.rollout_logp_BT.dtype)))
    if rollout.rollout_experts_BSLK is not None:
        # a replayed route must sit on a real token: the dropped responses are padding now
        P = rollout.num_prompt_positions
        experts_BSLK = rollout.rollout_experts_BSLK.clone()
        experts_BSLK[~keep_B.bool(), P:] = -1
        changes["rollout_experts_BSLK"] = experts_BSLK
    return rollout.with_(**changes)
