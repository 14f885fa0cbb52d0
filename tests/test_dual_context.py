"""Per-context multipliers (dual.context): one set of multipliers per context of the batch, each moved only by
its own batches; the float64 reference is one independent dual state per context."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dcmdp.config import ConfigError, ContextConfig, DualConfig, load_config
from dcmdp.dual import DualState, dual_step, enter_context, init_state
from dcmdp.loop import train
from constraints.config import ConstraintConfig
from runs import metric_history

CFG = DualConfig(rule="projected", relative=True,
                 constraints=[ConstraintConfig(measure="abs_prob_diff", tolerance=0.01, lambda_init=0.1, lr=0.5,
                                               lambda_max=2.0)])


def test_each_context_moves_alone_and_matches_an_independent_dual_state():
    """Batches of contexts a, b, a, c, b, ...: the per-context state equals one plain dual state per context fed
    only that context's measurements (float64, exact), and a new context starts at lambda_init."""
    rng = torch.Generator().manual_seed(0)
    keys = ["a", "a", "b", "a", "c", "b", "b", "a", "c", "a"]
    measured = (0.02 * torch.rand(len(keys), generator=rng, dtype=torch.float64)).tolist()
    state, refs = init_state(CFG), {}
    for key, d in zip(keys, measured):
        state = enter_context(state, key, CFG)
        ref = refs.get(key, init_state(CFG))
        assert torch.equal(state.lambda_C, ref.lambda_C), key
        state, _ = dual_step(state, torch.tensor([d], dtype=torch.float64), CFG)
        refs[key], _ = dual_step(ref, torch.tensor([d], dtype=torch.float64), CFG)
        assert torch.equal(state.lambda_C, refs[key].lambda_C), key
    # a context's lambda after its own batches: the projected relative step, by hand
    lam = 0.1
    for key, d in zip(keys, measured):
        if key == "b":
            lam = min(max(lam + 0.5 * (d - 0.01) / 0.01, 0.0), 2.0)
    state = enter_context(state, "b", CFG)
    assert state.lambda_C.item() == pytest.approx(lam, abs=1e-15)
    assert state.steps == len(keys)  # the step count is the run's


def test_entering_the_active_context_changes_nothing_and_the_first_takes_the_state():
    state = init_state(CFG)
    state, _ = dual_step(state, torch.tensor([0.05], dtype=torch.float64), CFG)
    moved = state.lambda_C.clone()
    first = enter_context(state, "a", CFG)
    assert torch.equal(first.lambda_C, moved) and first.context == "a"
    assert enter_context(first, "a", CFG) is first
    other = enter_context(first, "b", CFG)
    assert other.lambda_C.item() == 0.1 and other.contexts == {"a": {"lambda_C": moved.tolist(), "rule": {},
                                                                       "lambda_avg_C": first.lambda_avg().tolist()}}


def test_the_pid_state_is_per_context():
    cfg = DualConfig(rule="pid", constraints=CFG.constraints)
    cfg.pid.kp = 1.0
    state = enter_context(init_state(cfg), "a", cfg)
    state, _ = dual_step(state, torch.tensor([0.5], dtype=torch.float64), cfg)
    a_rule = json.loads(json.dumps(state.rule))
    state = enter_context(state, "b", cfg)
    assert state.rule == init_state(cfg).rule
    state, _ = dual_step(state, torch.tensor([0.0], dtype=torch.float64), cfg)
    state = enter_context(state, "a", cfg)
    assert state.rule == a_rule


def test_checkpoint_round_trip_keeps_every_context():
    state = init_state(CFG)
    for key, d in (("a", 0.03), ("b", 0.0), ("c", 0.02), ("b", 0.015)):
        state = enter_context(state, key, CFG)
        state, _ = dual_step(state, torch.tensor([d], dtype=torch.float64), CFG)
    back = DualState.from_state_dict(json.loads(json.dumps(state.state_dict())))
    assert back.state_dict() == state.state_dict()
    for key in ("a", "c", "b"):
        assert torch.equal(enter_context(back, key, CFG).lambda_C, enter_context(state, key, CFG).lambda_C)
    # a state written before contexts existed loads without them
    old = {k: v for k, v in state.state_dict().items() if k not in ("contexts", "context")}
    assert DualState.from_state_dict(old).contexts is None


def test_context_keys():
    s = ContextConfig(by="staleness", edges=[1, 4])
    assert [s.key(x, "int4", 3)[1] for x in (0.0, 0.99, 1.0, 3.5, 4.0, 8.0)] == [0, 0, 1, 1, 2, 2]
    assert ContextConfig(by="precision").key(0.0, "fp8", 3) == ("fp8", 8.0)
    assert ContextConfig(by="precision").key(0.0, "int8", 3)[0] != "fp8"
    assert ContextConfig(by="digits").key(0.0, "int4", 6) == ("digits6", 6.0)


@pytest.mark.parametrize("overrides,key", [
    (["dual.context.by=length"], "dual.context.by"),
    (["dual.context.by=precision", "dual.context.edges=[1]"], "dual.context.edges"),
    (["dual.context.by=staleness", "async_rollout.enabled=true", "dual.context.edges=[2, 2]"], "dual.context.edges"),
    (["dual.context.by=precision", "dual.average=true"], "dual.average"),
    (["dual.context.by=staleness"], "dual.context.by"),
])
def test_bad_context_configs_name_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [f"output_dir={tmp_path}", *overrides])


def test_a_run_switches_multipliers_with_the_rollout_precision(tmp_path):
    """fp32 (steps 1-2) -> int4 (3-4) -> fp32 (5): int4's multiplier starts at lambda_init, and back in fp32 the
    dual step continues from fp32's last multiplier (the projected step on step 5's D-hat, float64)."""
    torch.set_num_threads(1)
    summary = train(load_config(None, [
        "model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
        "steps=5", "threads=1", "progress=false", "task.eval_size=8", f"output_dir={tmp_path / 'run'}",
        "rollout.precision=fp32", "dual.context.by=precision", "dual.rule=projected",
        "dual.constraints=[{measure: abs_prob_diff, tolerance: 1e-4, lambda_init: 0.2, lr: 50.0}]",
        "rollout.precision_schedule=[{until_step: 2, precision: fp32}, {until_step: 4, precision: int4}, "
        "{precision: fp32}]"]))
    assert metric_history(summary, "dual/context") == [32.0, 32.0, 4.0, 4.0, 32.0]
    lam = metric_history(summary, "dual/lambda/abs_prob_diff")
    d = metric_history(summary, "dual/measured/abs_prob_diff")
    c = metric_history(summary, "dual/tolerance/abs_prob_diff")

    def step(prev, i):
        return min(max(prev + 50.0 * (d[i] - c[i]), 0.0), 10.0)

    assert lam[2] == pytest.approx(step(0.2, 2), abs=1e-12)  # int4 starts afresh
    assert lam[4] == pytest.approx(step(lam[1], 4), abs=1e-12)  # fp32 resumes from its step-2 multiplier
    assert not math.isclose(lam[4], step(lam[3], 4), abs_tol=1e-9)  # not from int4's
