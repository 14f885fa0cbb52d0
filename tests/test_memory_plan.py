"""The memory plan (``dcmdp.memplan``) of the recipes and ``dcmdp check --gpus/--gpu-memory``: the recipes fit the
GPUs they name, an oversized config is refused with the key that shrinks it, and the plan reproduces the peak
measured on one H200 (docs/gpu.md)."""

import pytest

from dcmdp.cli import main
from dcmdp.config import load_config
from dcmdp.memplan import GIB, model_shapes, plan_memory, route_dtype_bytes

# The recipes without their weights and task files (a random init at the real shapes, a generated task): the same
# memory, and a check that does not stop at a missing /models directory.
STANDALONE = ["model.init=random", "model.path=null", "task.name=long_addition", "task.path=null",
              "task.eval_path=null"]
RECIPES = ("configs/qwen3-8b.yaml", "configs/qwen3-30b-a3b.yaml")


def _check(capsys, tmp_path, config: str, *args: str) -> tuple[int, str, str]:
    code = main(["check", config, *STANDALONE, f"output_dir={tmp_path / 'run'}", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("config,gpus,gib", [("configs/qwen3-8b.yaml", 1, 139), ("configs/qwen3-8b.yaml", 8, 79),
                                             ("configs/qwen3-30b-a3b.yaml", 8, 79)])
def test_memory_plan_recipes_fit_their_gpus(capsys, tmp_path, config, gpus, gib):
    code, out, err = _check(capsys, tmp_path, config, "--gpus", str(gpus), "--gpu-memory", str(gib))
    assert code == 0, err
    assert f"memory plan per GPU ({gpus} x {gib} GiB" in out
    for term in ("weights", "gradients", "optimiser", "activations", "logits", "rollout_engine", "total (peak)"):
        assert term in out
    total = float(out.split("total (peak)")[1].split("GiB")[0])
    assert 0 < total <= gib


def test_memory_plan_refuses_an_oversized_config(capsys, tmp_path):
    # fp32 AdamW state alone is 16 B x 8.19 B parameters = 122 GiB: never on one 24 GiB GPU
    code, out, err = _check(capsys, tmp_path, "configs/qwen3-8b.yaml", "optim.precision=fp32", "--gpu-memory", "24")
    assert code == 2
    assert "does NOT fit" in out
    assert "config error at 'optim.precision'" in err and "largest term is optimiser" in err


def test_memory_plan_recipes_never_save_float32_logits():
    for config in RECIPES:
        cfg = load_config(config, [], check=False)
        assert cfg.model.fp32_lm_head and cfg.model.lm_head_kernel != "logits"
        plan = plan_memory(cfg, 1, 139)
        # the fused head keeps one tile and the float32 head gradient, not (tokens, vocab) float32 tensors
        assert plan.term("logits").gib < 4


def test_memory_plan_parameter_count_and_kv_of_the_real_shapes():
    cfg8 = load_config("configs/qwen3-8b.yaml", [], check=False)
    s8 = model_shapes(cfg8)
    assert s8.params == 8_190_735_360  # trainers.models.param_counts on the meta device (docs/scale.md)
    assert s8.kv_bytes_per_token() == 144 * 1024  # 36 layers x 8 KV heads x 128 x K and V x bf16
    s30 = model_shapes(load_config("configs/qwen3-30b-a3b.yaml", [], check=False))
    assert s30.params == 30_532_122_624
    # expert ids 0..127 and the -1 of padding fit int8; 129 experts need int16, 40,000 int32
    assert route_dtype_bytes(s30.experts) == 1
    assert route_dtype_bytes(129) == 2 and route_dtype_bytes(32_768) == 2 and route_dtype_bytes(40_000) == 4


def test_memory_plan_within_25_percent_of_the_h200_measurement():
    """One H200, 2026-11-28: Qwen3-8B full depth, 8 rows of 256 + 1,792 tokens in one forward (the learner then kept
    every micro-batch's graph), gradient checkpointing, the bf16x3 head, bf16 stochastic AdamW, the torch engine on
    the trainer's weights: 63.3 GiB peak allocated (torch.cuda.max_memory_allocated: no CUDA context in it)."""
    cfg = load_config("configs/qwen3-8b.yaml", [
        "algo.prompts_per_step=1", "algo.samples_per_prompt=8", "algo.minibatches=1", "rollout.max_new_tokens=1792",
        "algo.micro_batch_tokens=16384", "rollout.engine=torch", "rollout.torch.share_weights=true",
        "rollout.precision=bf16"], check=False)
    plan = plan_memory(cfg, 1, 139, prompt_tokens=256, overhead_gib=0.0)
    assert plan.micro_batches == 1
    assert abs(plan.total_gib - 63.3) <= 0.25 * 63.3, plan.lines()
    assert plan.total_bytes == pytest.approx(plan.persistent_bytes + max(plan.train_bytes, plan.rollout_bytes))
    assert plan.total_gib * GIB == plan.total_bytes
