"""Log-probabilities of response tokens under a causal LM: the training engine's scorer.

The rollout engine (``trainers.engines.torch_engine``) computes the same quantity token by token with
a KV cache; with identical precision the two agree to float rounding (~1e-6), so any larger gap is
the discrepancy the precision switches introduce.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from trainers.lm_head import HEAD_KERNELS, head_logprobs


def position_ids(attention_mask_BS: Tensor) -> Tensor:
    """(B, S) RoPE positions ``cumsum(mask) - 1`` clamped at 0.

    With left padding the first real token gets position 0 whatever the padding length, so a prompt
    is encoded identically in every batch; padding positions get 0 (their values are masked anyway).
    """
    return (attention_mask_BS.long().cumsum(dim=-1) - 1).clamp(min=0)


FSDP_FORWARD_METHOD = "dcmdp_response_logprobs"
"""Name under which an FSDP2-sharded model carries ``response_logprobs`` (see ``register_fsdp_scoring``)."""

FSDP_HEAD_METHOD = "dcmdp_head_logprobs"
"""Name under which an FSDP2-sharded LM head carries the fused head log-probs (see ``register_fsdp_scoring``)."""


def lm_head_logits(model: torch.nn.Module, hidden_BTH: Tensor, *, fp32_lm_head: bool) -> Tensor:
    """(B, T, V) logits of the model's LM head; in float32 if ``fp32_lm_head`` (MiniMax-M1 §3.2).

    A float32 head is called as a module (an FSDP2-sharded head gathers its weight in its forward hook);
    a low-precision head is upcast here.
    """
    head = model.get_output_embeddings()
    if not fp32_lm_head:
        return head(hidden_BTH)
    # a float32 head stays float32 inside a float16 autocast region (model.dtype=float16) too
    with torch.autocast(device_type=hidden_BTH.device.type, enabled=False):
        if head.weight.dtype != torch.float32:
            bias = None if head.bias is None else head.bias.float()
            return F.linear(hidden_BTH.float(), head.weight.float(), bias)
        return head(hidden_BTH.float())


def register_fsdp_scoring(model: torch.nn.Module) -> None:
    """Make ``response_logprobs(model, ...)`` run as an FSDP2 forward of the root ``model``.

    Scoring calls the decoder (``model.model``) and the LM head, never ``model.forward``; the root's
    parameters (embedding, final norm) are gathered only in the root's forward hooks, so the scorer is
    attached to the model and registered as an FSDP forward method (the left-justified scorer alike:
    ``packing.register_fsdp_justified``). The fused head (``lm_head_kernel`` other
    than ``logits``) reads the head's weight without calling the head, so it is registered on the head alike.
    """
    attach_fsdp_method(model, FSDP_FORWARD_METHOD, _response_logprobs)
    attach_fsdp_method(model.get_output_embeddings(), FSDP_HEAD_METHOD, _fused_head_logprobs)


def attach_fsdp_method(module: torch.nn.Module, name: str, fn: Callable[..., Any]) -> None:
    """Attach ``fn(module, ...)`` to the FSDP2-sharded ``module`` as its method ``name`` and register that as an FSDP
    forward method: the module's parameters are gathered around each call (``call_fsdp_method`` calls it)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(module, name, functools.partial(fn, module))
    register_fsdp_forward_method(module, name)


def call_fsdp_method(module: torch.nn.Module, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(module, *args, **kwargs)``, through the FSDP forward method ``attach_fsdp_method`` attached to ``module``
    under ``name`` when there is one (a sharded module), else directly."""
    sharded = getattr(module, name, None)
    if sharded is not None:
        return sharded(*args, **kwargs)
    return fn(module, *args, **kwargs)


def _fused_head_logprobs(head: torch.nn.Module, hidden_BTH: Tensor, response_BT: Tensor, *, temperature: float,
                         kernel: str, with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    B, T, H = hidden_BTH.shape
    logp_N, ent_N = head_logprobs(hidden_BTH.reshape(B * T, H), head.weight, head.bias, response_BT.reshape(B * T),
                                  temperature=temperature, kernel=kernel, with_entropy=with_entropy)
    return logp_N.view(B, T), None if ent_N is None else ent_N.view(B, T)


def fused_lm_head_logprobs(model: torch.nn.Module, hidden_BTH: Tensor, response_BT: Tensor, *, temperature: float,
                           kernel: str, with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    """(B, T) float32 log pi(y_t) and entropy of the tempered head, without (B, T, V) logits (``trainers.lm_head``)."""
    return call_fsdp_method(model.get_output_embeddings(), FSDP_HEAD_METHOD, _fused_head_logprobs, hidden_BTH,
                            response_BT, temperature=temperature, kernel=kernel, with_entropy=with_entropy)


def tempered_logp(logits_BTV: Tensor, temperature: float) -> Tensor:
    """(B, T, V) ``log softmax(logits / temperature)`` in the logits' dtype."""
    return torch.log_softmax(logits_BTV / temperature, dim=-1)


def response_logprobs(model: torch.nn.Module, input_ids_BS: Tensor, attention_mask_BS: Tensor,
                      num_prompt_positions: int, *, temperature: float, fp32_lm_head: bool = True,
                      lm_head_kernel: str = "logits", with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Per-token log pi(y_t) and entropy of the response under ``softmax(logits / temperature)``.

    ``input_ids_BS`` is ``cat(prompt_ids_BP, response_ids_BT)`` (S = P + T), ``num_prompt_positions``
    is P. One full forward over all S positions (so that routing capture/replay contexts see exactly
    the positions the rollout engine routed); only the hidden states at positions P-1 ... S-2, the ones
    that predict response tokens, go through the LM head.

    Returns ``(logp_BT, entropy_BT)`` with ``entropy_BT = -sum_v p_v log p_v`` (None unless
    ``with_entropy``). Values at padded response positions are finite but meaningless: mask them.
    A float32 head with ``lm_head_kernel`` other than ``logits`` (``trainers.lm_head.HEAD_KERNELS``) computes both
    without the (B, T, V) float32 logits.
    """
    if lm_head_kernel not in HEAD_KERNELS:
        raise ValueError(f"lm_head_kernel {lm_head_kernel!r} not in {HEAD_KERNELS}")
    return call_fsdp_method(model, FSDP_FORWARD_METHOD, _response_logprobs, input_ids_BS, attention_mask_BS,
                            num_prompt_positions, temperature=temperature, fp32_lm_head=fp32_lm_head,
                            lm_head_kernel=lm_head_kernel, with_entropy=with_entropy)


def _response_logprobs(model: torch.nn.Module, input_ids_BS: Tensor, attention_mask_BS: Tensor,
                       num_prompt_positions: int, *, temperature: float, fp32_lm_head: bool,
                       lm_head_kernel: str, with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    S = input_ids_BS.shape[1]
    P = num_prompt_positions
    if not 1 <= P < S:
        raise ValueError(f"need 1 <= num_prompt_positions < sequence length, got P={P}, S={S}")
    out = model.model(input_ids=input_ids_BS, attention_mask=attention_mask_BS,
                      position_ids=position_ids(attention_mask_BS), use_cache=False)
    hidden_BTH = out.last_hidden_state[:, P - 1:S - 1]
    response_BT = input_ids_BS[:, P:]
    if fp32_lm_head and lm_head_kernel != "logits":
        return fused_lm_head_logprobs(model, hidden_BTH, response_BT, temperature=temperature, kernel=lm_head_kernel,
                                      with_entropy=with_entropy)
    logp_BTV = tempered_logp(lm_head_logits(model, hidden_BTH, fp32_lm_head=fp32_lm_head), temperature)
    logp_BT = logp_BTV.gather(-1, response_BT.unsqueeze(-1)).squeeze(-1)
    entropy_BT = None
    if with_entropy:
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(dim=-1)
    return logp_BT, entropy_BT
