"""The torch engine under a KV-token budget (rollout.torch.kv_tokens): sub-batches of rows, the same rollout as one
batch, a peak that follows the budget; routes stored in the smallest integer type. Measured on the CPU."""

import random

import pytest
import torch

from tests.test_memory_learner import peak_bytes
from trainers import routing
from trainers.config import ModelConfig, RolloutConfig, TorchEngineConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model

torch.set_num_threads(1)
V, EOS = 101, 1


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, V) for _ in range(rng.randint(2, 9))] for _ in range(n)]


def _engine(model, kv_tokens: int, cache: str = "dynamic", new: int = 12) -> TorchEngine:
    return TorchEngine(RolloutConfig(precision="fp32", max_new_tokens=new,
                                     torch=TorchEngineConfig(kv_tokens=kv_tokens, kv_cache=cache)),
                       model, eos_id=EOS, pad_id=0)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_memory_rollout_under_a_kv_budget_is_the_one_batch_rollout(preset, cache):
    model = build_model(ModelConfig(preset=preset), V, seed=0)
    prompts = _prompts(10)
    one = _engine(model, 0, cache).generate(prompts, seed=3)
    P, T = one.prompt_ids_BP.shape[1], 12
    for rows in (3, 1):  # sub-batches of 3 rows (the last of 1), then one row at a time
        sub = _engine(model, rows * (P + T), cache)
        assert sub.kv_rows(P + T) == rows
        out = sub.generate(prompts, seed=3)
        assert torch.equal(out.response_ids_BT, one.response_ids_BT)
        assert torch.equal(out.response_mask_BT, one.response_mask_BT)
        # float32, the same rows' values: only the matmuls' batch size differs
        torch.testing.assert_close(out.rollout_logp_BT, one.rollout_logp_BT, rtol=0, atol=1e-5)
        if one.rollout_experts_BSLK is None:
            continue
        x, y = out.rollout_experts_BSLK, one.rollout_experts_BSLK
        assert x.dtype == y.dtype == torch.int8  # 8 experts: int8, not int64
        both = (x >= 0).all(-1) & (y >= 0).all(-1)
        assert torch.equal(x[both], y[both])
        # a route only one side has is a row's last token, which one batch feeds while other rows still decode and
        # a sub-batch whose rows all stopped does not; no loss or replay reads it (it shapes the logits after the
        # response)
        last_BS = torch.zeros_like(both)
        n_B = out.response_mask_BT.sum(-1)
        last_BS[torch.arange(len(n_B)), P + n_B - 1] = True
        assert not (((x >= 0).all(-1) ^ (y >= 0).all(-1)) & ~last_BS).any()


def test_memory_rollout_peak_follows_the_kv_budget():
    model = build_model(ModelConfig(preset="tiny-dense"), V, seed=0)
    # rows that never stop early (no EOS) and long responses: the KV cache dominates the rollout's memory
    with torch.no_grad():
        model.lm_head.weight[EOS] = -10.0
    prompts, new = _prompts(32), 96
    P = max(len(p) for p in prompts)
    full = _engine(model, 0, "static", new)
    budget = _engine(model, 4 * (P + new), "static", new)
    full.generate(prompts, seed=0), budget.generate(prompts, seed=0)  # warm-up
    peak_full = peak_bytes(lambda: full.generate(prompts, seed=0))
    peak_budget = peak_bytes(lambda: budget.generate(prompts, seed=0))
    kv_row = 2 * 2 * 1 * 32 * 4 * (-(-(P + new) // 64) * 64)  # K and V x layers x KV heads x head dim x fp32 x L
    assert peak_full >= 32 * kv_row  # the whole batch's cache is alive at once
    # 4 rows' cache, plus what every rollout holds whatever its sub-batches (the outputs, the (B, V) draws)
    assert peak_budget <= peak_full / 3, (peak_budget, peak_full)


def test_memory_routes_in_the_smallest_integer_type():
    assert routing.route_dtype(8) == torch.int8
    assert routing.route_dtype(128) == torch.int8  # Qwen3-30B-A3B: ids 0..127 and -1
    assert routing.route_dtype(129) == torch.int16
    assert routing.route_dtype(40_000) == torch.int32
    model = build_model(ModelConfig(preset="tiny-moe"), V, seed=0)
    ids = torch.tensor([[5, 6, 7, 8]])
    with routing.capture_routes(model) as cap:
        model.model(input_ids=ids)
    captured = cap.experts(1, 4)
    assert captured.dtype == torch.int8
    # replayed int8 routes route like the int64 ones
    with routing.replay_routes(model, captured) as stats:
        a = model.model(input_ids=ids).last_hidden_state
    with routing.replay_routes(model, captured.long()):
        b = model.model(input_ids=ids).last_hidden_state
    assert stats.replayed_pairs == 4 * captured.shape[2]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
