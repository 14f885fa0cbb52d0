"""Attention without copying grouped KV heads: transformers' ``sdpa`` path, except that a masked call on a model
with grouped-query attention (fewer KV heads than query heads) passes ``enable_gqa=True`` to
``torch.nn.functional.scaled_dot_product_attention`` instead of materialising ``repeat_kv`` copies of K and V.

transformers copies whenever a mask is given (``use_gqa_in_sdpa`` keeps ``enable_gqa`` for maskless CUDA calls),
and every dcmdp forward has one (left-padded prompts, right-padded responses). The kernel and the values are the
same: the output is bitwise that of the copying path; the K/V gradients sum over the group in another order,
which changes them at float rounding (tests/test_attention.py). Registered with transformers under
``GQA_ATTENTION`` at import; ``model.gqa_attention`` turns it on for the training engine.
"""

from __future__ import annotations

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

GQA_ATTENTION = "dcmdp_sdpa_gqa"


def sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """query (B, H, Q, D), key/value (B, H_kv, S, D) with H = g H_kv; returns ((B, Q, H, D), None) as ``sdpa`` does."""
    if attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_ATTENTION, sdpa_gqa)
ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_ATTENTION, sdpa_mask)
