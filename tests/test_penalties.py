"""Penalty forms: hinge gradients by hand, mean form, advantage shaping, normalizer semantics, routing."""

from __future__ import annotations

import math

import pytest
import torch

from constraints.config import ConstraintConfig
from constraints.penalties import PENALTIES, check_penalty_constraints, constraint_names

torch.set_num_threads(1)

# mu and pi_theta of 5 tokens; token 4 is padding (and far outside any tolerance, to prove it is ignored)
MU = [0.5, 0.3, 0.2, 0.6, 0.9]
PI = [0.52, 0.4, 0.1, 0.6, 0.01]
MASK = torch.tensor([[True, True, True, True, False]])
# |pi - mu| = [0.02, 0.10, 0.10, 0.00, (0.89)]; with c = 0.05 tokens 1 and 2 are outside
C = 0.05
LAM = 0.5
N = 10.0  # valid tokens of the global mini-batch (this micro-batch holds 4 of them)


def _inputs():
    logp = torch.tensor([PI], dtype=torch.float64).log().requires_grad_(True)
    rollout_logp = torch.tensor([MU], dtype=torch.float64).log()
    advantages = torch.tensor([[1.0, -1.0, 0.5, 2.0, 3.0]], dtype=torch.float64)
    return logp, rollout_logp, advantages


def test_hinge_gradient_zero_inside_and_hand_derived_outside():
    logp, rollout_logp, adv = _inputs()
    cons = [ConstraintConfig(measure="abs_prob_diff", tolerance=C)]
    loss, adv_out, metrics = PENALTIES["hinge"](logp, rollout_logp, adv, MASK, torch.tensor([LAM]), cons, N)
    # loss = lam * (relu(0.10 - 0.05) + relu(0.10 - 0.05)) / 10 = 0.5 * 0.1 / 10
    assert loss.item() == pytest.approx(0.005, rel=1e-9)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp |pi - mu| = sign(pi - mu) * pi: token 1 (pi > mu) +0.4, token 2 (pi < mu) -0.1; times lam / N
    expected = torch.tensor([[0.0, LAM * 0.4 / N, -LAM * 0.1 / N, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(adv_out, adv)  # hinge leaves the advantages alone
    assert metrics["penalty/loss"] == pytest.approx(0.005)
    assert metrics["dual/outside_frac/abs_prob_diff"] == pytest.approx(2 / 4)


def test_hinge_with_kl_k3_gradient_is_rho_minus_one_outside():
    logp, rollout_logp, adv = _inputs()
    rho = [p / m for p, m in zip(PI, MU)]
    k3 = [r - 1 - math.log(r) for r in rho]  # [0.00078, 0.0457, 0.1931, 0, ...]
    c = 0.01
    cons = [ConstraintConfig(measure="kl_k3", tolerance=c)]
    loss, _, metrics = PENALTIES["hinge"](logp, rollout_logp, adv, MASK, [2.0], cons, N)
    assert loss.item() == pytest.approx(2.0 * ((k3[1] - c) + (k3[2] - c)) / N, rel=1e-9)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = [0.0, 2.0 * (rho[1] - 1) / N, 2.0 * (rho[2] - 1) / N, 0.0, 0.0]
    torch.testing.assert_close(grad, torch.tensor([expected], dtype=torch.float64), rtol=1e-9, atol=1e-15)
    assert metrics["dual/outside_frac/kl_k3"] == pytest.approx(0.5)


def test_mean_form_pulls_every_valid_token():
    logp, rollout_logp, adv = _inputs()
    cons = [ConstraintConfig(measure="abs_log_ratio", tolerance=C)]
    loss, adv_out, _ = PENALTIES["mean"](logp, rollout_logp, adv, MASK, [LAM], cons, N)
    x = [math.log(p / m) for p, m in zip(PI, MU)]
    assert loss.item() == pytest.approx(LAM * sum(abs(v) for v in x[:4]) / N, rel=1e-9)
    (grad,) = torch.autograd.grad(loss, logp)
    sign = [math.copysign(1.0, v) if v != 0 else 0.0 for v in x[:4]] + [0.0]
    torch.testing.assert_close(grad, torch.tensor([sign], dtype=torch.float64) * LAM / N)
    torch.testing.assert_close(adv_out, adv)


def test_advantage_form_shapes_by_lambda_times_d():
    logp, rollout_logp, adv = _inputs()
    cons = [ConstraintConfig(measure="abs_prob_diff", tolerance=C), ConstraintConfig(measure="kl_k1", tolerance=0.0)]
    lam = torch.tensor([0.5, 2.0], dtype=torch.float64)
    loss, adv_out, metrics = PENALTIES["advantage"](logp, rollout_logp, adv, MASK, lam, cons, N)
    assert loss.item() == 0.0 and not loss.requires_grad
    assert not adv_out.requires_grad  # d_t is detached: the shaping is a cost, not a gradient path
    d1 = [abs(p - m) for p, m in zip(PI, MU)]
    d2 = [math.log(m / p) for p, m in zip(PI, MU)]
    expected = [a - 0.5 * x - 2.0 * y for a, x, y in zip([1.0, -1.0, 0.5, 2.0], d1, d2)] + [3.0]  # padding kept
    torch.testing.assert_close(adv_out, torch.tensor([expected], dtype=torch.float64))
    assert metrics["penalty/loss"] == 0.0
    # d2 > 0 (mu > pi) on token 2 only among the valid tokens (token 4 is padding)
    assert metrics["dual/outside_frac/kl_k1"] == pytest.approx(1 / 4)
    assert metrics["dual/outside_frac/abs_prob_diff"] == pytest.approx(2 / 4)


def test_normalizer_makes_micro_batches_add_up():
    torch.manual_seed(0)
    logp_full = (torch.rand(4, 6, dtype=torch.float64) * 0.9 + 0.05).log().requires_grad_(True)
    rollout = (logp_full.detach() + 0.3 * torch.randn(4, 6, dtype=torch.float64)).clamp(max=0)
    mask = torch.rand(4, 6) < 0.7
    adv = torch.randn(4, 6, dtype=torch.float64)
    cons = [ConstraintConfig(measure="kl_k3", tolerance=0.02)]
    n_global = mask.sum()
    for form in ("hinge", "mean"):
        full, _, _ = PENALTIES[form](logp_full, rollout, adv, mask, [1.5], cons, n_global)
        (g_full,) = torch.autograd.grad(full, logp_full)
        parts = [PENALTIES[form](logp_full[i:i + 2], rollout[i:i + 2], adv[i:i + 2], mask[i:i + 2], [1.5], cons,
                                 n_global)[0] for i in (0, 2)]
        (g_parts,) = torch.autograd.grad(sum(parts), logp_full)
        assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)
        torch.testing.assert_close(g_parts, g_full)
        # the loss is a sum over tokens divided by the normalizer
        half, _, _ = PENALTIES[form](logp_full, rollout, adv, mask, [1.5], cons, 2 * n_global)
        assert half.item() == pytest.approx(full.item() / 2, rel=1e-12)
    # no valid token at all: the normalizer is taken as 1 and the loss is 0, not NaN
    empty, _, _ = PENALTIES["hinge"](logp_full, rollout, adv, torch.zeros_like(mask), [1.5], cons, 0)
    assert empty.item() == 0.0


def test_garbage_in_padding_never_reaches_loss_or_gradient():
    logp, rollout_logp, adv = _inputs()
    logp_bad = logp.detach().clone()
    logp_bad[0, 4] = -float("inf")
    logp_bad.requires_grad_(True)
    rollout_bad = rollout_logp.clone()
    rollout_bad[0, 4] = float("nan")
    for measure in ("abs_prob_diff", "kl_k3", "chi2", "kl_k1", "abs_log_ratio"):
        cons = [ConstraintConfig(measure=measure, tolerance=0.0)]
        ref, _, _ = PENALTIES["hinge"](logp, rollout_logp, adv, MASK, [1.0], cons, N)
        loss, adv_out, _ = PENALTIES["hinge"](logp_bad, rollout_bad, adv, MASK, [1.0], cons, N)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12), measure
        (grad,) = torch.autograd.grad(loss, logp_bad)
        assert torch.isfinite(grad).all() and grad[0, 4] == 0, measure


def test_two_constraints_add_up_and_names_get_suffixes():
    logp, rollout_logp, adv = _inputs()
    cons = [ConstraintConfig(measure="abs_prob_diff", tolerance=C), ConstraintConfig(measure="abs_prob_diff",
                                                                                     tolerance=0.0)]
    loss, _, metrics = PENALTIES["hinge"](logp, rollout_logp, adv, MASK, [LAM, 1.0], cons, N)
    # second constraint: relu(|pi - mu| - 0) = [0.02, 0.1, 0.1, 0] -> 0.22 / N
    assert loss.item() == pytest.approx(0.005 + 0.22 / N, rel=1e-9)
    assert metrics["dual/outside_frac/abs_prob_diff_1"] == pytest.approx(0.5)
    assert metrics["dual/outside_frac/abs_prob_diff_2"] == pytest.approx(0.75)
    assert constraint_names([ConstraintConfig(measure="kl_k3"), ConstraintConfig(measure="abs_prob_diff"),
                             ConstraintConfig(measure="kl_k3")]) == ["kl_k3_1", "abs_prob_diff", "kl_k3_2"]
    assert constraint_names([ConstraintConfig(measure="abs_prob_diff"), ConstraintConfig(quantile=0.9),
                             ConstraintConfig(quantile=0.99)]) == ["abs_prob_diff", "abs_prob_diff_p90",
                                                                   "abs_prob_diff_p99"]
    with pytest.raises(ValueError, match="multipliers"):
        PENALTIES["hinge"](logp, rollout_logp, adv, MASK, [LAM], cons, N)


@pytest.mark.parametrize("form", ["hinge", "mean", "advantage"])
def test_routing_mismatch_acts_through_advantages_under_every_form(form):
    logp, rollout_logp, adv = _inputs()
    mismatch = torch.tensor([[0.0, 0.5, 0.25, 1.0, 1.0]])
    cons = [ConstraintConfig(measure="routing_mismatch", tolerance=0.3)]
    loss, adv_out, metrics = PENALTIES[form](logp, rollout_logp, adv, MASK, [2.0], cons, N,
                                             routing_mismatch_BT=mismatch)
    assert loss.item() == 0.0
    expected = torch.tensor([[1.0, -2.0, 0.0, 0.0, 3.0]], dtype=torch.float64)  # A - 2 m on valid tokens
    torch.testing.assert_close(adv_out, expected)
    assert metrics["dual/outside_frac/routing_mismatch"] == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="routing_mismatch_BT"):
        PENALTIES[form](logp, rollout_logp, adv, MASK, [2.0], cons, N)


@pytest.mark.parametrize("measure", ["seq_log_ratio", "extreme_rate", "ess"])
def test_measures_without_token_form_are_rejected(measure):
    logp, rollout_logp, adv = _inputs()
    cons = [ConstraintConfig(measure=measure, tolerance=0.1)]
    with pytest.raises(ValueError, match="no per-token form"):
        PENALTIES["hinge"](logp, rollout_logp, adv, MASK, [1.0], cons, N)
    with pytest.raises(ValueError, match="abs_log_ratio"):
        check_penalty_constraints(cons)
