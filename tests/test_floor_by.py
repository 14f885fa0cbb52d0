"""One floor per rollout precision (dual.floor_by=precision): each precision keeps its own EMA of the floor behind
an automatic tolerance; the float64 reference is one EMA per precision, computed here in closed form."""

from __future__ import annotations

import json

import pytest
import torch

from constraints.config import ConstraintConfig
from dcmdp.config import ConfigError, DualConfig, load_config
from dcmdp.dual import DualState, dual_step, enter_floor, init_state, needs_floor
from dcmdp.loop import train
from runs import metric_history

SLACK, EMA = 0.5, 0.8
CFG = DualConfig(rule="projected", relative=True,
                 constraints=[ConstraintConfig(measure="abs_prob_diff", tolerance=0.005, lambda_init=0.1, lr=0.5,
                                               lambda_max=2.0, floor_slack=SLACK, floor_ema=EMA),
                              ConstraintConfig(measure="kl_k3", tolerance=1e-3, lambda_init=0.1, lr=0.5)])


def test_each_precision_keeps_its_own_floor_ema():
    """Batches fp32, fp32, int4, int4, fp8, int4, fp32: the tolerance in force at each dual step is (1 + s) times
    the EMA of that precision's own earlier floors (the batch's own floor at a precision's first batch), float64
    to 1e-15 relative; the fixed tolerance of the second constraint never moves."""
    keys = ["fp32", "fp32", "int4", "int4", "fp8", "int4", "fp32", "fp8"]
    scale = {"fp32": 1e-7, "int4": 4e-3, "fp8": 1e-3}
    rng = torch.Generator().manual_seed(0)
    noise = (1 + 0.2 * torch.rand(len(keys), generator=rng, dtype=torch.float64)).tolist()
    state, ref = init_state(CFG), {}
    for key, u in zip(keys, noise):
        state = enter_floor(state, key)
        d = scale[key] * u
        state, metrics = dual_step(state, torch.tensor([d, 2e-3], dtype=torch.float64), CFG)
        floor_before = ref.get(key, d)  # a precision's first batch seeds its floor and sets its own tolerance
        assert metrics["dual/tolerance/abs_prob_diff"] == pytest.approx((1 + SLACK) * floor_before, rel=1e-15)
        assert metrics["dual/tolerance/kl_k3"] == 1e-3
        ref[key] = EMA * ref[key] + (1 - EMA) * d if key in ref else d
        assert float(state.floor_C[0]) == pytest.approx(ref[key], rel=1e-15)
        assert torch.isnan(state.floor_C[1])
    # the stored floors are the other precisions' EMAs
    assert set(state.floors) == {"fp32", "int4"}
    for key in ("fp32", "int4"):
        assert state.floors[key][0] == pytest.approx(ref[key], rel=1e-15) and state.floors[key][1] is None


def test_a_single_floor_carries_the_first_precision_into_the_next():
    """Without floor_by the fp32 floor sets int4's tolerance: the failure the option removes."""
    state = init_state(CFG)
    state, _ = dual_step(state, torch.tensor([1e-7, 2e-3], dtype=torch.float64), CFG)
    _, metrics = dual_step(state, torch.tensor([4e-3, 2e-3], dtype=torch.float64), CFG)
    assert metrics["dual/tolerance/abs_prob_diff"] == pytest.approx(1.5e-7, rel=1e-12)


def test_needs_floor_and_the_first_precision_takes_the_state():
    state = init_state(CFG)
    assert needs_floor(state, CFG)
    state = enter_floor(state, "int4")
    assert state.floor_key == "int4" and state.floors == {} and needs_floor(state, CFG)
    state, _ = dual_step(state, torch.tensor([4e-3, 2e-3], dtype=torch.float64), CFG)
    assert not needs_floor(state, CFG)
    assert enter_floor(state, "int4") is state
    state = enter_floor(state, "fp8")
    assert needs_floor(state, CFG)
    assert not needs_floor(enter_floor(state, "int4"), CFG)
    fixed_only = DualConfig(constraints=[ConstraintConfig(measure="abs_prob_diff", tolerance=0.005)])
    assert not needs_floor(init_state(fixed_only), fixed_only)


def test_checkpoint_round_trip_keeps_every_floor():
    state = init_state(CFG)
    for key, d in (("fp32", 1e-7), ("int4", 4e-3), ("fp8", 1e-3)):
        state = enter_floor(state, key)
        state, _ = dual_step(state, torch.tensor([d, 2e-3], dtype=torch.float64), CFG)
    back = DualState.from_state_dict(json.loads(json.dumps(state.state_dict())))
    assert back.state_dict() == state.state_dict()
    for key in ("int4", "fp32"):
        assert torch.allclose(enter_floor(back, key).floor_C, enter_floor(state, key).floor_C, rtol=0, atol=0,
                              equal_nan=True)


def test_bad_floor_by_configs_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"dual\.floor_by.*unknown 'digits'"):
        load_config(None, [f"output_dir={tmp_path}", "dual.floor_by=digits"])
    # the default constraint has a fixed tolerance: no floor to keep
    with pytest.raises(ConfigError, match=r"dual\.floor_by.*floor_slack"):
        load_config(None, [f"output_dir={tmp_path}", "dual.floor_by=precision"])


def _switch_run(tmp_path, name: str, *extra: str):
    """Asynchronous rollouts 2 versions stale, fp32 for steps 1-3 then int4: step 4's batch is stale."""
    return train(load_config(None, [
        "model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
        "steps=6", "threads=1", "progress=false", "task.eval_size=8", f"output_dir={tmp_path / name}",
        "rollout.precision=fp32", "async_rollout.enabled=true", "async_rollout.max_staleness=2",
        "async_rollout.threads=1", "dual.rule=projected", "dual.relative=true",
        "dual.constraints=[{measure: abs_prob_diff, tolerance: 0.005, lambda_init: 0.1, lr: 0.5, floor_slack: 0.5}]",
        "rollout.precision_schedule=[{until_step: 3, precision: fp32}, {precision: int4}]", *extra]))


def test_a_run_measures_the_new_precisions_floor_at_the_switch(tmp_path):
    """With floor_by=precision the first int4 batch (step 4) is sampled again with the trainer's weights, so its
    D-hat is int4's floor and sets the tolerance of that step (c = 1.5 D-hat, float64); the stale int4 batches after
    it leave the floor as it is. Without it the tolerance at step 4 stays at fp32's floor."""
    torch.set_num_threads(1)
    with_floor = _switch_run(tmp_path, "by_precision", "dual.floor_by=precision")
    assert metric_history(with_floor, "async/resampled_fresh") == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert metric_history(with_floor, "async/staleness_max")[3] == 0.0
    d = metric_history(with_floor, "dual/measured/abs_prob_diff")
    c = metric_history(with_floor, "dual/tolerance/abs_prob_diff")
    assert c[3] == pytest.approx(1.5 * d[3], rel=1e-12)
    assert c[4] == c[3] and c[5] == c[3]  # stale batches (version < step) measure no floor
    single = _switch_run(tmp_path, "single")
    assert metric_history(single, "async/resampled_fresh") == [0.0] * 6
    c_single = metric_history(single, "dual/tolerance/abs_prob_diff")
    assert c_single[3] == c_single[1]  # fp32's floor, held through the stale int4 batches
    assert c[3] > 10 * c_single[3]
