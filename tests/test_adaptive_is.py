"""Batch-adaptive corrections: M2PO's second-moment mask (``is_mode=m2po``) and VCPO's ESS step scale
(``algo.ess_lr_scale``), against float64 loop references, hand-worked examples and closed forms, then a few
tiny-moe updates with each."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from trainers import learner, routing
from trainers.config import AlgoConfig, M2Config, ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.losses import IS_MODES, POLICY_LOSSES, ess_lr_scale, m2po_keep, seq_ess_frac
from trainers.models import build_model

torch.set_num_threads(1)


def _m2po_loop(m2: list[float], tau: float) -> list[bool]:
    """The rule as written: while the kept tokens' mean M2 is >= tau, drop the largest (lowest index on ties)."""
    keep = [True] * len(m2)
    while any(keep):
        kept = [v for v, k in zip(m2, keep) if k]
        if sum(kept) / len(kept) < tau:
            break
        top = max(v for v, k in zip(m2, keep) if k)
        keep[next(i for i, (v, k) in enumerate(zip(m2, keep)) if k and v == top)] = False
    return keep


@pytest.mark.parametrize("seed", range(20))
def test_m2po_sorted_mask_equals_the_greedy_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g))
    log_rho = torch.randn(n, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g)) * 0.5
    if seed % 4 == 0:  # ties: quantised values
        log_rho = (log_rho * 20).round() / 20
    m2 = log_rho.square()
    tau = float(torch.rand(1, generator=g, dtype=torch.float64)) * 0.05 + 1e-4
    assert m2po_keep(m2, tau).tolist() == _m2po_loop(m2.tolist(), tau)


def test_m2po_hand_worked():
    # M2 = [0.25, 0.01, 0.0, 0.09, 0.04]; tau = 0.05
    # all: 0.39 / 5 = 0.078 >= 0.05 -> drop 0.25; rest 0.14 / 4 = 0.035 < 0.05 -> stop
    m2 = torch.tensor([0.25, 0.01, 0.0, 0.09, 0.04], dtype=torch.float64)
    assert m2po_keep(m2, 0.05).tolist() == [False, True, True, True, True]
    # tau = 0.03: 0.035 >= 0.03 -> drop 0.09; 0.05 / 3 = 0.0167 < 0.03 -> stop
    assert m2po_keep(m2, 0.03).tolist() == [False, True, True, False, True]
    # tau above the full mean keeps everything; the mean equal to tau is not below it
    assert m2po_keep(m2, 0.08).all()
    assert m2po_keep(torch.tensor([0.04, 0.04], dtype=torch.float64), 0.04).tolist() == [False, False]
    assert m2po_keep(torch.zeros(0, dtype=torch.float64), 0.04).tolist() == []


def _is_inputs(rhos: list[list[float]]):
    """old_logp = log rho, rollout_logp = 0 on valid tokens; padding holds NaN garbage."""
    T = max(map(len, rhos))
    old = torch.full((len(rhos), T), math.nan, dtype=torch.float64)
    roll = torch.full((len(rhos), T), -math.inf, dtype=torch.float64)
    mask = torch.zeros(len(rhos), T, dtype=torch.bool)
    for b, row in enumerate(rhos):
        for t, rho in enumerate(row):
            old[b, t], roll[b, t], mask[b, t] = math.log(rho), 0.0, True
    return old, roll, mask


def test_is_m2po_masks_the_outlier_tokens_and_weights_the_rest_by_rho():
    rhos = [[math.exp(0.5), math.exp(0.1)], [1.0, math.exp(-0.3)], [math.exp(0.2)]]
    old, roll, mask = _is_inputs(rhos)
    # M2 = 0.25, 0.01 | 0, 0.09 | 0.04: the hand-worked case above in batch layout, tau = 0.03
    w, kept, m = IS_MODES["m2po"](old, roll, mask, AlgoConfig(is_mode="m2po", m2po=M2Config(threshold=0.03)))
    assert kept.tolist() == [[False, True], [True, False], [True, False]]
    expected = torch.tensor([[0.0, math.exp(0.1)], [1.0, 0.0], [math.exp(0.2), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)
    assert m["is/mode_masked_frac"] == pytest.approx(2 / 5) and m["is/masked_frac"] == pytest.approx(2 / 5)
    assert m["is/m2_raw"] == pytest.approx(0.39 / 5, rel=1e-12)
    assert m["is/m2_kept"] == pytest.approx(0.05 / 3, rel=1e-12)


def test_is_m2po_masked_tokens_get_no_gradient():
    old, roll, mask = _is_inputs([[math.exp(0.5), math.exp(0.1)], [1.0, math.exp(-0.3)], [math.exp(0.2)]])
    w, kept, _ = IS_MODES["m2po"](old, roll, mask, AlgoConfig(m2po=M2Config(threshold=0.03)))
    logp = torch.where(mask, old, 0.0).clone().requires_grad_(True)  # r = 1: gradient -w A / N on kept tokens
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [2.0, 0.0]], dtype=torch.float64)
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, kept, AlgoConfig(), 5.0)
    loss.backward()
    expected = torch.where(kept, -w * adv / 5.0, 0.0)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0)
    assert logp.grad[0, 0] == 0 and logp.grad[1, 1] == 0 and logp.grad[2, 1] == 0


def test_seq_ess_frac_closed_forms():
    # sequence weights w = prod rho: [2, 1, 1, 0.5] (n = 4): (4.5)^2 / (4 * 6.25) = 0.81
    old, roll, mask = _is_inputs([[2.0], [0.5, 2.0], [1.0, 1.0, 1.0], [0.25, 2.0]])
    frac, n = seq_ess_frac(old, roll, mask)
    assert n == 4 and frac == pytest.approx(0.81, rel=1e-12)
    scale, m = ess_lr_scale(old, roll, mask)
    assert scale == pytest.approx(0.9, rel=1e-12) and m["optim/ess_lr_scale"] == scale
    # equal weights: ESS = n; one weight e^40 against n - 1 weights 1: ESS/n = (e^40 + 3)^2 / (4 (e^80 + 3)) ~ 1/4
    old, roll, mask = _is_inputs([[3.0, 3.0], [9.0], [9.0]])
    assert seq_ess_frac(old, roll, mask)[0] == pytest.approx(1.0, rel=1e-12)
    old, roll, mask = _is_inputs([[1.0], [1.0], [1.0], [1.0]])
    old[0, 0] = 40.0  # log rho = 40: exact in float64 with the max-shift
    a = math.exp(-40.0)
    expected = (1 + 3 * a) ** 2 / (4 * (1 + 3 * a * a))
    assert seq_ess_frac(old, roll, mask)[0] == pytest.approx(expected, rel=1e-12)
    assert ess_lr_scale(old, roll, mask)[0] == pytest.approx(math.sqrt(expected), rel=1e-12)
    # ESS above n is impossible, so the scale never exceeds 1; an empty batch keeps the full step
    assert ess_lr_scale(old, roll, torch.zeros_like(mask))[0] == 1.0


def test_seq_ess_skips_broken_and_empty_sequences():
    old, roll, mask = _is_inputs([[2.0], [0.5], [1.0, 1.0]])
    old[2, 1] = math.nan  # broken sequence: undefined product, left out
    mask = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])  # a row without response
    old = torch.cat([old, torch.zeros(1, old.shape[1], dtype=torch.float64)])
    roll = torch.cat([roll, torch.zeros(1, roll.shape[1], dtype=torch.float64)])
    frac, n = seq_ess_frac(old, roll, mask)
    assert n == 2 and frac == pytest.approx(2.5 ** 2 / (2 * 4.25), rel=1e-12)


# ------------------------------------------------------------------------------------------ tiny-moe updates

V = 101


def _rollout(model, precision: str):
    rng = random.Random(0)
    prompts = [[rng.randrange(5, V) for _ in range(rng.randint(2, 7))] for _ in range(8)]
    return TorchEngine(RolloutConfig(precision=precision, max_new_tokens=6), model, eos_id=1,
                       pad_id=0).generate(prompts, seed=0)


def _update(model, rollout, cfg, opt):
    scoring = learner.ScoringSpec(moe=routing.is_moe(model))
    batch = learner.score_old(model, rollout, torch.linspace(-1.0, 1.0, len(rollout)), cfg, scoring)
    return learner.update(model, learner.OptimStep(opt, grad_clip=1.0), batch, scoring=scoring,
                          penalty=learner.PenaltySpec(torch.zeros(0), ()), cfg=cfg,
                          generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mode,ess", [("m2po", False), ("tis", True), ("m2po", True)])
def test_tiny_moe_steps_change_parameters_with_finite_loss(mode, ess):
    model = build_model(ModelConfig(preset="tiny-moe"), V, seed=0)
    rollout = _rollout(model, "int4")
    before = copy.deepcopy(model.state_dict())
    cfg = AlgoConfig(is_mode=mode, ess_lr_scale=ess, minibatches=2, samples_per_prompt=2, prompts_per_step=4,
                     m2po=M2Config(threshold=1e-4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        result = _update(model, rollout, cfg, opt)
        assert result.skipped == 0
        for step in result.steps:
            assert math.isfinite(step["loss/total"])
            if ess:
                assert 0 < step["optim/ess_lr_scale"] <= 1 and 0 < step["is/seq_ess_frac"] <= 1
    if mode == "m2po":  # int4 rollouts against a tight tau: some tokens go, the rest's mean M2 is under it
        assert result.is_metrics["is/mode_masked_frac"] > 0 and result.is_metrics["is/m2_kept"] < 1e-4
    changed = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert len(changed) > 0.5 * len(before)
    assert opt.param_groups[0]["lr"] == 1e-3  # the ESS scale does not leak into the next step


def test_ess_lr_scale_scales_the_sgd_step_exactly():
    """SGD, one mini-batch: the parameter change with the ESS scale is scale x the change without it."""
    model = build_model(ModelConfig(preset="tiny-moe"), V, seed=0)
    rollout = _rollout(model, "int4")
    deltas, scales = [], []
    for ess in (False, True):
        m = copy.deepcopy(model)
        cfg = AlgoConfig(ess_lr_scale=ess, minibatches=1, samples_per_prompt=2, prompts_per_step=4)
        result = _update(m, rollout, cfg, torch.optim.SGD(m.parameters(), lr=0.05))
        scales.append(result.steps[0].get("optim/ess_lr_scale"))
        deltas.append(torch.cat([(p - q).flatten() for p, q in zip(m.parameters(), model.parameters())]))
    scale = scales[1]
    assert scales[0] is None and 0 < scale < 1
    # float32 parameters: p - q cancels to ~1e-7 absolute rounding
    torch.testing.assert_close(deltas[1], scale * deltas[0], rtol=1e-4, atol=1e-6)
