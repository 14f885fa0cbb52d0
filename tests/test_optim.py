"""optim.precision: bfloat16 AdamW with stochastic rounding or Kahan compensation against a float64 AdamW."""

from __future__ import annotations

import io

import pytest
import torch

from dcmdp import cli
from trainers.config import OptimConfig
from trainers.optim import PRECISIONS, BF16AdamW, build_optimizer, round_stochastic_bf16, state_bytes_per_param

BETAS, EPS = (0.9, 0.95), 1e-8


def adamw_f64(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float) -> torch.Tensor:
    """Reference AdamW in float64 (Loshchilov & Hutter, Algorithm 2, bias-corrected, decoupled decay)."""
    b1, b2 = BETAS
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for t, g in enumerate(grads, 1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * wd * p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + EPS)
    return p


def adamw_bf16_nearest(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float) -> torch.Tensor:
    """Plain bfloat16 AdamW: the same float32 arithmetic, every store rounded to nearest, no compensation."""
    b1, b2 = BETAS
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, 1):
        g = g.float()
        m = (b1 * m.float() + (1 - b1) * g).bfloat16()
        v = (b2 * v.float() + (1 - b2) * g * g).bfloat16()
        u = -lr * wd * p.float() - lr * (m.float() / (1 - b1 ** t)) / ((v.float() / (1 - b2 ** t)).sqrt() + EPS)
        p = (p.float() + u).bfloat16()
    return p


def run_bf16(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, rounding: str, seed: int = 0):
    p = torch.nn.Parameter(p0.clone())
    opt = BF16AdamW([p], lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, rounding=rounding, seed=seed)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p, opt


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    # 1 + 1e-3 lies between the bfloat16 neighbours 1 and 1 + 2^-7: P(up) = 1e-3 / 2^-7 = 0.128
    gen = torch.Generator().manual_seed(0)
    n, x = 200_000, 1.0 + 1e-3
    r = round_stochastic_bf16(torch.full((n,), x), gen).double()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    p_up = 1e-3 / 2 ** -7
    sd_mean = 2 ** -7 * (p_up * (1 - p_up) / n) ** 0.5  # binomial: sd of the mean of n draws
    assert abs(r.mean().item() - x) < 5 * sd_mean
    # negative values round in magnitude the same way; exact bfloat16 values and non-finite ones are kept
    assert abs(round_stochastic_bf16(torch.full((n,), -x), gen).double().mean().item() + x) < 5 * sd_mean
    special = torch.tensor([1.5, -0.25, float("inf"), -float("inf")])
    assert torch.equal(round_stochastic_bf16(special, gen).float(), special)
    assert round_stochastic_bf16(torch.tensor([float("nan")]), gen).isnan().all()


def test_kahan_tracks_float64_adamw_and_plain_bf16_drifts():
    # lr 1e-4 on weights of size ~1: every single update is below half a bfloat16 step (2^-9 of the weight)
    torch.manual_seed(0)
    steps, lr, wd = 1000, 1e-4, 0.01
    p0 = torch.randn(256).bfloat16()
    grads = [(torch.randn(256) + 0.5).bfloat16() for _ in range(steps)]
    ref = adamw_f64(p0, grads, lr, wd)
    path = (ref - p0.double()).abs()
    assert path.mean() > 0.03  # the weights do move: about 0.44 lr per step on average
    p, opt = run_bf16(p0, grads, lr, wd, "kahan")
    tracked = p.double() + opt.state[p]["compensation"].double()
    # bound: 1% of the largest possible path (lr x steps = 0.1); measured max 4.2e-4 (moments stored in bfloat16)
    assert (tracked - ref).abs().max() < 0.01 * lr * steps
    plain = adamw_bf16_nearest(p0, grads, lr, wd).double()
    # round-to-nearest loses every update: the weights stay where they were, the whole path is the error
    assert (plain == p0.double()).float().mean() > 0.99
    assert (plain - ref).abs().mean() > 0.9 * path.mean()


def test_stochastic_rounding_adamw_is_unbiased_against_float64():
    # 4 weights, each replicated R times with the same gradients: the replicas' mean estimates E[p_T]
    torch.manual_seed(1)
    R, steps, lr = 4096, 200, 1e-4
    base = torch.tensor([1.0, -0.3, 0.05, 3.0]).bfloat16()
    grads = [(torch.randn(4) + 0.3).bfloat16() for _ in range(steps)]
    ref = adamw_f64(base, grads, lr, 0.0)
    p, _ = run_bf16(base.repeat_interleave(R), [g.repeat_interleave(R) for g in grads], lr, 0.0, "stochastic")
    x = p.detach().double().view(4, R)
    moved = (ref - base.double()).abs()
    assert (moved > 0.003).all()
    # 5 standard errors of the replicas' mean (measured errors: 1e-5 .. 5e-5, the bounds 9e-5 .. 7e-4)
    assert ((x.mean(1) - ref).abs() < 5 * x.std(1) / R ** 0.5).all()
    plain = adamw_bf16_nearest(base, grads, lr, 0.0).double()
    assert torch.allclose((plain - ref).abs(), moved)  # round-to-nearest never moved: the error is the path


@pytest.mark.parametrize("rounding", BF16AdamW.ROUNDINGS)
def test_state_dict_round_trip_resumes_bit_for_bit(rounding):
    torch.manual_seed(2)
    p0 = torch.randn(3, 5).bfloat16()
    grads = [torch.randn(3, 5).bfloat16() for _ in range(12)]
    p, opt = run_bf16(p0, grads[:6], 1e-3, 0.1, rounding, seed=7)
    buf = io.BytesIO()
    torch.save({"p": p.detach().clone(), "opt": opt.state_dict()}, buf)
    for g in grads[6:]:  # uninterrupted
        p.grad = g.clone()
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    q = torch.nn.Parameter(saved["p"])
    resumed = BF16AdamW([q], lr=1e-3, betas=BETAS, eps=EPS, weight_decay=0.1, rounding=rounding, seed=0)
    resumed.load_state_dict(saved["opt"])
    for g in grads[6:]:
        q.grad = g.clone()
        resumed.step()
    assert torch.equal(p, q)
    for k, v in opt.state[p].items():
        assert torch.equal(v, resumed.state[q][k]), k
    other = BF16AdamW([torch.nn.Parameter(p0.clone())], rounding="kahan" if rounding == "stochastic" else "stochastic")
    with pytest.raises(ValueError, match="rounding"):
        other.load_state_dict(saved["opt"])


@pytest.mark.parametrize("precision, param_state, total", [
    # parameter + state bytes per parameter: fp32 4 + 8; bfloat16 2 + 4 (+ 2 for the Kahan buffer); gradients
    # in the parameters' dtype. The step counter adds 4 B per tensor: 4e-6 B per parameter here
    ("fp32", 12.0, 16.0), ("bf16_stochastic", 6.0, 8.0), ("bf16_kahan", 8.0, 10.0)])
def test_bytes_per_parameter(precision, param_state, total):
    dtype = PRECISIONS[precision].param_dtype or torch.float32
    p = torch.nn.Parameter(torch.randn(1000, 1000, dtype=dtype))
    opt = build_optimizer([p], OptimConfig(precision=precision), seed=0)
    p.grad = torch.randn_like(p)
    opt.step()
    b = state_bytes_per_param(opt)
    assert b["param+state"] == pytest.approx(param_state, abs=1e-4)
    assert b["total"] == pytest.approx(total, abs=1e-4)


def test_bf16_adamw_refuses_float32_parameters():
    with pytest.raises(TypeError, match="bfloat16 parameters"):
        BF16AdamW([torch.nn.Parameter(torch.zeros(2))])


def test_unknown_precision_is_a_config_error_exit_2(tmp_path, capsys):
    rc = cli.main(["train", "configs/default.yaml", f"output_dir={tmp_path / 'out'}", "optim.precision=bf8"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "'optim.precision'" in err and "bf8" in err and "bf16_kahan" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the optimiser's own state round trip (above) runs by default
@pytest.mark.parametrize("precision", ["bf16_kahan"])
def test_training_run_in_bf16_resumes_bit_for_bit(precision, tmp_path):
    """A tiny-moe run trains bfloat16 parameters with the chosen optimiser, checkpoints its state (moments,
    compensation, the rounding generator) and a run resumed from step 4 repeats steps 5-6 exactly."""
    import os
    import subprocess
    import sys

    from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint

    def args(out, *extra):
        return [sys.executable, "-m", "dcmdp.cli", "train", "model.preset=tiny-moe", "rollout.precision=int8",
                "cold_start.steps=5", f"cold_start.cache_dir={tmp_path / 'cache'}", "algo.prompts_per_step=4",
                "algo.samples_per_prompt=2", "algo.minibatches=2", "task.eval_size=8", "steps=6",
                "checkpoint.every=2", "checkpoint.keep=3", "threads=1", "progress=false", f"output_dir={out}",
                f"optim.precision={precision}", *extra]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(args(tmp_path / "ref"), check=True, env=env, timeout=300, capture_output=True)
    ref = load_checkpoint(find_resume_checkpoint(tmp_path / "ref" / "checkpoints", "auto"))
    assert all(v.dtype == torch.bfloat16 for v in ref["model"].values() if v.is_floating_point())
    first = next(iter(ref["optimizer"]["state"].values()))
    assert first["exp_avg"].dtype == torch.bfloat16 and "compensation" in first
    done = subprocess.run(args(tmp_path / "run", f"checkpoint.resume={tmp_path}/ref/checkpoints/step_00000004"),
                          env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    run = load_checkpoint(find_resume_checkpoint(tmp_path / "run" / "checkpoints", "auto"))
    strip = lambda h: {k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))}  # noqa: E731
    assert [strip(h) for h in run["history"]] == [strip(h) for h in ref["history"]]
    for name, w in ref["model"].items():
        assert torch.equal(w, run["model"][name]), name
