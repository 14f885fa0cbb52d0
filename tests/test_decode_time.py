"""The torch engine's decode-time estimate (``trainers.engines.decode_time``), worked by hand."""

import pytest

from trainers.engines.decode_time import torch_decode_estimate


def test_decode_estimate_by_hand():
    # 10 rows of 2 + 8 tokens under a 30-token budget: 3 rows at once, ceil(10 / 3) = 4 waves of 8 steps = 32 steps.
    # KV read per step, dynamic cache: 3 passes x 3 rows x (2 + 8 / 2) x 100 B = 5,400 B, plus 10,000 B of weights.
    # low: 32 x (2 layers x 0.5 ms + 15,400 / (0.8 x 1e6)) = 32 x 0.02025 = 0.648 s
    # high: 32 x (2 x 1 ms + 15,400 / (0.5 x 1e6)) = 32 x 0.0328 = 1.0496 s
    shape = dict(rows=10, prompt_tokens=2, max_new_tokens=8, kv_tokens=30, layers=2, kv_bytes_per_token=100,
                 weight_bytes=10_000, bandwidth_bytes_s=1e6)
    e = torch_decode_estimate(**shape)
    assert (e.rows_at_once, e.steps) == (3, 32)
    assert e.low_s == pytest.approx(0.648) and e.high_s == pytest.approx(1.0496)
    # a static cache reads the KV once: 32 x (0.001 + 11,800 / 0.8e6) = 0.504 s
    assert torch_decode_estimate(**shape, static_cache=True).low_s == pytest.approx(0.504)
    with pytest.raises(ValueError, match="kv_tokens"):
        torch_decode_estimate(**{**shape, "kv_tokens": 0})


def test_the_8b_recipe_on_one_h100_takes_hours_per_rollout_with_the_torch_engine():
    # Qwen3-8B (docs/scale.md): 36 layers, 8 KV heads x 128, 8,190,735,360 parameters of which the embedding is
    # 622,329,856; the recipe's 512 rows of 256 + 8,192 tokens under the one-GPU fallback's kv_tokens=131072
    e = torch_decode_estimate(rows=512, prompt_tokens=256, max_new_tokens=8192, kv_tokens=131072, layers=36,
                              kv_bytes_per_token=2 * 36 * 8 * 128 * 2,
                              weight_bytes=(8_190_735_360 - 622_329_856) * 2, bandwidth_bytes_s=3.35e12)
    assert (e.rows_at_once, e.steps) == (15, 35 * 8192)
    assert 2.5 * 3600 < e.low_s < e.high_s < 5.5 * 3600, e.line()
