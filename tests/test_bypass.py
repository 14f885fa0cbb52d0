"""Bypass mode (``algo.old_logp: rollout``): log mu stands in for log pi_old, no training-engine forward before the
updates. Checked against the recompute path on an fp32 rollout engine (mu = pi_old to float rounding, so both must
take the same step) and on a bf16 one (where they must differ exactly by the IS weight and the clip's reference),
and through the training loop (no pi_old pass at N > 1, the IS weight is 1, R2 refused)."""

import copy
import random

import pytest
import torch

from constraints.config import ConstraintConfig
from trainers import learner, routing
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model

torch.set_num_threads(1)
V = 101
CONSTRAINTS = [ConstraintConfig(measure="abs_prob_diff", tolerance=1e-6)]


def _setup(precision: str, replay: str = "none", minibatches: int = 2):
    model = build_model(ModelConfig(preset="tiny-moe"), V, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, V) for _ in range(rng.randint(2, 7))] for _ in range(16)]
    rollout = TorchEngine(RolloutConfig(precision=precision, max_new_tokens=6), model, eos_id=1,
                          pad_id=0).generate(prompts, seed=0)
    cfg = AlgoConfig(routing_replay=replay, minibatches=minibatches, is_mode="tis", samples_per_prompt=2,
                     prompts_per_step=8)
    return model, rollout, cfg, torch.linspace(-1.0, 1.0, len(rollout))


def _update(model, batch, cfg):
    calls = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = learner.update(model, learner.OptimStep(opt, grad_clip=1.0), batch,
                            scoring=learner.ScoringSpec(moe=routing.is_moe(model)),
                            penalty=learner.PenaltySpec(torch.tensor([0.5]), tuple(CONSTRAINTS)), cfg=cfg,
                            generator=torch.Generator().manual_seed(0))
    hook.remove()
    return result, len(calls)


@pytest.mark.parametrize("replay", ["none", "r3"])
def test_bypass_on_fp32_rollouts_takes_the_recompute_step(replay):
    model, rollout, cfg, adv_B = _setup("fp32", replay)
    ref_model = copy.deepcopy(model)
    batch = learner.score_bypass(rollout, adv_B, cfg)
    mask_BT = rollout.response_mask_BT.bool()
    assert torch.equal(batch.old_logp_BT, rollout.rollout_logp_BT.float())
    assert (batch.replay_experts_BSLK is rollout.rollout_experts_BSLK) == (replay == "r3")
    ref_batch = learner.score_old(ref_model, rollout, adv_B, cfg, learner.ScoringSpec(moe=routing.is_moe(model)))
    # fp32 engines: mu and pi_old agree to float rounding
    assert (batch.old_logp_BT - ref_batch.old_logp_BT)[mask_BT].abs().max() < 2e-5
    metrics, calls = _update(model, batch, cfg)
    ref_metrics, ref_calls = _update(ref_model, ref_batch, cfg)
    assert calls == ref_calls == cfg.minibatches  # the updates' forwards; the bypass ran none before them
    assert metrics.is_metrics["is/weight_mean"] == pytest.approx(ref_metrics.is_metrics["is/weight_mean"], abs=1e-4)
    for m, ref in zip(metrics.steps, ref_metrics.steps):
        for key in ("loss/policy", "clip/frac"):
            assert m[key] == pytest.approx(ref[key], rel=1e-3, abs=1e-5), key
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=1e-4)


def test_bypass_on_bf16_rollouts_has_unit_is_weights_and_clips_on_pi_theta_over_mu():
    model, rollout, cfg, adv_B = _setup("bf16")
    batch = learner.score_bypass(rollout, adv_B, cfg)
    ref_batch = learner.score_old(copy.deepcopy(model), rollout, adv_B, cfg, learner.ScoringSpec(moe=True))
    mask_BT = rollout.response_mask_BT.bool()
    assert (batch.old_logp_BT - ref_batch.old_logp_BT)[mask_BT].abs().max() > 1e-4  # a real discrepancy
    metrics, _ = _update(copy.deepcopy(model), batch, cfg)
    ref_metrics, _ = _update(copy.deepcopy(model), ref_batch, cfg)
    assert metrics.is_metrics["is/weight_mean"] == pytest.approx(1.0, abs=1e-7)  # rho = mu / mu
    assert abs(ref_metrics.is_metrics["is/weight_mean"] - 1.0) > 1e-5
    # first mini-batch: pi_theta = pi_old, so the bypass ratio r = pi_old / mu is the recompute path's rho
    assert metrics.steps[0]["policy/approx_kl"] > ref_metrics.steps[0]["policy/approx_kl"]


def test_r2_cannot_bypass():
    model, rollout, cfg, adv_B = _setup("fp32", "r2")
    with pytest.raises(ValueError, match="old_logp=rollout skips"):
        learner.score_bypass(rollout, adv_B, cfg)
    with pytest.raises(ValueError, match="algo.routing_replay.*old_logp=rollout skips"):
        AlgoConfig(routing_replay="r2", old_logp="rollout").check()
    with pytest.raises(ValueError, match="algo.old_logp.*recompute or rollout"):
        AlgoConfig(old_logp="mu").check()


@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_loop_skips_the_pi_old_pass_and_measures_the_updates(tmp_path, monkeypatch, minibatches):
    from dcmdp.config import load_config
    from dcmdp.loop import train

    def no_pi_old_pass(*args, **kwargs):
        raise AssertionError("score_old ran under old_logp=rollout")

    monkeypatch.setattr(learner, "score_old", no_pi_old_pass)
    cfg = load_config(None, ["model.preset=tiny-moe", "cold_start.steps=10", "steps=3", "algo.prompts_per_step=4",
                             "algo.samples_per_prompt=4", f"algo.minibatches={minibatches}", "algo.old_logp=rollout",
                             "algo.routing_replay=r3", "rollout.precision=bf16", "task.eval_size=8",
                             f"output_dir={tmp_path / 'run'}", f"cold_start.cache_dir={tmp_path / 'cache'}",
                             "progress=false", "threads=1", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    summary = train(cfg)
    from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint

    history = load_checkpoint(find_resume_checkpoint(tmp_path / "run" / "checkpoints", "auto"))["history"]
    assert len(history) == 3 and summary is not None
    for h in history:
        assert h["is/weight_mean"] == pytest.approx(1.0, abs=1e-7)
        # bf16 rollouts: the measures compare mu with the training engine's pi_theta, a real discrepancy
        assert 0.0 < h["discrepancy/abs_prob_diff"] < 1.0 and h["dual/measured/abs_prob_diff"] > 0.0
