"""The Qwen3-8B and Qwen3-30B-A3B recipes run end to end with a tiny model of the same architecture.

Only what cannot run on a CPU is overridden: the weights path (a saved tiny model), the data path (the
sample JSONL), lengths that must fit the tiny model's 128 positions, batch sizes, tensor parallelism and
the step count. Every other line of the recipe (engine, precision, dual settings, R3, optimiser) is used.
"""

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
                 "model.gradient_checkpointing=false", f"task.path={DATA}", "task.eval_path=null", "task.eval_size=2",
                 "rollout.max_new_tokens=6", "rollout.tensor_parallel_size=1", f"rollout.engine={engine}",
                 "algo.prompts_per_step=2", "algo.samples_per_prompt=2", "algo.minibatches=2", "steps=2",
                 "eval_every=0", "progress=false", "checkpoint.every=0", f"output_dir={tmp_path / 'out'}"]
    if engine == "torch":
        overrides.append("rollout.precision=bf16")
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
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_runs_with_vllm_engine(name, model_dirs, tmp_path):
    pytest.importorskip("vllm")
    cfg = _recipe(name, model_dirs[RECIPES[name]], tmp_path, "vllm")
    assert cfg.rollout.engine == "vllm" and cfg.rollout.precision == "bf16"
    summary = train(cfg)
    assert summary.steps == 2
    assert 0.0 <= summary.accuracy_after <= 1.0
