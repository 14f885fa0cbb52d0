"""model.dtype=float16: float32 master weights, the learner's forwards under float16 autocast (LM head in float32
when asked), dynamic loss scaling with torch's GradScaler; an overflow is skipped by the scaler, not counted as a
bad update."""

import copy
import random

import pytest
import torch

from constraints.config import ConstraintConfig
from trainers import learner
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model, compute_dtype

torch.set_num_threads(1)
V = 101


def _setup(dtype: str = "float16", precision: str = "fp16"):
    model = build_model(ModelConfig(preset="tiny-moe", dtype=dtype), V, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, V) for _ in range(rng.randint(2, 7))] for _ in range(16)]
    rollout = TorchEngine(RolloutConfig(precision=precision, max_new_tokens=6), model, eos_id=1,
                          pad_id=0).generate(prompts, seed=0)
    cfg = AlgoConfig(minibatches=2, is_mode="tis", samples_per_prompt=2, prompts_per_step=8)
    return model, rollout, cfg, torch.linspace(-1.0, 1.0, len(rollout))


def _score(model, rollout, cfg, adv_B):
    return learner.score_old(model, rollout, adv_B, cfg, learner.ScoringSpec(moe=True))


def test_float16_training_keeps_float32_weights_and_computes_in_float16():
    model, rollout, cfg, adv_B = _setup()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert compute_dtype(model) == torch.float16
    seen = {}
    # the matmuls run in float16 (autocast keeps the residual stream and the norms in float32)
    h1 = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.update(hidden=out.dtype))
    h2 = model.lm_head.register_forward_hook(lambda m, a, out: seen.update(logits=out.dtype))
    batch = _score(model, rollout, cfg, adv_B)
    h1.remove(), h2.remove()
    assert seen == {"hidden": torch.float16, "logits": torch.float32}  # fp32_lm_head holds inside autocast
    ref = copy.deepcopy(model)
    ref.dcmdp_compute_dtype = None  # the same weights computed in float32
    ref_batch = _score(ref, rollout, cfg, adv_B)
    mask = rollout.response_mask_BT.bool()
    diff = (batch.old_logp_BT - ref_batch.old_logp_BT)[mask].abs()
    assert 0 < diff.max() < 5e-2  # float16 rounding: present, and small


def _update(model, batch, cfg, scaler):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    penalty = learner.PenaltySpec(torch.tensor([0.5]), (ConstraintConfig(measure="abs_prob_diff", tolerance=1e-6),))
    return learner.update(model, learner.OptimStep(opt, scaler=scaler, grad_clip=1.0), batch,
                          scoring=learner.ScoringSpec(moe=True), penalty=penalty, cfg=cfg,
                          generator=torch.Generator().manual_seed(0))


def test_an_overflow_is_skipped_by_the_scaler_and_the_scale_backs_off():
    model, rollout, cfg, adv_B = _setup()
    batch = _score(model, rollout, cfg, adv_B)
    before = [p.detach().clone() for p in model.parameters()]
    # a scale this large overflows float16 gradients (and float32 ones: 3e38 times a gradient is inf)
    scaler = torch.amp.GradScaler("cpu", init_scale=3e38, growth_interval=1000)
    result = _update(model, batch, cfg, scaler)
    metrics = result.steps
    assert [m["optim/scale_overflow"] for m in metrics] == [1.0, 1.0]
    assert [m["guard/skipped_update"] for m in metrics] == [0.0, 0.0] and result.skipped == 0
    assert metrics[1]["optim/loss_scale"] == pytest.approx(3e38 * 0.5, rel=1e-6)  # backoff 0.5 per overflow
    assert scaler.get_scale() == pytest.approx(3e38 * 0.25, rel=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # no step was taken
    # at a sane scale the same batch trains
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    metrics = _update(model, batch, cfg, scaler).steps
    assert [m["optim/scale_overflow"] for m in metrics] == [0.0, 0.0]
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_scaled_steps_match_unscaled_float32_gradients_direction():
    """With no overflow, loss scaling changes nothing but rounding: the first mini-batch's unscaled gradient under
    float16 autocast points the way of the float32 gradient (cosine > 0.99)."""
    model, rollout, cfg, adv_B = _setup()
    batch = _score(model, rollout, cfg, adv_B)
    grads = {}

    def run(m, scaler):
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        def keep_first(o, *_):
            if id(m) not in grads:
                grads[id(m)] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]).clone()

        opt.register_step_pre_hook(keep_first)
        learner.update(m, learner.OptimStep(opt, scaler=scaler), batch, scoring=learner.ScoringSpec(moe=True),
                       penalty=learner.PenaltySpec(), cfg=cfg, generator=torch.Generator().manual_seed(0))

    ref = copy.deepcopy(model)
    ref.dcmdp_compute_dtype = None
    run(model, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    run(ref, None)
    g, r = grads[id(model)], grads[id(ref)]
    assert float(torch.nn.functional.cosine_similarity(g, r, dim=0)) > 0.99


def test_a_float16_run_trains_and_checkpoints_its_scaler(tmp_path):
    from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
    from dcmdp.config import load_config
    from dcmdp.loop import train

    cfg = load_config(None, ["model.preset=tiny-moe", "model.dtype=float16", "rollout.precision=fp16",
                             "cold_start.steps=10", "steps=3", "algo.prompts_per_step=4", "algo.samples_per_prompt=4",
                             "algo.minibatches=2", "task.eval_size=8", f"output_dir={tmp_path / 'run'}",
                             f"cold_start.cache_dir={tmp_path / 'cache'}", "progress=false", "threads=1",
                             f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    train(cfg)
    state = load_checkpoint(find_resume_checkpoint(tmp_path / "run" / "checkpoints", "auto"))
    assert state["scaler"]["scale"] > 0
    assert all(torch.isfinite(torch.tensor(h["loss/policy"])) for h in state["history"])
    assert all("optim/loss_scale" in h for h in state["history"])
