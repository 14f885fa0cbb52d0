"""Config dataclasses of the learner-side components (model, rollout engine, task, algorithm, optimiser).

One dataclass per component; defaults live only here. Field docstrings are the one-line comment above
each field. Bounds are checked in ``check()``, which raises ``ValueError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config error at '{key}': {msg}")


@dataclass
class ModelConfig:
    # Preset name: tiny-dense | tiny-moe | small-dense | small-moe | qwen3-8b | qwen3-30b-a3b (see
    # trainers.models.PRESETS).
    preset: str = "tiny-moe"
    # Local directory with weights + tokenizer (Hugging Face layout). Required for the real presets;
    # for tiny presets the cold-started model is cached and this may stay empty.
    path: Optional[str] = None
    # Training parameter dtype: float32 | bfloat16.
    dtype: str = "float32"
    # Compute the LM head and the log-softmax in float32 whatever the parameter dtype (MiniMax-M1 §3.2).
    fp32_lm_head: bool = True
    # Enable activation checkpointing in the training engine (real presets).
    gradient_checkpointing: bool = False

    def check(self, prefix: str = "model") -> None:
        _require(self.dtype in ("float32", "bfloat16"), f"{prefix}.dtype", f"got {self.dtype!r}, expected float32 or bfloat16")


@dataclass
class RolloutConfig:
    # Rollout engine: torch (embedded, default) | vllm.
    engine: str = "torch"
    # Inference precision of the rollout engine: fp32 | bf16 | fp16 | int8 (weight-only, per channel).
    precision: str = "fp32"
    # Sampling temperature; the trainer scores the same tempered distribution.
    temperature: float = 1.0
    # Nucleus sampling mass; 1.0 samples from the full tempered distribution.
    top_p: float = 1.0
    # Maximum number of generated tokens per response.
    max_new_tokens: int = 8
    # vLLM tensor-parallel size (ignored by the torch engine).
    tensor_parallel_size: int = 1
    # vLLM: disable CUDA graphs / torch.compile (faster start, used on CPU).
    enforce_eager: bool = True
    # vLLM: fraction of accelerator memory the engine may take.
    gpu_memory_utilization: float = 0.5

    def check(self, prefix: str = "rollout") -> None:
        _require(self.precision in ("fp32", "bf16", "fp16", "int8"), f"{prefix}.precision",
                 f"got {self.precision!r}, expected one of fp32, bf16, fp16, int8")
        _require(self.temperature > 0, f"{prefix}.temperature", f"must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"{prefix}.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _require(self.tensor_parallel_size >= 1, f"{prefix}.tensor_parallel_size", "must be >= 1")


@dataclass
class TaskConfig:
    # Task name: addition | sorting | long_addition | math (see trainers.tasks.TASKS).
    name: str = "addition"
    # Largest operand / list element has this many digits (generated tasks).
    digits: int = 2
    # Shortest operand has this many digits (long_addition draws each length uniformly in [min_digits, digits]).
    min_digits: int = 1
    # Number of items (sorting) or operands (addition).
    items: int = 2
    # Size of the held-out evaluation set: a fixed sample per task config that training never draws (at most
    # half of the prompt space of a generated task).
    eval_size: int = 256
    # JSONL file with prompts and reference answers (task `math`).
    path: Optional[str] = None
    # Held-out JSONL file for task `math`; defaults to the last `eval_size` lines of `path`.
    eval_path: Optional[str] = None

    def check(self, prefix: str = "task") -> None:
        _require(self.digits >= 1, f"{prefix}.digits", f"must be >= 1, got {self.digits}")
        _require(1 <= self.min_digits <= self.digits, f"{prefix}.min_digits",
                 f"must be in [1, digits={self.digits}], got {self.min_digits}")
        _require(self.items >= 1, f"{prefix}.items", f"must be >= 1, got {self.items}")
        _require(self.eval_size >= 1, f"{prefix}.eval_size", f"must be >= 1, got {self.eval_size}")


@dataclass
class ColdStartConfig:
    # Supervised steps on task demonstrations before RL (0 disables). Cached by content hash.
    steps: int = 500
    # Sequences per supervised step.
    batch_size: int = 64
    # Learning rate of the supervised cold start.
    lr: float = 6e-3
    # Directory for cached cold-started models (relative to the working directory).
    cache_dir: str = ".dcmdp_cache"
    # Seed of the cold start (initial weights and demonstration order); None: the run's seed. Fix it to give
    # runs with different seeds one shared starting model, so their spread is RL's alone.
    seed: Optional[int] = None
    # Stop early once the sampled accuracy (T=1) on 256 training-distribution prompts reaches this; None: run
    # every step. The cold start crosses a sharp transition whose position moves with seed, thread count and
    # kernels, so a target lands RL's start in a learnable range where a fixed step count may not.
    target_accuracy: Optional[float] = None
    # Steps between two accuracy checks when target_accuracy is set.
    check_every: int = 25

    def check(self, prefix: str = "cold_start") -> None:
        _require(self.steps >= 0, f"{prefix}.steps", f"must be >= 0, got {self.steps}")
        _require(self.batch_size >= 1, f"{prefix}.batch_size", "must be >= 1")
        _require(self.lr > 0, f"{prefix}.lr", "must be > 0")
        _require(self.target_accuracy is None or 0 < self.target_accuracy <= 1, f"{prefix}.target_accuracy",
                 f"must be in (0, 1] or null, got {self.target_accuracy}")
        _require(self.check_every >= 1, f"{prefix}.check_every", "must be >= 1")


@dataclass
class AlgoConfig:
    # Policy loss: ppo_clip | minirl | gspo (see trainers.losses.POLICY_LOSSES).
    loss: str = "ppo_clip"
    # Lower clip range eps_low on r = pi_theta / pi_old (gspo acts on a sequence ratio: use ~3e-4).
    clip_low: float = 0.2
    # Upper clip range eps_high (DAPO-style asymmetric clip; gspo: ~4e-4).
    clip_high: float = 0.28
    # Training-inference IS correction of rho = pi_old / mu: none | tis | icepop | seq_tis | seq_mis.
    is_mode: str = "tis"
    # Truncation cap C for tis / seq_tis.
    is_cap: float = 5.0
    # Lower bound of the kept band (icepop on rho; seq_mis on the geometric mean of rho, where a tight band
    # such as [0.999, 1.001] is usual: set both bounds when choosing seq_mis).
    is_low: float = 0.5
    # Upper bound of the kept band (icepop on rho, seq_mis on the geometric mean of rho).
    is_high: float = 5.0
    # Advantage estimator: grpo (group mean baseline) (see trainers.advantages.ADVANTAGES).
    advantage: str = "grpo"
    # Divide group-centred rewards by the group std (off by default, Zheng et al.).
    std_normalize: bool = False
    # Prompts per rollout batch (B prompts).
    prompts_per_step: int = 16
    # Samples per prompt (G).
    samples_per_prompt: int = 8
    # Mini-batches per rollout batch (N = off-policiness); one optimiser step each.
    minibatches: int = 1
    # MoE routing replay: none | r2 (training engine's routes) | r3 (rollout engine's routes).
    routing_replay: str = "none"
    # Entropy bonus coefficient (0 disables).
    entropy_coef: float = 0.0

    def check(self, prefix: str = "algo") -> None:
        _require(0 <= self.clip_low < 1, f"{prefix}.clip_low", f"must be in [0, 1), got {self.clip_low}")
        _require(self.clip_high >= 0, f"{prefix}.clip_high", f"must be >= 0, got {self.clip_high}")
        _require(self.is_cap >= 1, f"{prefix}.is_cap", f"must be >= 1, got {self.is_cap}")
        _require(0 <= self.is_low <= 1 <= self.is_high, f"{prefix}.is_low/is_high",
                 f"need is_low <= 1 <= is_high, got [{self.is_low}, {self.is_high}]")
        _require(self.prompts_per_step >= 1, f"{prefix}.prompts_per_step", "must be >= 1")
        _require(self.samples_per_prompt >= 2, f"{prefix}.samples_per_prompt",
                 f"group baselines need >= 2 samples per prompt, got {self.samples_per_prompt}")
        _require(self.minibatches >= 1, f"{prefix}.minibatches", "must be >= 1")
        total = self.prompts_per_step * self.samples_per_prompt
        _require(total % self.minibatches == 0, f"{prefix}.minibatches",
                 f"{self.minibatches} mini-batches do not divide the rollout batch of "
                 f"{self.prompts_per_step} x {self.samples_per_prompt} = {total} samples")
        _require(self.routing_replay in ("none", "r2", "r3"), f"{prefix}.routing_replay",
                 f"got {self.routing_replay!r}, expected none, r2 or r3")


@dataclass
class OptimConfig:
    # AdamW learning rate.
    lr: float = 1e-3
    # AdamW betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # AdamW weight decay.
    weight_decay: float = 0.0
    # Global gradient-norm clip (0 disables).
    grad_clip: float = 1.0
    # Linear warm-up steps of the LR schedule (then constant).
    warmup_steps: int = 0

    def check(self, prefix: str = "optim") -> None:
        _require(self.lr > 0, f"{prefix}.lr", f"must be > 0, got {self.lr}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{prefix}.betas",
                 f"need two values in [0, 1), got {list(self.betas)}")
        _require(self.grad_clip >= 0, f"{prefix}.grad_clip", "must be >= 0")
        _require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
