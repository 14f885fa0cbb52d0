"""The training engine's scorer against a float64 reference, padding invariance, routing contexts."""

import copy

import pytest
import torch

from trainers import routing
from trainers.config import ModelConfig
from trainers.models import build_model
from trainers.scoring import position_ids, response_logprobs

torch.set_num_threads(1)
PAD = 0


def _batch():
    """Three rows, P=5 left-padded prompts, T=4 right-padded responses (row 1 ends after 2 tokens)."""
    prompts = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31]]
    responses = [[40, 41, 42, 1], [50, 1], [60, 61, 62, 63]]
    P, T = 5, 4
    ids = torch.full((3, P + T), PAD)
    mask = torch.zeros((3, P + T), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, P - len(p):P] = torch.tensor(p)
        ids[b, P:P + len(r)] = torch.tensor(r)
        mask[b, P - len(p):P + len(r)] = True
    return prompts, responses, ids, mask, P


def _float64(model):
    m64 = copy.deepcopy(model).double()
    if routing.is_moe(m64):
        m64.set_experts_implementation("eager")  # the grouped_mm kernel has no float64 variant
    return m64


def _reference_logp(model, prompt, response, temperature):
    """float64 log pi of each response token, one unpadded row through the ordinary causal LM forward."""
    m64 = _float64(model)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = m64(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    P = len(prompt)
    return torch.stack([logp[P - 1 + t, tok] for t, tok in enumerate(response)])


def test_position_ids_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_matches_float64_reference_per_row(preset):
    model = build_model(ModelConfig(preset=preset), 101, seed=0)
    prompts, responses, ids, mask, P = _batch()
    with torch.no_grad():
        logp_BT, ent_BT = response_logprobs(model, ids, mask, P, temperature=0.7, with_entropy=True)
    assert logp_BT.shape == (3, 4) and ent_BT.shape == (3, 4)
    assert torch.isfinite(logp_BT).all() and torch.isfinite(ent_BT).all()
    for b in range(3):
        ref = _reference_logp(model, prompts[b], responses[b], 0.7)
        torch.testing.assert_close(logp_BT[b, :len(responses[b])].double(), ref, atol=1e-5, rtol=0)
    # Entropy of the first response position of row 0, by hand in float64.
    m64 = _float64(model)
    with torch.no_grad():
        logits = m64(input_ids=torch.tensor([prompts[0]])).logits[0, -1]
    lp = torch.log_softmax(logits / 0.7, dim=-1)
    assert abs(float(ent_BT[0, 0]) - float(-(lp.exp() * lp).sum())) < 1e-5


def test_fp32_lm_head_on_bf16_model_is_closer_to_float64():
    model = build_model(ModelConfig(preset="tiny-dense"), 101, seed=0)
    # Sharpen the head so that rounding the logits to bf16 matters.
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    prompts, responses, ids, mask, P = _batch()
    with torch.no_grad():
        fp32_head, _ = response_logprobs(bf16, ids, mask, P, temperature=1.0, fp32_lm_head=True)
        bf16_head, _ = response_logprobs(bf16, ids, mask, P, temperature=1.0, fp32_lm_head=False)
        # Reference: the same bf16 hidden states through the head and log-softmax in float64, so only
        # the head's precision separates the two modes.
        h = bf16.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
        logits = h[:, P - 1:-1].double() @ bf16.lm_head.weight.double().T
        ref = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    assert fp32_head.dtype == torch.float32 and bf16_head.dtype == torch.bfloat16
    valid = mask[:, P:]
    err_fp32 = (fp32_head.double() - ref)[valid].abs().max()
    err_bf16 = (bf16_head.double() - ref)[valid].abs().max()
    assert err_fp32 < 1e-4 and err_bf16 > 1e-2


def test_inside_capture_and_replay_contexts():
    model = build_model(ModelConfig(preset="tiny-moe"), 101, seed=0)
    _, _, ids, mask, P = _batch()
    with torch.no_grad():
        plain, _ = response_logprobs(model, ids, mask, P, temperature=1.0)
        with routing.capture_routes(model) as cap:
            captured, _ = response_logprobs(model, ids, mask, P, temperature=1.0)
        experts_BSLK = cap.experts(*ids.shape)
        assert experts_BSLK.shape == (3, 9, 2, 2)
        # Replaying the model's own routes changes nothing and replaces every valid (token, layer) pair.
        with routing.replay_routes(model, experts_BSLK) as stats:
            replayed, _ = response_logprobs(model, ids, mask, P, temperature=1.0)
        assert stats.replayed_pairs == 3 * 9 * 2
        # Replaying other experts at the response positions does change the log-probs.
        other = experts_BSLK.clone()
        other[:, P - 1:] = (other[:, P - 1:] + 3) % 8
        with routing.replay_routes(model, other):
            changed, _ = response_logprobs(model, ids, mask, P, temperature=1.0)
    assert torch.equal(plain, captured) and torch.equal(plain, replayed)
    assert (changed - plain)[mask[:, P:]].abs().max() > 1e-3


def test_gradients_are_finite_with_left_padding():
    model = build_model(ModelConfig(preset="tiny-moe"), 101, seed=0)
    _, _, ids, mask, P = _batch()
    logp_BT, _ = response_logprobs(model, ids, mask, P, temperature=1.0)
    (-(logp_BT * mask[:, P:]).sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
