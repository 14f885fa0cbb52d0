"""How long the torch engine takes to decode a rollout on a GPU: a per-step cost model, an estimate, not a measurement.

A decode step feeds one token per live row. Its time is taken as

    t_step = layers * launch_s  +  (weight_bytes + kv_passes * rows * context * kv_bytes_per_token) / bandwidth

- ``layers * launch_s``: the eager forward launches each decoder layer's ~30 kernels from Python (no CUDA graph),
  ~15-30 us each: 0.5-1 ms per layer, whatever the batch;
- ``weight_bytes``: every non-embedding weight and the LM head are read once per step (decode is a GEMV at ~15 rows);
- the KV cache of the rows decoding at once (``kv_tokens // (prompt + max_new_tokens)`` of them, at least one) at
  the mean context ``prompt + max_new_tokens / 2``: read once by attention with a static cache, three times with a
  dynamic one (``DynamicCache`` concatenates each step's K and V onto the whole cache: one more read and a write);
- ``bandwidth``: the GPU's memory bandwidth times the share a small-batch decode reaches (50-80%).

A full-length rollout (every row decodes ``max_new_tokens`` tokens, the recipes' worst case) takes
ceil(rows / rows_at_once) * max_new_tokens steps. ``low`` and ``high`` bracket it with the optimistic and the
pessimistic ends of launch_s and the bandwidth share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# (launch seconds per layer and step, share of the memory bandwidth reached): the optimistic and pessimistic ends
OPTIMISTIC = (0.5e-3, 0.8)
PESSIMISTIC = (1.0e-3, 0.5)


@dataclass(frozen=True)
class DecodeEstimate:
    """A rollout's decode time on one GPU with the torch engine, in seconds (low, high), and how it was counted."""

    rows_at_once: int
    steps: int
    low_s: float
    high_s: float

    def line(self) -> str:
        return (f"torch engine decode ~{self.low_s / 3600:.1f}-{self.high_s / 3600:.1f} h per full-length rollout "
                f"({self.rows_at_once} rows at once, {self.steps:,} decode steps; estimate, "
                f"trainers.engines.decode_time)")


def torch_decode_estimate(*, rows: int, prompt_tokens: int, max_new_tokens: int, kv_tokens: int, layers: int,
                          kv_bytes_per_token: int, weight_bytes: int, bandwidth_bytes_s: float,
                          static_cache: bool = False) -> DecodeEstimate:
    """``DecodeEstimate`` of ``rows`` sequences of ``prompt_tokens`` + ``max_new_tokens`` (the module docstring's
    model). ``kv_tokens``: ``rollout.torch.kv_tokens`` (> 0: the budget the engine decodes under);
    ``kv_bytes_per_token``: 2 (K and V) x layers x KV heads x head dim x dtype bytes; ``weight_bytes``: the
    non-embedding weights plus the LM head in the engine's dtype; ``bandwidth_bytes_s``: the GPU's memory bandwidth
    (H100 SXM 3.35e12, H200 4.8e12)."""
    if kv_tokens <= 0:
        raise ValueError("torch_decode_estimate needs the KV budget in tokens (rollout.torch.kv_tokens > 0)")
    length = prompt_tokens + max_new_tokens
    at_once = min(rows, max(kv_tokens // length, 1))
    steps = math.ceil(rows / at_once) * max_new_tokens
    kv_read = (1 if static_cache else 3) * at_once * (prompt_tokens + max_new_tokens / 2) * kv_bytes_per_token

    def total(launch_s: float, share: float) -> float:
        return steps * (layers * launch_s + (weight_bytes + kv_read) / (share * bandwidth_bytes_s))

    return DecodeEstimate(at_once, steps, total(*OPTIMISTIC), total(*PESSIMISTIC))
