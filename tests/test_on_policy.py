"""One mini-batch per rollout batch: the pi_old forward keeps its graph and the update back-propagates it.

``learner.score_on_policy`` + ``learner.update(forward=...)`` must take the same optimiser step as the two-pass
``score_old`` + ``update`` (same pi_old, loss, metrics, gradients and weights after the step, to float32
rounding: the rows are summed in another order) while running the model once instead of twice; with the
DCMDP penalty on, IS weights, replay R2/R3 and a float64 reference of pi_old.
"""

import copy
import random

import pytest
import torch

from constraints.config import ConstraintConfig
from trainers import learner, routing
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model
from trainers.scoring import response_logprobs

torch.set_num_threads(1)
V = 101
CONSTRAINTS = [ConstraintConfig(measure="abs_prob_diff", tolerance=1e-6)]


def _setup(preset: str, replay: str):
    model = build_model(ModelConfig(preset=preset), V, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, V) for _ in range(rng.randint(2, 7))] for _ in range(16)]
    rollout = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=6), model, eos_id=1,
                          pad_id=0).generate(prompts, seed=0)
    cfg = AlgoConfig(routing_replay=replay, minibatches=1, is_mode="tis", samples_per_prompt=2, prompts_per_step=8,
                     entropy_coef=0.01)
    adv_B = torch.linspace(-1.0, 1.0, len(rollout))
    return model, rollout, cfg, adv_B


def _step(model, rollout, cfg, adv_B, *, fused: bool):
    """One scored update with SGD; returns (batch, UpdateResult, gradients at the step, decoder forward count)."""
    calls = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    scoring = learner.ScoringSpec(moe=routing.is_moe(model))
    if fused:
        batch, forward = learner.score_on_policy(model, rollout, adv_B, cfg, scoring)
    else:
        batch, forward = learner.score_old(model, rollout, adv_B, cfg, scoring), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = {}
    opt.register_step_pre_hook(lambda o, *_: grads.update(
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}))
    result = learner.update(model, learner.OptimStep(opt, grad_clip=1.0), batch, scoring=scoring,
                            penalty=learner.PenaltySpec(torch.tensor([0.5]), tuple(CONSTRAINTS)), cfg=cfg,
                            generator=torch.Generator().manual_seed(0), forward=forward)
    hook.remove()
    return batch, result, grads, len(calls)


@pytest.mark.parametrize("preset,replay", [("tiny-dense", "none"), ("tiny-moe", "none"), ("tiny-moe", "r2"),
                                           ("tiny-moe", "r3")])
def test_the_fused_step_is_the_two_pass_step_with_one_forward(preset, replay):
    model, rollout, cfg, adv_B = _setup(preset, replay)
    ref_model = copy.deepcopy(model)
    batch, result, grads, calls = _step(model, rollout, cfg, adv_B, fused=True)
    ref_batch, ref_result, ref_grads, ref_calls = _step(ref_model, rollout, cfg, adv_B, fused=False)
    assert (calls, ref_calls) == (1, 2)
    mask_BT = rollout.response_mask_BT.bool()
    assert torch.allclose(batch.old_logp_BT[mask_BT], ref_batch.old_logp_BT[mask_BT], atol=1e-6, rtol=0)
    assert len(result.steps) == len(ref_result.steps) == 1
    metrics = result.metrics()
    for key, ref in ref_result.metrics().items():
        if not key.startswith("time/"):  # wall clock
            assert metrics[key] == pytest.approx(ref, rel=1e-4, abs=1e-6), key
    assert metrics["penalty/loss"] > 0.0  # the DCMDP penalty acted on this step
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6, rtol=1e-4), (name, (g - ref_grads[name]).abs().max())
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), name


def test_pi_old_of_the_fused_pass_matches_a_float64_forward():
    model, rollout, cfg, adv_B = _setup("tiny-dense", "none")
    m64 = copy.deepcopy(model).double()
    batch, _ = learner.score_on_policy(model, rollout, adv_B, cfg, learner.ScoringSpec())
    with torch.no_grad():
        ref_BT, _ = response_logprobs(m64, rollout.input_ids_BS, rollout.attention_mask_BS,
                                      rollout.num_prompt_positions, temperature=1.0, fp32_lm_head=False)
    mask_BT = rollout.response_mask_BT.bool()
    assert ref_BT.dtype == torch.float64
    # a float32 forward against float64 of the same weights (the MoE expert kernel has no float64 path)
    assert torch.allclose(batch.old_logp_BT[mask_BT].double(), ref_BT[mask_BT], atol=2e-5, rtol=0)


def test_a_fused_forward_needs_one_minibatch():
    model, rollout, cfg, adv_B = _setup("tiny-dense", "none")
    two = AlgoConfig(**{**cfg.__dict__, "minibatches": 2})
    with pytest.raises(ValueError, match="minibatches = 1"):
        learner.score_on_policy(model, rollout, adv_B, two, learner.ScoringSpec())
    batch, forward = learner.score_on_policy(model, rollout, adv_B, cfg, learner.ScoringSpec())
    with pytest.raises(ValueError, match="minibatches = 1"):
        learner.update(model, learner.OptimStep(torch.optim.SGD(model.parameters(), lr=0.1)), batch,
                       scoring=learner.ScoringSpec(), penalty=learner.PenaltySpec(), cfg=two,
                       generator=torch.Generator().manual_seed(0), forward=forward)


def test_screening_keeps_the_fused_forward_unless_it_drops_a_sample():
    model, rollout, cfg, adv_B = _setup("tiny-dense", "none")
    batch, forward = learner.score_on_policy(model, rollout, adv_B, cfg, learner.ScoringSpec())
    keep_B = torch.ones(len(rollout), dtype=torch.bool)
    keep_B[3] = False  # dropped before scoring (a bad reward, say): the forward still serves the update
    _, kept, same, _ = learner.screen_old(batch, keep_B, forward)
    assert same is forward and int(kept.sum()) == len(rollout) - 1
    batch.old_logp_BT[5, 0] = float("nan")  # a non-finite pi_old at a kept sample: the update runs its own forward
    _, kept, none, metrics = learner.screen_old(batch, keep_B, forward)
    assert none is None and not kept[5] and metrics["guard/bad_old_logp_samples"] == 1.0
