"""The dual acts only where its penalty can move D-hat (constraints[i].authority): each anchor window sets the
penalty's reach against the batch spread; under authority x spread lambda is held at 0 and the updates carry no
penalty (the dual stands down), at or above it lambda starts from lambda_init and the rule moves it. Checked by hand
against the closed forms of the reach and the spread, on the placebo arms, the probes, the checkpointed state, the
config's refusals, and a real run that stands down throughout and so trains exactly as its lambda = 0 placebo."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from constraints.config import ConstraintConfig
from dcmdp.config import DualConfig
from dcmdp.dual import (DualState, anchor_due, applied_lambda, dual_step, init_state, penalty_spec, record_anchor,
                        stood_down)
from dcmdp.loop import constraint_summaries, end_of_run_warnings, stand_down_sentence

torch.set_num_threads(1)
NAME = "abs_prob_diff"
F64 = torch.float64


def _cfg(rule: str = "chance", authority=1.0, anchor_start: int = 10, lambda_init: float = 0.1) -> DualConfig:
    return DualConfig(rule=rule, measure_at="updates", constraints=[ConstraintConfig(
        measure=NAME, tolerance=0.005, floor_slack=1.0, anchor=0.5, anchor_start=anchor_start, anchor_batches=2,
        anchor_every=90, lambda_init=lambda_init, lambda_max=0.3, lr=0.02, miss_rate=0.2, authority=authority)])


def _t(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=F64)


def _drive(cfg: DualConfig, steps: int, probes, d_of_step=lambda k: 1e-3 * math.e ** (k % 2), state=None):
    """The loop's order per step: anchor_due, dual_step (D-hat from ``d_of_step``, floor 1e-3), record_anchor with the
    next probe pair (D_0, D_max) of ``probes`` on a due step. Returns the state, each step's metrics and the applied
    lambda of each step's updates (taken before its dual step, as the loop's penalty_spec)."""
    state = init_state(cfg) if state is None else state
    probes, rows, applied = list(probes), [], []
    for k in range(steps):
        due = anchor_due(state, cfg, k)
        applied.append(float(penalty_spec(state, cfg).lambda_C[0]))
        state, m = dual_step(state, _t(d_of_step(k)), cfg, floor_C=_t(1e-3))
        if any(due):
            d0, dmax = probes.pop(0)
            state, am = record_anchor(state, cfg, k, due, _t(d0), _t(dmax), _t(1e-3))
            m = {**m, **am}
        rows.append(m)
    return state, rows, applied


# Twelve steps of D-hat alternating 1e-3, e x 1e-3 before the window closes at step 11: log D-hat alternates 0, 1
# around its mean, so the spread (sd, ddof 1) is sqrt(12 x 0.25 / 11).
SPREAD_12 = math.sqrt(12 * 0.25 / 11)


def test_the_window_compares_the_probes_reach_with_the_recent_spread_by_hand():
    assert SPREAD_12 == pytest.approx(float(np.std(np.tile([0.0, 1.0], 6), ddof=1)), rel=1e-12)
    # reach log 1.6 = 0.470 < 0.522: the dual stands down; log 1.8 = 0.588 >= 0.522: it acts
    for ratio, acts in ((1.6, False), (1.8, True)):
        state, rows, applied = _drive(_cfg(), 12, [(8e-3, 8e-3 / ratio)] * 2)
        closed = rows[11]
        assert closed[f"dual/authority_reach/{NAME}"] == pytest.approx(math.log(ratio), rel=1e-12)
        assert closed[f"dual/authority_spread/{NAME}"] == pytest.approx(SPREAD_12, rel=1e-12)
        assert closed[f"dual/authority/{NAME}"] == float(acts)
        assert applied == [0.0] * 12  # before the window closed no update carried a penalty, dither or not
        assert all(r[f"dual/stood_down/{NAME}"] == 1.0 for r in rows)
        assert float(state.lambda_C[0]) == (0.1 if acts else 0.0)
        assert bool(stood_down(state, _cfg())[0]) is (not acts)
    # the authority factor scales the spread: at 2 x the spread even log 1.8 is not enough
    _, rows, _ = _drive(_cfg(authority=2.0), 12, [(8e-3, 8e-3 / 1.8)] * 2)
    assert rows[11][f"dual/authority/{NAME}"] == 0.0


def test_with_authority_the_rule_moves_lambda_and_the_updates_carry_it():
    state, _, _ = _drive(_cfg(), 12, [(8e-3, 8e-3 / 1.8)] * 2)
    # D-hat 0.05 is far outside c: the chance rule raises lambda by eta (1 - alpha) = 0.016 a step from lambda_init
    state, rows, applied = _drive(_cfg(), 3, [], d_of_step=lambda k: 0.05, state=state)
    lams = [r[f"dual/lambda/{NAME}"] for r in rows]
    assert lams == pytest.approx([0.116, 0.132, 0.148], abs=1e-12)
    assert all(r[f"dual/stood_down/{NAME}"] == 0.0 for r in rows)
    # the chance rule's dither: lambda +/- eta alternating, never 0
    assert all(a > 0.05 for a in applied)


def test_standing_down_holds_lambda_at_zero_and_the_next_window_decides_again():
    cfg = _cfg()
    # window 1 (steps 10-11) stands down; D-hat far outside c for 80 steps leaves lambda and the penalty at 0, and does
    # not count as lambda stuck at its floor (no extra window before anchor_every = 90 after step 11)
    probes = [(8e-3, 8e-3 / 1.6)] * 2 + [(8e-3, 8e-3 / 1.8)] * 2
    state, rows, applied = _drive(cfg, 103, probes, d_of_step=lambda k: 1e-3 * math.e ** (k % 2) if k < 12 else 0.05)
    windows = [k for k, r in enumerate(rows) if f"dual/anchor_zero/{NAME}" in r]
    assert windows == [10, 11, 101, 102]
    assert applied[:102] == [0.0] * 102 and all(r[f"dual/lambda/{NAME}"] == 0.0 for r in rows[:101])
    # window 2 closes at step 102: the recent 50 steps of D-hat are all 0.05 (spread 0), reach log 1.8 > 0: it acts
    assert rows[102][f"dual/authority/{NAME}"] == 1.0 and float(state.lambda_C[0]) == pytest.approx(0.1)


def test_the_placebo_arms_and_a_dual_without_authority_are_not_gated():
    for cfg, lam0 in ((_cfg(rule="fixed", lambda_init=0.3), 0.3), (_cfg(authority=None), 0.1)):
        state, rows, applied = _drive(cfg, 12, [(8e-3, 8e-3 / 1.6)] * 2)
        assert not any(f"dual/stood_down/{NAME}" in r or f"dual/authority/{NAME}" in r for r in rows)
        assert float(state.lambda_C[0]) >= lam0 - 0.02 - 1e-12 and applied[0] > 0


def test_the_probes_measure_the_penalty_the_dual_would_carry():
    cfg = _cfg()
    state = init_state(cfg)
    assert bool(stood_down(state, cfg)[0])
    probe = DualState(**{**state.__dict__, "lambda_C": _t(0.3), "lambda_avg_C": _t(0.3),
                         "rule": {**state.rule, "dither": 0.0}})
    assert float(penalty_spec(probe, cfg, stand_down=False).lambda_C[0]) == pytest.approx(0.3)
    assert float(penalty_spec(probe, cfg).lambda_C[0]) == 0.0
    assert float(applied_lambda(probe, cfg, stand_down=False)[0]) == pytest.approx(0.3)


def test_the_decision_survives_a_checkpoint_and_an_old_state_loads_as_not_yet_decided():
    cfg = _cfg()
    state, _, _ = _drive(cfg, 12, [(8e-3, 8e-3 / 1.8)] * 2)
    back = DualState.from_state_dict(json.loads(json.dumps(state.state_dict())))
    assert back.anchor["authority_C"] == [True] and not bool(stood_down(back, cfg)[0])
    old = state.state_dict()
    old["anchor"] = {k: v for k, v in old["anchor"].items() if k != "authority_C"}
    assert bool(stood_down(DualState.from_state_dict(old), cfg)[0])


@pytest.mark.parametrize("over, text", [
    ({"authority": 0.0}, "the least reach / spread at which the dual acts, a finite value > 0, got 0.0"),
    ({"authority": math.inf}, "a finite value > 0, got inf"),
    ({"anchor": None}, "compares the penalty's reach, which the anchor's probes measure; set 'c.anchor' too"),
])
def test_the_config_refuses_an_authority_it_cannot_use(over, text):
    c = ConstraintConfig(**{**dict(measure=NAME, floor_slack=1.0, anchor=0.5, authority=1.0), **over})
    with pytest.raises(ValueError, match="config error at 'c.a"):
        c.check("c")
    with pytest.raises(ValueError) as err:
        c.check("c")
    assert text in str(err.value)


def test_the_summary_says_what_the_dual_did_and_judges_no_fault_it_stood_down_for():
    assert stand_down_sentence(0, 0, 1.0, 1.0).startswith("the dual stood down throughout (lambda held at 0, no penalty)"
                                                          ": no anchor window closed")
    assert "none of its 7 anchor windows showed the reach at least 1 x the spread" in stand_down_sentence(7, 0, 1.0, 1.0)
    assert stand_down_sentence(7, 2, 0.64, 1.5).startswith("the dual acted on 2 of 7 anchor windows (reach at least "
                                                           "1.5 x the spread")
    assert "64% of the steps carried no penalty" in stand_down_sentence(7, 2, 0.64, 1.5)
    cfg = _cfg()
    # stood down throughout, D-hat outside c on every step after the window: no "not held" / "rested" warning
    _, rows, _ = _drive(cfg, 40, [(8e-3, 8e-3 / 1.6)] * 2, d_of_step=lambda k: 1e-3 * math.e ** (k % 2) if k < 12 else 0.05)
    summary = constraint_summaries(rows, [NAME], cfg.constraints)[NAME]
    assert summary.windows == 1 and summary.windows_acting == 0 and summary.stood_down_frac == 1.0
    assert all(math.isnan(x) for x in (summary.slack_frac, summary.cap_frac, summary.acting_frac))
    assert "the dual stood down throughout" in summary.control and summary.inside_frac < 0.1
    assert end_of_run_warnings({NAME: summary}, "chance", 0.5, 0.0, 0) == []
    # the same steps judged as a dual that acted: the faults are warned of
    acted = constraint_summaries([{k: v for k, v in r.items() if "stood_down" not in k and "authority" not in k}
                                  for r in rows], [NAME], cfg.constraints)[NAME]
    assert any("was not held" in w for w in end_of_run_warnings({NAME: acted}, "chance", 0.5, 0.0, 0))


BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=2", "task.eval_size=4", "threads=1", "progress=false", "rollout.max_new_tokens=4",
        "rollout.precision=int8", "optim.lr=5e-3", "dual.measure_at=updates", "steps=8", "tracking.enabled=false"]
ANCHORED = ("dual.constraints=[{measure: abs_prob_diff, floor_slack: 1.0, anchor: 0.5, anchor_start: 2, "
            "anchor_batches: 3, lambda_init: %g, lambda_max: 0.3, lr: 0.02, authority: %s}]")


def test_a_run_that_stands_down_throughout_trains_as_its_lambda_zero_placebo(tmp_path, capsys, monkeypatch):
    """A real run whose authority no window can meet (1e6 x the spread) against the same config with lambda fixed at
    0: the same D-hat, c and accuracy on every step (bit for bit), and its end says it stood down."""
    from dcmdp import cli

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = {}
    for arm, over in (("gated", ["dual.rule=chance", ANCHORED % (0.1, "1.0e6")]),
                      ("placebo", ["dual.rule=fixed", ANCHORED % (0.0, "null")])):
        out = tmp_path / arm
        assert cli.main(["train", *BASE, f"output_dir={out}", *over]) == 0
        runs[arm] = (json.loads((out / "summary.json").read_text()), capsys.readouterr().out)
    (gated, stdout), (placebo, _) = runs["gated"], runs["placebo"]
    g, p = gated["constraints"][NAME], placebo["constraints"][NAME]
    for key in ("measured_mean", "tolerance_start", "tolerance_end", "inside_frac", "reach", "spread"):
        assert g[key] == p[key], key
    assert gated["accuracy_after"] == placebo["accuracy_after"] and g["lambda_mean"] == 0.0
    assert g["windows"] == 1 and g["windows_acting"] == 0 and g["stood_down_frac"] == 1.0
    assert "the dual stood down throughout (lambda held at 0, no penalty): none of its 1 anchor window showed" in stdout
    assert not [x for x in stdout.splitlines() if x.startswith("warning:") and "rested" in x]
    assert "lambda mean 0, final 0, never in force (the dual stood down)" in stdout and "nan%" not in stdout
