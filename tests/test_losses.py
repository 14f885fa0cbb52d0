"""Policy losses and IS modes against float64 per-token loop references and hand-computed values.

Tolerances: float64 inputs are compared at rtol 1e-12 / atol 1e-12 (same arithmetic, different order);
float32 runs at rtol 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainers.config import AlgoConfig, Band, CapConfig, ClipConfig, RejectConfig, SeqMaskConfig, VetoConfig
from trainers.losses import IS_MODES, LOG_RATIO_MAX, POLICY_LOSSES

torch.set_num_threads(1)
TOL = dict(rtol=1e-12, atol=1e-12)
NAN, INF = float("nan"), float("inf")

# Three sequences of lengths 4, 2, 3 (right padded to T = 4). log r = logp - old_logp per valid token,
# chosen with eps_low = 0.2, eps_high = 0.28 so that both clip bounds are hit with both advantage signs:
#   seq 0, A = +1.0: log r = [0, 0.5, -0.5, 0.1] -> r = e^0.5 = 1.6487 > 1.28 clipped high (t1); r = 0.607 with
#                    A > 0 is NOT clipped (min picks r A)
#   seq 1, A = -2.0: log r = [-0.5, 0.5]         -> r = 0.607 < 0.8 clipped low (t0); r = 1.649 with A < 0 is NOT
#                    clipped (min(-3.30, -2.56) = -3.30, the unclipped branch)
#   seq 2, A = +0.5: log r = [0.2, 0.3, -0.1]    -> r = 1.2214 inside; r = 1.3499 clipped high (t1)
LOG_R = [[0.0, 0.5, -0.5, 0.1], [-0.5, 0.5, 0.0, 0.0], [0.2, 0.3, -0.1, 0.0]]
LENGTHS = [4, 2, 3]
ADV = [1.0, -2.0, 0.5]
WEIGHTS = [[1.0, 0.5, 2.0, 1.5], [0.8, 1.2, 0.0, 0.0], [1.0, 3.0, 0.7, 0.0]]
OLD = [[-1.0, -2.0, -0.3, -1.7], [-0.9, -2.5, 0.0, 0.0], [-1.1, -0.6, -3.0, 0.0]]
CLIPPED_HIGH = {(0, 1), (2, 1)}
CLIPPED_LOW = {(1, 0)}


def _batch(dtype=torch.float64, garbage: bool = True):
    """(logp_BT requiring grad, old_logp_BT, advantages_BT, weights_BT, mask_BT); padding holds -inf / NaN."""
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = True
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = old + torch.tensor(LOG_R, dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None].expand(3, 4).clone()
    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    if garbage:
        logp = torch.where(mask, logp, torch.tensor(-INF, dtype=torch.float64))
        old = torch.where(mask, old, torch.tensor(NAN, dtype=torch.float64))
        w = torch.where(mask, w, torch.tensor(NAN, dtype=torch.float64))
    return logp.to(dtype).requires_grad_(True), old.to(dtype), adv.to(dtype), w.to(dtype), mask


def _cfg(**kw) -> AlgoConfig:
    return AlgoConfig(**{"ppo_clip": ClipConfig(low=0.2, high=0.28), "minirl": ClipConfig(low=0.2, high=0.28), **kw})


def _valid():
    return [(b, t) for b, n in enumerate(LENGTHS) for t in range(n)]


# ------------------------------------------------------------------------------------------------ ppo_clip


def _ppo_reference(cfg: AlgoConfig, normalizer: float):
    """Per-token float64 loop: value and d loss / d logp (hand-derived: -w A r / N unless clip active)."""
    value, grad = 0.0, {}
    for b, t in _valid():
        r, a, w = math.exp(LOG_R[b][t]), ADV[b], WEIGHTS[b][t]
        clipped = min(max(r, 1 - cfg.ppo_clip.low), 1 + cfg.ppo_clip.high)
        value += -w * min(r * a, clipped * a)
        active = (a > 0 and r > 1 + cfg.ppo_clip.high) or (a < 0 and r < 1 - cfg.ppo_clip.low)
        grad[b, t] = 0.0 if active else -w * a * r / normalizer
    return value / normalizer, grad


def test_ppo_clip_matches_loop_reference_value_and_gradient():
    cfg, N = _cfg(), 11.0
    logp, old, adv, w, mask = _batch()
    loss, m = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, mask, cfg, N)
    ref_value, ref_grad = _ppo_reference(cfg, N)
    torch.testing.assert_close(loss, torch.tensor(ref_value, dtype=torch.float64), **TOL)
    loss.backward()
    for (b, t), g in ref_grad.items():
        assert logp.grad[b, t].item() == pytest.approx(g, rel=1e-12, abs=1e-15), (b, t)
    assert torch.all(logp.grad[~mask] == 0)  # padding holds -inf / NaN and gets an exact zero gradient
    # clip at both bounds: 2 high (A > 0), 1 low (A < 0) out of 9 valid tokens
    assert m["clip/frac_high"] == pytest.approx(2 / 9)
    assert m["clip/frac_low"] == pytest.approx(1 / 9)
    assert m["clip/frac"] == pytest.approx(3 / 9)
    assert m["loss/policy"] == pytest.approx(ref_value, rel=1e-12)


def test_ppo_clip_hand_computed_single_tokens():
    # A = +1, r = e^0.5 = 1.6487 -> clip(r) = 1.28, min(1.6487, 1.28) = 1.28, w = 2 -> l = -2.56
    # A = -2, r = e^-0.5 = 0.6065 -> clip = 0.8: min(-1.2131, -1.6) = -1.6, w = 1 -> l = +1.6
    # A = -2, r = e^0.5: min(-3.2974, -2.56) = -3.2974 (unclipped branch), w = 1 -> l = +3.2974
    cfg = _cfg()
    old = torch.zeros(3, 1, dtype=torch.float64)
    logp = torch.tensor([[0.5], [-0.5], [0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-2.0], [-2.0]], dtype=torch.float64)
    w = torch.tensor([[2.0], [1.0], [1.0]], dtype=torch.float64)
    mask = torch.ones(3, 1, dtype=torch.bool)
    for i, expected in enumerate([-2.56, 1.6, 2 * math.exp(0.5)]):
        loss, _ = POLICY_LOSSES["ppo_clip"](logp[i:i + 1], old[i:i + 1], adv[i:i + 1], w[i:i + 1], mask[i:i + 1],
                                           cfg, 1.0)
        assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_ppo_clip_metrics_kl_and_ratio_mean():
    cfg = _cfg()
    logp, old, adv, w, mask = _batch()
    _, m = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, mask, cfg, 9.0)
    rs = [math.exp(LOG_R[b][t]) for b, t in _valid()]
    k3 = [r - 1 - math.log(r) for r in rs]
    assert m["policy/approx_kl"] == pytest.approx(sum(k3) / 9, rel=1e-12)
    assert m["policy/ratio_mean"] == pytest.approx(sum(rs) / 9, rel=1e-12)
    assert all("/" in k and " " not in k for k in m)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_loss_is_sum_over_tokens_divided_by_global_normalizer(name):
    """Two micro-batches with the global normalizer add up to the full batch (gradient accumulation)."""
    cfg = _cfg()
    logp, old, adv, w, mask = _batch()
    full, _ = POLICY_LOSSES[name](logp, old, adv, w, mask, cfg, 9.0)
    parts = [POLICY_LOSSES[name](logp[s], old[s], adv[s], w[s], mask[s], cfg, 9.0)[0] for s in (slice(0, 1), slice(1, 3))]
    torch.testing.assert_close(full, parts[0] + parts[1], **TOL)
    half, _ = POLICY_LOSSES[name](logp, old, adv, w, mask, cfg, 18.0)
    torch.testing.assert_close(half, full / 2, **TOL)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_loss_float32_matches_float64(name):
    cfg = _cfg()
    l64, _ = POLICY_LOSSES[name](*_batch(torch.float64), cfg, 9.0)
    l32, _ = POLICY_LOSSES[name](*_batch(torch.float32), cfg, 9.0)
    assert l32.dtype == torch.float32 and torch.isfinite(l32)
    assert l32.item() == pytest.approx(l64.item(), rel=1e-6)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_empty_mask_gives_zero_loss_and_finite_metrics(name):
    logp, old, adv, w, mask = _batch()
    loss, m = POLICY_LOSSES[name](logp, old, adv, w, torch.zeros_like(mask), _cfg(), 0)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(logp.grad == 0)
    assert all(math.isfinite(v) for v in m.values())


def test_nonfinite_logp_on_valid_token_is_not_hidden():
    logp, old, adv, w, mask = _batch()
    with torch.no_grad():
        logp[0, 0] = NAN
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, mask, _cfg(), 9.0)
    assert not torch.isfinite(loss)


def test_huge_ratio_is_clamped_to_finite_values():
    """log r = 200 would overflow exp in float32; the clamp at LOG_RATIO_MAX keeps value and gradient finite."""
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-100.0, 0.0]])
    adv = torch.tensor([[-1.0, -1.0]])
    w, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    for name in POLICY_LOSSES:
        loss, m = POLICY_LOSSES[name](logp, old, adv, w, mask, _cfg(), 2.0)
        assert torch.isfinite(loss), name
        assert all(math.isfinite(v) for v in m.values()), name
    # without dual-clip, A = -1 and r = e^200 -> e^20 (clamped): l = (e^20 + 1) / 2
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, mask, _cfg(clip_ratio_c=None), 2.0)
    assert loss.item() == pytest.approx((math.exp(LOG_RATIO_MAX) + 1.0) / 2, rel=1e-6)
    # with dual-clip c = 3 the first token's surrogate is max(-e^20, 3 * -1) = -3: l = (3 + 1) / 2
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, mask, _cfg(clip_ratio_c=3.0), 2.0)
    assert loss.item() == pytest.approx(2.0, rel=1e-6)


# -------------------------------------------------------------------------------------------------- minirl


def test_minirl_matches_loop_reference_value_and_gradient():
    """l_t = -M_t sg(r_t w_t) A_t log pi_t; d/d logp_t = -M_t r_t w_t A_t / N (hand-derived)."""
    cfg, N = _cfg(), 10.0
    logp, old, adv, w, mask = _batch()
    loss, m = POLICY_LOSSES["minirl"](logp, old, adv, w, mask, cfg, N)
    value = 0.0
    for b, t in _valid():
        r, a = math.exp(LOG_R[b][t]), ADV[b]
        masked = (a > 0 and r > 1 + cfg.minirl.high) or (a < 0 and r < 1 - cfg.minirl.low)
        lp = OLD[b][t] + LOG_R[b][t]
        if not masked:
            value += -r * WEIGHTS[b][t] * a * lp
    assert loss.item() == pytest.approx(value / N, rel=1e-12)
    loss.backward()
    for b, t in _valid():
        r, a = math.exp(LOG_R[b][t]), ADV[b]
        expected = 0.0 if (b, t) in CLIPPED_HIGH | CLIPPED_LOW else -r * WEIGHTS[b][t] * a / N
        assert logp.grad[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15), (b, t)
    assert torch.all(logp.grad[~mask] == 0)
    assert m["clip/frac_high"] == pytest.approx(2 / 9) and m["clip/frac_low"] == pytest.approx(1 / 9)


def test_minirl_gradient_is_reinforce_at_ratio_one():
    """On-policy (pi_theta = pi_old): grad = -w A grad log pi on every valid token, through a real module."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 5).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    tokens = torch.randint(0, 5, (2, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[0.7] * 4, [-1.3] * 4], dtype=torch.float64)
    w = torch.tensor([[1.0, 2.0, 0.5, 9.0], [1.5, 0.25, 9.0, 9.0]], dtype=torch.float64)

    def logp_fn():
        return torch.log_softmax(lin(x), -1).gather(-1, tokens[..., None])[..., 0]

    old = logp_fn().detach()
    loss, m = POLICY_LOSSES["minirl"](logp_fn(), old, adv, w, mask, _cfg(), 5.0)
    grads = torch.autograd.grad(loss, list(lin.parameters()))
    reinforce = -(torch.where(mask, w * adv * logp_fn(), 0.0)).sum() / 5.0
    ref = torch.autograd.grad(reinforce, list(lin.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, **TOL)
    assert m["clip/frac"] == 0.0 and m["policy/approx_kl"] == 0.0 and m["policy/ratio_mean"] == 1.0
    # ppo_clip has the same gradient at r = 1
    loss_ppo, _ = POLICY_LOSSES["ppo_clip"](logp_fn(), old, adv, w, mask, _cfg(), 5.0)
    for g, r in zip(torch.autograd.grad(loss_ppo, list(lin.parameters())), ref):
        torch.testing.assert_close(g, r, **TOL)


# ---------------------------------------------------------------------------------------------------- gspo


def test_gspo_matches_sequence_level_objective_with_constant_advantage_and_weight():
    """With A and w constant per sequence, GSPO-token's gradient equals that of the sequence objective
    -(1/N) sum_i n_i w_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (logp - old)), written independently."""
    cfg = AlgoConfig(gspo=ClipConfig(low=0.05, high=0.06))
    logp, old, adv, _, mask = _batch()
    w_seq = torch.tensor([1.5, 0.7, 2.0], dtype=torch.float64)
    w = torch.where(mask, w_seq[:, None].expand(3, 4), NAN)
    loss, m = POLICY_LOSSES["gspo"](logp, old, adv, w, mask, cfg, 9.0)
    loss.backward()

    logp_ref = torch.tensor(OLD, dtype=torch.float64) + torch.tensor(LOG_R, dtype=torch.float64)
    logp_ref.requires_grad_(True)
    total = 0.0
    for b, n in enumerate(LENGTHS):
        s = torch.exp((logp_ref[b, :n] - torch.tensor(OLD[b][:n], dtype=torch.float64)).mean())
        a = ADV[b]
        total = total - n * w_seq[b] * torch.minimum(s * a, s.clamp(1 - cfg.gspo.low, 1 + cfg.gspo.high) * a)
    ref = total / 9.0
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(logp.grad[mask], logp_ref.grad[mask], **TOL)
    # hand check of the sequence ratios: mean log r = 0.025 (seq 0), 0 (seq 1), 0.4/3 (seq 2); with
    # eps = (0.05, 0.06): seq 2 has s = e^0.1333 = 1.1426 > 1.06 and A > 0 -> clipped (3 tokens of 9)
    assert m["clip/frac_high"] == pytest.approx(3 / 9) and m["clip/frac_low"] == 0.0
    assert torch.all(logp.grad[2] == 0)
    s = [math.exp(0.025), 1.0, math.exp(0.4 / 3)]
    assert m["policy/ratio_mean"] == pytest.approx((4 * s[0] + 2 * s[1] + 3 * s[2]) / 9, rel=1e-12)


def test_gspo_token_gradient_with_per_token_advantages():
    """GSPO-token: d loss / d logp_u = -w_u A_u s_i / N where the sequence is not clipped for A_u's sign."""
    cfg = AlgoConfig()
    assert (cfg.gspo.low, cfg.gspo.high) == (3e-4, 4e-4)  # gspo's defaults: the GSPO paper's range
    old = torch.zeros(2, 3, dtype=torch.float64)
    # seq 0: mean log r = 1e-3 -> s = 1.001 > 1.0004: clipped for A > 0 tokens, not for A < 0 tokens
    # seq 1: mean log r = -1e-3 -> s = 0.999 < 0.9997: clipped for A < 0 tokens, not for A > 0 tokens
    logp = torch.tensor([[0.0, 2e-3, 1e-3], [-2e-3, 0.0, -1e-3]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0], [-0.5, 3.0, -1.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.5, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, m = POLICY_LOSSES["gspo"](logp, old, adv, w, mask, cfg, 6.0)
    loss.backward()
    s = [math.exp(1e-3), math.exp(-1e-3)]
    expected = [[0.0, -2.0 * -1.0 * s[0] / 6, 0.0], [0.0, -0.5 * 3.0 * s[1] / 6, 0.0]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected, dtype=torch.float64), **TOL)
    assert m["clip/frac_high"] == pytest.approx(2 / 6) and m["clip/frac_low"] == pytest.approx(2 / 6)
    # value: clipped tokens contribute -w clip(s) A, unclipped -w s A
    value = (-(1.0 * 1.0004 * 1.0) - 2.0 * s[0] * -1.0 - 0.5 * 1.0004 * 2.0
             - 1.5 * 0.9997 * -0.5 - 0.5 * s[1] * 3.0 - 1.0 * 0.9997 * -1.0) / 6
    assert loss.item() == pytest.approx(value, rel=1e-12)


# ------------------------------------------------------------------------------------------------ IS modes


def _is_inputs(rhos: list[list[float]], dtype=torch.float64):
    """old_logp = log rho, rollout_logp = 0 on valid tokens; padding (rho None) holds NaN / -inf garbage."""
    T = max(map(len, rhos))
    old = torch.full((len(rhos), T), NAN, dtype=torch.float64)
    roll = torch.full((len(rhos), T), -INF, dtype=torch.float64)
    mask = torch.zeros(len(rhos), T, dtype=torch.bool)
    for b, row in enumerate(rhos):
        for t, rho in enumerate(row):
            old[b, t], roll[b, t], mask[b, t] = math.log(rho), 0.0, True
    return old.to(dtype), roll.to(dtype), mask


def test_is_none():
    old, roll, mask = _is_inputs([[0.5, 2.0], [8.0]])
    w, kept, m = IS_MODES["none"](old, roll, mask, AlgoConfig())
    torch.testing.assert_close(w, mask.double(), **TOL)
    assert torch.equal(kept, mask)
    assert m["is/weight_max_raw"] == pytest.approx(8.0) and m["is/weight_min_raw"] == pytest.approx(0.5)
    assert m["is/truncated_frac"] == 0.0 and m["is/masked_frac"] == 0.0 and m["is/nonfinite_tokens"] == 0.0


def test_is_tis_truncates_at_cap():
    old, roll, mask = _is_inputs([[0.5, 2.0, 8.0], [6.0]])
    w, kept, m = IS_MODES["tis"](old, roll, mask, AlgoConfig(tis=CapConfig(cap=5.0)))
    # min(rho, 5): [0.5, 2, 5], [5]; two of four tokens truncated
    torch.testing.assert_close(w, torch.tensor([[0.5, 2.0, 5.0], [5.0, 0.0, 0.0]], dtype=torch.float64), **TOL)
    assert torch.equal(kept, mask)
    assert m["is/weight_max_raw"] == pytest.approx(8.0, rel=1e-12)
    assert m["is/weight_max"] == pytest.approx(5.0, rel=1e-12)
    assert m["is/weight_mean"] == pytest.approx((0.5 + 2 + 5 + 5) / 4, rel=1e-12)
    assert m["is/truncated_frac"] == pytest.approx(2 / 4)
    assert m["is/masked_frac"] == 0.0


def test_is_icepop_keeps_band_only():
    old, roll, mask = _is_inputs([[0.4, 0.5, 3.0, 6.0], [5.0, 0.7]])
    w, kept, m = IS_MODES["icepop"](old, roll, mask, AlgoConfig(icepop=Band(low=0.5, high=5.0)))
    # band [0.5, 5] inclusive: 0.4 and 6 dropped; kept weights are rho itself
    assert kept.tolist() == [[False, True, True, False], [True, True, False, False]]
    torch.testing.assert_close(w, torch.tensor([[0, 0.5, 3.0, 0], [5.0, 0.7, 0, 0]], dtype=torch.float64), **TOL)
    assert m["is/masked_frac"] == pytest.approx(2 / 6)
    assert m["is/weight_max_raw"] == pytest.approx(6.0) and m["is/weight_max"] == pytest.approx(5.0)
    assert m["is/weight_mean"] == pytest.approx((0.5 + 3 + 5 + 0.7) / 4)


def test_is_seq_tis_product_then_cap():
    old, roll, mask = _is_inputs([[2.0, 2.0, 2.0], [0.5, 3.0], [0.9]])
    w, kept, m = IS_MODES["seq_tis"](old, roll, mask, AlgoConfig(seq_tis=CapConfig(cap=5.0)))
    # products: 8 -> capped at 5; 1.5; 0.9
    expected = torch.tensor([[5.0, 5.0, 5.0], [1.5, 1.5, 0.0], [0.9, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, **TOL)
    assert torch.equal(kept, mask)
    assert m["is/weight_max_raw"] == pytest.approx(8.0, rel=1e-12)
    assert m["is/truncated_frac"] == pytest.approx(3 / 6)


def test_geo_seq_mask_drops_sequences_by_geometric_mean():
    """What seq_mis was: is_mode=none + seq_mask geo, w = 1 on the kept sequences."""
    old, roll, mask = _is_inputs([[1.2, 0.9], [1.5, 1.0], [0.8], [1.0, 1.0, 1.0]])
    cfg = AlgoConfig(seq_mask=SeqMaskConfig(mode="geo", geo=Band(low=0.9, high=1.1)))
    w, kept, m = IS_MODES["none"](old, roll, mask, cfg)
    # geometric means: sqrt(1.08) = 1.0392 keep; sqrt(1.5) = 1.2247 drop; 0.8 drop; 1.0 keep
    assert kept.tolist() == [[True, True, False], [False, False, False], [False, False, False], [True, True, True]]
    torch.testing.assert_close(w, kept.double(), **TOL)
    assert m["is/masked_frac"] == pytest.approx(3 / 8) and m["is/seq_masked_frac"] == pytest.approx(3 / 8)
    assert m["is/mode_masked_frac"] == 0.0 and m["is/vetoed_frac"] == 0.0 and m["is/rejected_frac"] == 0.0
    # raw weights are is_mode=none's per-token rho: max 1.5, min 0.8
    assert m["is/weight_max_raw"] == pytest.approx(1.5, rel=1e-12)
    assert m["is/weight_min_raw"] == pytest.approx(0.8, rel=1e-12)


def test_is_weights_follow_input_dtype_and_are_detached():
    old, roll, mask = _is_inputs([[0.5, 2.0]], torch.float32)
    old.requires_grad_(True)
    for name, fn in IS_MODES.items():
        w, kept, _ = fn(old, roll, mask, AlgoConfig())
        assert w.dtype == torch.float32 and not w.requires_grad and kept.dtype == torch.bool, name


@pytest.mark.parametrize("name", sorted(IS_MODES))
def test_is_nonfinite_tokens_are_masked_and_counted(name):
    old, roll, mask = _is_inputs([[1.1, 0.9, 1.0], [1.0, 1.05], [0.95]])
    roll[0, 1] = -INF  # log rho = +inf on a valid token
    old[1, 0] = NAN    # log rho = NaN on a valid token
    cfg = AlgoConfig(icepop=Band(low=0.5, high=2.0))
    w, kept, m = IS_MODES[name](old, roll, mask, cfg)
    assert torch.isfinite(w).all()
    assert m["is/nonfinite_tokens"] == 2.0  # padding garbage is not counted
    assert not kept[0, 1] and not kept[1, 0]
    assert all(math.isfinite(v) for v in m.values())
    if name.startswith("seq"):
        # the sequence ratio of a sequence with a broken token is undefined: the whole sequence goes
        assert not kept[0].any() and not kept[1].any() and kept[2, 0]
    else:
        assert kept[0, 0] and kept[0, 2] and kept[1, 1] and kept[2, 0]
    assert m["is/masked_frac"] == pytest.approx(1 - int(kept.sum()) / 6)


def test_is_empty_batch_reports_zeros():
    old, roll, mask = _is_inputs([[1.0, 1.0]])
    for name, fn in IS_MODES.items():
        w, kept, m = fn(old, roll, torch.zeros_like(mask), AlgoConfig())
        assert not kept.any() and torch.all(w == 0), name
        assert all(v == 0.0 for v in m.values()), name


def test_is_weights_feed_the_loss_end_to_end():
    """tis weights from real engine-like log-probs, then ppo_clip: gradient = -min(rho, C) A r / N."""
    old, roll, mask = _is_inputs([[0.5, 7.0], [1.2]])
    w, kept, _ = IS_MODES["tis"](old, roll, mask, AlgoConfig(tis=CapConfig(cap=5.0)))
    logp = torch.where(mask, old, 0.0).clone().requires_grad_(True)  # r = 1
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, kept, _cfg(), 3.0)
    loss.backward()
    expected = torch.tensor([[-0.5 / 3, -5.0 / 3], [1.2 / 3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, **TOL)


def test_registries_are_the_config_names():
    """Every registered IS mode and policy loss is a valid config value; a name outside the registry is refused
    with the registry's names (the config reads the registries, so a new entry needs no list updated)."""
    from dcmdp.config import ConfigError, load_config

    for key, registry in (("algo.is_mode", IS_MODES), ("algo.loss", POLICY_LOSSES)):
        for name in registry:
            assert load_config(None, [f"{key}={name}"]).algo.__dict__[key.split(".")[1]] == name
        with pytest.raises(ConfigError, match=rf"'{key}': unknown 'made_up'"):
            load_config(None, [f"{key}=made_up"])


# ----------------------------------------------------------------------------------------------- dual-clip

# Four tokens, N = 4: (A, r, w) = (-1, 4, 1), (-1, 2, 1.5), (-1, 0.5, 2), (+1, 4, 0.5); eps 0.2 / 0.28, c = 3.
DC_ADV, DC_R, DC_W = [-1.0, -1.0, -1.0, 1.0], [4.0, 2.0, 0.5, 4.0], [1.0, 1.5, 2.0, 0.5]


def _dual_clip_batch():
    old = torch.full((1, 4), -2.0, dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([DC_R], dtype=torch.float64))).requires_grad_(True)
    adv = torch.tensor([DC_ADV], dtype=torch.float64)
    w = torch.tensor([DC_W], dtype=torch.float64)
    return logp, old, adv, w, torch.ones(1, 4, dtype=torch.bool)


def test_ppo_dual_clip_hand_computed():
    # s = min(r A, clip(r) A), then c A where A < 0 and r > c (= max(s, c A) in value); l = -w s:
    #   r = 4,   A = -1: min(-4, -1.28) = -4 -> max(-4, -3) = -3, l = 3 * 1 = 3, gradient 0 (dual-clip)
    #   r = 2,   A = -1: min(-2, -1.28) = -2 -> max(-2, -3) = -2, l = 2 * 1.5 = 3, d l / d logp = -w A r = 3
    #   r = 0.5, A = -1: min(-0.5, -0.8) = -0.8 (clip low) -> l = 0.8 * 2 = 1.6, gradient 0
    #   r = 4,   A = +1: min(4, 1.28) = 1.28 (clip high, no dual-clip for A > 0) -> l = -0.64, gradient 0
    # loss = (3 + 3 + 1.6 - 0.64) / 4 = 1.74; gradient / N = [0, 0.75, 0, 0]
    logp, old, adv, w, mask = _dual_clip_batch()
    loss, m = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, mask, _cfg(clip_ratio_c=3.0), 4.0)
    assert loss.item() == pytest.approx(1.74, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.75, 0.0, 0.0]], dtype=torch.float64), **TOL)
    assert m["clip/frac_dual"] == 0.25 and m["clip/frac_low"] == 0.25 and m["clip/frac_high"] == 0.25
    # without it the first token is l = -w r A = 4 with gradient 4: loss (4 + 3 + 1.6 - 0.64) / 4 = 1.99
    logp, old, adv, w, mask = _dual_clip_batch()
    loss, m = POLICY_LOSSES["ppo_clip"](logp, old, adv, w, mask, _cfg(clip_ratio_c=None), 4.0)
    assert loss.item() == pytest.approx(1.99, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, 0.75, 0.0, 0.0]], dtype=torch.float64), **TOL)
    assert m["clip/frac_dual"] == 0.0


def test_minirl_dual_clip_masks_the_same_tokens():
    # d l / d logp = -M r w A / N: M = 0 for r = 4 with A < 0 (dual-clip), r = 0.5 with A < 0 (clip low) and
    # r = 4 with A > 0 (clip high); the r = 2 token gives -2 * 1.5 * -1 / 4 = 0.75, as in ppo_clip
    logp, old, adv, w, mask = _dual_clip_batch()
    loss, m = POLICY_LOSSES["minirl"](logp, old, adv, w, mask, _cfg(clip_ratio_c=3.0), 4.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.75, 0.0, 0.0]], dtype=torch.float64), **TOL)
    assert m["clip/frac_dual"] == 0.25
    logp, old, adv, w, mask = _dual_clip_batch()
    loss, _ = POLICY_LOSSES["minirl"](logp, old, adv, w, mask, _cfg(clip_ratio_c=None), 4.0)
    loss.backward()
    # unbounded without it: -r w A / N = 4 * 1 / 4 = 1
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, 0.75, 0.0, 0.0]], dtype=torch.float64), **TOL)


def test_clips_are_inactive_at_their_bound_exactly():
    """At r == c (A < 0), r == 1 + eps_high (A > 0) and r == 1 - eps_low (A < 0) exactly, no clip is active: both
    losses take the whole gradient d l / d logp = -w A r / N (the float64 closed form), and clip/frac* count
    nothing. A max(s, c A) in ppo_clip would split the dual-clip tie in half."""
    old = torch.full((1, 3), -2.0, dtype=torch.float64)
    logp0 = old + torch.tensor([[math.log(3.0), math.log(1.28), math.log(0.8)]], dtype=torch.float64)
    # the bounds are set to the ratios the losses compute, so each tie holds bit for bit (v - 1 and 1 + (v - 1)
    # are exact for v in [0.5, 2], and 1 - (1 - v) = v likewise)
    r = torch.exp(logp0 - old)[0].tolist()
    cfg = AlgoConfig(ppo_clip=ClipConfig(low=1.0 - r[2], high=r[1] - 1.0),
                     minirl=ClipConfig(low=1.0 - r[2], high=r[1] - 1.0), clip_ratio_c=r[0])
    assert (r[0], 1.0 + cfg.ppo_clip.high, 1.0 - cfg.ppo_clip.low) == (cfg.clip_ratio_c, r[1], r[2])
    adv = torch.tensor([[-1.0, 0.5, -2.0]], dtype=torch.float64)
    w = torch.tensor([[1.5, 0.7, 1.2]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    # -w A r / N with N = 3: [1.5 * 3, -0.7 * 0.5 * 1.28, 1.2 * 2 * 0.8] / 3, each r the bound itself
    expected = torch.tensor([[-wi * ai * ri / 3.0 for wi, ai, ri in zip(w[0].tolist(), adv[0].tolist(), r)]],
                            dtype=torch.float64)
    for name in ("ppo_clip", "minirl"):
        logp = logp0.clone().requires_grad_(True)
        loss, m = POLICY_LOSSES[name](logp, old, adv, w, mask, cfg, 3.0)
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, expected, rtol=1e-15, atol=0, msg=lambda why: f"{name}: {why}")
        assert m["clip/frac"] == m["clip/frac_dual"] == 0.0, name


@pytest.mark.parametrize("c", [None, 1.5, 3.0])
def test_minirl_and_ppo_clip_gradients_agree_token_for_token(c):
    """minirl's mask is the set where ppo_clip's surrogate has a gradient, dual-clip included."""
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 4
    log_r = torch.randn(6, 9, generator=gen, dtype=torch.float64) * 0.8  # r from ~0.1 to ~10
    adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 9)
    w = torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(6, 9, generator=gen) < 0.8
    grads = []
    for name in ("ppo_clip", "minirl"):
        logp = (old + log_r).requires_grad_(True)
        loss, m = POLICY_LOSSES[name](logp, old, adv, w, mask, _cfg(clip_ratio_c=c), 40.0)
        (g,) = torch.autograd.grad(loss, logp)
        grads.append(g)
        r = log_r.exp()
        expected_dual = 0.0 if c is None else float((mask & (adv < 0) & (r > c)).sum()) / int(mask.sum())
        assert m["clip/frac_dual"] == pytest.approx(expected_dual)
    if c is not None:
        assert m["clip/frac_dual"] > 0  # the case is informative
    torch.testing.assert_close(grads[0], grads[1], **TOL)


# -------------------------------------------------------------------------------- composable IS rules


def test_veto_drops_sequences_with_a_catastrophic_token():
    # rho rows: [1, 1e-5, 1.2] has a token below 1e-4 -> the whole row goes; [0.9, 1.1] stays; [2e-4] stays
    old, roll, mask = _is_inputs([[1.0, 1e-5, 1.2], [0.9, 1.1], [2e-4]])
    w, kept, m = IS_MODES["tis"](old, roll, mask, AlgoConfig(veto=VetoConfig(threshold=1e-4)))
    assert kept.tolist() == [[False, False, False], [True, True, False], [True, False, False]]
    expected = torch.tensor([[0, 0, 0], [0.9, 1.1, 0], [2e-4, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, **TOL)
    assert m["is/vetoed_frac"] == pytest.approx(3 / 6) and m["is/masked_frac"] == pytest.approx(3 / 6)
    # pi_old = 0 on a valid token (log rho = -inf) is the worst token: its row is vetoed, not just the token
    old, roll, mask = _is_inputs([[1.0, 1.0], [1.0]])
    old[0, 1] = -INF
    _, kept, m = IS_MODES["tis"](old, roll, mask, AlgoConfig(veto=VetoConfig(threshold=1e-4)))
    assert kept.tolist() == [[False, False], [True, False]]
    assert m["is/vetoed_frac"] == pytest.approx(2 / 3) and m["is/nonfinite_tokens"] == 1.0
    # off by default: only the broken token goes
    _, kept, _ = IS_MODES["tis"](old, roll, mask, AlgoConfig())
    assert kept.tolist() == [[True, False], [True, False]]


def test_reject_on_a_per_token_divergence():
    # mu = 1 (rollout log-prob 0), pi_old = rho. kl_k3 = rho - 1 - log rho:
    #   rho = 1: 0; 2: 1 - ln 2 = 0.3069 > 0.1 reject; 0.5: -0.5 + ln 2 = 0.1931 > 0.1 reject; 1.3: 0.3 - ln 1.3 =
    #   0.0376 keep
    old, roll, mask = _is_inputs([[1.0, 2.0, 0.5], [1.3]])
    w, kept, m = IS_MODES["none"](old, roll, mask, AlgoConfig(reject=RejectConfig(measure="kl_k3", bound=0.1)))
    assert kept.tolist() == [[True, False, False], [True, False, False]]
    assert m["is/rejected_frac"] == pytest.approx(2 / 4) and m["is/seq_masked_frac"] == 0.0
    # abs_prob_diff = |rho - 1| here: 0, 1, 0.5, 0.3 against 0.25 -> only the first stays
    _, kept, m = IS_MODES["none"](old, roll, mask, AlgoConfig(reject=RejectConfig(measure="abs_prob_diff", bound=0.25)))
    assert kept.tolist() == [[True, False, False], [False, False, False]]
    # kl_k1 = -log rho is signed: only rho < e^-0.1 = 0.905 exceeds 0.1 (the 0.5 token)
    _, kept, _ = IS_MODES["none"](old, roll, mask, AlgoConfig(reject=RejectConfig(measure="kl_k1", bound=0.1)))
    assert kept.tolist() == [[True, True, False], [True, False, False]]


def test_prod_seq_mask_on_the_sequence_ratio():
    # prod rho: 2 * 1.5 = 3 > 2 drop; 0.9 * 0.8 = 0.72 keep; 1.0 keep; 0.3 * 1.5 = 0.45 < 0.5 drop
    old, roll, mask = _is_inputs([[2.0, 1.5], [0.9, 0.8], [1.0], [0.3, 1.5]])
    cfg = AlgoConfig(seq_mask=SeqMaskConfig(mode="prod"))  # default band [0.5, 2]
    w, kept, m = IS_MODES["tis"](old, roll, mask, cfg)
    assert kept.tolist() == [[False, False], [True, True], [True, False], [False, False]]
    torch.testing.assert_close(w, torch.tensor([[0, 0], [0.9, 0.8], [1.0, 0], [0, 0]], dtype=torch.float64), **TOL)
    assert m["is/seq_masked_frac"] == pytest.approx(4 / 7)


def test_token_tis_geo_mask_veto_and_reject_compose():
    """tis (C = 5) + geo mask [0.5, 2] + veto 1e-4 + reject kl_k3 > 1, by hand (10 valid tokens):

    row 0 [1, 6, 1]:        geo 6^(1/3) = 1.817 in band; k3(6) = 5 - ln 6 = 3.208 > 1 rejects t1 (which tis
                            truncated to 5); t0, t2 kept with w = 1
    row 1 [1.1, 0.95]:      geo 1.022, k3 0.0047 / 0.0013: kept, w = rho
    row 2 [1, 5e-5, 1]:     geo 0.037 < 0.5 (seq mask), 5e-5 < 1e-4 (veto), k3(5e-5) = 8.903 > 1 (reject t1)
    row 3 [2.5, 2]:         geo sqrt(5) = 2.236 > 2 (seq mask); k3 0.584 / 0.307 keep
    kept 4 of 10: weights 1, 1, 1.1, 0.95 -> mean 1.0125, max 1.1
    """
    old, roll, mask = _is_inputs([[1.0, 6.0, 1.0], [1.1, 0.95], [1.0, 5e-5, 1.0], [2.5, 2.0]])
    cfg = AlgoConfig(is_mode="tis", tis=CapConfig(cap=5.0), seq_mask=SeqMaskConfig(mode="geo", geo=Band(0.5, 2.0)),
                     veto=VetoConfig(threshold=1e-4), reject=RejectConfig(measure="kl_k3", bound=1.0))
    w, kept, m = IS_MODES[cfg.is_mode](old, roll, mask, cfg)
    assert kept.tolist() == [[True, False, True], [True, True, False], [False] * 3, [False] * 3]
    expected = torch.tensor([[1, 0, 1], [1.1, 0.95, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, **TOL)
    assert m["is/masked_frac"] == pytest.approx(6 / 10)
    assert m["is/seq_masked_frac"] == pytest.approx(5 / 10)
    assert m["is/vetoed_frac"] == pytest.approx(3 / 10)
    assert m["is/rejected_frac"] == pytest.approx(2 / 10)
    assert m["is/mode_masked_frac"] == 0.0
    assert m["is/truncated_frac"] == 0.0  # the one truncated token was rejected
    assert m["is/weight_mean"] == pytest.approx(4.05 / 4, rel=1e-12) and m["is/weight_max"] == pytest.approx(1.1)
    assert m["is/weight_max_raw"] == pytest.approx(6.0, rel=1e-12)


def test_seq_tis_with_prod_mask_and_icepop_with_veto():
    # seq_tis C = 5 + prod band [0.5, 2]: products 3 (drop), 1.5 (w = 1.5), 0.4 (drop)
    old, roll, mask = _is_inputs([[2.0, 1.5], [1.5], [0.5, 0.8]])
    cfg = AlgoConfig(is_mode="seq_tis", seq_mask=SeqMaskConfig(mode="prod"))
    w, kept, m = IS_MODES["seq_tis"](old, roll, mask, cfg)
    torch.testing.assert_close(w, torch.tensor([[0, 0], [1.5, 0], [0, 0]], dtype=torch.float64), **TOL)
    assert m["is/seq_masked_frac"] == pytest.approx(4 / 5)
    # icepop [0.5, 5] drops 0.4 and 6 itself (mode_masked); the veto at 1e-3 drops row 1 for its 1e-4 token
    old, roll, mask = _is_inputs([[0.4, 1.0, 6.0], [1.0, 1e-4]])
    w, kept, m = IS_MODES["icepop"](old, roll, mask, AlgoConfig(is_mode="icepop", veto=VetoConfig(threshold=1e-3)))
    assert kept.tolist() == [[False, True, False], [False, False, False]]
    assert m["is/mode_masked_frac"] == pytest.approx(3 / 5)  # 0.4, 6 and 1e-4 are outside the band
    assert m["is/vetoed_frac"] == pytest.approx(2 / 5) and m["is/masked_frac"] == pytest.approx(4 / 5)


def test_approx_kl_keeps_its_precision_for_ratios_near_one():
    # k3(x) = e^x - 1 - x = sum_{n >= 2} x^n / n!; at |x| <= 1e-3 twelve terms leave less than 1e-30 of the value,
    # so their fsum is the float64 reference. expm1(x) - x loses ~|log10 x| digits there (6e-9 relative at 1e-7).
    cfg = _cfg()
    for x in [1e-3, -1e-3, 3e-5, -3e-5, 1e-7, -1e-7]:
        logp = torch.tensor([[x]], dtype=torch.float64)
        ones = torch.ones_like(logp)
        _, m = POLICY_LOSSES["ppo_clip"](logp, torch.zeros_like(logp), ones, ones, ones.bool(), cfg, 1.0)
        assert m["policy/approx_kl"] == pytest.approx(math.fsum(x ** n / math.factorial(n) for n in range(2, 14)), rel=1e-13, abs=0), x
