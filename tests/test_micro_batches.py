"""Token-budget micro-batches (algo.micro_batch_tokens): rows sorted by length, each micro-batch cut to its
longest row. The loss normalisation is unchanged, so a bucketed step must take the padded step's optimiser step:
same pi_old, metrics and gradients to float32 rounding, for the fused N = 1 step and for N = 2 mini-batches,
dense and MoE, with R2 and R3 replay and the DCMDP penalty on."""

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
V, EOS = 101, 1
CONSTRAINTS = (ConstraintConfig(measure="abs_prob_diff", tolerance=1e-6),)


def test_length_buckets_by_hand():
    # lengths 5 3 9 2 7, budget 14: sorted 9 (row 2), 7 (4), 5 (0), 3 (1), 2 (3); 9 + 7 would pad to 18 > 14,
    # 7 + 5 pads to 14 (kept), a third row to 21; 3 + 2 pads to 6
    groups = learner.length_buckets(torch.tensor([5, 3, 9, 2, 7]), 14)
    assert [g.tolist() for g in groups] == [[2], [4, 0], [1, 3]]
    # a budget below the longest row still gives every row a micro-batch
    assert [g.tolist() for g in learner.length_buckets(torch.tensor([4, 4]), 3)] == [[0], [1]]


def _setup(preset: str, replay: str, minibatches: int):
    model = build_model(ModelConfig(preset=preset), V, seed=0)
    with torch.no_grad():  # P(EOS) ~ 1/8 per token: responses of 1 to 12 tokens
        head = torch.nn.Linear(model.lm_head.in_features, V, bias=True)
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[EOS] = 2.6
        model.lm_head = head
    rng = random.Random(0)
    prompts = [[rng.randrange(5, V) for _ in range(rng.randint(2, 9))] for _ in range(16)]
    rollout = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=12), model, eos_id=EOS,
                          pad_id=0).generate(prompts, seed=0)
    lengths = rollout.response_mask_BT.sum(-1)
    assert lengths.min() < lengths.max() - 4  # uneven, so trimming a micro-batch removes padding
    cfg = AlgoConfig(routing_replay=replay, minibatches=minibatches, is_mode="tis", samples_per_prompt=2,
                     prompts_per_step=8, entropy_coef=0.01)
    return model, rollout, cfg, torch.linspace(-1.0, 1.0, len(rollout))


def _step(model, rollout, cfg, adv_B, budget: int):
    """One scored update with SGD; returns (batch, UpdateResult, gradients of the first step, forward count)."""
    calls = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    scoring = learner.ScoringSpec(moe=routing.is_moe(model), micro_batch_tokens=budget)
    if cfg.minibatches == 1:
        batch, forward = learner.score_on_policy(model, rollout, adv_B, cfg, scoring)
    else:
        batch, forward = learner.score_old(model, rollout, adv_B, cfg, scoring), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    opt.register_step_pre_hook(lambda o, *_: grads.append(
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}))
    result = learner.update(model, learner.OptimStep(opt, grad_clip=1.0), batch, scoring=scoring,
                            penalty=learner.PenaltySpec(torch.tensor([0.5]), CONSTRAINTS), cfg=cfg,
                            generator=torch.Generator().manual_seed(0), forward=forward)
    hook.remove()
    return batch, result, grads, len(calls)


@pytest.mark.parametrize("preset,replay,minibatches", [("tiny-dense", "none", 1), ("tiny-moe", "none", 1),
                                                       ("tiny-moe", "r2", 2), ("tiny-moe", "r3", 1),
                                                       ("tiny-moe", "r3", 2)])
def test_bucketed_step_equals_the_padded_step(preset, replay, minibatches):
    model, rollout, cfg, adv_B = _setup(preset, replay, minibatches)
    ref_model = copy.deepcopy(model)
    batch, result, grads, calls = _step(model, rollout, cfg, adv_B, budget=48)
    ref_batch, ref_result, ref_grads, ref_calls = _step(ref_model, rollout, cfg, adv_B, budget=0)
    assert calls > ref_calls  # several micro-batches per forward
    mask_BT = rollout.response_mask_BT.bool()
    assert torch.allclose(batch.old_logp_BT[mask_BT], ref_batch.old_logp_BT[mask_BT], atol=1e-5, rtol=0)
    if replay == "r2":
        assert torch.equal(batch.train_experts_BSLK, ref_batch.train_experts_BSLK)
    metrics = result.metrics()
    for key, ref in ref_result.metrics().items():
        if not key.startswith("time/"):  # wall clock
            assert metrics[key] == pytest.approx(ref, rel=1e-4, abs=1e-6), key
    assert metrics["penalty/loss"] > 0.0
    assert len(grads) == len(ref_grads) == minibatches
    for step, ref_step in zip(grads, ref_grads):
        assert step.keys() == ref_step.keys() and step
        for name, g in step.items():
            assert torch.allclose(g, ref_step[name], atol=1e-6, rtol=1e-4), (name, (g - ref_step[name]).abs().max())
