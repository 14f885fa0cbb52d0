"""The chance rule and the anchored tolerance (dcmdp.dual, dcmdp.probe): the rule against its closed-form equilibrium
on a noisy monotone response, its sign test on scripted U-shaped responses, the anchor's arithmetic and schedule by
hand, and the probes on a real tiny model (every pass from the same weights, which are put back bit for bit)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from constraints.config import ConstraintConfig
from dcmdp.config import DualConfig
from dcmdp.dual import (SIGN_WINDOW, DualState, anchor_due, anchor_gap, applied_lambda, dual_step, init_state,
                        record_anchor, tolerances)

torch.set_num_threads(1)


def _chance_cfg(c: float, lambda_init: float, lr: float = 0.01, miss_rate: float = 0.2,
                lambda_max: float = 1.0) -> DualConfig:
    return DualConfig(rule="chance", constraints=[ConstraintConfig(
        measure="abs_prob_diff", tolerance=c, lambda_init=lambda_init, lambda_max=lambda_max, lr=lr,
        miss_rate=miss_rate)])


def _respond(cfg: DualConfig, response, steps: int, noise: float, seed: int = 0):
    """Drive dual_step with a scripted D_hat(lambda): each batch's D_hat is response(the lambda its updates carried,
    i.e. the dithered one) x (1 + noise N(0, 1)). Returns lambda (undithered) and D_hat per step."""
    rng = np.random.default_rng(seed)
    state = init_state(cfg)
    lams, ds = [], []
    for _ in range(steps):
        carried = applied_lambda(state, cfg).item()
        d = response(carried) * (1.0 + noise * rng.standard_normal())
        lams.append(state.lambda_C.item())
        ds.append(d)
        state, _ = dual_step(state, torch.tensor([d], dtype=torch.float64), cfg)
    return np.array(lams), np.array(ds)


def _falling(lam: float) -> float:
    return 2e-3 + 4e-3 * math.exp(-5.0 * lam)


def _u(lam: float) -> float:
    """D_hat(lambda) with a U: least 3e-3 at lambda* = 0.15 (tests/test_dual.py's shape)."""
    return 3e-3 * (1.0 + 13.0 * (lam - 0.15) ** 2)


def test_chance_rule_step_by_hand_and_the_dither():
    cfg = _chance_cfg(c=3e-3, lambda_init=0.1, lr=0.02, miss_rate=0.2)
    state = init_state(cfg)
    # the first batch carries lambda + eta, the second lambda' - eta, ...
    assert applied_lambda(state, cfg).item() == pytest.approx(0.12)
    state, m = dual_step(state, torch.tensor([4e-3], dtype=torch.float64), cfg)   # outside: + 0.02 x (1 - 0.2)
    assert state.lambda_C.item() == pytest.approx(0.1 + 0.016, abs=1e-12)
    assert applied_lambda(state, cfg).item() == pytest.approx(0.116 - 0.02, abs=1e-12)
    state, _ = dual_step(state, torch.tensor([2e-3], dtype=torch.float64), cfg)   # inside: - 0.02 x 0.2
    assert state.lambda_C.item() == pytest.approx(0.116 - 0.004, abs=1e-12)
    # the dither never leaves [lambda_min, lambda_max]
    low = init_state(_chance_cfg(c=3e-3, lambda_init=0.0, lr=0.02))
    assert applied_lambda(low, _chance_cfg(c=3e-3, lambda_init=0.0, lr=0.02)).item() == pytest.approx(0.02)
    assert m["dual/direction/abs_prob_diff"] == 1.0


def test_chance_rule_holds_d_hat_inside_c_on_one_minus_alpha_of_the_steps():
    # D_hat = D(lambda) (1 + 0.1 z): the stationary lambda* of E[1(D_hat > c)] = alpha solves
    # D(lambda*) (1 + 0.1 z_{1-alpha}) = c. The mean-based projected rule holds E[D_hat] = c instead (inside ~50%).
    c, alpha, noise = 3.2e-3, 0.2, 0.1
    lam_star = brentq(lambda x: _falling(x) * (1 + noise * norm.ppf(1 - alpha)) - c, 0.0, 1.0)
    lam, d = _respond(_chance_cfg(c, 0.0, lr=0.01, miss_rate=alpha), _falling, 4000, noise, seed=3)
    late = slice(1000, None)
    assert abs(float(np.median(lam[late])) - lam_star) < 0.03
    assert 0.76 <= float((d[late] <= c).mean()) <= 0.84
    assert (lam[late] > 0.01).mean() == 1.0 and (lam[late] >= 1.0 - 1e-12).mean() == 0.0


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_chance_rule_turns_down_on_the_right_arm_of_the_u_and_settles_left_of_the_bottom(noise):
    # c = 3.5e-3 is feasible: D_hat = c at lambda = 0.041 and 0.259. Started at 0.6 (right arm, outside c), ascent
    # would run to the cap; the dithered slope is positive there, so lambda walks down across the bottom and holds
    # the left branch, where raising lambda lowers D_hat
    c = 3.5e-3
    lam, d = _respond(_chance_cfg(c, 0.6, lr=0.01), _u, 1500, noise, seed=4)
    late = slice(700, None)
    assert (lam[late] >= 1.0 - 1e-12).mean() == 0.0
    assert float(np.median(lam[late])) < 0.15 + 0.02
    assert float((d[late] <= c).mean()) >= 0.7


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_chance_rule_holds_the_bottom_of_the_u_when_c_is_infeasible(noise):
    # c = 2.5e-3 lies under the least D_hat (3e-3 at 0.15): every step is outside; ascent alone would wind up to the
    # cap, the sign test turns lambda down each time the slope it reads is significantly positive. Without noise it
    # stays within a few steps of the bottom; with 5% noise the slope near the bottom is within its error, so lambda
    # swings over the bottom's right side (0.1-0.3) before the slope is read, and mean D_hat stays within ~20% of its least
    lam, d = _respond(_chance_cfg(2.5e-3, 0.05, lr=0.01), _u, 1500, noise, seed=5)
    late = slice(500, None)
    assert abs(float(np.mean(lam[late])) - 0.15) < (0.03 if noise == 0 else 0.12)
    assert float(np.quantile(lam[late], 0.9)) < 0.35 and (lam[late] >= 1.0 - 1e-12).mean() == 0.0
    assert float(np.mean(d[late])) < (1.05 if noise == 0 else 1.25) * 3e-3


def test_chance_rule_steps_down_from_a_cap_that_does_not_hold_d_hat():
    # D_hat does not respond to lambda and stays outside: after SIGN_WINDOW + 1 steps at the cap (the dither reads no
    # slope) the rule steps lambda down by eta (1 - alpha)
    cfg = _chance_cfg(3e-3, 1.0, lr=0.02)
    lam, _ = _respond(cfg, lambda x: 4e-3, SIGN_WINDOW + 2, 0.0)
    assert (lam[:SIGN_WINDOW + 1] == 1.0).all()
    assert lam[SIGN_WINDOW + 1] == pytest.approx(1.0 - 0.02 * 0.8, abs=1e-12)


# ------------------------------------------------------------------ the anchored tolerance


def _anchor_cfg(**kw) -> DualConfig:
    c = dict(measure="abs_prob_diff", tolerance=0.005, floor_slack=1.0, anchor=0.5, anchor_start=2, anchor_batches=2,
             anchor_every=10, anchor_ratio=1.5, lambda_init=0.1, lambda_max=0.3, lr=0.02)
    c.update(kw)
    return DualConfig(rule="chance", measure_at="updates", constraints=[ConstraintConfig(**c)])


def test_anchor_gap_by_hand():
    z = norm.ppf(0.8)
    # too few recent steps: the probes give the level. D_0 = 6e-3, D_max = 5e-3 on both batches: Delta = log 1.2,
    # log c = log 6e-3 - Delta + 0.5 Delta (sigma 0): c = 6e-3 / sqrt(1.2); g = c - F
    g = anchor_gap([6e-3, 6e-3], [5e-3, 5e-3], [2e-3, 2e-3], [], 0.3, 0.5, 0.2)
    assert g == pytest.approx(6e-3 / math.sqrt(1.2) - 2e-3, rel=1e-12)
    # the run's recent D-hat at lambda-bar = 0.15 (midway to lambda_max = 0.3), half at 5e-3 e^0.1 and half at
    # 5e-3 e^-0.1: median log 5e-3, MAD 0.1; xi = 0.5 puts c at that level, plus z sigma
    recent = [[0.15, 5e-3 * math.exp(0.1)]] * 5 + [[0.15, 5e-3 * math.exp(-0.1)]] * 5
    g = anchor_gap([6e-3, 6e-3], [5e-3, 5e-3], [2e-3, 2e-3], recent, 0.3, 0.5, 0.2)
    assert g == pytest.approx(5e-3 * math.exp(z * 1.4826 * 0.1) - 2e-3, rel=1e-9)
    # one odd batch of three does not move c (medians)
    odd = anchor_gap([6e-3, 6e-3, 60e-3], [5e-3, 5e-3, 20e-3], [2e-3, 2e-3, 2e-3], recent, 0.3, 0.5, 0.2)
    assert odd == pytest.approx(g, rel=1e-9)
    # lambda_max does not lower D_hat: c at the recent level plus z sigma, which the dual rests under
    flat = anchor_gap([5e-3], [5.5e-3], [2e-3], recent, 0.3, 0.5, 0.2)
    assert flat == pytest.approx(5e-3 * math.exp(z * 1.4826 * 0.1) - 2e-3, rel=1e-9)
    assert anchor_gap([1e-3], [0.9e-3], [2e-3], [], 0.3, 0.5, 0.2) == 0.0  # never under the floor


def test_anchor_window_schedule_and_the_tolerance_it_sets():
    cfg = _anchor_cfg()
    state = init_state(cfg)
    assert anchor_due(state, cfg, 0) == [False] and anchor_due(state, cfg, 1) == [False]
    lam0 = state.lambda_C.item()
    # the floor seeds c = F (1 + floor_slack) until the window closes; lambda holds (no tolerance to hold yet)
    state, _ = dual_step(state, torch.tensor([9e-3], dtype=torch.float64), cfg, floor_C=torch.tensor([2e-3]))
    assert tolerances(state, cfg).item() == pytest.approx(4e-3)
    assert state.lambda_C.item() == lam0
    for step, (d0, dmax) in zip((2, 3), ((6e-3, 4e-3), (8e-3, 4e-3))):
        assert anchor_due(state, cfg, step) == [True]
        state, m = record_anchor(state, cfg, step, [True], torch.tensor([d0]), torch.tensor([dmax]),
                                 torch.tensor([2e-3]))
    # D_0 = {6, 8}e-3, D_max = {4, 4}e-3, F = 2e-3 (anchor_gap)
    g = anchor_gap([6e-3, 8e-3], [4e-3, 4e-3], [2e-3, 2e-3], [], 0.3, 0.5, 0.2)  # 1 recent step: the probes' level
    assert m["dual/anchor_gap/abs_prob_diff"] == pytest.approx(g)
    assert tolerances(state, cfg).item() == pytest.approx(2e-3 + g)
    assert anchor_due(state, cfg, 4) == [False]
    # lambda moves once anchored
    moved, _ = dual_step(state, torch.tensor([9e-3], dtype=torch.float64), cfg, floor_C=torch.tensor([2e-3]))
    assert moved.lambda_C.item() > lam0
    # c follows the floor additively; a floor 1.5x away re-opens the window, and so does anchor_every
    state.floor_C = torch.tensor([2.9e-3], dtype=torch.float64)
    assert tolerances(state, cfg).item() == pytest.approx(2.9e-3 + g) and anchor_due(state, cfg, 5) == [False]
    state.floor_C = torch.tensor([3.1e-3], dtype=torch.float64)
    assert anchor_due(state, cfg, 5) == [True]
    state.floor_C = torch.tensor([2e-3], dtype=torch.float64)
    assert anchor_due(state, cfg, 12) == [False] and anchor_due(state, cfg, 13) == [True]
    # lambda held at its floor (or cap) for ANCHOR_STUCK steps: probed again
    from dcmdp.dual import ANCHOR_STUCK
    stuck = state
    for _ in range(ANCHOR_STUCK + 30):  # lambda falls by 0.004 a step from 0.1 to 0, then stays
        stuck, _ = dual_step(stuck, torch.tensor([1e-4], dtype=torch.float64), cfg, floor_C=torch.tensor([2e-3]))
    assert stuck.lambda_C.item() == 0.0 and anchor_due(stuck, cfg, 6) == [True]
    # the state round-trips through a checkpoint
    again = DualState.from_state_dict(state.state_dict())
    assert again.anchor == state.anchor and tolerances(again, cfg).item() == pytest.approx(tolerances(state, cfg).item())


def test_anchor_needs_the_updates_and_an_automatic_tolerance():
    from dcmdp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="measure_at=updates"):
        load_config("configs/default.yaml", ["dual.measure_at=drift", "cold_start.steps=1"])
    with pytest.raises(Exception, match="floor_slack"):
        ConstraintConfig(anchor=0.5).check("dual.constraints[0]")
    with pytest.raises(Exception, match="miss_rate"):
        ConstraintConfig(miss_rate=1.0).check("dual.constraints[0]")


def test_probes_run_from_the_same_weights_and_put_everything_back(tmp_path):
    """Two probe passes at the same lambda give the same D-hat bit for bit (same weights, moments, schedule,
    mini-batches); the model and the optimiser are as before; and a probe's D-hat is the one the real update at that
    lambda then measures (dcmdp.loop's D-hat at the updates)."""
    from dataclasses import replace

    from dcmdp.config import load_config
    from dcmdp.dual import penalty_spec
    from dcmdp.loop import reward_phase, rollout_phase, screen_phase, setup, train_step
    from dcmdp.policy import step_seed
    from dcmdp.probe import constraint_values, probe_updates
    from trainers import learner

    cfg = load_config("configs/default.yaml", [
        f"output_dir={tmp_path / 'run'}", "cold_start.steps=20", "cold_start.target_accuracy=null",
        "algo.prompts_per_step=4", "algo.samples_per_prompt=4", "algo.std_normalize=false", "steps=3",
        "optim.warmup_steps=2", "progress=false", "tracking.enabled=false"])
    s = setup(cfg, owns_folder=False)
    try:
        train_step(s, 0)  # AdamW with moments and a schedule under way, as a run has them
        examples, rollout = rollout_phase(s.policy, cfg, 1)
        rewards_B, _ = reward_phase(s.policy, examples, rollout)
        rollout, adv_B, _, _ = screen_phase(cfg.algo, rollout, rewards_B)
        batch = learner.score_old(s.policy.model, rollout, adv_B, cfg.algo, s.scoring)
        weights = {k: v.clone() for k, v in s.policy.model.state_dict().items()}
        steps_before = [st["step"].clone() for st in s.optim.optimizer.state.values() if "step" in st]
        lr_before = s.optim.scheduler.get_last_lr()
        zero, cap = torch.zeros(1, dtype=torch.float64), torch.tensor([0.3], dtype=torch.float64)
        d0, dmax, d0_again = probe_updates(s.policy.model, s.optim, batch, scoring=s.scoring, algo=cfg.algo,
                                           dual_state=s.state.dual, dual_cfg=cfg.dual, lambdas=[zero, cap, zero],
                                           seed=step_seed(cfg.seed, 1, 2))
        assert torch.equal(d0, d0_again) and not torch.equal(d0, dmax)
        for k, v in s.policy.model.state_dict().items():
            assert torch.equal(v, weights[k]), k
        steps_after = [st["step"] for st in s.optim.optimizer.state.values() if "step" in st]
        assert all(torch.equal(a, b) for a, b in zip(steps_before, steps_after))
        assert s.optim.scheduler.get_last_lr() == lr_before
        # the real update at lambda_max measures what the probe did
        state = replace(s.state.dual, lambda_C=cap, lambda_avg_C=cap, rule={**s.state.dual.rule, "dither": 0.0})
        result = learner.update(s.policy.model, s.optim, batch, scoring=s.scoring,
                                penalty=penalty_spec(state, cfg.dual, stand_down=False),
                                cfg=cfg.algo, generator=torch.Generator().manual_seed(step_seed(cfg.seed, 1, 2)))
        assert torch.equal(constraint_values(cfg.dual.constraints, batch, result.trained_logp_BT), dmax)
    finally:
        s.policy.engine.close()


def test_the_summary_of_an_anchored_constraint_starts_after_its_first_window():
    """Before the anchor's first window closes there is no tolerance in force (lambda holds): the run's summary counts
    inside, cap and acting shares from the step after it; a constraint never anchored is counted over every step."""
    from dcmdp.loop import constraint_summaries

    anchored = [ConstraintConfig(measure="abs_prob_diff", floor_slack=1.0, anchor=0.5, lambda_max=0.3)]
    # 3 steps outside c before the window closes (at the 3rd), then 4 steps inside with lambda acting
    rows = [{"dual/measured/abs_prob_diff": 5e-3, "dual/tolerance/abs_prob_diff": 3e-3,
             "dual/lambda/abs_prob_diff": 0.1} for _ in range(3)]
    rows[2]["dual/anchor_gap/abs_prob_diff"] = 2e-3
    rows += [{"dual/measured/abs_prob_diff": 4e-3, "dual/tolerance/abs_prob_diff": 5e-3,
              "dual/lambda/abs_prob_diff": 0.2} for _ in range(4)]
    (s,) = constraint_summaries(rows, ["abs_prob_diff"], anchored).values()
    assert s.inside_frac == 1.0 and s.acting_frac == 1.0 and s.measured_mean == pytest.approx(4e-3)
    plain = [ConstraintConfig(measure="abs_prob_diff", lambda_max=0.3)]
    (s,) = constraint_summaries(rows, ["abs_prob_diff"], plain).values()
    assert s.inside_frac == pytest.approx(4 / 7)
    (s,) = constraint_summaries(rows[:2], ["abs_prob_diff"], anchored).values()  # never anchored: every step
    assert s.inside_frac == 0.0
