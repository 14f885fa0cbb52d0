"""Dual controller: projected arithmetic by hand, clipping, NaN skips, fixed/disabled, PID vs an independent
float64 re-implementation, coupled projection vs closed forms and scipy, state round trip."""

from __future__ import annotations

import json
import math
from collections import deque

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from constraints.config import ConstraintConfig
from dcmdp.config import CouplingConfig, DualConfig, PIDConfig
from dcmdp.dual import DUAL_RULES, DualState, dual_step, init_state, project

torch.set_num_threads(1)


def _cfg(**kw) -> DualConfig:
    cons = kw.pop("constraints", [ConstraintConfig(measure="abs_prob_diff", tolerance=0.005, lambda_init=0.1, lr=1.0),
                                  ConstraintConfig(measure="kl_k3", tolerance=0.01, lambda_init=0.5, lr=2.0)])
    return DualConfig(constraints=cons, **kw)


def test_projected_step_arithmetic_and_metrics():
    cfg = _cfg()
    state = init_state(cfg)
    assert state.lambda_C.tolist() == [0.1, 0.5] and state.lambda_C.dtype == torch.float64
    state, m = dual_step(state, torch.tensor([0.007, 0.004]), cfg)
    # 0.1 + 1.0 * (0.007 - 0.005) = 0.102;  0.5 + 2.0 * (0.004 - 0.01) = 0.488
    assert state.lambda_C.tolist() == pytest.approx([0.102, 0.488], abs=1e-7)
    assert m["dual/lambda/abs_prob_diff"] == pytest.approx(0.102, abs=1e-7)
    assert m["dual/lambda/kl_k3"] == pytest.approx(0.488, abs=1e-7)
    assert m["dual/measured/kl_k3"] == pytest.approx(0.004, abs=1e-7)
    assert m["dual/tolerance/kl_k3"] == 0.01
    assert m["dual/violation/abs_prob_diff"] == pytest.approx(0.002, abs=1e-7)
    assert m["dual/skipped"] == 0.0
    assert state.steps == 1 and state.skipped == 0
    # float64 measurements give float64-exact arithmetic
    state, _ = dual_step(state, torch.tensor([0.005, 0.01], dtype=torch.float64), cfg)
    assert state.lambda_C.tolist() == pytest.approx([0.102, 0.488], abs=1e-7)


def test_projected_clips_at_both_bounds():
    cons = [ConstraintConfig(tolerance=0.1, lambda_init=0.5, lambda_min=0.2, lambda_max=1.0, lr=10.0)]
    cfg = _cfg(constraints=cons)
    state = init_state(cfg)
    state, _ = dual_step(state, torch.tensor([0.2]), cfg)   # 0.5 + 10 * 0.1 = 1.5 -> 1.0
    assert state.lambda_C.item() == pytest.approx(1.0)
    state, _ = dual_step(state, torch.tensor([0.05]), cfg)  # 1.0 - 0.5 = 0.5
    assert state.lambda_C.item() == pytest.approx(0.5)
    state, _ = dual_step(state, torch.tensor([0.0]), cfg)   # 0.5 - 1.0 = -0.5 -> 0.2
    assert state.lambda_C.item() == pytest.approx(0.2)


@pytest.mark.parametrize("rule", ["projected", "pid"])
def test_non_finite_measurements_are_skipped(rule):
    cfg = _cfg(rule=rule, pid=PIDConfig(kp=1.0, kd=1.0, alpha_p=0.5, alpha_d=0.5, delay=2))
    state = init_state(cfg)
    state, _ = dual_step(state, torch.tensor([0.01, 0.02]), cfg)
    before = state.state_dict()
    state, m = dual_step(state, torch.tensor([float("nan"), 0.03]), cfg)
    after = state.state_dict()
    assert after["lambda_C"][0] == before["lambda_C"][0]
    for key, value in after["rule"].items():  # the rule's own state (PID: I, P, C_bar, history)
        assert value[0] == before["rule"][key][0], key  # constraint 0 untouched
    assert after["lambda_C"][1] != before["lambda_C"][1]
    assert m["dual/skipped"] == 1.0 and state.skipped == 1 and state.steps == 2
    state, m = dual_step(state, torch.tensor([float("inf"), -float("inf")]), cfg)
    assert state.lambda_C.tolist() == after["lambda_C"] and state.skipped == 3 and m["dual/skipped"] == 2.0


def test_fixed_and_disabled():
    fixed = _cfg(rule="fixed")
    state = init_state(fixed)
    for _ in range(3):
        state, m = dual_step(state, torch.tensor([1.0, 1.0]), fixed)
    assert state.lambda_C.tolist() == [0.1, 0.5]
    assert m["dual/violation/abs_prob_diff"] == pytest.approx(0.995)  # still measured and logged
    off = _cfg(rule="off")
    state = init_state(off)
    assert state.lambda_C.tolist() == [0.0, 0.0]
    state, m = dual_step(state, torch.tensor([1.0, 1.0]), off)
    assert state.lambda_C.tolist() == [0.0, 0.0] and m["dual/lambda/kl_k3"] == 0.0


def test_duplicate_measures_get_suffixed_metric_names_and_shapes_are_checked():
    cfg = _cfg(constraints=[ConstraintConfig(measure="kl_k3"), ConstraintConfig(measure="kl_k3", tolerance=0.1)])
    state, m = dual_step(init_state(cfg), torch.tensor([0.0, 0.0]), cfg)
    assert {"dual/lambda/kl_k3_1", "dual/lambda/kl_k3_2"} <= set(m)
    with pytest.raises(ValueError, match="2 constraints"):
        dual_step(state, torch.tensor([0.0]), cfg)
    with pytest.raises(ValueError, match="unknown dual rule 'pi'; known: projected, pid, signed, chance, fixed, off"):
        dual_step(state, torch.tensor([0.0, 0.0]), _cfg(rule="pi"))


# ---------------------------------------------------------------------------------------------- PID


class ReferencePID:
    """Stooke, Achiam, Abbeel (2020) for one constraint, written from the formula with python floats:
    the integral clipped to [lo, hi] (= max(0, .) when lo = 0, hi = inf), C_bar starting at the first
    measurement, the derivative against the oldest of the last `delay` C_bar values (0 before any)."""

    def __init__(self, lam0, ki, kp, kd, alpha_p, alpha_d, delay, c, lo, hi):
        self.i, self.p, self.cbar, self.lam = lam0, 0.0, None, lam0
        self.hist = deque(maxlen=delay)
        self.ki, self.kp, self.kd, self.ap, self.ad, self.c, self.lo, self.hi = ki, kp, kd, alpha_p, alpha_d, c, lo, hi

    def step(self, cost):
        if not math.isfinite(cost):
            return self.lam
        delta = cost - self.c
        self.i = min(max(self.i + self.ki * delta, self.lo), self.hi)
        self.p = self.ap * self.p + (1 - self.ap) * delta
        self.cbar = cost if self.cbar is None else self.ad * self.cbar + (1 - self.ad) * cost
        d = max(0.0, self.cbar - self.hist[0]) if self.hist else 0.0
        self.hist.append(self.cbar)
        self.lam = min(max(max(0.0, self.kp * self.p + self.i + self.kd * d), self.lo), self.hi)
        return self.lam


def test_pid_matches_independent_float64_reimplementation_step_by_step():
    pid = PIDConfig(kp=2.0, kd=5.0, alpha_p=0.8, alpha_d=0.6, delay=3)
    cons = [ConstraintConfig(measure="kl_k3", tolerance=0.01, lambda_init=0.2, lambda_max=1e6, lr=3.0),
            ConstraintConfig(measure="chi2", tolerance=0.05, lambda_init=0.0, lambda_min=0.0, lambda_max=0.6, lr=1.0)]
    cfg = DualConfig(rule="pid", constraints=cons, pid=pid)
    refs = [ReferencePID(c.lambda_init, c.lr, pid.kp, pid.kd, pid.alpha_p, pid.alpha_d, pid.delay, c.tolerance,
                         c.lambda_min, c.lambda_max) for c in cons]
    rng = np.random.default_rng(0)
    costs = rng.uniform(0.0, 0.12, size=(40, 2))
    costs[7, 0] = np.nan
    costs[20, 1] = np.inf
    state = init_state(cfg)
    hit_max = False
    for k, row in enumerate(costs):
        state, m = dual_step(state, torch.tensor(row, dtype=torch.float64), cfg)
        expected = [ref.step(float(x)) for ref, x in zip(refs, row)]
        np.testing.assert_allclose(state.lambda_C.numpy(), expected, rtol=1e-12, atol=1e-14, err_msg=f"step {k}")
        assert m["dual/lambda/kl_k3"] == pytest.approx(expected[0], rel=1e-12)
        hit_max |= expected[1] == 0.6
    assert hit_max  # the box clip of the second constraint was exercised
    assert state.skipped == 2


def test_pid_first_steps_by_hand():
    # K_I = 1, K_P = 2, K_D = 4, alpha_p = alpha_d = 0.5, delay 1, c = 0.1, lambda_0 = 0
    cfg = DualConfig(rule="pid", constraints=[ConstraintConfig(tolerance=0.1, lambda_init=0.0, lr=1.0)],
                     pid=PIDConfig(kp=2.0, kd=4.0, alpha_p=0.5, alpha_d=0.5, delay=1))
    state = init_state(cfg)
    # k=1, J=0.3: I = 0.2, P = 0.5*0.2 = 0.1, C_bar = 0.3 (first measurement), D = 0 -> 2*0.1 + 0.2 = 0.4
    state, _ = dual_step(state, torch.tensor([0.3]), cfg)
    assert state.lambda_C.item() == pytest.approx(0.4)
    # k=2, J=0.5: I = 0.6, P = 0.05 + 0.2 = 0.25, C_bar = 0.4, D = 0.1 -> 0.5 + 0.6 + 0.4 = 1.5
    state, _ = dual_step(state, torch.tensor([0.5]), cfg)
    assert state.lambda_C.item() == pytest.approx(1.5)
    # k=3, J=0.0: I = 0.5, P = 0.125 - 0.05 = 0.075, C_bar = 0.2, D = max(0, -0.2) = 0 -> 0.15 + 0.5 = 0.65
    state, _ = dual_step(state, torch.tensor([0.0]), cfg)
    assert state.lambda_C.item() == pytest.approx(0.65)


def test_pid_without_p_and_d_is_the_projected_rule():
    cons = [ConstraintConfig(tolerance=0.05, lambda_init=0.3, lambda_max=0.8, lr=1.5)]
    proj, pid = DualConfig(rule="projected", constraints=cons), DualConfig(rule="pid", constraints=cons)
    a, b = init_state(proj), init_state(pid)
    for x in np.random.default_rng(1).uniform(0, 0.2, size=30):
        a, _ = dual_step(a, torch.tensor([x]), proj)
        b, _ = dual_step(b, torch.tensor([x]), pid)
        assert b.lambda_C.item() == pytest.approx(a.lambda_C.item(), rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------------------------- coupling


def _coupled(B: float, lam_max: float = 10.0) -> DualConfig:
    cons = [ConstraintConfig(tolerance=0.0, lambda_init=0.0, lambda_max=lam_max),
            ConstraintConfig(measure="kl_k3", tolerance=0.0, lambda_init=0.0, lambda_max=lam_max)]
    return DualConfig(constraints=cons, coupling=CouplingConfig(A=[[1.0, 1.0]], b=[B]))


@pytest.mark.parametrize("point, expected", [
    ((1.5, 1.0), (1.25, 0.75)),   # sum 2.5 > 2: move along -(1, 1)/2 by 0.25 each
    ((3.0, 0.2), (2.0, 0.0)),     # (2.4, -0.4) would leave the box: KKT with lambda_2 = 0 gives (2, 0)
    ((0.5, 0.7), (0.5, 0.7)),     # feasible: unchanged
    ((-1.0, 3.0), (0.0, 2.0)),    # box first, then the sum
])
def test_coupled_projection_sum_limit_closed_form(point, expected):
    out = project(torch.tensor(point, dtype=torch.float64), _coupled(2.0))
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-6)


def test_coupled_projection_matches_scipy_on_a_random_polytope():
    rng = np.random.default_rng(3)
    cons = [ConstraintConfig(tolerance=0.0, lambda_init=0.0, lambda_min=0.1 * i, lambda_max=2.0 + i) for i in range(3)]
    A = rng.uniform(0.2, 1.5, size=(2, 3))
    b = np.array([1.5, 2.0])
    cfg = DualConfig(constraints=cons, coupling=CouplingConfig(A=A.tolist(), b=b.tolist()))
    lo = np.array([c.lambda_min for c in cons])
    hi = np.array([c.lambda_max for c in cons])
    for _ in range(5):
        y = rng.uniform(-1, 4, size=3)
        res = minimize(lambda x: ((x - y) ** 2).sum(), x0=lo, jac=lambda x: 2 * (x - y), method="SLSQP",
                       bounds=list(zip(lo, hi)), constraints=[{"type": "ineq", "fun": lambda x: b - A @ x,
                                                               "jac": lambda x: -A}],
                       options={"ftol": 1e-14, "maxiter": 500})
        assert res.success
        out = project(torch.tensor(y), cfg).numpy()
        np.testing.assert_allclose(out, res.x, atol=1e-5)
        assert np.all(A @ out <= b + 1e-6) and np.all(out >= lo - 1e-9) and np.all(out <= hi + 1e-9)


def test_coupled_dual_step_keeps_a_skipped_lambda_fixed():
    cfg = _coupled(1.0)
    cfg.constraints[0].lambda_init, cfg.constraints[0].lr = 0.6, 1.0
    cfg.constraints[1].lambda_init, cfg.constraints[1].lr = 0.2, 1.0
    state = init_state(cfg)
    # constraint 0 skipped (NaN); constraint 1 wants 0.2 + 1.0 -> but 0.6 + x <= 1 caps it at 0.4
    state, _ = dual_step(state, torch.tensor([float("nan"), 1.0]), cfg)
    np.testing.assert_allclose(state.lambda_C.numpy(), [0.6, 0.4], atol=1e-6)
    # both move: target (0.6 + 1, 0.4 + 1) = (1.6, 1.4), sum 3 > 1 -> (1.6, 1.4) - 1 = (0.6, 0.4)
    state, _ = dual_step(state, torch.tensor([1.0, 1.0]), cfg)
    np.testing.assert_allclose(state.lambda_C.numpy(), [0.6, 0.4], atol=1e-6)


def test_infeasible_initial_multipliers_are_an_error():
    cfg = _coupled(0.5)
    cfg.constraints[0].lambda_init = cfg.constraints[1].lambda_init = 0.4
    with pytest.raises(ValueError, match="violates the coupled limits"):
        init_state(cfg)


# ---------------------------------------------------------------------------------------------- state


@pytest.mark.parametrize("rule", sorted(DUAL_RULES))
def test_state_dict_round_trip_continues_identically(rule):
    cfg = _cfg(rule=rule, pid=PIDConfig(kp=1.0, kd=2.0, alpha_p=0.7, alpha_d=0.7, delay=4))
    state = init_state(cfg)
    rng = np.random.default_rng(2)
    for _ in range(6):
        state, _ = dual_step(state, torch.tensor(rng.uniform(0, 0.03, size=2)), cfg)
    restored = DualState.from_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored.state_dict() == state.state_dict()
    for _ in range(6):
        x = torch.tensor(rng.uniform(0, 0.03, size=2))
        state, _ = dual_step(state, x, cfg)
        restored, _ = dual_step(restored, x, cfg)
        assert restored.state_dict() == state.state_dict()


# ------------------------------------------------------------------------- relative step, automatic tolerance


def _one(**kw) -> ConstraintConfig:
    return ConstraintConfig(**{"measure": "abs_prob_diff", "tolerance": 0.002, "lambda_init": 0.1, "lr": 1.0, **kw})


def test_relative_step_moves_lambda_by_eta_per_tolerance_exceeded():
    cfg = _cfg(constraints=[_one()], relative=True)
    state = init_state(cfg)
    state, m = dual_step(state, torch.tensor([0.003], dtype=torch.float64), cfg)  # 0.1 + (0.003 - 0.002) / 0.002 = 0.6
    assert state.lambda_C.item() == pytest.approx(0.6, abs=1e-12)
    assert m["dual/violation/abs_prob_diff"] == pytest.approx(0.001, abs=1e-15)  # logged in the measure's units
    state, _ = dual_step(state, torch.tensor([0.001], dtype=torch.float64), cfg)  # 0.6 + (0.001 - 0.002) / 0.002 = 0.1
    assert state.lambda_C.item() == pytest.approx(0.1, abs=1e-12)
    absolute = _cfg(constraints=[_one()])
    a, _ = dual_step(init_state(absolute), torch.tensor([0.003], dtype=torch.float64), absolute)  # 0.1 + 0.001
    assert a.lambda_C.item() == pytest.approx(0.101, abs=1e-12)


def test_relative_pid_without_p_and_d_is_relative_projected():
    proj = _cfg(constraints=[_one()], relative=True)
    pid = _cfg(constraints=[_one()], relative=True, rule="pid", pid=PIDConfig(kp=0.0, kd=0.0))
    a, b = init_state(proj), init_state(pid)
    for x in (0.004, 0.0035, 0.001, 0.0, 0.01):
        a, _ = dual_step(a, torch.tensor([x], dtype=torch.float64), proj)
        b, _ = dual_step(b, torch.tensor([x], dtype=torch.float64), pid)
        assert b.lambda_C.item() == pytest.approx(a.lambda_C.item(), abs=1e-12)


def test_relative_step_needs_a_positive_tolerance(tmp_path):
    from dcmdp.config import ConfigError, load_config

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("dual:\n  relative: true\n  constraints:\n    - measure: kl_k3\n      tolerance: 0.0\n")
    with pytest.raises(ConfigError, match=r"dual.constraints\[0\].tolerance.*> 0"):
        load_config(cfg_file, [])


def test_automatic_tolerance_tracks_the_floor_by_hand():
    # slack 0.5, EMA 0.9; the configured c = 0.01 is never used once a floor is measured: the first batch's
    # floor sets its own tolerance (c_1 = 0.002 * 1.5 = 0.003)
    cfg = _cfg(constraints=[_one(tolerance=0.01, floor_slack=0.5, floor_ema=0.9)])
    state = init_state(cfg)
    state, m = dual_step(state, torch.tensor([0.005], dtype=torch.float64), cfg, floor_C=torch.tensor([0.002], dtype=torch.float64))
    assert m["dual/tolerance/abs_prob_diff"] == pytest.approx(0.003, abs=1e-15)
    assert state.lambda_C.item() == pytest.approx(0.1 + 0.005 - 0.003, abs=1e-12)  # 0.102
    assert state.floor_C.item() == pytest.approx(0.002, abs=1e-15)  # F_1 = the first floor
    # c_2 = F_1 (1 + 0.5) = 0.003; D = 0.005 -> lambda 0.102 + 0.002; F_2 = 0.9 * 0.002 + 0.1 * 0.004 = 0.0022
    state, m = dual_step(state, torch.tensor([0.005], dtype=torch.float64), cfg, floor_C=torch.tensor([0.004], dtype=torch.float64))
    assert m["dual/tolerance/abs_prob_diff"] == pytest.approx(0.003, abs=1e-15)
    assert state.lambda_C.item() == pytest.approx(0.104, abs=1e-12)
    assert state.floor_C.item() == pytest.approx(0.0022, abs=1e-15)
    # a non-finite floor leaves F (and c_3 = 0.0022 * 1.5 = 0.0033) as they were
    state, m = dual_step(state, torch.tensor([0.0033], dtype=torch.float64), cfg, floor_C=torch.tensor([float("nan")], dtype=torch.float64))
    assert m["dual/tolerance/abs_prob_diff"] == pytest.approx(0.0033, abs=1e-15)
    assert state.lambda_C.item() == pytest.approx(0.104, abs=1e-12)
    assert state.floor_C.item() == pytest.approx(0.0022, abs=1e-15)
    # no finite floor yet (a NaN first measurement): the configured tolerance holds until one arrives
    state = init_state(cfg)
    state, m = dual_step(state, torch.tensor([0.005], dtype=torch.float64), cfg, floor_C=torch.tensor([float("nan")], dtype=torch.float64))
    assert m["dual/tolerance/abs_prob_diff"] == pytest.approx(0.01) and math.isnan(state.floor_C.item())


def test_a_held_floor_keeps_the_tolerance_of_the_first_batches_by_hand():
    # floor_steps 2, slack 1, EMA 0.5: F_1 = 0.002, F_2 = 0.5 * 0.002 + 0.5 * 0.004 = 0.003, then held whatever
    # the floor measures (a drifting policy's 0.02); c = 2 F from the batch after each update
    cfg = _cfg(constraints=[_one(tolerance=0.01, floor_slack=1.0, floor_ema=0.5, floor_steps=2),
                            _one(measure="kl_k3", tolerance=0.01, floor_slack=1.0, floor_ema=0.5)])
    state = init_state(cfg)
    tol = []
    for floor in (0.002, 0.004, 0.02, 0.02):
        state, m = dual_step(state, torch.tensor([0.005, 0.005], dtype=torch.float64), cfg,
                             floor_C=torch.tensor([floor, floor], dtype=torch.float64))
        tol.append((m["dual/tolerance/abs_prob_diff"], m["dual/tolerance/kl_k3"]))
    held, followed = zip(*tol)
    assert held == pytest.approx([0.004, 0.004, 0.006, 0.006], abs=1e-15)
    # without floor_steps the same measurements move c on: F = 0.002, 0.003, 0.0115, 0.01575
    assert followed == pytest.approx([0.004, 0.004, 0.006, 0.023], abs=1e-15)
    assert state.floor_C.tolist() == pytest.approx([0.003, 0.01575], abs=1e-15)
    # it survives a checkpoint: the held floor stays held after a round trip
    state = DualState.from_state_dict(state.state_dict())
    state, m = dual_step(state, torch.tensor([0.005, 0.005], dtype=torch.float64), cfg,
                         floor_C=torch.tensor([0.05, 0.05], dtype=torch.float64))
    assert m["dual/tolerance/abs_prob_diff"] == pytest.approx(0.006, abs=1e-15)
    assert state.floor_C[0].item() == pytest.approx(0.003, abs=1e-15)
    with pytest.raises(ValueError, match=r"floor_steps.*set '.*floor_slack' too"):
        _one(floor_steps=3).check("dual.constraints[0]")


def test_a_ratcheted_floor_follows_the_measure_down_and_never_back_up_by_hand():
    # slack 0.5, EMA 0.5, floors 0.004, 0.002, 0.006, 0.0005, 0.01: F = 0.004, 0.003, 0.0045, 0.0025, 0.00625;
    # its running minimum 0.004, 0.003, 0.003, 0.0025, 0.0025; c = 1.5 x that minimum from the batch after each
    # update (the first batch: its own floor), against c = 1.5 F for the plain automatic tolerance beside it
    cfg = _cfg(constraints=[_one(tolerance=0.01, floor_slack=0.5, floor_ema=0.5, floor_ratchet=True),
                            _one(measure="kl_k3", tolerance=0.01, floor_slack=0.5, floor_ema=0.5),
                            _one(measure="chi2", tolerance=0.01)])
    state = init_state(cfg)
    tol = []
    for floor in (0.004, 0.002, 0.006, 0.0005, 0.01):
        state, m = dual_step(state, torch.tensor([0.005, 0.005, 0.005], dtype=torch.float64), cfg,
                             floor_C=torch.tensor([floor] * 3, dtype=torch.float64))
        tol.append((m["dual/tolerance/abs_prob_diff"], m["dual/tolerance/kl_k3"], m["dual/tolerance/chi2"]))
    ratchet, plain, fixed = zip(*tol)
    assert ratchet == pytest.approx([0.006, 0.006, 0.0045, 0.0045, 0.00375], abs=1e-15)
    assert plain == pytest.approx([0.006, 0.006, 0.0045, 0.00675, 0.00375], abs=1e-15)
    assert fixed == pytest.approx([0.01] * 5, abs=1e-15)
    assert state.floor_C[0].item() == pytest.approx(0.00625, abs=1e-15)
    assert state.floor_low_C[0].item() == pytest.approx(0.0025, abs=1e-15)
    assert math.isnan(state.floor_low_C[1].item()) and math.isnan(state.floor_low_C[2].item())
    # the lowest floor survives a checkpoint: a high floor after the round trip does not raise c
    state = DualState.from_state_dict(state.state_dict())
    state, m = dual_step(state, torch.tensor([0.005] * 3, dtype=torch.float64), cfg,
                         floor_C=torch.tensor([0.05] * 3, dtype=torch.float64))
    assert m["dual/tolerance/abs_prob_diff"] == pytest.approx(0.00375, abs=1e-15)
    assert state.floor_low_C[0].item() == pytest.approx(0.0025, abs=1e-15)
    # a state written before the ratchet existed: the lowest floor starts from its F
    old = state.state_dict()
    del old["floor_low_C"]
    assert DualState.from_state_dict(old).floor_low_C is None
    with pytest.raises(ValueError, match=r"floor_ratchet.*set '.*floor_slack' too"):
        _one(floor_ratchet=True).check("dual.constraints[0]")


def test_a_ratchet_with_floor_steps_restarts_its_floor_after_them_and_takes_the_minimum_over_a_full_window():
    # floor_steps 2, EMA 0.5 (window 1 / (1 - 0.5) = 2 batches): F = 0.0001 (a warm-up's near-zero drift), 0.00205,
    # then restarts at step 3 (F = 0.006, the warm-up gone), 0.004, 0.005, 0.0055; the minimum starts at step
    # 2 + 2 = 4 (0.004). c = 2 F until the minimum exists, then 2 x the minimum, from the batch after each update.
    # Without the restart the minimum would keep the warm-up's 0.00205 EMA for the whole run.
    cfg = _cfg(constraints=[_one(tolerance=0.01, floor_slack=1.0, floor_ema=0.5, floor_steps=2, floor_ratchet=True)])
    state, tol = init_state(cfg), []
    for floor in (0.0001, 0.004, 0.006, 0.002, 0.006, 0.006):
        state, m = dual_step(state, torch.tensor([0.005], dtype=torch.float64), cfg,
                             floor_C=torch.tensor([floor], dtype=torch.float64))
        tol.append(m["dual/tolerance/abs_prob_diff"])
    assert tol == pytest.approx([0.0002, 0.0002, 0.0041, 0.012, 0.008, 0.008], abs=1e-15)
    assert state.floor_C.item() == pytest.approx(0.0055, abs=1e-15)
    assert state.floor_low_C.item() == pytest.approx(0.004, abs=1e-15)
    # at EMA 0.9 the minimum waits ten batches (the EMA's window) after floor_steps: c = 2 F up to step 12
    cfg = _cfg(constraints=[_one(tolerance=0.01, floor_slack=1.0, floor_ema=0.9, floor_steps=2, floor_ratchet=True)])
    state = init_state(cfg)
    for k in range(1, 14):
        state, m = dual_step(state, torch.tensor([0.005], dtype=torch.float64), cfg,
                             floor_C=torch.tensor([0.001 * k], dtype=torch.float64))
        assert math.isnan(state.floor_low_C.item()) == (k < 12), k


def test_a_ratchet_needs_its_minimum_to_start_after_the_learning_rate_warm_up():
    from dcmdp.config import ConfigError, load_config
    ratchet = "dual.constraints=[{measure: abs_prob_diff, floor_slack: 0.5, floor_ratchet: true%s}]"
    with pytest.raises(ConfigError, match=r"floor_steps': a ratcheted tolerance.*warmup_steps=10.*floor_steps >= 10"):
        load_config("configs/default.yaml", [ratchet % ""])
    assert load_config("configs/default.yaml", [ratchet % ", floor_steps: 10"]).dual.constraints[0].floor_ratchet
    with pytest.raises(ValueError, match=r"floor_steps': must be >= 1"):
        _one(floor_slack=1.0, floor_steps=0).check("dual.constraints[0]")


def test_fixed_tolerances_stay_fixed_and_the_penalty_gets_the_tolerance_in_force():
    from dcmdp.dual import constraints_in_force

    cfg = _cfg(constraints=[_one(tolerance=0.01, floor_slack=1.0), _one(measure="kl_k3", tolerance=0.02)])
    state = init_state(cfg)
    assert [c.tolerance for c in constraints_in_force(state, cfg)] == [0.01, 0.02]
    state, _ = dual_step(state, torch.tensor([0.1, 0.1], dtype=torch.float64), cfg, floor_C=torch.tensor([0.003, 0.004], dtype=torch.float64))
    # the automatic one: 0.003 * (1 + 1); the fixed one unchanged, and no floor recorded for it
    assert [c.tolerance for c in constraints_in_force(state, cfg)] == pytest.approx([0.006, 0.02])
    assert math.isnan(state.floor_C[1].item())


def test_state_with_a_floor_round_trips_and_old_states_load():
    cfg = _cfg(constraints=[_one(floor_slack=0.25), _one(measure="kl_k3")])
    state = init_state(cfg)
    state, _ = dual_step(state, torch.tensor([0.003, 0.001], dtype=torch.float64), cfg)
    restored = DualState.from_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored.state_dict() == state.state_dict()
    old = {k: v for k, v in state.state_dict().items() if k != "floor_C"}  # a checkpoint from before floors
    legacy = DualState.from_state_dict(old)
    assert torch.isnan(legacy.floor_C).all() and legacy.lambda_C.tolist() == state.lambda_C.tolist()


def test_a_dual_state_written_before_rules_owned_their_state_loads_and_continues():
    """tests/data/dual_state_pid_c81e5a3.json: the state_dict of a PID dual after 4 steps, written by the dual
    controller of commit c81e5a3 (PID terms at the top level), with that code's next step under '_next'."""
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "dual_state_pid_c81e5a3.json").read_text())
    cfg = _cfg(rule="pid", pid=PIDConfig(kp=1.0, kd=2.0, alpha_p=0.7, alpha_d=0.7, delay=3))
    state = DualState.from_state_dict({k: v for k, v in data.items() if k != "_next"})
    assert state.rule["integral_C"] == data["integral_C"] and state.steps == 4
    state, _ = dual_step(state, torch.tensor(data["_next"]["measured"], dtype=torch.float64), cfg)
    expected = data["_next"]["state"]
    assert state.lambda_C.tolist() == pytest.approx(expected["lambda_C"], rel=1e-12, abs=1e-15)
    for key in ("integral_C", "p_C", "cost_ema_C"):
        assert state.rule[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-15), key
    assert state.rule["cost_hist"] == [pytest.approx(h, rel=1e-12) for h in expected["cost_hist"]]


def test_a_new_rule_is_one_registry_line(monkeypatch):
    """A toy rule with state of its own (a step counter doubling lambda) runs through dual_step and round-trips."""
    from dcmdp import dual as dual_mod

    def init(cfg):
        return {"calls": 0}

    def step(lambda_C, rule_state, measured_C, tolerance_C, cfg):
        return lambda_C * 2, {"calls": rule_state["calls"] + 1}

    monkeypatch.setitem(dual_mod.DUAL_RULES, "doubling", dual_mod.DualRule(init, step))
    cfg = _cfg(rule="doubling")
    state = init_state(cfg)
    for _ in range(3):
        state, m = dual_step(state, torch.tensor([0.0, 0.0], dtype=torch.float64), cfg)
    assert state.lambda_C.tolist() == pytest.approx([0.8, 4.0]) and state.rule == {"calls": 3}
    assert DualState.from_state_dict(json.loads(json.dumps(state.state_dict()))).rule == {"calls": 3}


# ------------------------------------------------------------------------- averaged multiplier


def test_averaged_multiplier_is_the_running_mean_the_penalty_carries():
    """dual.average: lambda_bar_k = mean(lambda_0..lambda_k) against numpy's mean of the iterates (float64), the
    iterates themselves unchanged by it; the penalty carries lambda_bar with average on, lambda_k with it off."""
    from dcmdp.dual import penalty_spec

    cons = [ConstraintConfig(tolerance=0.02, lambda_init=0.3, lambda_max=1.0, lr=20.0),
            ConstraintConfig(measure="kl_k3", tolerance=0.02, lambda_init=0.0, lr=5.0)]
    averaged, plain = _cfg(constraints=cons, average=True), _cfg(constraints=cons)
    sa, sp = init_state(averaged), init_state(plain)
    rng = np.random.default_rng(4)
    iterates = [sa.lambda_C.numpy().copy()]
    for k in range(1, 41):
        x = torch.tensor(rng.uniform(0, 0.04, size=2), dtype=torch.float64)
        if k <= 15:  # a high phase drives lambda to its cap, a low one to 0 (the mean then lies between)
            x[0] = 0.04 if k <= 5 else 0.0
        if k == 7:
            x[0] = float("nan")  # a skipped measurement keeps lambda, which still counts in the mean
        sa, m = dual_step(sa, x, averaged)
        sp, mp = dual_step(sp, x, plain)
        assert sa.lambda_C.tolist() == sp.lambda_C.tolist()  # the rule's iterates do not depend on the average
        iterates.append(sa.lambda_C.numpy().copy())
        mean = np.mean(iterates, axis=0)
        assert sa.lambda_avg().numpy() == pytest.approx(mean, rel=1e-12, abs=1e-15)
        assert m["dual/lambda_avg/abs_prob_diff"] == pytest.approx(mean[0], rel=1e-12, abs=1e-15)
        assert "dual/lambda_avg/abs_prob_diff" not in mp
        assert penalty_spec(sa, averaged).lambda_C.tolist() == pytest.approx(mean.tolist(), rel=1e-6)
        assert penalty_spec(sp, plain).lambda_C.tolist() == pytest.approx(sp.lambda_C.tolist(), rel=1e-6)
    # the iterates visited both bounds, so the mean is not one of them
    assert np.asarray(iterates)[:, 0].max() == 1.0 and np.asarray(iterates)[:, 0].min() == 0.0


def test_averaged_multiplier_round_trips_and_an_older_state_restarts_it_at_lambda():
    cfg = _cfg(average=True)
    state = init_state(cfg)
    for x in ([0.02, 0.0], [0.0, 0.03], [0.01, 0.02]):
        state, _ = dual_step(state, torch.tensor(x, dtype=torch.float64), cfg)
    restored = DualState.from_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored.lambda_avg().tolist() == state.lambda_avg().tolist()
    older = DualState.from_state_dict({k: v for k, v in state.state_dict().items() if k != "lambda_avg_C"})
    assert older.lambda_avg().tolist() == state.lambda_C.tolist()
    x = torch.tensor([0.02, 0.02], dtype=torch.float64)
    older, _ = dual_step(older, x, cfg)
    # lambda_bar_4 = lambda_bar_3 + (lambda_4 - lambda_bar_3) / 5, lambda_bar_3 taken as lambda_3
    expected = state.lambda_C + (older.lambda_C - state.lambda_C) / 5
    assert older.lambda_avg().tolist() == pytest.approx(expected.tolist(), rel=1e-12)


# ------------------------------------------------------------------ the sign test on a U-shaped response


def _respond(cfg: DualConfig, response, steps: int, noise: float = 0.0, seed: int = 0):
    """Drive dual_step with a scripted D_hat(lambda): each batch's D_hat is response(lambda its updates carried),
    times (1 + noise x N(0, 1)). Returns the lambdas carried and the D_hat measured, per step."""
    rng = np.random.default_rng(seed)
    state = init_state(cfg)
    lams, ds = [], []
    for _ in range(steps):
        lam = state.lambda_C.item()
        d = response(lam) * (1.0 + noise * rng.standard_normal())
        state, _ = dual_step(state, torch.tensor([d], dtype=torch.float64), cfg)
        lams.append(lam)
        ds.append(d)
    return np.array(lams), np.array(ds)


def _u(lam: float) -> float:
    """D_hat(lambda) with a U: least 3e-3 at lambda* = 0.15, rising on both sides (docs/design.md §"The U-shaped response")."""
    return 3e-3 * (1.0 + 13.0 * (lam - 0.15) ** 2)


def _u_cfg(rule: str, c: float, lambda_init: float) -> DualConfig:
    return DualConfig(rule=rule, relative=True, constraints=[
        ConstraintConfig(measure="abs_prob_diff", tolerance=c, lambda_init=lambda_init, lambda_max=1.0, lr=0.05)])


@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_signed_rule_finds_the_left_root_where_projected_ascent_runs_to_the_cap(noise):
    # c = 3.5e-3 is feasible: D_hat(lambda) = c at lambda = 0.15 -/+ 0.109 (0.041 and 0.259). Started right of
    # lambda*, outside c, projected ascent raises lambda, which raises D_hat: it runs to the cap and stays there
    c, lam0 = 3.5e-3, 0.5
    lam_p, d_p = _respond(_u_cfg("projected", c, lam0), _u, 300, noise, seed=1)
    lam_s, d_s = _respond(_u_cfg("signed", c, lam0), _u, 300, noise, seed=1)
    late = slice(100, None)
    assert (lam_p[late] >= 1.0 - 1e-12).mean() == 1.0 and (d_p[late] <= c).mean() == 0.0
    # the sign test turns lambda down; it settles near the left root, inside c about half the time (noise)
    assert (lam_s[late] >= 1.0 - 1e-12).mean() == 0.0
    assert abs(np.median(lam_s[late]) - 0.041) < 0.06
    assert (d_s[late] <= c).mean() >= 0.4 and np.mean(d_s[late]) < 1.05 * c


@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_signed_rule_settles_at_the_bottom_of_the_u_when_c_is_infeasible(noise):
    # c = 2.5e-3 is below the least D_hat (3e-3): projected ascent from lambda_0 = 0.1 winds up to the cap and the
    # policy pays lambda = 1; the sign test holds lambda near lambda* = 0.15, where D_hat is least
    lam_p, d_p = _respond(_u_cfg("projected", 2.5e-3, 0.1), _u, 300, noise, seed=2)
    lam_s, d_s = _respond(_u_cfg("signed", 2.5e-3, 0.1), _u, 300, noise, seed=2)
    late = slice(100, None)
    assert (lam_p[late] >= 1.0 - 1e-12).mean() == 1.0
    assert abs(np.mean(lam_s[late]) - 0.15) < 0.05 and np.quantile(lam_s[late], 0.9) < 0.4
    assert (lam_s[late] >= 1.0 - 1e-12).mean() == 0.0
    # the noise keeps the slope estimate moving, and lambda around lambda*: mean D_hat 1.2-1.3 x the least at 20%
    assert np.mean(d_s[late]) < (1.05 if noise == 0 else 1.4) * 3e-3 < 0.2 * np.mean(d_p[late])


def test_signed_rule_is_projected_ascent_where_raising_lambda_lowers_d_hat():
    # a monotone response (every slope < 0): step for step the same lambdas as the projected rule
    falling = lambda lam: 2e-3 + 4e-3 * math.exp(-5.0 * lam)  # noqa: E731
    lam_p, _ = _respond(_u_cfg("projected", 3e-3, 0.0), falling, 80)
    lam_s, _ = _respond(_u_cfg("signed", 3e-3, 0.0), falling, 80)
    assert np.array_equal(lam_p, lam_s)
    assert lam_s[-1] == pytest.approx(-math.log(0.25) / 5.0, abs=0.02)  # D_hat(lambda) = c at lambda = ln 4 / 5


def test_signed_rule_probes_down_from_a_cap_that_does_not_hold_d_hat():
    # D_hat does not respond to lambda at all and stays outside c: projected ascent sits at the cap for good; the
    # sign test, after SIGN_WINDOW + 1 steps pinned there without a slope to read, steps lambda down
    from dcmdp.dual import SIGN_MIN_STEP, SIGN_WINDOW

    flat = lambda lam: 4e-3  # noqa: E731
    cfg = _u_cfg("signed", 3e-3, 1.0)
    lam_s, _ = _respond(cfg, flat, SIGN_WINDOW + 2)
    assert (lam_s[:SIGN_WINDOW + 1] == 1.0).all()  # the (SIGN_WINDOW + 1)-th pair at the cap completes the window
    # relative excess (4 - 3) / 3 plus the least step 0.1, times eta 0.05, downward
    assert lam_s[SIGN_WINDOW + 1] == pytest.approx(1.0 - 0.05 * (1.0 / 3.0 + SIGN_MIN_STEP), abs=1e-12)
    _, m = dual_step(init_state(cfg), torch.tensor([4e-3], dtype=torch.float64), cfg)
    assert math.isnan(m["dual/slope/abs_prob_diff"]) and m["dual/direction/abs_prob_diff"] == 1.0


def test_response_slope_reads_the_differences_not_the_levels():
    from dcmdp.dual import response_slope

    # D = 2 + 3 lambda + 0.5 k (a drift over the steps k): the differences give slope 3 whatever the drift
    lams = [0.1, 0.3, 0.2, 0.5, 0.4, 0.45]
    pairs = [[lam, 2 + 3 * lam + 0.5 * k] for k, lam in enumerate(lams)]
    assert response_slope(pairs) == pytest.approx(3.0, abs=1e-12)
    # closed loop: lambda rose with D (levels correlate), but D did not respond to lambda's changes
    pairs = [[0.1 * k, 1.0 + (0.2 if k % 2 else 0.0) + 0.1 * k] for k in range(6)]
    assert response_slope(pairs) is None  # lambda's changes are all equal: no slope to read
    assert response_slope([[0.1, 1.0], [0.2, 2.0], [0.3, 1.0]]) is None  # fewer than 3 differences


# ------------------------------------------------------------------ the drift constraint


def test_drift_constraint_anchors_the_penalty_at_pi_old():
    from dcmdp.dual import penalty_spec

    cons = [_one(tolerance=0.01, floor_slack=0.5, floor_ema=0.9)]
    updates, drift = _cfg(constraints=cons, measure_at="updates"), _cfg(constraints=cons, measure_at="drift")
    assert penalty_spec(init_state(drift), drift).anchor == "old"
    assert penalty_spec(init_state(updates), updates).anchor == "rollout"
    assert penalty_spec(init_state(_cfg(constraints=cons)), _cfg(constraints=cons)).anchor == "rollout"


# ------------------------------------------------------------------ feasibility and end-of-run warnings


def _history(d, c, lam, floor=None):
    return [{"dual/measured/abs_prob_diff": di, "dual/tolerance/abs_prob_diff": ci, "dual/lambda/abs_prob_diff": li,
             **({} if floor is None else {"dual/floor_at_point/abs_prob_diff": floor[k]})}
            for k, (di, ci, li) in enumerate(zip(d, c, lam))]


def test_end_of_run_warnings_name_a_pinned_lambda_and_a_constraint_not_held():
    from dcmdp.loop import constraint_summaries, end_of_run_warnings

    con = [ConstraintConfig(measure="abs_prob_diff", lambda_max=0.3)]
    # 10 steps: lambda at its cap on 6, D-hat outside c on 7; the floor at the measurement point under c
    h = _history([4e-3] * 7 + [2e-3] * 3, [3e-3] * 10, [0.3] * 6 + [0.2] * 4, floor=[1e-3] * 10)
    (s,) = constraint_summaries(h, ["abs_prob_diff"], con).values()
    assert s.cap_frac == pytest.approx(0.6) and s.inside_frac == pytest.approx(0.3) and s.start_floor == 1e-3
    warnings = end_of_run_warnings({"abs_prob_diff": s}, "signed", 0.5, 0.0, 100)
    assert [w.split(":")[1].split(" on ")[0].strip() for w in warnings] == ["lambda sat at its cap lambda_max",
                                                                            "D-hat was outside c"]
    assert "60% of the steps" in warnings[0] and "70% of the steps" in warnings[1]
    # a constraint held: at the cap on 20% of the steps, outside c on 30% (the limits, CAP_FRAC and OUTSIDE_FRAC),
    # acting on all; a constant lambda is not warned about
    h = _history([4e-3] * 3 + [2e-3] * 7, [3e-3] * 10, [0.3] * 2 + [0.2] * 8, floor=[1e-3] * 10)
    assert end_of_run_warnings(constraint_summaries(h, ["abs_prob_diff"], con), "projected", 0.5, 0.0, 100) == []
    # lambda above 0.01 on 4 of 10 steps (not slack throughout): the dual mostly rested
    h = _history([2e-3] * 10, [3e-3] * 10, [0.05] * 4 + [0.0] * 6, floor=[1e-3] * 10)
    (s,) = constraint_summaries(h, ["abs_prob_diff"], con).values()
    assert s.acting_frac == pytest.approx(0.4)
    (w,) = end_of_run_warnings({"abs_prob_diff": s}, "chance", 0.5, 0.0, 100)
    assert "on only 40% of the steps" in w and "mostly rested" in w and "let the run anchor it" in w
    # the same with c anchored by the run: the advice is the anchor, and for a rule holding the mean, the chance rule
    anchored = [ConstraintConfig(measure="abs_prob_diff", lambda_max=0.3, anchor=0.5, floor_slack=1.0)]
    (s,) = constraint_summaries(h, ["abs_prob_diff"], anchored).values()
    assert s.anchored and not constraint_summaries(h, ["abs_prob_diff"], con)["abs_prob_diff"].anchored
    (w,) = end_of_run_warnings({"abs_prob_diff": s}, "pid", 0.5, 0.0, 100)
    assert "lower the anchor (constraints[i].anchor)" in w and "dual.rule=chance" in w and "let the run" not in w
    (w,) = end_of_run_warnings({"abs_prob_diff": s}, "chance", 0.5, 0.0, 100)
    assert w.endswith("lower the anchor (constraints[i].anchor)")
    h = _history([4e-3] * 10, [3e-3] * 10, [0.3] * 10)
    assert end_of_run_warnings(constraint_summaries(h, ["abs_prob_diff"], con), "fixed", 0.5, 0.0, 100) == []


def test_feasibility_is_decided_on_the_first_steps_and_names_the_numbers():
    from dcmdp.loop import FEASIBILITY_STEPS, constraint_summaries, end_of_run_warnings, feasibility_warnings

    con = [ConstraintConfig(measure="abs_prob_diff", lambda_max=0.3)]
    n = FEASIBILITY_STEPS
    h = _history([5e-3] * n, [3e-3] * n, [0.2] * n, floor=[4e-3, 3.5e-3, 4.5e-3][:n])
    (w,) = feasibility_warnings(h, ["abs_prob_diff"], con, "projected", "updates")
    assert "infeasible at its measurement point (dual.measure_at=updates)" in w
    assert "0.004, 0.0035, 0.0045" in w and "(0.003, 0.003, 0.003)" in w and "cap (0.3)" in w
    assert "dual.measure_at=drift" in w and "dcmdp calibrate" in w
    (s,) = constraint_summaries(h, ["abs_prob_diff"], con).values()
    assert s.start_floor == 3.5e-3 and s.start_tolerance == 3e-3
    assert any(x.startswith("constraint abs_prob_diff was infeasible from the start") for x in
               end_of_run_warnings({"abs_prob_diff": s}, "projected", 0.5, 0.0, 100))
    # one of the first steps with its floor under c: feasible; fewer steps than FEASIBILITY_STEPS: not decided yet
    h[1]["dual/floor_at_point/abs_prob_diff"] = 2.9e-3
    assert feasibility_warnings(h, ["abs_prob_diff"], con, "projected", "updates") == []
    assert feasibility_warnings(h[:n - 1], ["abs_prob_diff"], con, "projected", "updates") == []
    # a rule that does not move lambda cannot wind it up
    h[1]["dual/floor_at_point/abs_prob_diff"] = 4e-3
    assert feasibility_warnings(h, ["abs_prob_diff"], con, "fixed", "updates") == []


_RUN = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=2", "task.eval_size=4", "threads=1", "rollout.max_new_tokens=4", "rollout.precision=int8",
        "steps=3", "dual.relative=true", "tracking.async_log=false"]


@pytest.mark.slow
def test_a_run_whose_c_lies_under_the_floor_says_so_at_the_first_steps(tmp_path, caplog, monkeypatch):
    from dcmdp.config import load_config
    from dcmdp.loop import FEASIBILITY_STEPS, train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert FEASIBILITY_STEPS == 3
    con = "dual.constraints=[{measure: abs_prob_diff, tolerance: 1.0e-9, lambda_init: 0.1, lambda_max: 0.3, lr: 1.0}]"
    with caplog.at_level("WARNING", logger="dcmdp"):
        summary = train(load_config(None, [*_RUN, con, "dual.measure_at=updates", f"output_dir={tmp_path / 'u'}"]))
    (w,) = [r.getMessage() for r in caplog.records if "infeasible at its measurement point" in r.getMessage()]
    assert "is above c (1e-09, 1e-09, 1e-09)" in w
    assert any(x.startswith("constraint abs_prob_diff was infeasible from the start") for x in summary.warnings)
    assert any("lambda sat at its cap lambda_max on 100% of the steps" in x for x in summary.warnings)
    # the same c on the drift: its floor at the measurement point is 0, every step's D-hat is pi_theta vs pi_old
    caplog.clear()
    with caplog.at_level("WARNING", logger="dcmdp"):
        # an entropy bonus moves the weights even where every reward is 0 (an untrained model)
        summary = train(load_config(None, [*_RUN, con, "dual.measure_at=drift", "algo.entropy_coef=0.1",
                                           f"output_dir={tmp_path / 'd'}"]))
    assert not [r for r in caplog.records if "infeasible" in r.getMessage()]
    c = summary.constraints["abs_prob_diff"]
    assert c.start_floor == 0.0 and math.isfinite(c.measured_mean) and c.measured_mean >= 0.0
    # the first mini-batch update starts at pi_old (drift 0), the second one after a step: a positive mean drift
    assert c.measured_mean > 0.0
    # an automatic tolerance on the drift follows the run's own drift, not the engines' floor: with fp32 rollouts
    # (pi_old = mu to rounding) c is still (1 + s) x the drift, held after floor_steps batches
    summary = train(load_config(None, [*_RUN, "rollout.precision=fp32", "dual.measure_at=drift",
                                       "algo.entropy_coef=0.1", f"output_dir={tmp_path / 'a'}",
                                       "dual.constraints=[{measure: abs_prob_diff, floor_slack: 0.5, floor_steps: 1}]"]))
    c = summary.constraints["abs_prob_diff"]
    assert summary.mean_discrepancy["abs_prob_diff"] < 1e-5 < c.tolerance_start == c.tolerance_end
