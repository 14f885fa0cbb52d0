"""Inference precisions of the embedded rollout engine: fp32, bf16, fp16 casts and int8 weight-only quantisation.

``int8`` models a cheap W8A16 deployment (the weight-only schemes of LLM.int8 / GPTQ / AWQ style
serving, Dettmers et al. 2022, arXiv 2208.07339; Frantar et al. 2022, arXiv 2210.17323): every linear
weight is rounded to a symmetric per-output-channel int8 grid and stored dequantised ("fake
quantisation"), activations stay in float32. Embeddings, norms, the LM head and the MoE router are
kept in full precision, as such deployments do: they are a small share of the weights, and the LM
head and router decide the sampled token and the chosen experts directly, so quantising them costs
accuracy out of proportion to the memory saved.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

# precision name -> parameter dtype of the engine copy
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}


def fake_quantize_int8(weight_OI: Tensor) -> Tensor:
    """Symmetric per-output-channel int8 round trip of ``(..., O, I)`` weights.

    ``scale_o = max_i |w_oi| / 127``, ``w_oi <- scale_o * clamp(round(w_oi / scale_o), -127, 127)``,
    computed in float32 and returned in the input dtype; all-zero rows stay zero.
    """
    w = weight_OI.float()
    scale = w.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(w / scale), -127, 127) * scale).to(weight_OI.dtype)


@torch.no_grad()
def quantize_int8_(module: nn.Module) -> nn.Module:
    """In place: int8 fake-quantise every ``nn.Linear`` weight and every Qwen3-MoE expert weight.

    Skipped: the LM head (``module.get_output_embeddings()``), embeddings, norms and the MoE router
    (``Qwen3MoeTopKRouter`` is not an ``nn.Linear``). Expert weights are ``(E, O, I)`` and get one
    scale per expert and output row.
    """
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    for m in module.modules():
        if isinstance(m, nn.Linear) and m is not head:
            m.weight.copy_(fake_quantize_int8(m.weight))
        elif isinstance(m, Qwen3MoeExperts):
            m.gate_up_proj.copy_(fake_quantize_int8(m.gate_up_proj))
            m.down_proj.copy_(fake_quantize_int8(m.down_proj))
    return module


def cast_for_precision(model: nn.Module, precision: str) -> nn.Module:
    """A frozen copy of ``model`` in eval mode for inference in ``precision`` (fp32|bf16|fp16|int8)."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"unknown inference precision {precision!r}; available: {', '.join(PRECISION_DTYPES)}")
    engine_model = copy.deepcopy(model).to(PRECISION_DTYPES[precision])
    engine_model.eval()
    engine_model.requires_grad_(False)
    if precision == "int8":
        quantize_int8_(engine_model)
    return engine_model
