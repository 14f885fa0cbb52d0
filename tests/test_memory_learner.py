"""Memory of an update, measured on the CPU: one backward per micro-batch bounds it by the micro-batch, whatever the
mini-batch's size; and the memory plan (``dcmdp.memplan``) predicts the measured peak of a training step.

The peak is measured with torch's profiler (every allocation and free of the CPU allocator inside the window, in
time order), above what was alive before it (the weights)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dcmdp.config import load_config
from dcmdp.memplan import model_shapes, plan_memory
from trainers import learner
from trainers.batch import Rollout
from trainers.config import AlgoConfig, ModelConfig
from trainers.models import build_model
from trainers.optim import build_optimizer

torch.set_num_threads(1)
V = 101
PROMPT, RESPONSE = 8, 56
# The micro-batch test's rows: long enough that a micro-batch's activations outweigh the gradients several times
# (the gradients are alive beside every micro-batch after the first)
LONG = 120


def peak_bytes(fn) -> int:
    """Peak bytes allocated by torch on the CPU while ``fn()`` runs, above what was allocated before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _rollout(rows: int, response: int = RESPONSE, seed: int = 0) -> Rollout:
    """``rows`` rows of PROMPT + ``response`` real tokens (no padding: every micro-batch has the same shape)."""
    g = torch.Generator().manual_seed(seed)
    return Rollout(prompt_ids_BP=torch.randint(5, V, (rows, PROMPT), generator=g),
                   prompt_mask_BP=torch.ones(rows, PROMPT, dtype=torch.bool),
                   response_ids_BT=torch.randint(5, V, (rows, response), generator=g),
                   response_mask_BT=torch.ones(rows, response, dtype=torch.bool),
                   rollout_logp_BT=torch.full((rows, response), -2.0))


def _step_peak(rows: int, budget: int, minibatches: int = 1) -> int:
    """Peak bytes of the loop's pi_old pass and update on ``rows`` rows of small-dense (fp32, SGD)."""
    model = build_model(ModelConfig(preset="small-dense"), V, seed=0)
    cfg = AlgoConfig(prompts_per_step=rows // 2, samples_per_prompt=2, minibatches=minibatches,
                     micro_batch_tokens=budget)
    spec = learner.ScoringSpec(micro_batch_tokens=budget)
    rollout = _rollout(rows, LONG)
    adv_B = torch.linspace(-1.0, 1.0, rows)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        old = learner.old_pass(model, rollout, adv_B, torch.ones(rows, dtype=torch.bool), cfg, spec)
        learner.update(model, learner.OptimStep(opt), old.batch, scoring=spec, penalty=learner.PenaltySpec(), cfg=cfg,
                       generator=torch.Generator().manual_seed(0), forward=old.forward)

    step()  # warm-up: lazily built state (kernels' scratch) is not the update's
    return peak_bytes(step)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_memory_update_peak_independent_of_micro_batches_per_mini_batch(minibatches):
    # a micro-batch is 4 rows; the mini-batch holds 1 of them, then 4: the peak must stay within 1.2x (one backward
    # per mini-batch would keep 4 micro-batches' activations: ~3x here, where activations outweigh the gradients)
    budget = 4 * (PROMPT + LONG)
    one = _step_peak(4 * minibatches, budget, minibatches)
    four = _step_peak(16 * minibatches, budget, minibatches)
    assert four <= 1.2 * one, (one, four)
    # and the test can fail: without a budget the 16-row mini-batch is one forward, ~4x the activations
    unbounded = _step_peak(16 * minibatches, 0, minibatches)
    assert unbounded > 2 * one, (one, unbounded)


def test_memory_plan_within_25_percent_of_a_measured_cpu_step():
    """The plan's weights + optimiser + training phase against the measured peak of a pi_old pass and an AdamW update
    (fp32, no checkpointing, the float32 logits head) of small-dense, at one and at four micro-batches."""
    for budget in (0, 4 * (PROMPT + RESPONSE)):
        rows = 16
        overrides = ["model.preset=small-dense", "rollout.engine=torch", f"rollout.max_new_tokens={RESPONSE}",
                     f"algo.prompts_per_step={rows // 2}", "algo.samples_per_prompt=2", "algo.minibatches=1",
                     f"algo.micro_batch_tokens={budget}", "rollout.torch.share_weights=true"]
        run = load_config(None, overrides, check=False)
        model = build_model(run.model, V, seed=0)
        opt = build_optimizer(model.parameters(), run.optim, seed=0)
        spec = learner.ScoringSpec(micro_batch_tokens=budget, lm_head_kernel=run.model.lm_head_kernel)
        rollout, adv_B = _rollout(rows), torch.linspace(-1.0, 1.0, rows)

        def step():
            old = learner.old_pass(model, rollout, adv_B, torch.ones(rows, dtype=torch.bool), run.algo, spec)
            learner.update(model, learner.OptimStep(opt), old.batch, scoring=spec, penalty=learner.PenaltySpec(),
                           cfg=run.algo, generator=torch.Generator().manual_seed(0), forward=old.forward)

        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        measured = weights + peak_bytes(step)  # the first step: AdamW's moments are allocated inside it
        shapes = model_shapes(run)
        assert shapes.params == sum(p.numel() for p in model.parameters())
        plan = plan_memory(run, 1, 1.0, prompt_tokens=PROMPT, overhead_gib=0.0, shapes=shapes)
        planned = plan.term("weights").bytes + plan.term("optimiser").bytes + plan.train_bytes
        assert 0.75 * measured <= planned <= 1.25 * measured, (budget, planned / 2**20, measured / 2**20)
