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
              "task.eval_path=null", "rollout.vllm.enforce_eager=true"]
RECIPES = ("configs/qwen3-8b.yaml", "configs/qwen3-30b-a3b.yaml")


def _check(capsys, tmp_path, config: str, *args: str) -> tuple[int, str, str]:
    code = main(["check", config, *STANDALONE, f"output_dir={tmp_path / 'run'}", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# What torchrun needs of a recipe on 8 GPUs (dcmdp.distributed.check_world): one vLLM engine over the 8 ranks, float32
# master weights with bf16 compute.
TORCHRUN_8 = ["rollout.vllm.tensor_parallel_size=8", "model.dtype=float32", "dist.param_dtype=bf16"]


@pytest.mark.parametrize("config,gpus,gib", [("configs/qwen3-8b.yaml", 1, 139), ("configs/qwen3-8b.yaml", 8, 79),
                                             ("configs/qwen3-30b-a3b.yaml", 8, 79)])
def test_memory_plan_recipes_fit_their_gpus(capsys, tmp_path, config, gpus, gib):
    code, out, err = _check(capsys, tmp_path, config, *(TORCHRUN_8 if gpus > 1 else []), "--gpus", str(gpus),
                            "--gpu-memory", str(gib))
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


@pytest.mark.parametrize("config,fixed,key", [
    ("configs/qwen3-8b.yaml", [], "rollout.vllm.tensor_parallel_size"),
    ("configs/qwen3-8b.yaml", ["rollout.vllm.tensor_parallel_size=8"], "model.dtype"),
    ("configs/qwen3-30b-a3b.yaml", [], "rollout.vllm.tensor_parallel_size")])
def test_memory_plan_of_8_gpus_makes_the_torchrun_checks(capsys, tmp_path, config, fixed, key):
    """The recipes as written do not start under torchrun on 8 GPUs (dcmdp.distributed.check_world): the plan refuses
    them with torchrun's own error instead of printing a plan that fits."""
    code, out, err = _check(capsys, tmp_path, config, *fixed, "--gpus", "8", "--gpu-memory", "79")
    assert code == 2
    assert f"config error at '{key}'" in err and "memory plan per GPU" not in out


def test_memory_plan_kv_tokens_0_is_the_engines_budget_from_free_memory():
    """rollout.torch.kv_tokens=0 decodes as many rows as KV_FREE_FRACTION of the free memory holds (TorchEngine.kv_rows),
    not every row at once: 512 rows x 8,704 tokens x 144 KiB would be 612 GiB."""
    from trainers.engines.torch_engine import KV_FREE_FRACTION

    cfg = load_config("configs/qwen3-8b.yaml", ["rollout.engine=torch", "rollout.torch.kv_tokens=0"], check=False)
    plan = plan_memory(cfg, 1, 139)
    kv = plan.term("kv_cache").bytes
    held = sum(plan.term(n).bytes for n in ("weights", "optimiser", "rollout_engine", "overhead"))
    free = 139 * GIB - held
    row = model_shapes(cfg).kv_bytes_per_token() * (512 + 8192)
    assert kv == int(KV_FREE_FRACTION * free // model_shapes(cfg).kv_bytes_per_token()) // (512 + 8192) * row
    assert kv <= KV_FREE_FRACTION * free and "kv_tokens=0" in plan.term("kv_cache").formula


def test_memory_plan_refusal_never_proposes_the_value_already_set(capsys, tmp_path):
    """On one 24 GiB GPU the 8B recipe's largest term is its optimiser state, already bf16_stochastic: the hint says
    so and proposes more GPUs, not the recipe's own setting; and never a smaller --gpu-memory."""
    code, out, err = _check(capsys, tmp_path, "configs/qwen3-8b.yaml", "--gpu-memory", "24")
    assert code == 2
    from dcmdp.memplan import FIXES

    assert FIXES["optimiser"] not in err and "bf16_stochastic already" in err
    assert "lower --gpu-memory" not in err and "more GPUs" in err


def test_memory_plan_vllm_share_holds_its_bf16_weights():
    """gpu_memory_utilization 0.3 of 24 GiB is 7.2 GiB, below the 15.3 GiB of the 8B's bf16 weights: the plan holds the
    weights plus one row's KV and says vLLM cannot start; on 139 GiB the share is utilization x GPU."""
    cfg = load_config("configs/qwen3-8b.yaml", [], check=False)
    s = model_shapes(cfg)
    small = plan_memory(cfg, 1, 24).term("rollout_engine")
    assert small.bytes == 2 * s.params + s.kv_bytes_per_token() * (512 + 8192)
    assert "cannot start" in small.formula
    assert plan_memory(cfg, 1, 139).term("rollout_engine").bytes == pytest.approx(0.3 * 139 * GIB)


def test_memory_plan_counts_the_float32_sum_of_the_micro_batches_gradients():
    # bf16 parameters: one micro-batch per mini-batch keeps the bfloat16 gradient (2 B); several sum theirs in float32
    # (trainers.optim.Float32Grads, 4 B), which the rehearsal traces on the 8B recipe
    cfg = load_config("configs/qwen3-8b.yaml", [], check=False)
    params = model_shapes(cfg).params
    several = plan_memory(cfg, 1, 141)
    assert several.micro_batches > 1 and several.term("gradients").bytes == 4 * params
    one = plan_memory(load_config("configs/qwen3-8b.yaml", ["algo.micro_batch_tokens=0"], check=False), 1, 141)
    assert one.micro_batches == 1 and one.term("gradients").bytes == 2 * params
    fp32 = plan_memory(load_config("configs/qwen3-8b.yaml", ["optim.precision=fp32"], check=False), 1, 141)
    assert fp32.term("gradients").bytes == 4 * params  # float32 parameters: no second copy
