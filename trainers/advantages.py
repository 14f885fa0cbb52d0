"""Advantage estimators (docs/design.md §"The primal learner"): rewards of a rollout batch -> one advantage per sample.

One signature::

    ADVANTAGES[name](rewards_B, group_size, cfg) -> (advantages_B, metrics)

Rows are grouped as consecutive blocks of ``group_size``: sample g of prompt p is row p * G + g (the order
``dcmdp.loop.rollout_phase`` produces). The learner broadcasts advantages_B over the response tokens;
there is no length normalisation (Zheng et al., arXiv 2512.01374).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from trainers.config import AlgoConfig

STD_EPS = 1e-6
"""Added to the group std before dividing (std_normalize), so all-equal groups give 0, not NaN."""

Advantage = Callable[[Tensor, int, AlgoConfig], tuple[Tensor, dict[str, float]]]


def grpo_advantages(rewards_B: Tensor, group_size: int, cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """GRPO group-mean baseline (Shao et al. 2024, DeepSeekMath; Zheng et al. 2512.01374 drop the std):

        A_{p,g} = R_{p,g} - mean_g R_{p,g}                      (cfg.std_normalize = False, default)
        A_{p,g} = (R_{p,g} - mean_g R_{p,g}) / (std_g R_{p,g} + 1e-6)  (cfg.std_normalize = True)

    std_g is the sample standard deviation of the group (Bessel-corrected, as in GRPO implementations);
    a group of one sample gets advantage 0. Computed in float64, returned in the dtype of ``rewards_B``
    (float32 for integer rewards).

    Non-finite rewards are the caller's to filter: a NaN or inf reward makes its own group's advantages
    NaN (the group mean is undefined), and leaves every other group untouched. The metrics are computed
    over finite rewards and fully finite groups only, so they stay finite.

    Metrics: reward/mean, reward/std (population std over the batch), advantage/abs_mean,
    advantage/zero_groups_frac (share of groups whose rewards are all equal: they carry no signal).
    """
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D, got shape {tuple(rewards_B.shape)}")
    B = rewards_B.numel()
    if group_size < 1 or B % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide the batch of {B} rewards")
    out_dtype = rewards_B.dtype if rewards_B.is_floating_point() else torch.float32
    rewards_PG = rewards_B.detach().double().reshape(-1, group_size)
    adv_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if cfg.std_normalize and group_size > 1:
        adv_PG = adv_PG / (rewards_PG.std(dim=1, keepdim=True) + STD_EPS)
    advantages_B = adv_PG.reshape(-1)

    finite_P = torch.isfinite(rewards_PG).all(dim=1)
    finite_rewards = rewards_PG[torch.isfinite(rewards_PG)]
    good_adv = adv_PG[finite_P]
    zero_P = (rewards_PG == rewards_PG[:, :1]).all(dim=1)
    metrics = {
        "reward/mean": float(finite_rewards.mean()) if finite_rewards.numel() else 0.0,
        "reward/std": float(finite_rewards.std(correction=0)) if finite_rewards.numel() else 0.0,
        "advantage/abs_mean": float(good_adv.abs().mean()) if good_adv.numel() else 0.0,
        "advantage/zero_groups_frac": float(zero_P.double().mean()) if B else 0.0,
    }
    return advantages_B.to(out_dtype), metrics


ADVANTAGES: dict[str, Advantage] = {
    "grpo": grpo_advantages,
}
