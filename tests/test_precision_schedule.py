"""rollout.precision_schedule: the torch engine switches precision at the scheduled steps, re-quantising from
full-precision weights, and the loop logs the precision in effect."""

from __future__ import annotations

import random

import pytest
import torch

from dcmdp.config import ConfigError, load_config
from dcmdp.loop import train
from trainers.config import ModelConfig, PrecisionPhase, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model

torch.set_num_threads(1)
V = 101
SCHEDULE = [PrecisionPhase(until_step=2, precision="fp32"), PrecisionPhase(until_step=4, precision="int4"),
            PrecisionPhase(precision="fp8")]


def test_precision_at_follows_the_schedule():
    r = RolloutConfig(precision="fp32", precision_schedule=SCHEDULE)
    r.check()
    assert [r.precision_at(s) for s in range(6)] == ["fp32", "fp32", "int4", "int4", "fp8", "fp8"]
    assert RolloutConfig(precision="int8").precision_at(10) == "int8"


@pytest.mark.parametrize("schedule,key", [
    ([PrecisionPhase(until_step=2, precision="int4")], "rollout.precision_schedule[0].until_step"),
    ([PrecisionPhase(until_step=2, precision="fp32"), PrecisionPhase(until_step=2, precision="int4"),
      PrecisionPhase(precision="fp32")], "rollout.precision_schedule[1].until_step"),
    ([PrecisionPhase(until_step=2, precision="fp32"), PrecisionPhase(precision="int3")],
     "rollout.precision_schedule[1].precision"),
    ([PrecisionPhase(until_step=2, precision="int4"), PrecisionPhase(precision="fp32")], "rollout.precision"),
])
def test_bad_schedules_name_the_key(schedule, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        RolloutConfig(precision="fp32", precision_schedule=schedule).check()


def test_vllm_refuses_a_schedule(tmp_path):
    with pytest.raises(ConfigError, match="precision_schedule"):
        load_config(None, ["rollout.engine=vllm", f"output_dir={tmp_path}",
                           "rollout.precision_schedule=[{until_step: 2, precision: fp32}, {precision: bf16}]"])


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(5, V) for _ in range(rng.randint(2, 6))] for _ in range(6)]


def test_switch_requantises_from_full_precision_weights():
    """After a switch the engine equals a fresh engine of that precision on the same weights, token for token,
    also after a weight load in between (the quantised copy is never the source of the next grid)."""
    model = build_model(ModelConfig(preset="tiny-moe"), V, seed=0)
    cfg = RolloutConfig(precision="fp32", max_new_tokens=5, precision_schedule=SCHEDULE)
    engine = TorchEngine(cfg, model, eos_id=1, pad_id=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    engine.load_weights(model.state_dict(), version=1)
    for precision in ("int4", "fp8", "int4", "fp32"):
        engine.set_precision(precision)
        fresh = TorchEngine(RolloutConfig(precision=precision, max_new_tokens=5), model, eos_id=1, pad_id=0)
        got, ref = engine.generate(_prompts(), seed=3), fresh.generate(_prompts(), seed=3)
        assert engine.precision == precision
        assert torch.equal(got.response_ids_BT, ref.response_ids_BT), precision
        assert torch.equal(got.rollout_logp_BT, ref.rollout_logp_BT), precision
        for (name, a), b in zip(engine.model.state_dict().items(), fresh.model.state_dict().values()):
            assert torch.equal(a, b), (precision, name)
    assert engine.version == 1


def test_set_precision_without_a_schedule_is_refused():
    engine = TorchEngine(RolloutConfig(precision="fp32"), build_model(ModelConfig(preset="tiny-dense"), V, seed=0),
                         eos_id=1, pad_id=0)
    engine.set_precision("fp32")  # already in effect: nothing to do
    with pytest.raises(ValueError, match="precision_schedule"):
        engine.set_precision("int4")


def _history(summary, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(tracking_uri=summary.tracking_uri).get_metric_history(summary.run_id, key)
    return [m.value for m in sorted(hist, key=lambda m: m.step)]


def test_run_logs_the_precision_and_the_discrepancy_jumps_at_the_switch(tmp_path):
    """fp32 for two steps (engine = trainer: |log pi_old - log mu| at float rounding), then int4: the measured
    discrepancy rises by orders of magnitude at the switch step and precision_bits says 32 -> 4."""
    summary = train(load_config(None, [
        "model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
        "steps=4", "threads=1", "progress=false", "task.eval_size=8", f"output_dir={tmp_path / 'run'}",
        "rollout.precision=fp32", "rollout.precision_schedule=[{until_step: 2, precision: fp32}, {precision: int4}]"]))
    assert _history(summary, "rollout/precision_bits") == [32.0, 32.0, 4.0, 4.0]
    disc = _history(summary, "discrepancy/abs_log_ratio")
    assert len(disc) == 4 and max(disc[:2]) < 1e-5
    assert min(disc[2:]) > 100 * max(max(disc[:2]), 1e-7)
