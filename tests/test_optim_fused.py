"""The multi-tensor step of ``BF16AdamW``: the rounding law on each element, independence from how the parameters
are cut into buckets, and the compiled step against the eager one."""

from __future__ import annotations

import pytest
import torch

from trainers import optim
from trainers.optim import BF16AdamW, adamw_bf16_update, adamw_scalars

SHAPES = [(300, 70), (1000,), (17, 3, 5), (64, 129)]


def _bf16_neighbours(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and above |x| in magnitude (truncation of the bit pattern, and one step up)."""
    low = (x32.view(torch.int32) & -(1 << 16)).view(torch.float32)
    high = ((x32.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
    return low, high


@pytest.mark.parametrize("kahan", [False, True])
def test_update_follows_adamw_in_float64_and_the_rounding_law(kahan):
    torch.manual_seed(0)
    n = 20_000
    p, g, m = torch.randn(n).bfloat16(), torch.randn(n).bfloat16(), (0.1 * torch.randn(n)).bfloat16()
    v = (0.01 * torch.rand(n)).bfloat16()
    c = (1e-4 * torch.randn(n)).bfloat16() if kahan else None
    draws = torch.empty(n, dtype=torch.int64).random_(generator=torch.Generator().manual_seed(1))
    lr, b1, b2, eps, wd, t = 1e-3, 0.9, 0.95, 1e-8, 0.1, 7
    p_new, m_new, v_new, c_new = adamw_bf16_update(p, g, m, v, c, draws, *adamw_scalars(lr, b1, b2, eps, wd, t))
    # float64 AdamW of the same stored state (Loshchilov & Hutter, Algorithm 2)
    m64 = b1 * m.double() + (1 - b1) * g.double()
    v64 = b2 * v.double() + (1 - b2) * g.double() ** 2
    base = p.double() + (c.double() if kahan else 0.0)
    p64 = base - lr * wd * p.double() - lr * (m64 / (1 - b1 ** t)) / ((v64 / (1 - b2 ** t)).sqrt() + eps)
    for new, exact, field in ((m_new, m64, 0), (v_new, v64, 1)) + (() if kahan else ((p_new, p64, 2),)):
        x32 = exact.float()  # within float32 rounding of the kernel's float32 value: compare the rounding itself
        low, high = _bf16_neighbours(x32)
        assert ((new.float() == low) | (new.float() == high)).float().mean() > 0.999
        # the law: the magnitude rounds up exactly when the noise field carries the low 16 bits past 2^16
        noise = (draws >> (16 * field)) & 0xFFFF
        up = (x32.view(torch.int32).long() & 0xFFFF) + noise >= (1 << 16)
        exact_bf16 = (x32.view(torch.int32) & 0xFFFF) == 0
        agree = torch.where(up & ~exact_bf16, new.float() == high, new.float() == low)
        assert agree.float().mean() > 0.999  # the rest: float32 rounding moved the low bits by an ulp
    if kahan:
        # p + c holds the float64 result to the rounding of c (bfloat16 c: 2^-9 of it) plus float32 rounding
        err = (p_new.double() + c_new.double() - p64).abs()
        assert (err <= c_new.double().abs() * 2 ** -8 + p64.abs() * 2 ** -22).all()
        # p is p + c + u rounded to nearest (but where float32 rounding crosses a midpoint)
        assert (p_new == p64.float().bfloat16()).float().mean() > 0.999


def _run(rounding: str, compile: bool = False, steps: int = 3) -> tuple[list[torch.Tensor], BF16AdamW]:
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16())
              for i, s in enumerate(SHAPES)]
    opt = BF16AdamW(params, lr=1e-3, weight_decay=0.1, rounding=rounding, seed=3, compile=compile)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
    return params, opt


@pytest.mark.parametrize("rounding", BF16AdamW.ROUNDINGS)
def test_the_step_does_not_depend_on_the_bucket_size(rounding, monkeypatch):
    # the CPU generator draws one element after another, so the same stream reaches every element whatever the
    # buckets: cutting tensors into pieces of 100 elements (and buckets of up to 100) changes nothing
    ref, ref_opt = _run(rounding)
    monkeypatch.setattr(optim, "BUCKET", 100)
    cut, cut_opt = _run(rounding)
    for a, b in zip(ref, cut):
        assert torch.equal(a, b)
        for k, v in ref_opt.state[a].items():
            assert torch.equal(v, cut_opt.state[b][k]), k


def _one_step_apart(a: torch.Tensor, b: torch.Tensor) -> None:
    """a and b (bfloat16) equal but on at most 0.1% of the elements, where they are neighbours."""
    diff = a != b
    assert diff.float().mean() <= 1e-3
    ia, ib = a[diff].view(torch.int16).int(), b[diff].view(torch.int16).int()
    assert ((ia - ib).abs() <= 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("rounding", BF16AdamW.ROUNDINGS)
def test_compiled_step_equals_the_eager_step(rounding):
    # the compiled kernel runs the same float32 operations on the same draws (casts emulated); the C++ compiler may
    # contract a multiply-add into one rounding, which moves a float32 result by an ulp: measured 0 parameters and
    # 0 (stochastic) or 2 of 30,511 (kahan) compensation values one bfloat16 step apart. About 20 s of compilation.
    eager, eager_opt = _run(rounding, compile=False)
    fused, fused_opt = _run(rounding, compile=True)
    for a, b in zip(eager, fused):
        _one_step_apart(a.detach(), b.detach())
        for k, v in eager_opt.state[a].items():
            if k != "step":
                _one_step_apart(v, fused_opt.state[b][k])


def test_fsdp2_sharded_parameters_step_like_plain_ones(monkeypatch):
    # FSDP2 parameters are DTensors: the step runs on their local shards. At world size 1 (gloo, one process) the
    # shard is the whole tensor, so the sharded model must take bit for bit the unsharded model's steps.
    import copy
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).bfloat16()
        sharded = copy.deepcopy(plain)
        fully_shard(sharded)
        for rounding in BF16AdamW.ROUNDINGS:
            for model in (plain, sharded):
                opt = BF16AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, rounding=rounding, seed=1)
                for step in range(3):
                    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).bfloat16()
                    model(x).float().pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
            for a, b in zip(plain.parameters(), sharded.parameters()):
                assert type(b).__name__ == "DTensor"
                assert torch.equal(a, b.full_tensor())
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rounding", BF16AdamW.ROUNDINGS)
def test_cuda_compiled_step_equals_the_cuda_eager_step(rounding):
    # on CUDA the compiled step is the default: the same draws as the eager step (same buckets), the same float32
    # operations in a Triton kernel, so the parameters and state agree but for float32 rounding
    def run(compile: bool):
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16().cuda())
                  for i, s in enumerate(SHAPES)]
        opt = BF16AdamW(params, lr=1e-3, weight_decay=0.1, rounding=rounding, seed=3, compile=compile)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16().cuda()
            opt.step()
        return params, opt

    eager, eager_opt = run(False)
    fused, fused_opt = run(True)
    for a, b in zip(eager, fused):
        _one_step_apart(a.detach().cpu(), b.detach().cpu())
        for k, v in eager_opt.state[a].items():
            if k != "step":
                _one_step_apart(v.cpu(), fused_opt.state[b][k].cpu())
