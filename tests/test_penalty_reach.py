"""The penalty's reach against the batch spread (dcmdp.dual.penalty_reach, batch_spread; dcmdp.loop's summary): by
hand, both branches of what the share inside c then says, c's movement, the placebo arms' anchored c schedule, and a
tiny real anchored run whose summary.json and end lines carry them."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from constraints.config import ConstraintConfig
from dcmdp.config import DualConfig
from dcmdp.dual import (ANCHOR_STUCK, anchor_due, batch_spread, dual_step, init_state, penalty_reach, record_anchor,
                        tolerances)
from dcmdp.loop import C_MOVE_FACTOR, constraint_summaries, control_sentence, end_of_run_warnings

torch.set_num_threads(1)
NAME = "abs_prob_diff"


def test_reach_is_the_median_paired_log_ratio_of_the_probes():
    # log(6/5) = 0.18232, log(8/4) = 0.69315, log(5/5) = 0: the median is log 1.2; a pair with a value <= 0 or NaN
    # is left out, so the median of the three stays
    assert penalty_reach([6e-3, 8e-3, 5e-3], [5e-3, 4e-3, 5e-3]) == pytest.approx(math.log(1.2), rel=1e-12)
    assert penalty_reach([6e-3, 8e-3, 5e-3, 0.0, math.nan], [5e-3, 4e-3, 5e-3, 1e-3, 1e-3]) == pytest.approx(
        math.log(1.2), rel=1e-12)
    # an even count: the mean of the middle two, (log 1.2 + log 2) / 2
    assert penalty_reach([6e-3, 8e-3], [5e-3, 4e-3]) == pytest.approx((math.log(1.2) + math.log(2)) / 2, rel=1e-12)
    # a penalty that raises D-hat has a negative reach
    assert penalty_reach([4e-3], [5e-3]) == pytest.approx(math.log(0.8), rel=1e-12)
    assert penalty_reach([], []) is None and penalty_reach([0.0], [1e-3]) is None


def test_spread_is_the_sd_of_log_d_hat():
    # log D-hat = log 1e-3 + {0, 1, 2}: mean + 1, squared deviations 1 + 0 + 1 over n - 1 = 2: sd 1
    assert batch_spread([1e-3, 1e-3 * math.e, 1e-3 * math.e ** 2]) == pytest.approx(1.0, rel=1e-12)
    # {0, 0, 0, 0.4} on the log scale: mean 0.1, squared deviations 3 x 0.01 + 0.09 = 0.12, / 3 = 0.04: sd 0.2
    values = [2e-3, 2e-3, 2e-3, 2e-3 * math.exp(0.4), math.nan, 0.0]
    assert batch_spread(values) == pytest.approx(0.2, rel=1e-12)
    assert batch_spread([2e-3]) is None and batch_spread([]) is None


def test_the_sentence_says_control_only_where_the_reach_exceeds_the_spread():
    under = control_sentence(0.063, 0.31, 0.74, probes=16, steps=640, lambda_max=0.3)
    assert "the penalty's reach 0.063 (median log D_0 - log D_max over 16 probed batches)" in under
    assert "is under the batch spread 0.31 (sd of log D-hat over 640 steps after warm-up)" in under
    assert "cannot move D-hat much here, so inside c on 74% of the steps is set by where c sits, not by lambda" in under
    assert all(x in under for x in ("a longer horizon", "dual.measure_at=drift", "a larger lambda_max (now 0.3)"))
    assert "reflect control" not in under
    over = control_sentence(0.5, 0.31, 0.74, probes=1, steps=640, lambda_max=0.3)
    assert "over 1 probed batch)" in over and "is at least the batch spread 0.31" in over
    assert "can reflect control" in over and "placebos" in over and "cannot move" not in over
    # equal: the penalty moves D-hat as far as a batch scatters it, the branch that can reflect control
    assert "can reflect control" in control_sentence(0.31, 0.31, 0.74)
    unknown = control_sentence(None, 0.31, 0.74, steps=640)
    assert unknown.startswith("the penalty's reach was not measured (no probe ran") and "0.31" in unknown
    assert "not evidence of control" in unknown and not re.search(r"reach \d", unknown)
    assert "not compared" in control_sentence(0.1, None, 0.74, probes=2)


def _row(d, c, lam, d0=None, dmax=None):
    row = {f"dual/measured/{NAME}": d, f"dual/tolerance/{NAME}": c, f"dual/lambda/{NAME}": lam}
    if d0 is not None:
        row.update({f"dual/anchor_zero/{NAME}": d0, f"dual/anchor_max/{NAME}": dmax})
    return row


def test_the_summary_reports_reach_spread_and_cs_movement_by_hand():
    """Steps 1-2 are the warm-up (D-hat 1e-2, left out of the spread); steps 3-4 are probed (D_0 / D_max = 1.2 and
    2: reach = (log 1.2 + log 2) / 2); the window closes at step 4; c = 3e-3 then 5e-3 from step 5 on."""
    anchored = [ConstraintConfig(measure=NAME, floor_slack=1.0, anchor=0.5, lambda_max=0.3)]
    rows = [_row(1e-2, 3e-3, 0.1), _row(1e-2, 3e-3, 0.1), _row(2e-3, 3e-3, 0.1, 6e-3, 5e-3),
            _row(2e-3, 3e-3, 0.1, 8e-3, 4e-3)]
    rows[3][f"dual/anchor_gap/{NAME}"] = 1e-3
    rows += [_row(2e-3 * math.exp(0.4), 5e-3, 0.2), _row(2e-3, 5e-3, 0.2)]
    (s,) = constraint_summaries(rows, [NAME], anchored, warmup=2).values()
    assert s.reach == pytest.approx((math.log(1.2) + math.log(2)) / 2, rel=1e-12) and s.reach_probes == 2
    # steps 3-6: log D-hat = log 2e-3 + {0, 0, 0.4, 0}: sd 0.2 (test_spread_is_the_sd_of_log_d_hat)
    assert s.spread == pytest.approx(0.2, rel=1e-12) and s.spread_steps == 4
    assert s.reach > s.spread and "can reflect control" in s.control
    # the summarised steps start after the window: c 5e-3 throughout, so no movement
    assert (s.tolerance_min, s.tolerance_max) == (5e-3, 5e-3)
    # without the warm-up cut the spread takes the warm-up's 1e-2 too
    (s0,) = constraint_summaries(rows, [NAME], anchored).values()
    logs = np.log([1e-2, 1e-2, 2e-3, 2e-3, 2e-3 * math.exp(0.4), 2e-3])
    assert s0.spread == pytest.approx(float(np.std(logs, ddof=1)), rel=1e-12) and s0.reach < s0.spread
    assert "cannot move D-hat much here" in s0.control
    # a fixed tolerance: no probe ran, the reach is not measured, and nothing stands in for it
    fixed = [ConstraintConfig(measure=NAME, tolerance=3e-3, lambda_max=0.3)]
    plain = [{k: v for k, v in r.items() if "anchor" not in k} for r in rows]
    (sf,) = constraint_summaries(plain, [NAME], fixed, warmup=2).values()
    assert sf.reach is None and sf.reach_probes == 0 and "was not measured" in sf.control
    assert (sf.tolerance_min, sf.tolerance_max) == (3e-3, 5e-3)


def test_a_c_that_moves_more_than_the_factor_is_warned_of_under_every_rule():
    con = [ConstraintConfig(measure=NAME, lambda_max=0.3)]
    # c 3e-3 -> 4.5e-3: exactly 1.5x is not more; 3e-3 -> 4.6e-3 is (and under fixed, which moves no lambda, too)
    at = lambda top: [_row(2e-3, 3e-3, 0.1)] * 5 + [_row(2e-3, top, 0.1)] * 5  # noqa: E731
    assert C_MOVE_FACTOR == 1.5
    assert not [w for w in end_of_run_warnings(constraint_summaries(at(4.5e-3), [NAME], con), "chance", 0.5, 0.0, 100)
                if "c moved" in w]
    for rule in ("chance", "fixed"):
        (w,) = [w for w in end_of_run_warnings(constraint_summaries(at(4.6e-3), [NAME], con), rule, 0.5, 0.0, 100)
                if "c moved" in w]
        assert w.startswith("constraint abs_prob_diff: c moved 1.5x during the run (from 0.003 to 0.0046; 0.003 at "
                            "the start, 0.0046 at the end), more than 1.5x"), w


def _placebo_cfg(rule: str, lambda_init: float) -> DualConfig:
    return DualConfig(rule=rule, measure_at="updates", constraints=[ConstraintConfig(
        measure=NAME, tolerance=0.005, floor_slack=1.0, anchor=0.5, anchor_start=2, anchor_batches=2, anchor_every=90,
        lambda_init=lambda_init, lambda_max=0.3, lr=0.02, miss_rate=0.2)])


def _anchor_schedule(cfg: DualConfig, steps: int, d: float) -> tuple[list[int], list[float]]:
    """Drive the dual as the loop does, with a steady floor 2e-3 and D-hat ``d``: the steps whose batch is probed
    (D_0 = 6e-3, D_max = 4e-3) and the tolerance in force after each step."""
    state, due_steps, c = init_state(cfg), [], []
    for step in range(steps):
        due = anchor_due(state, cfg, step)
        state, _ = dual_step(state, torch.tensor([d], dtype=torch.float64), cfg, floor_C=torch.tensor([2e-3]))
        if any(due):
            due_steps.append(step)
            state, _ = record_anchor(state, cfg, step, due, torch.tensor([6e-3]), torch.tensor([4e-3]),
                                     torch.tensor([2e-3]))
        c.append(tolerances(state, cfg).item())
    return due_steps, c


def test_the_placebo_arms_keep_the_anchored_c_and_its_schedule():
    """dual.rule=fixed with lambda_init 0 (no penalty) and lambda_init = lambda_max: the same anchored c = F + g and
    the same probe schedule as the chance rule (windows at steps 2-3, then every anchor_every = 90 steps), though
    lambda sits at an edge throughout; the chance rule, whose lambda is driven to its floor, re-anchors after
    ANCHOR_STUCK steps there instead."""
    windows = [2, 3, 93, 94]
    for lam in (0.0, 0.3):
        due, c = _anchor_schedule(_placebo_cfg("fixed", lam), 100, 1e-3)
        assert due == windows, (lam, due)
        assert c[1] == pytest.approx(4e-3) and c[4] > 2e-3 and c[4] != pytest.approx(0.005)  # F (1 + s), then F + g
    # D-hat inside c: lambda falls by 0.02 x 0.2 a step from 0.1 to 0 (25 steps), then sits there ANCHOR_STUCK steps
    due, _ = _anchor_schedule(_placebo_cfg("chance", 0.1), 100, 1e-3)
    assert due[:2] == [2, 3] and 3 + 25 + ANCHOR_STUCK <= due[2] < 93, due


BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=2", "task.eval_size=4", "threads=1", "progress=false", "rollout.max_new_tokens=4",
        "rollout.precision=int8", "optim.lr=5e-3", "dual.measure_at=updates", "steps=8", "tracking.enabled=false"]
ANCHORED = ("dual.constraints=[{measure: abs_prob_diff, floor_slack: 1.0, anchor: 0.5, anchor_start: 2, "
            "anchor_batches: 3, lambda_init: %g, lambda_max: 0.3, lr: 0.02}]")


@pytest.mark.parametrize("rule, lam", [("chance", 0.1), ("fixed", 0.0)])
def test_a_tiny_anchored_run_says_reach_and_spread_in_summary_json_and_at_its_end(tmp_path, capsys, monkeypatch,
                                                                                  rule, lam):
    """A real run with c anchored on 3 probed batches (steps 3-5): summary.json holds the reach (from the probes'
    logged D_0 and D_max), the spread and c's range, and the end lines say the branch that the two numbers give; the
    placebo (fixed, lambda 0) keeps the anchored c and its probes."""
    from dcmdp import cli

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    assert cli.main(["train", *BASE, f"output_dir={out}", f"dual.rule={rule}", ANCHORED % lam]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    c = summary["constraints"][NAME]
    assert c["reach_probes"] == 3 and isinstance(c["reach"], float)
    assert c["spread_steps"] == 8 and isinstance(c["spread"], float) and c["spread"] > 0
    assert c["tolerance_min"] <= c["tolerance_start"] <= c["tolerance_max"]
    assert c["tolerance_min"] != 0.005  # the anchored c, not the configured placeholder
    branch = "cannot move D-hat much here" if c["reach"] < c["spread"] else "can reflect control"
    assert branch in c["control"]
    (line,) = [x for x in stdout.splitlines() if x.startswith(f"constraint {NAME}: the penalty's reach")]
    assert line == f"constraint {NAME}: {c['control']}"
    assert f"the penalty's reach {c['reach']:.3g} (median log D_0 - log D_max over 3 probed batches)" in line
    assert f"spread {c['spread']:.3g} (sd of log D-hat over 8 steps after warm-up)" in line
