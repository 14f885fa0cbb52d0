"""The fused float32 LM head (trainers.lm_head) against float64: log-probs, entropies and gradients."""

import copy

import pytest
import torch

from trainers.config import ModelConfig
from trainers.lm_head import head_logprobs, split_bf16
from trainers.models import build_model
from trainers.scoring import response_logprobs

torch.set_num_threads(1)


def _problem(N=96, H=256, V=5003, seed=0, logit_scale=4.0):
    """Hidden states of unit RMS and a head whose logits have std ``logit_scale`` (a trained head's spread)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) * logit_scale / H**0.5
    b = torch.randn(V, generator=gen, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (N,), generator=gen)
    g_logp = torch.randn(N, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return h, w, b, y, g_logp, g_ent


def _float64_head(h, w, b, y, temperature, g_logp, g_ent):
    """log p, entropy and the gradients of sum(g_logp log p + g_ent H) of the float64 (N, V) head."""
    h, w = h.double().detach().requires_grad_(), w.double().detach().requires_grad_()
    b = None if b is None else b.double().detach().requires_grad_()
    z = h @ w.T if b is None else h @ w.T + b
    lp = torch.log_softmax(z / temperature, dim=-1)
    logp, ent = lp.gather(1, y[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)
    (g_logp * logp + g_ent * ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad, None if b is None else b.grad


def _fused(h, w, b, y, temperature, g_logp, g_ent, **kw):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    logp, ent = head_logprobs(h, w, b, y, temperature=temperature, with_entropy=True, **kw)
    (g_logp.float() * logp + g_ent.float() * ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad, None if b is None else b.grad


def _rel(x, ref):
    return float((x.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kernel, tol_logp, tol_grad", [("chunked", None, 1e-5), ("bf16x3", 2e-4, 1e-4)])
def test_float32_operands_match_float64_with_chunks_that_do_not_divide(kernel, tol_logp, tol_grad):
    """tol_logp None: the chunked kernel's log-probs and entropies within 2x of the plain float32 head's own error
    against float64 (log-probs down to -44 here, where float32's spacing is 3.8e-6: measured 1.06e-5 fused vs
    1.26e-5 plain on an Intel Xeon; the fused under 1e-5 on an AMD EPYC)."""
    h, w, b, y, g_logp, g_ent = _problem()
    ref = _float64_head(h, w, b, y, 0.7, g_logp, g_ent)
    lp32 = torch.log_softmax((h.float() @ w.float().T + b.float()) / 0.7, dim=-1)
    float32_err = (lp32.gather(1, y[:, None]).squeeze(1).double() - ref[0]).abs().max(), \
        (-(lp32.exp() * lp32).sum(-1).double() - ref[1]).abs().max()
    assert max(float32_err) < 5e-5
    tol_logp, tol_ent = (2 * float32_err[0], 2 * float32_err[1]) if tol_logp is None else (tol_logp, tol_logp)
    # 5003 = 3 x 1667 + 2 and 96 = 5 x 17 + 11: ragged last tiles in both directions
    out = _fused(h.float(), w.float(), b.float(), y, 0.7, g_logp, g_ent, kernel=kernel, row_chunk=17, vocab_chunk=1667)
    logp, ent, gh, gw, gb = out
    assert logp.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert (logp.double() - ref[0]).abs().max() < tol_logp
    assert (ent.double() - ref[1]).abs().max() < tol_ent
    assert _rel(gh, ref[2]) < tol_grad and _rel(gw, ref[3]) < tol_grad and _rel(gb, ref[4]) < tol_grad
    # the plain bfloat16 head, for scale: two orders of magnitude worse than either fused kernel
    z16 = (h.bfloat16() @ w.bfloat16().T + b.bfloat16()) / 0.7
    bf16_logp = torch.log_softmax(z16, dim=-1).gather(1, y[:, None]).squeeze(1)
    assert (bf16_logp.double() - ref[0]).abs().max() > 100 * tol_logp


def test_one_tile_and_many_tiles_agree_and_chunked_matches_the_float32_logits():
    h, w, b, y, g_logp, g_ent = _problem(N=40, H=64, V=777)
    one = _fused(h.float(), w.float(), b.float(), y, 1.0, g_logp, g_ent, kernel="chunked", row_chunk=40,
                 vocab_chunk=777)
    many = _fused(h.float(), w.float(), b.float(), y, 1.0, g_logp, g_ent, kernel="chunked", row_chunk=3,
                  vocab_chunk=50)
    for a, c in zip(one, many):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    lp = torch.log_softmax(h.float() @ w.float().T + b.float(), dim=-1)
    torch.testing.assert_close(one[0], lp.gather(1, y[:, None]).squeeze(1), atol=2e-6, rtol=0)


def test_split_bf16_parts_carry_sixteen_bits():
    x = torch.randn(10_000, dtype=torch.float64).float()
    hi, lo = split_bf16(x)
    assert hi.dtype == lo.dtype == torch.bfloat16
    # |x - hi - lo| <= 2^-17 |x| (hi rounds at 2^-9, lo rounds the remainder at 2^-9 of itself)
    assert ((x.double() - hi.double() - lo.double()).abs() <= 2**-17 * x.double().abs()).all()
    assert split_bf16(x.bfloat16())[1] is None


@pytest.mark.parametrize("kernel, grad_tol", [("chunked", 2**-8), ("bf16x3", 2**-7)])
def test_bfloat16_weights_and_hidden_reach_float32_accuracy_and_return_bfloat16_grads(kernel, grad_tol):
    h, w, b, y, g_logp, g_ent = _problem(N=64, H=128, V=3001)
    h16, w16 = h.bfloat16(), w.bfloat16()
    # the reference sees the same bfloat16 values: only the head's arithmetic differs
    ref = _float64_head(h16, w16, None, y, 1.0, g_logp, g_ent)
    logp, ent, gh, gw, _ = _fused(h16, w16, None, y, 1.0, g_logp, g_ent, kernel=kernel, vocab_chunk=1000)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert (logp.double() - ref[0]).abs().max() < 1e-5 and (ent.double() - ref[1]).abs().max() < 1e-5
    # bfloat16 gradients: the float64 gradient rounded to bfloat16 (2^-9 relative); bf16x3 also rounds dL/dz to
    # bfloat16 before its one GEMM (another 2^-9)
    assert _rel(gh, ref[2]) < grad_tol and _rel(gw, ref[3]) < grad_tol


def test_entropy_only_and_logp_only_losses():
    h, w, b, y, g_logp, g_ent = _problem(N=20, H=32, V=300)
    zeros = torch.zeros_like(g_logp)
    ref = _float64_head(h, w, b, y, 1.3, zeros, g_ent)
    hf = h.float().requires_grad_()
    _, ent = head_logprobs(hf, w.float(), b.float(), y, temperature=1.3, kernel="chunked", with_entropy=True,
                           vocab_chunk=64)
    (g_ent.float() * ent).sum().backward()
    assert _rel(hf.grad, ref[2]) < 1e-5
    ref = _float64_head(h, w, None, y, 1.0, g_logp, zeros)
    hf = h.float().requires_grad_()
    logp, ent = head_logprobs(hf, w.float(), None, y, kernel="bf16x3", vocab_chunk=64)
    assert ent is None
    (g_logp.float() * logp).sum().backward()
    assert _rel(hf.grad, ref[2]) < 1e-4


def test_bad_arguments_name_the_problem():
    h, w = torch.zeros(3, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="kernel"):
        head_logprobs(h, w, None, torch.zeros(3, dtype=torch.long), kernel="logits")
    with pytest.raises(ValueError, match="vocab_chunk=0"):
        head_logprobs(h, w, None, torch.zeros(3, dtype=torch.long), vocab_chunk=0)
    with pytest.raises(ValueError, match="model.lm_head_kernel"):
        ModelConfig(lm_head_kernel="fused").check()
    with pytest.raises(ValueError, match="fp32_lm_head"):
        ModelConfig(lm_head_kernel="chunked", fp32_lm_head=False).check()


def _graph_has(fn, name: str) -> bool:
    """Whether the autograd graph behind ``fn`` holds a node called ``name``."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        if type(f).__name__ == name:
            return True
        todo.extend(g for g, _ in f.next_functions)
    return False


def _padded_batch():
    P, T = 5, 4
    ids = torch.tensor([[0, 10, 11, 12, 13, 40, 41, 42, 1], [0, 0, 0, 20, 21, 50, 1, 0, 0]])
    mask = ids != 0
    mask[:, 0] = False
    return ids, mask, P


@pytest.mark.parametrize("kernel, tol", [("chunked", 1e-5), ("bf16x3", 1e-4)])
def test_scorer_with_masked_tokens_matches_the_logits_path_values_and_grads(kernel, tol):
    model = build_model(ModelConfig(preset="tiny-dense"), 101, seed=0)
    fused = copy.deepcopy(model)
    ids, mask, P = _padded_batch()
    valid = mask[:, P:]
    out = {}
    for name, m, k in (("logits", model, "logits"), ("fused", fused, kernel)):
        logp, ent = response_logprobs(m, ids, mask, P, temperature=0.8, lm_head_kernel=k, with_entropy=True)
        (-(logp * valid).sum() + 0.1 * (ent * valid).sum()).backward()
        out[name] = (logp.detach(), ent.detach(), {n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(out["fused"][0][valid], out["logits"][0][valid], atol=tol, rtol=0)
    torch.testing.assert_close(out["fused"][1][valid], out["logits"][1][valid], atol=tol, rtol=0)
    for n, g in out["logits"][2].items():
        torch.testing.assert_close(out["fused"][2][n], g, atol=tol * float(g.abs().max()), rtol=0, msg=n)


@pytest.mark.parametrize("kernel", ["chunked", "bf16x3"])
def test_learner_update_with_the_fused_head_takes_the_logits_step(kernel):
    """One learner update (micro-batches, MoE, a biased head, penalty, entropy bonus) with ScoringSpec.lm_head_kernel
    against the float32-logits head: the same pi_old, metrics and gradients to float32 rounding."""
    from constraints.config import ConstraintConfig
    from trainers import learner
    from trainers.config import AlgoConfig, RolloutConfig
    from trainers.engines.torch_engine import TorchEngine

    V, EOS = 101, 1
    model = build_model(ModelConfig(preset="tiny-moe"), V, seed=0)
    with torch.no_grad():
        head = torch.nn.Linear(model.lm_head.in_features, V, bias=True)
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[EOS] = 2.6
        model.lm_head = head
    prompts = [[5 + (7 * i + j) % 90 for j in range(3 + i % 5)] for i in range(8)]
    rollout = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=10), model, eos_id=EOS,
                          pad_id=0).generate(prompts, seed=0)
    cfg = AlgoConfig(minibatches=1, is_mode="tis", samples_per_prompt=2, prompts_per_step=4, entropy_coef=0.01)
    adv_B = torch.linspace(-1.0, 1.0, len(rollout))
    out = {}
    for k in ("logits", kernel):
        m = copy.deepcopy(model)
        spec = learner.ScoringSpec(moe=True, micro_batch_tokens=32, lm_head_kernel=k)
        batch, forward = learner.score_on_policy(m, rollout, adv_B, cfg, spec)
        assert _graph_has(forward.logp_BT.grad_fn, "_FusedHeadLogprobsBackward") == (k != "logits")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        grads = []
        opt.register_step_pre_hook(lambda o, *_: grads.append({n: p.grad.clone() for n, p in m.named_parameters()
                                                              if p.grad is not None}))
        result = learner.update(m, learner.OptimStep(opt, grad_clip=1.0), batch, scoring=spec, cfg=cfg, forward=forward,
                                penalty=learner.PenaltySpec(torch.tensor([0.5]), (ConstraintConfig(tolerance=1e-6),)),
                                generator=torch.Generator().manual_seed(0))
        out[k] = (batch, result.metrics(), grads[0])
    (batch, metrics, grads), (ref_batch, ref_metrics, ref_grads) = out[kernel], out["logits"]
    mask_BT = rollout.response_mask_BT.bool()
    tol = 1e-5 if kernel == "chunked" else 1e-4
    torch.testing.assert_close(batch.old_logp_BT[mask_BT], ref_batch.old_logp_BT[mask_BT], atol=tol, rtol=0)
    for key, ref in ref_metrics.items():
        if not key.startswith("time/"):  # wall clock
            assert metrics[key] == pytest.approx(ref, rel=10 * tol, abs=tol), key
    assert grads.keys() == ref_grads.keys() and "lm_head.bias" in grads
    for name, g in grads.items():
        scale = float(ref_grads[name].abs().max())
        assert (g - ref_grads[name]).abs().max() <= 10 * tol * scale + 1e-7, name
