"""Discrepancy measures vs float64 numpy closed forms; routing mismatch on hand-built routes; extreme inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from constraints.config import ConstraintConfig
from constraints.measures import (LOG_RATIO_MAX, MEASURES, discrepancy_metrics, measure_constraint, routing_mismatch,
                                  routing_mismatch_per_token)

torch.set_num_threads(1)

LENGTHS = [7, 3, 0, 5, 1, 7]  # row 2 has no valid token
B, T = len(LENGTHS), 7


def _batch(seed: int, dtype=torch.float32, spread: float = 0.7):
    """Random log-probs in [-8, 0) with rollout = train + noise; padding holds garbage (NaN / -inf)."""
    rng = np.random.default_rng(seed)
    train = np.log(rng.uniform(3e-4, 1.0, size=(B, T)))
    rollout = np.minimum(train + rng.normal(0, spread, size=(B, T)), 0.0)
    mask = np.arange(T)[None, :] < np.array(LENGTHS)[:, None]
    train_t = torch.tensor(train, dtype=dtype)
    rollout_t = torch.tensor(rollout, dtype=dtype)
    # the float64 reference sees exactly the values the measure sees (after rounding to `dtype`)
    train, rollout = train_t.double().numpy().copy(), rollout_t.double().numpy().copy()
    train_t[~torch.tensor(mask)] = float("nan")
    rollout_t[~torch.tensor(mask)] = -float("inf")
    return train_t, rollout_t, torch.tensor(mask), train, rollout, mask


def _reference(train: np.ndarray, rollout: np.ndarray, mask: np.ndarray, tau: float = 2.0) -> dict[str, float]:
    x = (train - rollout)[mask]
    rho = np.exp(x)
    seq = [abs((train[b] - rollout[b])[mask[b]].sum()) for b in range(train.shape[0]) if mask[b].any()]
    rows = [b for b in range(train.shape[0]) if mask[b].any()]
    mean_train = np.array([train[b][mask[b]].mean() for b in rows])
    mean_rollout = np.array([rollout[b][mask[b]].mean() for b in rows])
    log_prod = np.array([(train[b] - rollout[b])[mask[b]].sum() for b in rows])
    return {
        "training_ppl": np.mean(np.exp(-mean_train)),
        "rollout_ppl": np.mean(np.exp(-mean_rollout)),
        # verl's sign: mean log mu - mean log pi_old = log ppl_pi_old - log ppl_mu
        "log_ppl_diff": np.mean(mean_rollout - mean_train),
        "log_ppl_abs_diff": np.mean(np.abs(mean_train - mean_rollout)),
        "chi2_seq": np.mean((np.exp(log_prod) - 1) ** 2),
        "max_abs_log_ratio": np.max(np.abs(x)),
        "max_abs_prob_diff": np.max(np.abs(np.exp(train[mask]) - np.exp(rollout[mask]))),
        "abs_prob_diff": np.mean(np.abs(np.exp(train[mask]) - np.exp(rollout[mask]))),
        "kl_k1": np.mean(rollout[mask] - train[mask]),
        "kl_k3": np.mean(rho - 1 - x),
        "chi2": np.mean((rho - 1) ** 2),
        "abs_log_ratio": np.mean(np.abs(x)),
        "seq_log_ratio": np.mean(seq),
        "extreme_rate": np.mean(np.maximum(rho, 1 / rho) > tau),
        "ess": rho.sum() ** 2 / (len(rho) * (rho ** 2).sum()),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_measure_matches_float64_closed_form(seed, dtype):
    train_t, rollout_t, mask_t, train, rollout, mask = _batch(seed, dtype)
    ref = _reference(train, rollout, mask)
    for name, expected in ref.items():
        got = MEASURES[name].batch(train_t, rollout_t, mask_t)
        assert got.dtype == torch.float64 and got.dim() == 0
        assert got.item() == pytest.approx(expected, rel=1e-10, abs=1e-14), name


def test_extreme_rate_tau_and_float_mask():
    train_t, rollout_t, mask_t, train, rollout, mask = _batch(3, spread=2.0)
    for tau in (1.5, 2.0, 5.0):
        expected = _reference(train, rollout, mask, tau=tau)["extreme_rate"]
        assert 0 < expected < 1  # the case is informative
        assert MEASURES["extreme_rate"].batch(train_t, rollout_t, mask_t, tau=tau).item() == pytest.approx(expected)
    # a float 0/1 mask means the same as a boolean one
    got = MEASURES["kl_k3"].batch(train_t, rollout_t, mask_t.float()).item()
    assert got == pytest.approx(_reference(train, rollout, mask)["kl_k3"], rel=1e-10)


def test_token_forms_are_the_per_token_values():
    _, _, _, train, rollout, mask = _batch(4, torch.float64)
    a, b = torch.tensor(train), torch.tensor(rollout)
    x = train - rollout
    expected = {"abs_prob_diff": np.abs(np.exp(train) - np.exp(rollout)), "kl_k1": -x,
                "kl_k3": np.exp(x) - 1 - x, "chi2": np.expm1(x) ** 2, "abs_log_ratio": np.abs(x),
                "max_abs_prob_diff": np.abs(np.exp(train) - np.exp(rollout)), "max_abs_log_ratio": np.abs(x)}
    for name, ref in expected.items():
        np.testing.assert_allclose(MEASURES[name].token(a, b).numpy(), ref, rtol=1e-10, atol=1e-15, err_msg=name)
    assert {n for n, m in MEASURES.items() if m.token is not None} == set(expected)


def test_token_form_gradients_match_closed_forms():
    _, _, _, train, rollout, _ = _batch(9, torch.float64)
    x, rho = train - rollout, np.exp(train - rollout)
    expected = {"abs_prob_diff": np.sign(np.exp(train) - np.exp(rollout)) * np.exp(train), "kl_k1": -np.ones_like(x),
                "kl_k3": rho - 1, "chi2": 2 * (rho - 1) * rho, "abs_log_ratio": np.sign(x)}
    for name, ref in expected.items():
        a = torch.tensor(train, requires_grad=True)
        (grad,) = torch.autograd.grad(MEASURES[name].token(a, torch.tensor(rollout)).sum(), a)
        np.testing.assert_allclose(grad.numpy(), ref, rtol=1e-10, atol=1e-15, err_msg=name)


def test_empty_batch_and_all_masked_rows():
    train_t, rollout_t, mask_t, train, rollout, mask = _batch(5)
    none = torch.zeros_like(mask_t)
    for name in ("abs_prob_diff", "kl_k1", "kl_k3", "chi2", "abs_log_ratio", "seq_log_ratio", "extreme_rate",
                 "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff", "max_abs_log_ratio", "max_abs_prob_diff"):
        assert MEASURES[name].batch(train_t, rollout_t, none).item() == 0.0, name
    for name in ("ess", "training_ppl", "rollout_ppl"):
        assert MEASURES[name].batch(train_t, rollout_t, none).item() == 1.0, name
    # all-masked rows are ignored: dropping row 2 (no valid token) changes nothing
    keep = torch.tensor([0, 1, 3, 4, 5])
    for name in ("kl_k3", "seq_log_ratio", "ess", "training_ppl", "log_ppl_abs_diff", "chi2_seq", "max_abs_prob_diff"):
        full = MEASURES[name].batch(train_t, rollout_t, mask_t).item()
        dropped = MEASURES[name].batch(train_t[keep], rollout_t[keep], mask_t[keep]).item()
        assert full == pytest.approx(dropped, rel=1e-12), name


def test_seq_log_ratio_is_the_sum_not_the_geometric_mean():
    # one sequence of 4 tokens, each log rho = 0.1 -> |sum| = 0.4 (the geometric mean would give 0.1)
    train = torch.full((1, 4), -1.0, dtype=torch.float64)
    rollout = train - 0.1
    value = MEASURES["seq_log_ratio"].batch(train, rollout, torch.ones(1, 4, dtype=torch.bool))
    assert value.item() == pytest.approx(0.4, rel=1e-12)


def test_identical_engines_give_zero_discrepancy():
    train_t, _, mask_t, *_ = _batch(6)
    m = discrepancy_metrics(train_t, train_t.clone(), mask_t)
    assert m["discrepancy/training_ppl"] == m["discrepancy/rollout_ppl"] > 1  # the scale, not a discrepancy
    for key, value in m.items():
        if key in ("discrepancy/training_ppl", "discrepancy/rollout_ppl"):
            continue
        expected = 1.0 if key == "is/ess_frac" else 0.0
        assert value == expected, key


def test_discrepancy_metrics_keys_and_values():
    train_t, rollout_t, mask_t, train, rollout, mask = _batch(7)
    ref = _reference(train, rollout, mask)
    m = discrepancy_metrics(train_t, rollout_t, mask_t)
    # every measure of the registry at its metric key, routing_mismatch only with the engines' routes
    expected_keys = {MEASURES[n].metric_key for n in MEASURES if MEASURES[n].kind != "routing"}
    assert {"discrepancy/kl_k3", "discrepancy/extreme_rate_2", "is/ess_frac"} <= expected_keys
    assert set(m) == expected_keys
    for name in ("chi2_seq", "log_ppl_diff", "training_ppl", "max_abs_prob_diff"):
        assert m[f"discrepancy/{name}"] == pytest.approx(ref[name], rel=1e-10), name
    assert all(isinstance(v, float) for v in m.values())
    assert m["discrepancy/kl_k3"] == pytest.approx(ref["kl_k3"], rel=1e-10)
    assert m["discrepancy/extreme_rate_2"] == pytest.approx(ref["extreme_rate"])
    assert m["is/ess_frac"] == pytest.approx(ref["ess"], rel=1e-10)
    experts = torch.zeros(B, T + 2, 2, 2, dtype=torch.long)
    experts[..., 1] = 1
    other = experts.clone()
    other[0, 0, 0] = torch.tensor([1, 3])  # 1 of B*(T+2)*2 pairs differs
    m = discrepancy_metrics(train_t, rollout_t, mask_t, experts_train_BSLK=experts, experts_rollout_BSLK=other)
    assert m["routing/mismatch"] == pytest.approx(1 / (B * (T + 2) * 2))


# ---------------------------------------------------------------------------------------------- routing


def _hand_routes():
    # B=1, S=3, L=2, K=2
    train = torch.tensor([[[[1, 2], [0, 3]],      # pos 0: layer 0 same set, other order; layer 1 differs
                           [[5, 6], [1, 2]],      # pos 1: layer 0 same; layer 1 unrecorded on the rollout side
                           [[-1, -1], [-1, -1]]]])  # pos 2: never routed
    rollout = torch.tensor([[[[2, 1], [0, 4]],
                             [[5, 6], [-1, -1]],
                             [[-1, -1], [-1, -1]]]])
    return train, rollout


def test_routing_mismatch_on_hand_built_routes():
    train, rollout = _hand_routes()
    # valid pairs: (0, 0) same, (0, 1) differs, (1, 0) same -> 1/3
    assert routing_mismatch(train, rollout).item() == pytest.approx(1 / 3)
    assert routing_mismatch(train, rollout, torch.tensor([[False, True, True]])).item() == 0.0
    assert routing_mismatch(train, rollout, torch.tensor([[True, False, False]])).item() == pytest.approx(1 / 2)
    per_token = routing_mismatch_per_token(train, rollout)
    torch.testing.assert_close(per_token, torch.tensor([[0.5, 0.0, 0.0]]))
    # same sets in a different order are never a mismatch
    assert routing_mismatch(train, train.flip(-1)).item() == 0.0
    # nothing valid -> 0
    assert routing_mismatch(train[:, 2:], rollout[:, 2:]).item() == 0.0


def test_routing_mismatch_vs_python_sets():
    rng = np.random.default_rng(0)
    Bq, S, L, K, E = 3, 6, 4, 2, 5
    train = np.stack([[[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(S)] for _ in range(Bq)])
    rollout = train.copy()
    flip = rng.uniform(size=(Bq, S, L)) < 0.3
    for b, s, layer in zip(*np.nonzero(flip)):
        rollout[b, s, layer] = rng.choice(E, K, replace=False)
    rollout[0, 0] = -1
    mask = rng.uniform(size=(Bq, S)) < 0.8
    same, total = 0, 0
    for b in range(Bq):
        for s in range(S):
            for layer in range(L):
                if not mask[b, s] or (train[b, s, layer] < 0).any() or (rollout[b, s, layer] < 0).any():
                    continue
                total += 1
                same += set(train[b, s, layer]) == set(rollout[b, s, layer])
    got = routing_mismatch(torch.tensor(train), torch.tensor(rollout), torch.tensor(mask)).item()
    assert got == pytest.approx((total - same) / total)


# ---------------------------------------------------------------------------------------------- entry point


def test_measure_constraint_passes_tau_and_requires_routes():
    train_t, rollout_t, mask_t, train, rollout, mask = _batch(8, spread=2.0)
    got = measure_constraint(ConstraintConfig(measure="extreme_rate", tau=3.0), train_t, rollout_t, mask_t)
    assert got.item() == pytest.approx(_reference(train, rollout, mask, tau=3.0)["extreme_rate"])
    got = measure_constraint(ConstraintConfig(measure="kl_k3"), train_t, rollout_t, mask_t)
    assert got.item() == pytest.approx(_reference(train, rollout, mask)["kl_k3"], rel=1e-10)
    with pytest.raises(ValueError, match="routes"):
        measure_constraint(ConstraintConfig(measure="routing_mismatch"), train_t, rollout_t, mask_t)
    r_train, r_rollout = _hand_routes()
    got = measure_constraint(ConstraintConfig(measure="routing_mismatch"), train_t, rollout_t, mask_t,
                             experts_train_BSLK=r_train, experts_rollout_BSLK=r_rollout)
    assert got.item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="higher is better"):
        measure_constraint(ConstraintConfig(measure="ess"), train_t, rollout_t, mask_t)
    with pytest.raises(ValueError, match="unknown measure"):
        measure_constraint(ConstraintConfig(measure="kl"), train_t, rollout_t, mask_t)


# ---------------------------------------------------------------------------------------------- extreme inputs

logps = st.one_of(st.just(-1e4), st.just(0.0), st.floats(-1e4, 0.0, allow_nan=False, allow_infinity=False))


@settings(max_examples=150, deadline=None)
@given(train=st.lists(logps, min_size=1, max_size=6), rollout=st.lists(logps, min_size=6, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_extreme_log_probs_give_finite_values_and_gradients(train, rollout, dtype):
    n = len(train)
    a = torch.tensor([train], dtype=dtype, requires_grad=True)
    b = torch.tensor([rollout[:n]], dtype=dtype)
    mask = torch.ones(1, n, dtype=torch.bool)
    for name, m in MEASURES.items():
        if m.kind == "routing":
            continue
        value = m.batch(a, b, mask)
        assert torch.isfinite(value), name
        if m.token is not None:
            d = m.token(a, b)
            assert torch.isfinite(d).all(), name
            (grad,) = torch.autograd.grad(d.sum(), a)
            assert torch.isfinite(grad).all(), name
    assert MEASURES["kl_k3"].batch(a, b, mask) >= 0
    assert MEASURES["chi2"].batch(a, b, mask) >= 0
    assert 0 <= MEASURES["abs_prob_diff"].batch(a, b, mask) <= 1
    assert 0 < MEASURES["ess"].batch(a, b, mask) <= 1


@settings(max_examples=100, deadline=None)
@given(base=st.floats(-30.0, 0.0), delta=st.floats(1e-13, 1e-6), sign=st.sampled_from([-1.0, 1.0]))
def test_tiny_differences_keep_their_leading_order(base, delta, sign):
    """log rho = delta ~ 1e-12: kl_k3 ~ delta^2/2, chi2 ~ delta^2, abs_prob_diff ~ pi delta (relative 1e-5)."""
    a = torch.tensor([[base]], dtype=torch.float64)
    b = a - sign * delta
    x = (a - b).item()  # the difference after rounding of b
    mask = torch.ones(1, 1, dtype=torch.bool)
    assert MEASURES["kl_k3"].batch(a, b, mask).item() == pytest.approx(x * x / 2, rel=1e-5)
    assert MEASURES["chi2"].batch(a, b, mask).item() == pytest.approx(x * x, rel=1e-5)
    assert MEASURES["abs_prob_diff"].batch(a, b, mask).item() == pytest.approx(math.exp(base) * abs(x), rel=1e-5)
    assert MEASURES["kl_k3"].batch(a, b, mask).item() > 0


K3_ULPS = 2  # the largest error seen over 40,000 log-spaced |x| in [1e-12, 20], value and gradient alike


def test_k3_value_and_gradient_within_two_ulps_of_a_200_bit_reference():
    """k3(x) = e^x - 1 - x and its gradient e^x - 1 against mpmath at 200 bits, at every float64 x of a log-spaced
    grid of |x| from 1e-12 to 20, both signs, and at the series/expm1 switch |x| = 0.5 and its neighbours.
    Error in ulps of the reference (np.spacing of the true value). A series cut after x^5 misses by ~3e-11
    relative near |x| = 1e-2 (~1e5 ulps), expm1(x) - x by ~2 / |x| ulps below the switch."""
    mpmath = pytest.importorskip("mpmath")
    switch = [np.nextafter(0.5, 0.0), 0.5, np.nextafter(0.5, 1.0)]
    mags = np.concatenate([np.geomspace(1e-12, LOG_RATIO_MAX, 1500), [1e-2], switch])
    xs = np.concatenate([mags, -mags])
    with mpmath.workprec(200):
        ref = np.array([[float(mpmath.expm1(mpmath.mpf(v)) - mpmath.mpf(v)), float(mpmath.expm1(mpmath.mpf(v)))]
                        for v in xs])
    x = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    value = MEASURES["kl_k3"].token(x, torch.zeros_like(x))
    (grad,) = torch.autograd.grad(value.sum(), x)
    ulps_value = np.abs(value.detach().numpy() - ref[:, 0]) / np.spacing(np.abs(ref[:, 0]))
    ulps_grad = np.abs(grad.numpy() - ref[:, 1]) / np.spacing(np.abs(ref[:, 1]))
    assert ulps_value.max() <= K3_ULPS, xs[ulps_value.argmax()]
    assert ulps_grad.max() <= K3_ULPS, xs[ulps_grad.argmax()]


def test_linear_continuation_above_the_log_ratio_cap():
    X = LOG_RATIO_MAX
    x = torch.tensor([[X - 1.0, X, X + 5.0, 1e4]], dtype=torch.float64, requires_grad=True)
    zero = torch.zeros_like(x)
    k3 = MEASURES["kl_k3"].token(x, zero)
    expected_k3 = [math.expm1(X - 1) - (X - 1), math.expm1(X) - X, math.expm1(X) - X + math.expm1(X) * 5,
                   math.expm1(X) - X + math.expm1(X) * (1e4 - X)]
    np.testing.assert_allclose(k3.detach().numpy()[0], expected_k3, rtol=1e-12)
    (grad,) = torch.autograd.grad(k3.sum(), x)
    np.testing.assert_allclose(grad.numpy()[0], [math.expm1(X - 1)] + [math.expm1(X)] * 3, rtol=1e-12)
    chi2 = MEASURES["chi2"].token(x, zero)
    slope = 2 * math.expm1(X) * math.exp(X)
    assert chi2[0, 2].item() == pytest.approx(math.expm1(X) ** 2 + 5 * slope, rel=1e-12)
    # float32 stays finite well beyond the point where exp overflows (x > 88)
    x32 = torch.tensor([[200.0, 1e4]], dtype=torch.float32)
    assert torch.isfinite(MEASURES["chi2"].token(x32, torch.zeros_like(x32))).all()


# ---------------------------------------------------------------------------------------------- the panel


def _hand_panel_batch():
    # seq 0: log pi_old = [-1, -3], log mu = [-1.5, -2.7] -> log rho = [0.5, -0.3]
    # seq 1: log pi_old = [-2],     log mu = [-1.6]       -> log rho = [-0.4]
    train = torch.tensor([[-1.0, -3.0], [-2.0, float("nan")]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -2.7], [-1.6, -float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    return train, rollout, mask


def test_panel_measures_by_hand():
    train, rollout, mask = _hand_panel_batch()
    e = math.exp
    expected = {
        # per-sequence mean log pi_old: -2 and -2 -> E_seq exp(2) = e^2
        "training_ppl": e(2.0),
        # mean log mu: (-1.5 - 2.7) / 2 = -2.1 and -1.6 -> (e^2.1 + e^1.6) / 2 = (8.16617 + 4.95303) / 2
        "rollout_ppl": (e(2.1) + e(1.6)) / 2,
        # mean log mu - mean log pi_old per sequence: -2.1 - (-2) = -0.1 and -1.6 - (-2) = 0.4 -> (-0.1 + 0.4) / 2
        # = 0.15 (> 0: mu, with the lower perplexity, is the more confident engine on average)
        "log_ppl_diff": 0.15,
        # (|0.1| + |-0.4|) / 2 = 0.25
        "log_ppl_abs_diff": 0.25,
        # prod rho: e^0.2 and e^-0.4 -> ((e^0.2 - 1)^2 + (e^-0.4 - 1)^2) / 2 = (0.049019 + 0.108689) / 2
        "chi2_seq": ((e(0.2) - 1) ** 2 + (e(-0.4) - 1) ** 2) / 2,
        "max_abs_log_ratio": 0.5,
        # |e^-1 - e^-1.5| = 0.144749 > |e^-3 - e^-2.7| = 0.017419, |e^-2 - e^-1.6| = 0.066562
        "max_abs_prob_diff": e(-1.0) - e(-1.5),
    }
    for name, value in expected.items():
        assert MEASURES[name].batch(train, rollout, mask).item() == pytest.approx(value, rel=1e-12), name
    # log_ppl_diff weighs sequences equally; kl_k1 (same log mu - log pi_old) weighs tokens: (-0.5 + 0.3 + 0.4) / 3
    assert MEASURES["kl_k1"].batch(train, rollout, mask).item() == pytest.approx(0.2 / 3, rel=1e-12)
    # verl's definition: log ppl_pi_old - log ppl_mu per sequence, i.e. log(training_ppl / rollout_ppl) of one
    # sequence: log(e^2 / e^2.1) = -0.1 and log(e^2 / e^1.6) = 0.4
    per_seq = [math.log(e(2.0) / e(2.1)), math.log(e(2.0) / e(1.6))]
    assert MEASURES["log_ppl_diff"].batch(train, rollout, mask).item() == pytest.approx(sum(per_seq) / 2, rel=1e-12)


def test_chi2_seq_compounds_with_length_and_stays_finite():
    # 100 tokens of log rho = 0.01: token chi2 = (e^0.01 - 1)^2 = 1.005e-4, chi2_seq = (e^1 - 1)^2 = 2.9525
    train = torch.full((1, 100), -1.0, dtype=torch.float64)
    mask = torch.ones(1, 100, dtype=torch.bool)
    assert MEASURES["chi2"].batch(train, train - 0.01, mask).item() == pytest.approx(math.expm1(0.01) ** 2, rel=1e-12)
    assert MEASURES["chi2_seq"].batch(train, train - 0.01, mask).item() == pytest.approx(math.expm1(1.0) ** 2,
                                                                                         rel=1e-10)
    # prod rho = e^1000: continued linearly above e^20 like chi2 (finite in float32 too)
    big = MEASURES["chi2_seq"].batch(train.float(), (train - 10.0).float(), mask).item()
    slope = 2 * math.expm1(LOG_RATIO_MAX) * math.exp(LOG_RATIO_MAX)
    assert big == pytest.approx(math.expm1(LOG_RATIO_MAX) ** 2 + slope * (1000 - LOG_RATIO_MAX), rel=1e-6)


@pytest.mark.parametrize("log_rho", [-20.0, -30.0, -40.0, -700.0])
def test_token_forms_keep_relative_precision_far_below_one(log_rho):
    """pi_old << mu: d/d logp_train |pi_old - mu| = -pi_old and d/dx (e^x - 1)^2 = 2 (e^x - 1) e^x, both tiny
    and normal numbers down to e^-700; torch's expm1 backward rounds them to 0 below log rho ~ -37."""
    lr = -1e-9
    lt = torch.tensor([[lr + log_rho]], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([[lr]], dtype=torch.float64)
    pi, mu = math.exp(lr + log_rho), math.exp(lr)
    (g,) = torch.autograd.grad(MEASURES["abs_prob_diff"].token(lt, b).sum(), lt)
    assert g.item() == pytest.approx(-pi, rel=1e-12) and g.item() != 0.0
    assert MEASURES["abs_prob_diff"].token(lt, b).item() == pytest.approx(mu - pi, rel=1e-15)
    rho = math.exp(log_rho)
    (g,) = torch.autograd.grad(MEASURES["chi2"].token(lt, b).sum(), lt)
    assert g.item() == pytest.approx(2 * (rho - 1) * rho, rel=1e-12) and g.item() != 0.0
    assert MEASURES["chi2"].token(lt, b).item() == pytest.approx((rho - 1) ** 2, rel=1e-15)
    if log_rho == -40.0:  # what the plain expm1 form gave
        x = torch.tensor(40.0 - 1e-9, dtype=torch.float64, requires_grad=True)
        (g0,) = torch.autograd.grad(-torch.expm1(-x), x)
        assert g0.item() == 0.0


@pytest.mark.parametrize("log_rho", [-20.0, -30.0, -40.0])
def test_token_form_gradients_far_below_one_in_float32(log_rho):
    lt = torch.tensor([[log_rho - 0.5]], dtype=torch.float32, requires_grad=True)
    b = torch.tensor([[-0.5]], dtype=torch.float32)
    (g,) = torch.autograd.grad(MEASURES["abs_prob_diff"].token(lt, b).sum(), lt)
    assert g.item() == pytest.approx(-math.exp(log_rho - 0.5), rel=1e-5)
    (g,) = torch.autograd.grad(MEASURES["chi2"].token(lt, b).sum(), lt)
    assert g.item() == pytest.approx(2 * (math.exp(log_rho) - 1) * math.exp(log_rho), rel=1e-5)


def test_token_quantiles_match_numpy_and_hand_values():
    from constraints.measures import token_quantiles

    # abs_log_ratio of 11 tokens = 0, 0.1, ..., 1.0: p50 = 0.5, p90 = 0.9, p99 = 0.99 (linear: 0.9 + 0.9 * 0.1)
    train = -torch.arange(11, dtype=torch.float64)[None, :] * 0.1 - 1.0
    rollout = torch.full_like(train, -1.0)
    q = token_quantiles("abs_log_ratio", train, rollout, torch.ones_like(train, dtype=torch.bool))
    np.testing.assert_allclose(q.numpy(), [0.5, 0.9, 0.99], rtol=1e-12)
    train_t, rollout_t, mask_t, train, rollout, mask = _batch(11, torch.float64)
    for name in ("abs_prob_diff", "kl_k3", "chi2", "max_abs_log_ratio"):
        values = MEASURES[name].token(torch.tensor(train), torch.tensor(rollout)).numpy()[mask]
        np.testing.assert_allclose(token_quantiles(name, train_t, rollout_t, mask_t).numpy(),
                                   np.percentile(values, [50, 90, 99]), rtol=1e-12, err_msg=name)
    none = torch.zeros_like(mask_t)
    assert token_quantiles("kl_k3", train_t, rollout_t, none).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no per-token form"):
        token_quantiles("chi2_seq", train_t, rollout_t, mask_t)
    m = discrepancy_metrics(train_t, rollout_t, mask_t, quantiles_of=["kl_k3", "routing_mismatch", "kl_k3", "ess"])
    hist = {k: v for k, v in m.items() if k.endswith(("_p50", "_p90", "_p99"))}
    ref = np.percentile(MEASURES["kl_k3"].token(torch.tensor(train), torch.tensor(rollout)).numpy()[mask], [50, 90, 99])
    assert hist == pytest.approx({"discrepancy/kl_k3_p50": ref[0], "discrepancy/kl_k3_p90": ref[1],
                                  "discrepancy/kl_k3_p99": ref[2]}, rel=1e-12)


def test_quantile_constraint_is_the_numpy_percentile_of_the_token_measure():
    """A tail constraint's D is the q-quantile of the per-token measure over the valid tokens (float64 numpy
    reference, linear interpolation), not the mean; it needs a per-token form and a q in (0, 1)."""
    from constraints.penalties import check_penalty_constraints

    train_t, rollout_t, mask_t, train, rollout, mask = _batch(11, torch.float64)
    for name, q in (("abs_prob_diff", 0.9), ("kl_k3", 0.5), ("abs_log_ratio", 0.99)):
        values = MEASURES[name].token(torch.tensor(train), torch.tensor(rollout)).numpy()[mask]
        got = measure_constraint(ConstraintConfig(measure=name, quantile=q), train_t, rollout_t, mask_t)
        assert got.dtype == torch.float64
        assert got.item() == pytest.approx(np.percentile(values, 100 * q), rel=1e-12), name
        assert got.item() != pytest.approx(values.mean(), rel=1e-3), name
    assert measure_constraint(ConstraintConfig(quantile=0.9), train_t, rollout_t, torch.zeros_like(mask_t)).item() == 0
    for cfg in (ConstraintConfig(measure="chi2_seq", quantile=0.9),):
        with pytest.raises(ValueError, match="per-token form"):
            measure_constraint(cfg, train_t, rollout_t, mask_t)
        with pytest.raises(ValueError, match="per-token form"):
            check_penalty_constraints([cfg])
    with pytest.raises(ValueError, match="per-token form"):
        check_penalty_constraints([ConstraintConfig(measure="routing_mismatch", quantile=0.9)])
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="quantile"):
            ConstraintConfig(quantile=bad).check()
    ConstraintConfig(quantile=0.9).check()


def test_every_measure_is_a_constraint_and_a_calibration_row():
    """The registry is the one list: the panel, the constraint configs and dcmdp calibrate's rows follow it."""
    from constraints.measures import panel_constraints
    from constraints.penalties import check_penalty_constraints
    from dcmdp.calibrate import FLOOR_MEASURES

    panel = panel_constraints()
    assert {c.measure for c in panel.values()} == set(MEASURES) - {"ess"}
    assert FLOOR_MEASURES == panel
    assert panel["discrepancy/extreme_rate_2"].tau == 2.0 and "routing/mismatch" in panel
    train_t, rollout_t, mask_t, *_ = _batch(12)
    m = discrepancy_metrics(train_t, rollout_t, mask_t)
    for key, c in panel.items():
        if c.measure == "routing_mismatch":
            continue
        assert measure_constraint(c, train_t, rollout_t, mask_t).item() == pytest.approx(m[key], rel=1e-12), key
    # max_* measures have the token form a hinge penalty acts on exactly; the sequence-level ones do not
    check_penalty_constraints([ConstraintConfig(measure="max_abs_prob_diff"), ConstraintConfig(measure="max_abs_log_ratio")])
    with pytest.raises(ValueError, match="no per-token form"):
        check_penalty_constraints([ConstraintConfig(measure="chi2_seq")])
