"""Left-justified rows: the training forward of a padded batch without a padding mask.

The rollout layout (``trainers.batch``) left-pads prompts and right-pads responses, so a row's real tokens are
one contiguous run of positions [P - p_b, P + r_b) of the S = P + T columns (p_b prompt, r_b response tokens).
Shifted left by o_b = P - p_b, every row starts at column 0 and its padding is all at the right: the causal mask
alone then keeps every real token from seeing a pad (pads come after all of a row's real tokens), the RoPE
positions are the column indices 0 ... J - 1 (``scoring.position_ids`` of the padded row gives its real tokens the
same ones), and the width shrinks from P + T to J = max_b (p_b + r_b). With no mask, attention is
``scaled_dot_product_attention(..., is_causal=True)``, whose flash kernel applies on a GPU, where a masked
grouped-query call falls back to the math or cuDNN kernels (docs/speed.md: padded prompts cost the 8B step 1.37x).

Only the hidden states that predict a real response token go through the LM head (N = sum_b r_b rows instead of
B x T). Log-probs and entropies are those of the padded forward to float rounding (the same keys and values in
every softmax: tests/test_packing.py); at padded response positions they are 0. MoE routes are moved into the
justified columns for a replay and back for a capture, so R2 and R3 see the positions the rollout engine routed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from trainers.scoring import attach_fsdp_method, call_fsdp_method, fused_lm_head_logprobs, lm_head_logits, tempered_logp


@dataclass(frozen=True)
class Justified:
    """Where each row's real tokens go: justified column j of row b holds padded column offset_B[b] + j."""

    # (B,) o_b = P - p_b: the row's shift to the left.
    offset_B: Tensor
    # (B,) p_b + r_b: real tokens of the row.
    length_B: Tensor
    # (B,) p_b: real prompt tokens of the row.
    prompt_len_B: Tensor
    # Width J of the justified batch: the longest row (at least 1).
    width: int

    def columns(self, S: int) -> Tensor:
        """(B, J) padded column of every justified one (pads past a row's end read column S - 1)."""
        j = torch.arange(self.width, device=self.offset_B.device)
        return (self.offset_B[:, None] + j).clamp(max=S - 1)

    def real_BJ(self) -> Tensor:
        return torch.arange(self.width, device=self.length_B.device) < self.length_B[:, None]

    def to_justified(self, x_BS: Tensor, fill) -> Tensor:
        """(B, S, ...) values of the padded layout -> (B, J, ...), ``fill`` at the pads."""
        B, S = x_BS.shape[:2]
        cols_BJ = self.columns(S).reshape(B, self.width, *([1] * (x_BS.dim() - 2))).expand(B, self.width,
                                                                                         *x_BS.shape[2:])
        out = x_BS.gather(1, cols_BJ)
        real = self.real_BJ().reshape(B, self.width, *([1] * (x_BS.dim() - 2)))
        return out.masked_fill(~real, fill)

    def from_justified(self, x_BJ: Tensor, S: int, fill) -> Tensor:
        """(B, J, ...) values of the justified layout -> (B, S, ...) of the padded one, ``fill`` at its pads."""
        B = x_BJ.shape[0]
        out = x_BJ.new_full((B, S, *x_BJ.shape[2:]), fill)
        rows, j = self.real_BJ().nonzero(as_tuple=True)
        out[rows, self.offset_B[rows] + j] = x_BJ[rows, j]
        return out


def justify(prompt_mask_BP: Tensor, response_mask_BT: Tensor) -> Optional[Justified]:
    """The justification of a batch in the rollout layout, or None when some row's real tokens are not one run of
    [left padding][prompt][response][right padding] (a custom layout is then scored padded), or when a row has a
    response but no prompt token to predict its first token from."""
    P, T = prompt_mask_BP.shape[1], response_mask_BT.shape[1]
    prompt_len_B, response_len_B = prompt_mask_BP.sum(-1), response_mask_BT.sum(-1)
    p_cols = torch.arange(P, device=prompt_mask_BP.device)
    t_cols = torch.arange(T, device=response_mask_BT.device)
    if not torch.equal(prompt_mask_BP.bool(), p_cols >= P - prompt_len_B[:, None]):
        return None
    if not torch.equal(response_mask_BT.bool(), t_cols < response_len_B[:, None]):
        return None
    if bool(((prompt_len_B == 0) & (response_len_B > 0)).any()):
        return None
    length_B = prompt_len_B + response_len_B
    return Justified(P - prompt_len_B, length_B, prompt_len_B, max(int(length_B.max()), 1))


FSDP_JUSTIFIED_METHOD = "dcmdp_justified_logprobs"
"""Name under which an FSDP2-sharded model carries ``justified_response_logprobs`` (``register_fsdp_justified``)."""


def register_fsdp_justified(model: torch.nn.Module) -> None:
    """Make ``justified_response_logprobs(model, ...)`` run as an FSDP2 forward of the root ``model``: it calls the
    decoder and the head, never ``model.forward``, and the root's parameters (embedding, final norm) are gathered
    only in the root's forward hooks (as ``scoring.register_fsdp_scoring`` does for the padded scorer)."""
    attach_fsdp_method(model, FSDP_JUSTIFIED_METHOD, _justified_response_logprobs)


def justified_response_logprobs(model: torch.nn.Module, layout: Justified, input_ids_BS: Tensor,
                                response_mask_BT: Tensor, *, temperature: float, fp32_lm_head: bool,
                                lm_head_kernel: str, with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    """``scoring.response_logprobs`` of the same batch through its justified rows: one causal forward of (B, J) with
    no padding mask, the LM head on the N real response tokens only. Returns (logp_BT, entropy_BT), 0 at padding.
    An FSDP2-sharded model runs it as its registered forward method (``register_fsdp_justified``)."""
    return call_fsdp_method(model, FSDP_JUSTIFIED_METHOD, _justified_response_logprobs, layout, input_ids_BS,
                            response_mask_BT, temperature=temperature, fp32_lm_head=fp32_lm_head,
                            lm_head_kernel=lm_head_kernel, with_entropy=with_entropy)


def _justified_response_logprobs(model: torch.nn.Module, layout: Justified, input_ids_BS: Tensor,
                                 response_mask_BT: Tensor, *, temperature: float, fp32_lm_head: bool,
                                 lm_head_kernel: str, with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    B, S = input_ids_BS.shape
    T = response_mask_BT.shape[1]
    P = S - T
    ids_BJ = layout.to_justified(input_ids_BS, 0)
    position_BJ = torch.arange(layout.width, device=ids_BJ.device).expand(B, layout.width)
    hidden_BJH = model.model(input_ids=ids_BJ, attention_mask=None, position_ids=position_BJ,
                             use_cache=False).last_hidden_state
    rows_N, t_N = response_mask_BT.bool().nonzero(as_tuple=True)
    # response token t of row b is justified column p_b + t, predicted by the hidden state one column before
    hidden_1NH = hidden_BJH[rows_N, layout.prompt_len_B[rows_N] + t_N - 1][None]
    tokens_1N = input_ids_BS[rows_N, P + t_N][None]
    if fp32_lm_head and lm_head_kernel != "logits":
        logp_1N, ent_1N = fused_lm_head_logprobs(model, hidden_1NH, tokens_1N, temperature=temperature,
                                                 kernel=lm_head_kernel, with_entropy=with_entropy)
    else:
        logp_1NV = tempered_logp(lm_head_logits(model, hidden_1NH, fp32_lm_head=fp32_lm_head), temperature)
        logp_1N = logp_1NV.gather(-1, tokens_1N.unsqueeze(-1)).squeeze(-1)
        ent_1N = -(logp_1NV.exp() * logp_1NV).sum(dim=-1) if with_entropy else None

    def scatter(x_1N: Tensor) -> Tensor:
        return x_1N.new_zeros((B, T)).index_put((rows_N, t_N), x_1N[0])

    return scatter(logp_1N), None if ent_1N is None else scatter(ent_1N)
