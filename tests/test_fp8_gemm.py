"""The fp8 rollout precision's emulation against Hopper's own fp8 GEMM (GPU only; CI skips these).

``trainers/quant.py`` emulates vLLM's W8A8 e4m3 (one scale per weight output channel, one dynamic scale per
token) on any device: both operands are rounded to the e4m3 grid, dequantised and multiplied in float32. On a
GPU with fp8 tensor cores the same codes go to ``torch._scaled_mm`` (the fp8 GEMM with row-wise scales, the
kernel class vLLM's per-token / per-channel fp8 linear runs). Checked here, with the measured values printed:

- the values the emulation rounds to are the hardware GEMM's codes times its scales, bit for bit, and the
  CPU rounding (where CI runs it) agrees with the GPU's within 2^-22 relative (the GPU divides by a Python
  scalar through its reciprocal, so a scale can differ by one float32 ulp);
- the emulated product is exact to float32: ``|y_emu - y_ref| <= K 2^-23 sum_k |a_k b_k|`` against float64;
- the hardware product is not: Hopper's fp8 tensor cores accumulate with fewer bits than float32 (H200,
  torch 2.11: one 32-deep MMA already deviates by 7e-5 of ``sum_k |a_k b_k|``, up to 2.1e-4 at the presets'
  shapes; at K = 2048 1.9e-5 with promotion to float32 between MMAs, 3.0e-4 with ``use_fast_accum``);
  bound asserted: 2^-10 of it, under the bf16 rounding of the output vLLM writes (2^-9 of |y|);
- at the model level the emulation reproduces the size of the fp8 mismatch (the mean |log pi_fp32 - log mu|
  of a dense model on hardware fp8 GEMMs within 25% of the emulated one's), not each token's value: the
  accumulation error moves single tokens' log-probabilities by a share of the mismatch itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainers.config import ModelConfig
from trainers.models import build_model
from trainers.quant import (cast_for_precision, fake_quantize_fp8, fp8_codes, fp8_gemm_available,
                            quantized_weights)
from trainers.scoring import response_logprobs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fp8_gemm_available(), reason="needs a GPU with fp8 tensor cores (sm_89+)")]

_ALIGN = 16  # cuBLAS fp8 GEMMs want every dimension a multiple of 16


def _codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_codes(x.float())


def _pad(t: torch.Tensor, dim: int) -> torch.Tensor:
    extra = (-t.shape[dim]) % _ALIGN
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t, pad).view(t.dtype)


def hw_fp8_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
                  fast_accum: bool = False) -> torch.Tensor:
    """x @ w.T through ``torch._scaled_mm`` on e4m3 codes with per-row scales (zero padding is exact)."""
    M, N = x_MK.shape[0], w_NK.shape[0]
    xq, xs = _codes(x_MK)
    wq, ws = _codes(w_NK)
    xq, wq = _pad(_pad(xq, 1), 0), _pad(_pad(wq, 1), 0)
    xs = F.pad(xs, (0, 0, 0, xq.shape[0] - M), value=1.0)
    ws = F.pad(ws, (0, 0, 0, wq.shape[0] - N), value=1.0)
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t().contiguous(), out_dtype=out_dtype,
                         use_fast_accum=fast_accum)
    return y[:M, :N]


def _out_dtype() -> torch.dtype:
    """float32 output where this torch's row-wise fp8 GEMM offers it (vLLM's kernel writes the model dtype)."""
    a = torch.ones(16, 16, device="cuda")
    try:
        hw_fp8_matmul(a, a, out_dtype=torch.float32)
        return torch.float32
    except RuntimeError:
        return torch.bfloat16


@pytest.mark.parametrize("M,K,N", [(64, 32, 64), (64, 64, 192), (96, 192, 64), (40, 128, 133), (256, 128, 64),
                                   (64, 2048, 128)])
def test_emulated_w8a8_matmul_equals_hopper_fp8_gemm_within_its_accumulation_error(M, K, N):
    """Token activations x weights of the tiny / small presets' linears and experts (133: padded), and one long K."""
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    x = torch.randn(M, K, device="cuda", generator=g)
    x[::7] *= 30.0  # outlier tokens: per-token scales differ by 30x
    w = 0.02 * torch.randn(N, K, device="cuda", generator=g)
    a, b = fake_quantize_fp8(x), fake_quantize_fp8(w)
    ref = a.double() @ b.double().T
    sum_abs = a.double().abs() @ b.double().abs().T
    emu = a @ b.T
    out_dtype = _out_dtype()
    hw = {fast: hw_fp8_matmul(x, w, out_dtype=out_dtype, fast_accum=fast) for fast in (False, True)}
    rel = {name: ((y.double() - ref).abs() / sum_abs).max().item()
           for name, y in (("emu", emu), ("hw", hw[False]), ("hw fast accum", hw[True]))}
    print(f"\n[fp8 gemm] M={M} K={K} N={N} out={out_dtype}: max |y - y_ref| / sum|ab|: "
          + ", ".join(f"{k} {v:.2e}" for k, v in rel.items()))
    assert rel["emu"] <= K * 2.0 ** -23
    bound = 2.0 ** -10 if out_dtype == torch.float32 else 2.0 ** -8
    assert rel["hw"] <= bound and rel["hw fast accum"] <= bound


class _HopperFp8Linear(nn.Module):
    """An ``nn.Linear`` whose matmul is the hardware fp8 GEMM on the weight's per-channel e4m3 codes."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype):
        super().__init__()
        self.weight, self.bias, self.out_dtype = linear.weight, linear.bias, out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = hw_fp8_matmul(x.reshape(-1, x.shape[-1]), self.weight, out_dtype=self.out_dtype).float()
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _hardware_fp8_model(model: nn.Module, out_dtype: torch.dtype) -> nn.Module:
    hw = cast_for_precision(model, "fp32")
    names = {n.rsplit(".", 1)[0] for n, _ in quantized_weights(hw)}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = hw.get_submodule(parent_name) if parent_name else hw
        setattr(parent, child, _HopperFp8Linear(getattr(parent, child), out_dtype))
    return hw


@pytest.mark.parametrize("preset", ["tiny-dense", "small-dense"])
def test_emulated_fp8_engine_logprobs_match_a_model_on_hopper_fp8_gemms(preset):
    V = 64
    model = build_model(ModelConfig(preset=preset), V, seed=0).cuda()
    emu = cast_for_precision(model, "fp8")
    out_dtype = _out_dtype()
    hw = _hardware_fp8_model(model, out_dtype)
    n_swapped = sum(isinstance(m, _HopperFp8Linear) for m in hw.modules())
    assert n_swapped == sum(1 for _ in quantized_weights(model)) > 0
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, V, (16, 48), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        lp_emu, _ = response_logprobs(emu, ids, mask, 8, temperature=1.0)
        lp_hw, _ = response_logprobs(hw, ids, mask, 8, temperature=1.0)
        lp_fp32, _ = response_logprobs(cast_for_precision(model, "fp32"), ids, mask, 8, temperature=1.0)
    d = (lp_hw - lp_emu).abs()
    gap_emu, gap_hw = (lp_fp32 - lp_emu).abs().mean().item(), (lp_fp32 - lp_hw).abs().mean().item()
    print(f"\n[fp8 model] {preset} out={out_dtype}: the fp8 mismatch mean |logp fp32 - logp|: emulated {gap_emu:.3e}, "
          f"hardware {gap_hw:.3e}; per token |logp hw - logp emu| max {d.max().item():.3e} mean {d.mean().item():.3e}")
    assert gap_emu > 1e-3  # the mismatch is there to be reproduced
    assert abs(gap_hw / gap_emu - 1) <= 0.25
