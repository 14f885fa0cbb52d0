"""Left-justified scoring (``trainers.packing``): the log-probs, entropies, gradients and MoE routes of the padded
forward, from a forward without a padding mask over the real width only."""

import copy

import pytest
import torch
import torch.nn.functional as F

from trainers import learner, packing
from tests.test_micro_batches import _setup, _step

torch.set_num_threads(1)


def test_justify_by_hand():
    # P = 4, T = 3. Row 0: prompt 2 tokens, response 3; row 1: prompt 4, response 1; row 2: prompt 1, response 0
    prompt = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    response = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    layout = packing.justify(prompt, response)
    assert layout.offset_B.tolist() == [2, 0, 3] and layout.length_B.tolist() == [5, 5, 1] and layout.width == 5
    ids = torch.arange(21).view(3, 7)
    assert layout.to_justified(ids, -1).tolist() == [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [17, -1, -1, -1, -1]]
    back = layout.from_justified(layout.to_justified(ids, -1), 7, -1)
    real = torch.cat([prompt, response], 1)
    assert torch.equal(back, ids.masked_fill(~real, -1))
    # a hole inside a row's real tokens, or a response without a prompt, keeps the padded layout
    assert packing.justify(prompt, torch.tensor([[1, 0, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)) is None
    assert packing.justify(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool), response[:1]) is None
    assert packing.justify(torch.zeros(1, 4, dtype=torch.bool), response[:1]) is None


@pytest.mark.parametrize("preset,replay,minibatches", [("tiny-dense", "none", 1), ("tiny-moe", "none", 1),
                                                       ("tiny-moe", "r2", 2), ("tiny-moe", "r3", 2)])
def test_justified_step_equals_the_padded_step(preset, replay, minibatches, monkeypatch):
    model, rollout, cfg, adv_B = _setup(preset, replay, minibatches)
    ref_model = copy.deepcopy(model)
    masks = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):  # records whether each attention call got a mask
        masks.append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(learner, "ScoringSpec", _with_justify(learner.ScoringSpec, True))
    batch, result, grads, _ = _step(model, rollout, cfg, adv_B, budget=0)
    assert masks and not any(masks)  # every training forward ran unmasked (causal only)
    masks.clear()
    monkeypatch.setattr(learner, "ScoringSpec", _with_justify(learner.ScoringSpec.__wrapped__, False))
    ref_batch, ref_result, ref_grads, _ = _step(ref_model, rollout, cfg, adv_B, budget=0)
    assert all(masks)
    mask_BT = rollout.response_mask_BT.bool()
    # same keys, values and positions in every softmax: float32 rounding only (measured max 1e-6)
    assert torch.allclose(batch.old_logp_BT[mask_BT], ref_batch.old_logp_BT[mask_BT], atol=1e-5, rtol=0)
    assert (batch.old_logp_BT[~mask_BT] == 0).all()
    if replay == "r2":  # the routes captured in the justified columns come back to the rollout's positions
        assert torch.equal(batch.train_experts_BSLK, ref_batch.train_experts_BSLK)
    metrics = result.metrics()
    for key, ref in ref_result.metrics().items():
        if key.startswith("time/"):
            continue
        assert metrics[key] == pytest.approx(ref, rel=1e-4, abs=1e-6), key
    for step, ref_step in zip(grads, ref_grads):
        assert step.keys() == ref_step.keys() and step
        for name, g in step.items():
            assert torch.allclose(g, ref_step[name], atol=1e-6, rtol=1e-4), (name, (g - ref_step[name]).abs().max())


def _with_justify(spec_cls, justify: bool):
    """``ScoringSpec`` with ``justify`` as its default (``_step`` builds its own spec)."""
    def make(*args, **kwargs):
        return spec_cls(*args, **{"justify": justify, **kwargs})
    make.__wrapped__ = spec_cls
    return make


@pytest.mark.parametrize("fp32_lm_head,kernel", [(True, "logits"), (True, "chunked"), (True, "bf16x3"),
                                                 (False, "logits")])
def test_justified_head_paths_equal_the_padded_ones(fp32_lm_head, kernel):
    # the justified forward sends only the N real response tokens through the head, as a (1, N) batch: every head
    # kernel gives the padded forward's log-probs and entropies there (float32 rounding; bf16x3 splits the float32
    # operands into three bfloat16 parts either way) and 0 at padding
    model, rollout, _, _ = _setup("tiny-dense", "none", 1)
    out = {}
    for justify in (True, False):
        spec = learner.ScoringSpec(fp32_lm_head=fp32_lm_head, lm_head_kernel=kernel, justify=justify)
        with torch.no_grad():
            out[justify] = learner._forward_logp(model, rollout, spec, with_entropy=True, replay_experts_BSLK=None,
                                                 capture=False)
    mask_BT = rollout.response_mask_BT.bool()
    for got, ref in zip(out[True][:2], out[False][:2]):
        assert torch.allclose(got[mask_BT], ref[mask_BT], atol=1e-5, rtol=0), (got - ref)[mask_BT].abs().max()
        assert (got[~mask_BT] == 0).all()
