"""GRPO advantages against hand-computed values (tolerance: rel 1e-12 in float64, 1e-6 in float32)."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.advantages import ADVANTAGES, STD_EPS
from trainers.config import AlgoConfig

torch.set_num_threads(1)
grpo = ADVANTAGES["grpo"]


def test_grpo_group_mean_baseline_by_hand():
    # prompt 0: rewards [1, 0, 0, 1] mean 0.5 -> [0.5, -0.5, -0.5, 0.5]
    # prompt 1: rewards [1, 1, 1, 0] mean 0.75 -> [0.25, 0.25, 0.25, -0.75]
    # prompt 2: rewards [0, 0, 0, 0] -> zeros (no signal)
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.float64)
    adv, m = grpo(rewards, 4, AlgoConfig(std_normalize=False))
    expected = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert adv.dtype == torch.float64
    assert m["reward/mean"] == pytest.approx(5 / 12)
    # population std over the batch: sqrt(5/12 - (5/12)^2)
    assert m["reward/std"] == pytest.approx(math.sqrt(5 / 12 - (5 / 12) ** 2), rel=1e-12)
    assert m["advantage/abs_mean"] == pytest.approx((4 * 0.5 + 3 * 0.25 + 0.75) / 12, rel=1e-12)
    assert m["advantage/zero_groups_frac"] == pytest.approx(1 / 3)


def test_grpo_std_normalized_by_hand():
    # G = 2: [1, 0] and [0, 1]: mean 0.5, sample std (Bessel) sqrt(0.5) -> +-0.5 / (0.70711 + 1e-6)
    #        [2, 4]: mean 3, sample std sqrt(2) -> [-1, 1] / (1.41421 + 1e-6); [3, 3] -> [0, 0]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 3.0, 3.0], dtype=torch.float64)
    adv, m = grpo(rewards, 2, AlgoConfig(std_normalize=True))
    s1, s2 = math.sqrt(0.5), math.sqrt(2.0)
    expected = [0.5 / (s1 + STD_EPS), -0.5 / (s1 + STD_EPS), -0.5 / (s1 + STD_EPS), 0.5 / (s1 + STD_EPS),
                -1 / (s2 + STD_EPS), 1 / (s2 + STD_EPS), 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert m["advantage/zero_groups_frac"] == pytest.approx(1 / 4)

    # G = 4: [1, 0, 0, 1]: sample std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735
    adv4, _ = grpo(rewards[:4], 4, AlgoConfig(std_normalize=True))
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv4, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / (s + STD_EPS),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("std_normalize", [False, True])
def test_grpo_all_equal_groups_give_exact_zeros(std_normalize):
    rewards = torch.tensor([0.7] * 4 + [1.0] * 4)
    adv, m = grpo(rewards, 4, AlgoConfig(std_normalize=std_normalize))
    assert torch.equal(adv, torch.zeros(8))
    assert m["advantage/zero_groups_frac"] == 1.0 and m["advantage/abs_mean"] == 0.0


def test_grpo_float32_and_integer_rewards():
    r64 = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.float64)
    a64, _ = grpo(r64, 3, AlgoConfig(std_normalize=True))
    a32, _ = grpo(r64.float(), 3, AlgoConfig(std_normalize=True))
    aint, _ = grpo(r64.long(), 3, AlgoConfig(std_normalize=True))
    assert a32.dtype == torch.float32 and aint.dtype == torch.float32
    torch.testing.assert_close(a32.double(), a64, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(aint, a32)


def test_grpo_nan_stays_inside_its_group():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.0, 0.0])
    adv, m = grpo(rewards, 3, AlgoConfig(std_normalize=True))
    assert torch.isnan(adv[:3]).all()
    s = math.sqrt(1 / 3)  # [1, 0, 0]: mean 1/3, sample std sqrt(1/3)
    torch.testing.assert_close(adv[3:], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (s + STD_EPS))
    assert all(math.isfinite(v) for v in m.values())
    assert m["reward/mean"] == pytest.approx(2 / 5)  # finite rewards only


def test_grpo_rejects_batch_not_divisible_by_group():
    with pytest.raises(ValueError, match="group_size=4"):
        grpo(torch.zeros(6), 4, AlgoConfig())


def test_grpo_group_of_one_is_zero():
    adv, _ = grpo(torch.tensor([1.0, 0.0, 3.0]), 1, AlgoConfig(std_normalize=True))
    assert torch.equal(adv, torch.zeros(3))
