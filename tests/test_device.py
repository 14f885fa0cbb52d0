"""One device for the whole loop (``dcmdp.device``), RoPE kept float32 under every cast, random-init recipes.

The CUDA half of these checks runs where a GPU is (``-m gpu``, and ``benchmarks/gpu_check.sh``); on the CPU the
same code runs with ``device=cpu`` and the device choice is tested with the CUDA count as a parameter.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dcmdp.config import ConfigError, load_config
from dcmdp.device import check_backend, default_backend, resolve_device
from trainers.batch import Rollout
from trainers.config import ModelConfig
from trainers.models import build_model, cast_model, get_preset, model_from_config
from trainers.quant import cast_for_precision

from cli_process import run_dcmdp, run_modules

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------ the setting


@pytest.mark.parametrize("setting, rank, count, expected", [
    ("auto", 0, 0, "cpu"),
    ("auto", 0, 1, "cuda:0"),
    ("auto", 3, 8, "cuda:3"),  # torchrun: each process takes the GPU of its local rank
    ("cuda", 1, 2, "cuda:1"),
    ("cuda:1", 0, 2, "cuda:1"),
    ("cpu", 0, 8, "cpu"),
])
def test_the_device_follows_the_setting_the_local_rank_and_the_hardware(setting, rank, count, expected):
    device, why = resolve_device(setting, rank, cuda_count=count)
    assert device == torch.device(expected)
    assert why  # logged at start with the reason


@pytest.mark.parametrize("setting, rank, count, message", [
    ("cuda", 0, 0, "device=cuda but"),
    ("cuda:0", 0, 0, "device=cuda:0 but"),
    ("cuda", 2, 2, "needs CUDA device 2"),
    ("cuda:4", 0, 2, "needs CUDA device 4"),
    ("gpu", 0, 1, "expected auto, cpu, cuda or cuda:N"),
])
def test_a_device_that_cannot_be_had_is_a_config_error_naming_the_setting(setting, rank, count, message):
    with pytest.raises(ConfigError, match=r"config error at 'device'") as err:
        resolve_device(setting, rank, cuda_count=count)
    assert message in str(err.value)


def test_a_misspelt_device_fails_when_the_config_is_loaded():
    with pytest.raises(ConfigError, match="'device'"):
        load_config(None, ["device=GPU"])


def test_the_backend_follows_the_device():
    assert default_backend(torch.device("cuda", 0)) == "nccl"
    assert default_backend(torch.device("cpu")) == "gloo"
    check_backend("gloo", torch.device("cpu"))
    check_backend("nccl", torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="nccl reduces CUDA tensors"):
        check_backend("nccl", torch.device("cpu"))


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_train_with_device_cuda_without_cuda_exits_2_before_building_anything(tmp_path):
    done, modules = run_dcmdp(["train", str(ROOT / "configs/default.yaml"), "device=cuda",
                               f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "config error at 'device'" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was made: no folder, no lock, no MLflow store, no cache
    assert run_modules(modules) == [], "the refusal came after the run started being built"


def test_the_cpu_run_logs_where_it_trains_and_tags_it(tmp_path):
    from dcmdp.loop import train

    cfg = load_config(ROOT / "configs/default.yaml", [
        "device=cpu", "model.preset=tiny-dense", "cold_start.steps=20", f"cold_start.cache_dir={tmp_path / 'cache'}",
        "cold_start.target_accuracy=null", "task.eval_size=4", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "steps=1", "progress=false", f"output_dir={tmp_path / 'out'}", "threads=1"])
    summary = train(cfg)
    import mlflow

    run = mlflow.MlflowClient(tracking_uri=summary.tracking_uri).get_run(summary.run_id)
    assert run.data.tags["dcmdp.device"] == "cpu"
    assert "dcmdp.random_init" not in run.data.tags


# ------------------------------------------------------------------------------------------------ RoPE in float32


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if "inv_freq" in m._buffers]
    assert mods, "the model has no rotary embedding"
    return mods


def _phase_error(model: torch.nn.Module, reference_inv_freq: torch.Tensor, position: int) -> float:
    """Largest |angle - reference angle| (radians) at ``position`` over the rotary frequencies, in float64."""
    worst = 0.0
    for m in _rotary_modules(model):
        angle = m.inv_freq.double() * position
        worst = max(worst, float((angle - reference_inv_freq.double() * position).abs().max()))
    return worst


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, torch.nn.Module]:
    return {name: build_model(ModelConfig(preset=name), 64, seed=0) for name in ("tiny-dense", "tiny-moe")}


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_the_rotary_frequencies_stay_float32_under_every_cast_the_project_makes(tiny_models, preset):
    base = tiny_models[preset]
    reference = _rotary_modules(base)[0].inv_freq.clone()
    assert reference.dtype == torch.float32
    # the mechanism this guards against: a plain .to(bfloat16) rounds the frequencies (relative error ~4e-3), a
    # phase error of over a radian at position 8,191 on this config
    import copy

    plain = copy.deepcopy(base).to(torch.bfloat16)
    assert _phase_error(plain, reference, 8191) > 0.5
    casts = {
        "loop cast (optim.precision=bf16_*)": cast_model(copy.deepcopy(base), torch.bfloat16),
        "fp16 cast": cast_model(copy.deepcopy(base), torch.float16),
        **{f"rollout engine copy ({p})": cast_for_precision(base, p) for p in ("bf16", "fp16", "int8", "fp8")},
        "random init in bfloat16": model_from_config(get_preset(preset).make_config(64), seed=0, dtype="bfloat16"),
    }
    for what, model in casts.items():
        for m in _rotary_modules(model):
            assert m.inv_freq.dtype == torch.float32, what
            assert torch.equal(m.inv_freq, reference), what  # the float32 values, not a float32 copy of rounded ones
        assert _phase_error(model, reference, 40959) == 0.0, what
        if "int8" not in what and "fp8" not in what:  # quantised copies keep their rounded weights in float32
            assert next(model.parameters()).dtype in (torch.bfloat16, torch.float16), what


def test_a_bf16_model_saved_and_loaded_keeps_float32_rope(tiny_models, tmp_path):
    from trainers.models import load_model_dir, save_model_dir
    from trainers.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_model(ModelConfig(preset="tiny-dense"), len(tok), seed=0)
    reference = _rotary_modules(model)[0].inv_freq.clone()
    save_model_dir(cast_model(model, torch.bfloat16), tok, tmp_path / "m")
    loaded = load_model_dir(tmp_path / "m", "bfloat16")
    assert _phase_error(loaded, reference, 40959) == 0.0


def test_the_training_setup_casts_keep_rope_float32_in_trainer_and_engine(tmp_path):
    from dcmdp.loop import setup

    cfg = load_config(ROOT / "configs/default.yaml", [
        "model.preset=tiny-dense", "cold_start.steps=0", "optim.precision=bf16_stochastic", "rollout.precision=bf16",
        "device=cpu", "progress=false", f"output_dir={tmp_path / 'out'}", "threads=1", "task.eval_size=4"])
    s = setup(cfg)
    try:
        reference = model_from_config(get_preset("tiny-dense").make_config(len(s.policy.tokenizer)), seed=0)
        ref = _rotary_modules(reference)[0].inv_freq
        for what, model in (("trainer", s.policy.model), ("engine", s.policy.engine.model)):
            assert next(model.parameters()).dtype == torch.bfloat16, what
            assert _phase_error(model, ref, 40959) == 0.0, what
    finally:
        s.tracker.finish()
        s.lock.release()


# ------------------------------------------------------------------------------------------------ placement


def test_a_rollout_moves_whole_and_stays_itself_when_already_there():
    r = Rollout(prompt_ids_BP=torch.zeros(2, 3, dtype=torch.long), prompt_mask_BP=torch.ones(2, 3, dtype=torch.bool),
                response_ids_BT=torch.zeros(2, 4, dtype=torch.long),
                response_mask_BT=torch.ones(2, 4, dtype=torch.bool), rollout_logp_BT=torch.zeros(2, 4),
                version_B=torch.zeros(2, dtype=torch.long))
    assert r.to("cpu") is r
    moved = r.to("meta")
    assert all(getattr(moved, f).device.type == "meta" for f in ("prompt_ids_BP", "prompt_mask_BP", "response_ids_BT",
                                                                  "response_mask_BT", "rollout_logp_BT", "version_B"))
    assert moved.rollout_experts_BSLK is None


# ------------------------------------------------------------------------------------------------ random init


@pytest.mark.parametrize("overrides, message", [
    (["model.init=random", "model.path=/models/x"], "drop one of them"),
    (["model.num_layers=2"], "needs model.init=random"),
    (["model.init=random", "model.num_layers=0"], "must be >= 1"),
    (["model.init=weights"], "expected auto or random"),
])
def test_random_init_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_real_preset_without_weights_names_random_init_as_the_way_out():
    with pytest.raises(FileNotFoundError, match="model.init=random"):
        build_model(ModelConfig(preset="qwen3-8b"), 64, seed=0)


def test_a_real_preset_builds_at_random_init_with_fewer_layers_on_the_meta_device():
    # shapes only (no memory): the real widths, the layer count cut
    model = build_model(ModelConfig(preset="qwen3-30b-a3b", init="random", num_layers=2, dtype="bfloat16"), 64,
                        seed=0, device="meta")
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert model.config.hidden_size == 2048 and model.config.num_experts == 128
    assert model.model.embed_tokens.weight.shape == (151936, 2048)


def test_a_random_init_run_is_marked_in_the_log_and_in_mlflow(tmp_path, caplog):
    from dcmdp.loop import train

    cfg = load_config(ROOT / "configs/default.yaml", [
        "model.preset=tiny-moe", "model.init=random", "model.num_layers=1", "cold_start.steps=0", "task.eval_size=4",
        "algo.prompts_per_step=2", "algo.samples_per_prompt=2", "algo.minibatches=1", "steps=1", "progress=false",
        f"output_dir={tmp_path / 'out'}", "threads=1", "device=auto"])
    with caplog.at_level("WARNING", logger="dcmdp"):
        summary = train(cfg)
    assert any("RANDOM weights at 1 layers" in r.getMessage() for r in caplog.records)
    import mlflow

    tags = mlflow.MlflowClient(tracking_uri=summary.tracking_uri).get_run(summary.run_id).data.tags
    assert "RANDOM weights (1 layers)" in tags["dcmdp.random_init"]
    assert tags["dcmdp.device"] == ("cuda:0" if CUDA else "cpu")


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_checkpoint_written_on_cuda_resumes_on_the_cpu_and_back(tmp_path):
    """CPU <-> CUDA resume: the model, the optimiser state (bf16 stochastic rounding included) and the RNG states."""
    from dcmdp.loop import train

    def run(device: str, steps: int):
        cfg = load_config(ROOT / "configs/default.yaml", [
            "model.preset=tiny-moe", "cold_start.steps=20", f"cold_start.cache_dir={tmp_path / 'cache'}",
            "cold_start.target_accuracy=null", "task.eval_size=4", "algo.prompts_per_step=2",
            "algo.samples_per_prompt=2", "algo.minibatches=2", f"steps={steps}", "checkpoint.every=1",
            "checkpoint.resume=auto", "optim.precision=bf16_stochastic", "progress=false", f"device={device}",
            "tracking.enabled=false",
            f"output_dir={tmp_path / 'out'}", "threads=1"])
        return train(cfg)

    assert run("cuda", 1).steps == 1
    assert run("cpu", 2).resumed_at == 1
    s = run("cuda", 3)
    assert s.resumed_at == 2 and math.isfinite(s.accuracy_after)


# ------------------------------------------------------------------------------------------------ shared weights


@pytest.mark.parametrize("overrides, message", [
    (["rollout.precision=bf16"], "the trainer's parameters are fp32"),
    (["optim.precision=bf16_stochastic"], "rollouts are asked in fp32"),
    (["rollout.engine=vllm"], "only the torch engine"),
    (["async_rollout.enabled=true"], "asynchronous rollouts"),
])
def test_shared_weights_that_cannot_be_shared_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.torch.share_weights=true", *overrides])


def test_an_engine_on_the_trainers_weights_samples_what_a_copy_samples_and_needs_no_sync(tmp_path):
    """bf16 trainer parameters shared with the engine: the same rollouts as an engine copy of the same weights, the
    trainer's train mode restored after generating, and an update reaches the engine without load_weights."""
    from trainers.config import RolloutConfig, TorchEngineConfig
    from trainers.engines.torch_engine import TorchEngine

    model = cast_model(build_model(ModelConfig(preset="tiny-moe"), 64, seed=0), torch.bfloat16).train()
    shared = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=12,
                                       torch=TorchEngineConfig(share_weights=True)), model, eos_id=1, pad_id=0)
    copied = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=12), model, eos_id=1, pad_id=0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    a, b = shared.generate(prompts, seed=3), copied.generate(prompts, seed=3)
    assert model.training  # restored
    assert shared.model is model and copied.model is not model
    assert torch.equal(a.response_ids_BT, b.response_ids_BT)
    torch.testing.assert_close(a.rollout_logp_BT, b.rollout_logp_BT, rtol=0, atol=0)
    assert torch.equal(a.rollout_experts_BSLK, b.rollout_experts_BSLK)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    shared.load_weights({}, version=1)  # a no-op: nothing to copy
    assert shared.version == 1
    c = shared.generate(prompts, seed=3)
    assert not torch.equal(c.rollout_logp_BT, a.rollout_logp_BT)  # it samples from the updated weights


def test_a_bf16_optimizer_state_saved_on_another_device_loads_and_reseeds(caplog):
    """A checkpoint of a CUDA run resumed on the CPU: the moments load, the CUDA generator state is not restored
    where no parameter lives, and the CPU stream restarts from the seed and the step count (not step 1's draws)."""
    from trainers.optim import BF16AdamW

    def fresh():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
        return p, BF16AdamW([p], lr=1e-3, seed=7)

    p, opt = fresh()
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    sd = opt.state_dict()
    cpu_state = sd["rounding"]["generators"]["cpu"]
    # as if written on a GPU: the generator state is keyed by the CUDA device
    sd["rounding"]["generators"] = {"cuda:0": cpu_state}
    q, opt2 = fresh()
    with caplog.at_level("WARNING"):
        opt2.load_state_dict(sd)
    assert "restarts from the seed and step 3" in caplog.text
    assert torch.equal(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    assert not torch.equal(opt2._generator(torch.device("cpu")).get_state(),
                           torch.Generator().manual_seed(7).get_state())
    q.grad = torch.randn_like(q)
    opt2.step()  # and it steps
    assert torch.isfinite(q.float()).all()


@pytest.mark.parametrize("doc, recipe", [("docs/gpu.md", "qwen3-8b"), ("docs/gpu.md", "qwen3-30b-a3b"),
                                         ("README.md", "qwen3-8b")])
def test_the_documented_eight_gpu_launch_of_each_recipe_passes_the_world_check(doc, recipe):
    """The torchrun lines of the docs (``torchrun`` or ``.venv/bin/torchrun``): their overrides make the recipe valid at 8 ranks (FSDP2 over nccl, one
    colocated vLLM engine at tensor-parallel size 8)."""
    from dcmdp.distributed import check_world

    text = (ROOT / doc).read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().split(" ")[0].endswith("torchrun")
                and f"configs/{recipe}.yaml" in ln and "--nproc_per_node 8" in ln)
    args = line.split(f"configs/{recipe}.yaml", 1)[1].split("#")[0].split()
    cfg = load_config(ROOT / "configs" / f"{recipe}.yaml", args)
    check_world(cfg, 8)
    assert cfg.device == "auto" and cfg.dist.backend == "auto"
