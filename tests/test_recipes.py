"""The Qwen3-8B and Qwen3-30B-A3B recipes run end to end with a tiny model of the same architecture.

Only what cannot run on a CPU is overridden: the weights path (a saved tiny model), the data path (the
sample JSONL), lengths that must fit the tiny model's 128 positions, batch sizes, tensor parallelism and
the step count. Every other line of the recipe (engine, precision, dual settings, R3, optimiser) is used.
"""

import math
from pathlib import Path

import pytest

from dcmdp.config import load_config
from dcmdp.loop import train
from trainers.models import build_model, save_model_dir
from trainers.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "math_sample.jsonl"
RECIPES = {"qwen3-8b": "tiny-dense", "qwen3-30b-a3b": "tiny-moe"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from trainers.config import ModelConfig

    tok = build_char_tokenizer()
    out = {}
    for preset in ("tiny-dense", "tiny-moe"):
        path = tmp_path_factory.mktemp(preset) / "model"
        save_model_dir(build_model(ModelConfig(preset=preset), len(tok), seed=0), tok, path)
        out[preset] = str(path)
    return out


def _recipe(name: str, model_dir: str, tmp_path: Path, engine: str):
    overrides = [f"model.preset={RECIPES[name]}", f"model.path={model_dir}", "model.dtype=float32",
                 f"task.path={DATA}", "task.eval_path=null", "task.eval_size=2",
                 "rollout.max_new_tokens=6", "rollout.vllm.tensor_parallel_size=1", f"rollout.engine={engine}",
                 "algo.prompts_per_step=2", "algo.samples_per_prompt=2", "algo.minibatches=2", "steps=2",
                 "eval_every=0", "progress=false", "checkpoint.every=0", f"output_dir={tmp_path / 'out'}"]
    if engine == "torch":
        overrides.append("rollout.precision=bf16")
    else:  # on the CPU vLLM's routes (R3) come from router hooks, which run in eager mode only
        overrides.append("rollout.vllm.enforce_eager=true")
    return load_config(ROOT / "configs" / f"{name}.yaml", overrides)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_runs_with_torch_engine(name, model_dirs, tmp_path):
    cfg = _recipe(name, model_dirs[RECIPES[name]], tmp_path, "torch")
    assert cfg.dual.constraints[0].tolerance == {"qwen3-8b": 0.0037, "qwen3-30b-a3b": 0.0050}[name]
    summary = train(cfg)
    assert summary.steps == 2
    assert set(summary.final_lambda) == {"abs_prob_diff"}
    assert (tmp_path / "out" / "dual.png").is_file()


@pytest.mark.vllm
# the MoE recipe by default (R3 through vLLM); the dense one on request
@pytest.mark.parametrize("name", [n if "a3b" in n else pytest.param(n, marks=pytest.mark.slow) for n in sorted(RECIPES)])
def test_recipe_runs_with_vllm_engine(name, model_dirs, tmp_path):
    pytest.importorskip("vllm")
    cfg = _recipe(name, model_dirs[RECIPES[name]], tmp_path, "vllm")
    assert cfg.rollout.engine == "vllm" and cfg.rollout.precision == "bf16"
    summary = train(cfg)
    assert summary.steps == 2
    assert 0.0 <= summary.accuracy_after <= 1.0


def _real_shapes():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("real_shapes", ROOT / "benchmarks" / "real_shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def real_shape_dirs(tmp_path_factory):
    """One-layer models of both recipes at the real widths and vocabulary (benchmarks/real_shapes.py), ~2.7 GB each
    on disk; built once per module, only when a real-shape test runs."""
    rs = _real_shapes()
    root = tmp_path_factory.mktemp("real_shapes")
    return rs, {name: (root / name, rs.build_model_dir(name, root / name)) for name in sorted(RECIPES)}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_at_real_shape_one_layer_two_steps(name, engine, real_shape_dirs, tmp_path):
    """Two steps of the recipe through ``dcmdp train`` with one decoder layer at the real hidden size, heads, head_dim,
    intermediate sizes, 128 experts top-8 and the 151936-token vocabulary (bf16, fp32 LM head, activation
    checkpointing, R3 on the MoE; benchmarks/real_shapes.py lists what is overridden and why).

    Step 1 moves the policy far (policy/approx_kl ~0.9 measured on the 8B at lr 1e-3 with the entropy bonus), so
    step 2, sampled after the weight sync, would show a k3 of that order had the engine kept the old weights; synced,
    it stays at the engines' bf16 floor (2.4e-5 measured). Peak RSS ~31-38 GB estimated (float32 master weights and
    AdamW states under bf16 autocast, `real_shapes.memory_estimate`): skipped when the machine has less free.
    About 8-10 minutes per case on 2 cores."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    rs, dirs = real_shape_dirs
    model_dir, counts = dirs[name]
    assert counts["params"] == {"qwen3-8b": 1_437_610_240, "qwen3-30b-a3b": 1_245_452_544}[name]
    need = rs.memory_estimate(name, engine)["total"] * 0.9
    if rs.mem_available_gb() < need:
        pytest.skip(f"needs ~{need:.0f} GB of free memory, {rs.mem_available_gb():.1f} GB available")
    result = rs.run_recipe(name, engine, model_dir, tmp_path / "run")
    assert result.returncode == 0, result.error
    assert len(result.steps) == 2
    step1, step2 = result.steps
    tolerance = {"qwen3-8b": 0.0037, "qwen3-30b-a3b": 0.0050}[name]
    for step in result.steps:
        assert math.isfinite(step["loss/total"]) and math.isfinite(step["optim/grad_norm"])
        assert "dual/lambda/abs_prob_diff" in step
    # one projected dual step per batch: lambda_0 + eta * (D - c), D ~1e-7 here
    lambda_1 = {"qwen3-8b": 0.1, "qwen3-30b-a3b": 0.05}[name] + step1["discrepancy/abs_prob_diff"] - tolerance
    assert step1["dual/lambda/abs_prob_diff"] == pytest.approx(lambda_1, rel=1e-6)
    assert step2["dual/lambda/abs_prob_diff"] < step1["dual/lambda/abs_prob_diff"]
    # the update changed the weights and moved the policy; the engine sampled step 2 from the new weights
    assert result.changed_fraction > 0.1
    assert step1["policy/approx_kl"] > 1e-2
    assert step2["discrepancy/kl_k3"] < 1e-3
    assert step2["discrepancy/abs_prob_diff"] < tolerance
    if name == "qwen3-30b-a3b":
        assert step1["routing/mismatch"] == 0.0 and step2["routing/mismatch"] == 0.0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_moe_recipe_asks_for_eager_vllm_only_where_routes_come_from_hooks(device):
    """vLLM returns its own routes on GPUs (CUDA graphs keep them), so the 30B recipe leaves enforce_eager to the
    engine (null: eager on the CPU, graphs on GPUs) and loads on either device; on the CPU its routes come from router
    hooks, which only eager forwards run, so an explicit false is refused there."""
    from dcmdp.config import ConfigError

    overrides = [f"device={device}", f"task.path={DATA}", "task.eval_path=null"]
    cfg = load_config(ROOT / "configs" / "qwen3-30b-a3b.yaml", overrides)
    assert cfg.algo.routing_replay == "r3" and cfg.rollout.vllm.enforce_eager is None
    if device == "cpu":
        with pytest.raises(ConfigError, match=r"rollout\.vllm\.enforce_eager"):
            load_config(ROOT / "configs" / "qwen3-30b-a3b.yaml", [*overrides, "rollout.vllm.enforce_eager=false"])
    else:
        load_config(ROOT / "configs" / "qwen3-30b-a3b.yaml", [*overrides, "rollout.vllm.enforce_eager=false"])
