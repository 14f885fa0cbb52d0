"""Float32-accurate LM-head log-probabilities without (N, V) float32 logits: a chunked fused linear + log-sum-exp.

The float32 LM head (``model.fp32_lm_head``, MiniMax-M1 §3.2) materialises ``hidden @ W^T`` as an (N, V) float32
tensor (N scored tokens, V ~ 152k for Qwen3), log-softmaxes it, and keeps both for the backward. ``head_logprobs``
computes the same two per-token quantities,

    log p(y_n) = z_{n, y_n} - logsumexp_v z_{n, v},      H_n = logsumexp_v z_{n, v} - sum_v p_{n, v} z_{n, v},

with z = (hidden W^T + b) / temperature, over (row chunk x vocabulary chunk) tiles with a running (online) max,
sum and sum of p z in float32 (Milakov & Gimelshein 2018, arXiv 1805.02867), and keeps only the (N,) log-sum-exp
and mean logit for the backward, which recomputes each tile's logits:

    dL/dz_{n, v} = g_n (1[v = y_n] - p_{n, v}) - e_n p_{n, v} (z_{n, v} - sum_u p_{n, u} z_{n, u})

(g = dL/dlog p, e = dL/dH), then dL/dhidden = dL/dz W / temperature and dL/dW = (dL/dz)^T hidden / temperature.

Two tile matmuls (``HEAD_KERNELS``):

- ``chunked``: float32 operands, a float32 GEMM per tile (today's numerics, no (N, V) tensor);
- ``bf16x3``: each float32 operand split into a bfloat16 high part and the bfloat16 rounding of its remainder,
  x = x_hi + x_lo (|x - x_hi - x_lo| <= 2^-17 |x|), and a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi: three
  bfloat16 GEMMs with float32 accumulation and float32 output (the split-precision scheme of Henry, Tang &
  Heinecke, "Leveraging the bfloat16 Artificial Intelligence Datatype For Higher-Precision Computations",
  ARITH 2019, arXiv 1904.06376). An operand that is already bfloat16 has no low part, so its terms drop: bfloat16
  hidden states and weights cost one GEMM, with every product exact and a float32 sum, as in the float32 head.
  Gradients are computed the same way, except that a gradient whose result is rounded to bfloat16 anyway (that of
  a bfloat16 operand) uses the high parts only.

On CUDA the bfloat16 GEMMs with float32 output run on tensor cores (``torch.mm(..., out_dtype=torch.float32)``); on
the CPU (and where that call is missing) the same exact bfloat16 products are summed by a float32 GEMM.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# How the float32 LM head computes its log-probs (the names live with the config, which checks them): "logits"
# materialises the (B, T, V) float32 logits (trainers.scoring.lm_head_logits); the others go through head_logprobs.
from trainers.config import HEAD_KERNELS

# Tile of one fused step: rows x vocabulary entries (a 4096 x 16384 float32 tile is 256 MiB).
ROW_CHUNK = 4096
VOCAB_CHUNK = 16384

_CUDA_OUT_DTYPE_MM: dict[str, bool] = {}


def _mm_f32(a: Tensor, b_t: Tensor) -> Tensor:
    """float32 ``a @ b_t.T`` of two bfloat16 (or float32) operands: every bfloat16 product is exact, the sum float32."""
    if a.dtype == torch.bfloat16 and b_t.dtype == torch.bfloat16 and a.is_cuda and _CUDA_OUT_DTYPE_MM.get("ok", True):
        # a layout the kernel refuses gets contiguous operands before the float32 fallback is taken for good
        for x, y in ((a, b_t), (a.contiguous(), b_t.contiguous())):
            try:
                out = torch.mm(x, y.t(), out_dtype=torch.float32)
                _CUDA_OUT_DTYPE_MM["ok"] = True
                return out
            except (RuntimeError, TypeError):
                pass
        _CUDA_OUT_DTYPE_MM["ok"] = False
    return a.float() @ b_t.float().t()


def split_bf16(x: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """(x_hi, x_lo): bfloat16 parts with x ~ x_hi + x_lo to 2^-17 relative; x_lo is None for a bfloat16 x."""
    hi = x.to(torch.bfloat16)
    if x.dtype == torch.bfloat16:
        return hi, None
    return hi, (x.float() - hi.float()).to(torch.bfloat16)


def split_matmul(a: Tensor, b_t: Tensor, kernel: str, *, full: bool = True) -> Tensor:
    """float32 ``a @ b_t.T``: one float32 GEMM (``chunked``) or the bf16x3 sum of split-bfloat16 GEMMs.

    ``full=False`` keeps the high parts only (for a result that is rounded to bfloat16 anyway).
    """
    if kernel == "chunked":
        return a.float() @ b_t.float().t()
    a_hi, a_lo = split_bf16(a)
    b_hi, b_lo = split_bf16(b_t)
    out = _mm_f32(a_hi, b_hi)
    if full:
        if b_lo is not None:
            out += _mm_f32(a_hi, b_lo)
        if a_lo is not None:
            out += _mm_f32(a_lo, b_hi)
    return out


def _tile_logits(h_RH: Tensor, w_CH: Tensor, bias_C: Optional[Tensor], temperature: float, kernel: str) -> Tensor:
    z_RC = split_matmul(h_RH, w_CH, kernel)
    if bias_C is not None:
        z_RC += bias_C.float()
    return z_RC / temperature if temperature != 1.0 else z_RC


class _FusedHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, targets_N, temperature, kernel, with_entropy, row_chunk,
                vocab_chunk):
        N, V = hidden_NH.shape[0], weight_VH.shape[0]
        dev = hidden_NH.device
        logp_N = torch.empty(N, dtype=torch.float32, device=dev)
        lse_N = torch.empty(N, dtype=torch.float32, device=dev)
        mean_z_N = torch.empty(N, dtype=torch.float32, device=dev) if with_entropy else None
        with torch.autocast(device_type=dev.type, enabled=False):
            for r0 in range(0, N, row_chunk):
                h_RH, y_R = hidden_NH[r0:r0 + row_chunk], targets_N[r0:r0 + row_chunk]
                R = h_RH.shape[0]
                m_R = torch.full((R,), float("-inf"), dtype=torch.float32, device=dev)
                s_R = torch.zeros(R, dtype=torch.float32, device=dev)
                t_R = torch.zeros(R, dtype=torch.float32, device=dev) if with_entropy else None
                zy_R = torch.zeros(R, dtype=torch.float32, device=dev)
                for v0 in range(0, V, vocab_chunk):
                    b = None if bias_V is None else bias_V[v0:v0 + vocab_chunk]
                    z_RC = _tile_logits(h_RH, weight_VH[v0:v0 + vocab_chunk], b, temperature, kernel)
                    m_new_R = torch.maximum(m_R, z_RC.amax(dim=-1))
                    scale_R = torch.exp(m_R - m_new_R)
                    e_RC = torch.exp(z_RC - m_new_R[:, None])
                    s_R = s_R * scale_R + e_RC.sum(dim=-1)
                    if with_entropy:
                        t_R = t_R * scale_R + (e_RC * z_RC).sum(dim=-1)
                    m_R = m_new_R
                    inside_R = (y_R >= v0) & (y_R < v0 + z_RC.shape[1])
                    local_R = (y_R - v0).clamp(0, z_RC.shape[1] - 1)
                    zy_R += torch.where(inside_R, z_RC.gather(1, local_R[:, None]).squeeze(1), 0.0)
                lse_N[r0:r0 + R] = m_R + torch.log(s_R)
                logp_N[r0:r0 + R] = zy_R - lse_N[r0:r0 + R]
                if with_entropy:
                    mean_z_N[r0:r0 + R] = t_R / s_R
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, targets_N, lse_N, mean_z_N)
        ctx.cfg = (temperature, kernel, row_chunk, vocab_chunk)
        if not with_entropy:
            return logp_N, None
        return logp_N, lse_N - mean_z_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        hidden_NH, weight_VH, bias_V, targets_N, lse_N, mean_z_N = ctx.saved_tensors
        temperature, kernel, row_chunk, vocab_chunk = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        N, V = hidden_NH.shape[0], weight_VH.shape[0]
        dev = hidden_NH.device
        g_logp_N = torch.zeros(N, device=dev) if g_logp_N is None else g_logp_N.float()
        g_ent_N = None if (g_ent_N is None or mean_z_N is None) else g_ent_N.float()
        grad_h = torch.zeros(hidden_NH.shape, dtype=torch.float32, device=dev) if need_h else None
        grad_w = torch.zeros(weight_VH.shape, dtype=torch.float32, device=dev) if need_w else None
        grad_b = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None
        # a gradient rounded to bfloat16 on return needs no low parts
        full_h = hidden_NH.dtype != torch.bfloat16
        full_w = weight_VH.dtype != torch.bfloat16
        with torch.autocast(device_type=dev.type, enabled=False):
            for r0 in range(0, N, row_chunk):
                h_RH, y_R = hidden_NH[r0:r0 + row_chunk], targets_N[r0:r0 + row_chunk]
                lse_R, g_R = lse_N[r0:r0 + row_chunk], g_logp_N[r0:r0 + row_chunk]
                for v0 in range(0, V, vocab_chunk):
                    w_CH = weight_VH[v0:v0 + vocab_chunk]
                    b = None if bias_V is None else bias_V[v0:v0 + vocab_chunk]
                    z_RC = _tile_logits(h_RH, w_CH, b, temperature, kernel)
                    p_RC = torch.exp(z_RC - lse_R[:, None])
                    if g_ent_N is not None:
                        e_R = g_ent_N[r0:r0 + row_chunk]
                        # dH/dz = -p (z - E_p z)
                        dz_RC = -p_RC * (g_R[:, None] + e_R[:, None] * (z_RC - mean_z_N[r0:r0 + row_chunk, None]))
                    else:
                        dz_RC = p_RC.mul_(-g_R[:, None])
                    del z_RC
                    C = dz_RC.shape[1]
                    # + g at each row's target column if it lies in this tile (a masked scatter: no host sync)
                    inside_R = (y_R >= v0) & (y_R < v0 + C)
                    dz_RC.scatter_add_(1, (y_R - v0).clamp(0, C - 1)[:, None], torch.where(inside_R, g_R, 0.0)[:, None])
                    if temperature != 1.0:
                        dz_RC /= temperature
                    if need_h:
                        # (R, C) @ (C, H): b_t is W^T, i.e. (H, C)
                        grad_h[r0:r0 + row_chunk] += split_matmul(dz_RC, w_CH.t(), kernel, full=full_h)
                    if need_w:
                        grad_w[v0:v0 + C] += split_matmul(dz_RC.t(), h_RH.t(), kernel, full=full_w)
                    if need_b:
                        grad_b[v0:v0 + C] += dz_RC.sum(dim=0)
        return (None if grad_h is None else grad_h.to(hidden_NH.dtype),
                None if grad_w is None else grad_w.to(weight_VH.dtype),
                None if grad_b is None else grad_b.to(bias_V.dtype),
                None, None, None, None, None, None)


def head_logprobs(hidden_NH: Tensor, weight_VH: Tensor, bias_V: Optional[Tensor], targets_N: Tensor, *,
                  temperature: float = 1.0, kernel: str = "bf16x3", with_entropy: bool = False,
                  row_chunk: int = ROW_CHUNK, vocab_chunk: int = VOCAB_CHUNK) -> tuple[Tensor, Optional[Tensor]]:
    """(N,) float32 ``log softmax(z)[y]`` and (with_entropy) entropy ``-sum p log p``, z = (h W^T + b) / temperature.

    hidden_NH: (N, H) float32 or bfloat16; weight_VH: (V, H); bias_V: (V,) or None; targets_N: (N,) token ids.
    Differentiable in hidden, weight and bias; no (N, V) tensor is kept (see the module docstring).
    """
    if kernel not in HEAD_KERNELS[1:]:
        raise ValueError(f"head_logprobs: kernel {kernel!r} not in {HEAD_KERNELS[1:]}")
    if row_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"head_logprobs: chunks must be >= 1, got row_chunk={row_chunk}, vocab_chunk={vocab_chunk}")
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"head_logprobs: hidden {tuple(hidden_NH.shape)} and weight {tuple(weight_VH.shape)} "
                         "must be (N, H) and (V, H)")
    return _FusedHeadLogprobs.apply(hidden_NH, weight_VH, bias_V, targets_N, float(temperature), kernel,
                                    with_entropy, row_chunk, vocab_chunk)
