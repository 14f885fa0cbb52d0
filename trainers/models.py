"""Model presets (Qwen3 dense and Qwen3-MoE from ``transformers``), building, saving and loading.

Presets:
- ``tiny-dense`` / ``tiny-moe``: the real architectures shrunk to hidden size 64 so that a supervised
  cold start plus RL runs on two CPU cores; random init from ``seed``.
- ``small-dense`` / ``small-moe``: the same architectures at 4 layers, hidden size 128 and 4 query / 2 KV
  heads, with a context of 192 positions, for long responses (``long_addition``) on CPU. ``small-moe``
  has 16 experts of intermediate size 64, top-2, in every layer: 1,804,928 parameters, 428,672 active
  per token. ``small-dense`` has intermediate size 133, the closest to the same active count (428,160:
  the router's 16 x 128 weights per layer are not a multiple of the 3 x 128 of one intermediate unit).
- ``qwen3-8b`` / ``qwen3-30b-a3b``: the published shapes (Qwen3 technical report, arXiv 2505.09388,
  and the released ``config.json`` files); the weights always come from ``ModelConfig.path``.

Both engines (trainer and the embedded rollout engine, which deep-copies the trainer's model) run the
same attention kernel, ``ATTN_IMPLEMENTATION``, and the same MoE expert kernel,
``EXPERTS_IMPLEMENTATION``: a discrepancy measured between them then comes from the precision
switches the user chose, not from two different kernels.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from trainers import routing
from trainers.config import ModelConfig
from trainers.jsonfile import read_model_config

# "sdpa" keeps padded query rows finite (transformers unmasks fully masked rows), so left-padded
# batches give finite values and gradients at every position; both engines use it.
ATTN_IMPLEMENTATION = "sdpa"
# "grouped_mm" sorts tokens by expert and runs one grouped matmul (torch.nn.functional.grouped_mm):
# no Python loop over experts; on two CPU cores it is ~1.5x faster than the looped "eager" kernel and
# ~25x faster than "batched_mm" (which gathers a weight copy per token) for the tiny MoE.
EXPERTS_IMPLEMENTATION = "grouped_mm"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Preset:
    name: str
    is_moe: bool
    # True for presets whose weights must be loaded from ModelConfig.path.
    needs_path: bool
    # vocab_size -> the transformers config of the architecture.
    make_config: Callable[[int], PretrainedConfig]

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else "qwen3"


def _tiny_attention() -> dict:
    # 2 query heads sharing 1 KV head (GQA like the real models); head_dim 32, the smallest that vLLM's CPU
    # attention kernels accept, so the same directory serves both rollout engines.
    return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, max_position_embeddings=128, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0},
                rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02)


def _tiny_dense(vocab_size: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, intermediate_size=192, **_tiny_attention())


def _tiny_moe(vocab_size: int) -> Qwen3MoeConfig:
    # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers) so routing replay touches each one.
    return Qwen3MoeConfig(vocab_size=vocab_size, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                          intermediate_size=192, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          router_aux_loss_coef=0.0, **_tiny_attention())


def _small_attention() -> dict:
    # 4 query heads sharing 2 KV heads of head_dim 32 (4 x 32 = hidden 128); 192 positions hold the longest
    # long_addition prompt (18 tokens) plus 96 generated tokens with room to spare.
    return dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, max_position_embeddings=192, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0},
                rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02)


def _small_dense(vocab_size: int) -> Qwen3Config:
    # 3 x 128 x 133 = 51,072 MLP weights per layer vs small-moe's active 2 x 3 x 128 x 64 + router 16 x 128
    # = 51,200: the closest match of active parameters.
    return Qwen3Config(vocab_size=vocab_size, intermediate_size=133, **_small_attention())


def _small_moe(vocab_size: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=vocab_size, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
                          intermediate_size=133, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          router_aux_loss_coef=0.0, **_small_attention())


def _qwen3_8b(vocab_size: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=max(vocab_size, 151936), hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _qwen3_30b_a3b(vocab_size: int) -> Qwen3MoeConfig:
    # Qwen3MoeConfig has no head_dim field; it is passed through so attention gets 128, not 2048/32.
    return Qwen3MoeConfig(vocab_size=max(vocab_size, 151936), hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                          max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)


PRESETS: dict[str, Preset] = {
    p.name: p for p in (
        Preset("tiny-dense", is_moe=False, needs_path=False, make_config=_tiny_dense),
        Preset("tiny-moe", is_moe=True, needs_path=False, make_config=_tiny_moe),
        Preset("small-dense", is_moe=False, needs_path=False, make_config=_small_dense),
        Preset("small-moe", is_moe=True, needs_path=False, make_config=_small_moe),
        Preset("qwen3-8b", is_moe=False, needs_path=True, make_config=_qwen3_8b),
        Preset("qwen3-30b-a3b", is_moe=True, needs_path=True, make_config=_qwen3_30b_a3b),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]


# The attribute that marks a training model whose forward runs under autocast (``model.dtype=float16``).
COMPUTE_DTYPE_ATTR = "dcmdp_compute_dtype"


def param_dtype(train_dtype: str) -> str:
    """The parameters' dtype for ``model.dtype``: float16 and bfloat16 training keep float32 master weights and
    compute in the 16-bit dtype under autocast. In 16-bit parameters AdamW's small updates vanish: at lr 1e-6
    an update moves a weight of size 0.02 by ~5e-5 of itself, below bfloat16's rounding step (2^-8)."""
    return "float32" if train_dtype in ("float16", "bfloat16") else train_dtype


def set_compute_dtype(model: torch.nn.Module, train_dtype: str) -> None:
    """Mark ``model`` for autocast in the learner's forwards when ``train_dtype`` is float16 or bfloat16."""
    setattr(model, COMPUTE_DTYPE_ATTR, {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(train_dtype))


def compute_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The autocast dtype of the learner's forwards (None: the parameters' own dtype)."""
    return getattr(model, COMPUTE_DTYPE_ATTR, None)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; available: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _set_kernels(model: PreTrainedModel) -> PreTrainedModel:
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if isinstance(model, Qwen3MoeForCausalLM):
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return model


# Buffers that keep float32 under every cast the project makes: the rotary inverse frequencies. transformers' bf16
# loading and vLLM keep them float32; rounded to bfloat16 (relative error ~4e-3) they rotate position 2,047 by
# ~2.4 rad more or less than the engine does at theta = 1e6.
FLOAT32_BUFFERS = ("inv_freq", "original_inv_freq")


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` for the parameters and every floating buffer except ``FLOAT32_BUFFERS``, which keep
    their float32 values (not a float32 copy of the rounded ones). Returns ``model`` (cast in place)."""
    kept = {(id(m), n): b for m in model.modules() for n, b in m._buffers.items()
            if n in FLOAT32_BUFFERS and b is not None and b.dtype == torch.float32}
    model.to(dtype)
    for m in model.modules():
        for n in list(m._buffers):
            if (id(m), n) in kept:
                m._buffers[n] = kept[(id(m), n)].to(device=m._buffers[n].device)
    return model


def model_from_config(config: PretrainedConfig, *, seed: int, dtype: str | torch.dtype = "float32",
                      device: torch.device | str = "cpu") -> PreTrainedModel:
    """A randomly initialised Qwen3 / Qwen3-MoE model built on ``device``; the global RNG state is left untouched.

    The same seed gives the same weights on the same device type (the CPU and CUDA draw different streams)."""
    cls = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = cls(config)
    return _set_kernels(cast_model(model, _dtype(dtype)))


def build_model(cfg: ModelConfig, vocab_size: int, *, seed: int, device: torch.device | str = "cpu"
                ) -> PreTrainedModel:
    """The training model of ``cfg`` on ``device``: random init for tiny presets and for ``model.init=random``
    (``model.num_layers`` deep when set), loaded from ``cfg.path`` otherwise.

    ``vocab_size`` is the tokenizer's length; a loaded model must have at least that many embedding rows. The small
    presets are drawn on the CPU and moved, so a seed gives the same model on every device (their cold start and its
    cache are device-independent); a real preset at random init is drawn where it will train (8 B parameters drawn
    on the CPU take minutes).
    """
    preset = get_preset(cfg.preset)
    if cfg.path and cfg.init != "random":
        model = load_model_dir(cfg.path, param_dtype(cfg.dtype)).to(device)
        _check_loaded(model.config, cfg, preset, vocab_size)
    elif preset.needs_path and cfg.init != "random":
        raise _needs_weights(preset, cfg)
    else:
        config = _preset_config(preset, cfg, vocab_size)
        where = device if preset.needs_path else "cpu"
        model = model_from_config(config, seed=seed, dtype=param_dtype(cfg.dtype), device=where).to(device)
    return _finish(model, cfg)


def init_device(cfg: ModelConfig, device: torch.device | str) -> torch.device:
    """Where ``build_model`` draws a random init: the training device for a real preset, the CPU for the small ones."""
    return torch.device(device) if get_preset(cfg.preset).needs_path else torch.device("cpu")


def build_meta_model(cfg: ModelConfig, vocab_size: int) -> tuple[PreTrainedModel, Optional[list]]:
    """``build_model``'s model with its parameters on the meta device: no memory, every shape, config and switch as
    ``build_model`` sets them, and how to fill it. Returns (model, init_ops): ``init_ops`` is the record of the random
    init (``trainers.weights.record_init``; ``random_init_tensors(init_ops, seed=...)`` replays ``build_model``'s
    draws for that seed), None when the weights come from ``cfg.path`` (``trainers.weights.checkpoint_tensors``)."""
    from transformers import AutoConfig

    from trainers.weights import record_init

    preset = get_preset(cfg.preset)
    if cfg.path and cfg.init != "random":
        read_model_config(cfg.path)
        config = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        _check_loaded(config, cfg, preset, vocab_size)
        cls = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM
        with torch.device("meta"):
            model = cls(config)
        ops = None
    elif preset.needs_path and cfg.init != "random":
        raise _needs_weights(preset, cfg)
    else:
        config = _preset_config(preset, cfg, vocab_size)
        cls = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM
        model, ops = record_init(config, cls)
    return _finish(_set_kernels(cast_model(model, _dtype(param_dtype(cfg.dtype)))), cfg), ops


def _check_loaded(config: PretrainedConfig, cfg: ModelConfig, preset: Preset, vocab_size: int) -> None:
    """ValueError when the model in ``cfg.path`` (its ``config``) is not the preset's kind or has fewer embedding rows
    than the tokenizer has tokens."""
    if config.model_type != preset.model_type:
        raise ValueError(f"model.path {cfg.path!r} holds a {config.model_type!r} model, preset "
                         f"{preset.name!r} expects {preset.model_type!r}")
    if config.vocab_size < vocab_size:
        raise ValueError(f"tokenizer has {vocab_size} tokens but the model in {cfg.path!r} has only "
                         f"{config.vocab_size} embedding rows")


def _needs_weights(preset: Preset, cfg: ModelConfig) -> FileNotFoundError:
    """The error of a real preset with neither ``model.path`` nor ``model.init=random``."""
    return FileNotFoundError(f"preset {preset.name!r} loads real weights: set model.path to a local "
                             f"Hugging Face directory (got model.path={cfg.path!r}), or model.init=random for a "
                             f"speed or memory run without them")


def _preset_config(preset: Preset, cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The preset's model config for ``vocab_size`` tokens, cut to ``cfg.num_layers`` layers when set."""
    config = preset.make_config(vocab_size)
    if cfg.num_layers is not None:
        config.num_hidden_layers = cfg.num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:cfg.num_layers]
    return config


def _finish(model: PreTrainedModel, cfg: ModelConfig) -> PreTrainedModel:
    """The switches ``build_model`` sets on a built model: checkpointing, no KV cache, router precision, autocast."""
    if cfg.gradient_checkpointing:
        # the recomputed layers route like their forward did (R2/R3 replay), see routing.checkpoint_context_fn
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": routing.checkpoint_context_fn})
    model.config.use_cache = False
    routing.set_fp32_router(model, cfg.fp32_router)
    set_compute_dtype(model, cfg.dtype)
    return model


def load_model_dir(path: str | os.PathLike, dtype: str | torch.dtype) -> PreTrainedModel:
    """Load a causal LM saved in Hugging Face format from a local directory (never the hub)."""
    path = os.fspath(path)
    read_model_config(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype), local_files_only=True,
                                                 attn_implementation=ATTN_IMPLEMENTATION)
    return _set_kernels(model)


def save_model_dir(model: PreTrainedModel, tokenizer, path: str | os.PathLike,
                   finalize: Callable[[str], None] | None = None) -> None:
    """Save weights (safetensors), config and tokenizer to ``path`` atomically.

    Everything is written to a temporary sibling directory first and renamed into place, so a reader
    (the cold-start cache, a vLLM engine) never sees a half-written model. ``finalize(tmp_dir)`` runs on
    the complete temporary directory before the rename (the cold-start cache writes its checksum manifest
    there, so an entry appears with its manifest or not at all). An existing ``path`` is replaced.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if finalize is not None:
            finalize(tmp)
        old = None
        if os.path.exists(path):
            old = os.path.join(parent, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def check_context(prompts: list[list[int]], max_new_tokens: int, model: torch.nn.Module,
                  texts: list[str] | None = None) -> None:
    """Raise ValueError when a prompt plus ``max_new_tokens`` does not fit the model's context.

    The context is ``config.max_position_embeddings``: beyond it rotary positions were never trained on
    (and a learned position table would fail with an index error deep in the forward pass).
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not limit or not prompts:
        return
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    n = len(prompts[i])
    if n + max_new_tokens > limit:
        text = f" ({texts[i][:60]!r}{'...' if len(texts[i]) > 60 else ''})" if texts else ""
        raise ValueError(f"prompt {i}{text} has {n} tokens; with rollout.max_new_tokens={max_new_tokens} that is "
                         f"{n + max_new_tokens} positions, beyond the model's context of {limit} "
                         f"(max_position_embeddings): shorten the prompts or lower rollout.max_new_tokens")


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total, active per token) parameter counts.

    Active counts, per MoE layer, only ``top_k / num_experts`` of the expert weights (every token runs
    ``top_k`` experts); everything else (attention, router, embeddings, LM head) is active. Tied
    weights are counted once. Works on the meta device.
    """
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    for m in model.modules():
        if isinstance(m, Qwen3MoeExperts):
            expert_params = sum(p.numel() for p in m.parameters(recurse=False))
            inactive += expert_params * (m.num_experts - top_k) // m.num_experts
    return total, total - inactive
