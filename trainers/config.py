"""Config dataclasses of the learner-side components (model, rollout engine, task, algorithm, optimiser).

One dataclass per component; defaults live only here. Field docstrings are the one-line comment above
each field. Bounds are checked in ``check()``, which raises ``ConfigError`` naming the key (``require``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainers.errors import require


# How a float32 LM head computes log-probs (trainers.lm_head implements them): here so a config check needs no torch.
HEAD_KERNELS = ("logits", "chunked", "bf16x3")


@dataclass
class ModelConfig:
    # Preset name: tiny-dense | tiny-moe | small-dense | small-moe | qwen3-8b | qwen3-30b-a3b (see
    # trainers.models.PRESETS).
    preset: str = "tiny-moe"
    # Local directory with weights + tokenizer (Hugging Face layout). Required for the real presets;
    # for tiny presets the cold-started model is cached and this may stay empty.
    path: Optional[str] = None
    # Training dtype: float32 | bfloat16 (float32 master weights, forward and backward under bfloat16 autocast)
    # | float16 (the same under float16 autocast, with dynamic loss scaling, torch's GradScaler: the FP16 recipe
    # of Qi et al., arXiv 2510.26788, whose rollouts then run in fp16 too, rollout.precision=fp16).
    dtype: str = "float32"
    # Compute the LM head and the log-softmax in float32 whatever the parameter dtype (MiniMax-M1 §3.2).
    fp32_lm_head: bool = True
    # How the float32 head computes log-probs (trainers.lm_head.HEAD_KERNELS): logits (the (B, T, V) float32 logits)
    # | chunked (float32 GEMM per tile, no (B, T, V) tensor) | bf16x3 (split-bfloat16 tensor-core GEMMs, the same tiles).
    lm_head_kernel: str = "logits"
    # MoE: router logits, softmax and top-k in float32 whatever the parameter dtype, in the training engine and the
    # torch rollout engine (prime-rl's default; vLLM routes in its own precision). A no-op for float32 parameters.
    fp32_router: bool = False
    # Enable activation checkpointing in the training engine (real presets).
    gradient_checkpointing: bool = False
    # Training forwards attend to grouped KV heads in place (SDPA enable_gqa, trainers.attention) instead of copying
    # them per query head: the same values, K/V gradients at float rounding. Not during the cold start.
    gqa_attention: bool = True
    # Where the starting weights come from: auto (model.path when set; the tiny/small presets' seeded random init
    # and cold start otherwise) | random (seeded random weights for any preset, the real ones included, with the
    # character tokenizer as a stand-in: for speed and memory runs of the recipes without their weights; the log,
    # summary and MLflow tag dcmdp.random_init say so).
    init: str = "auto"
    # Build the preset with only this many decoder layers (null: all of them), for speed and memory runs at the real
    # width; needs model.init=random (loaded weights have their own depth).
    num_layers: Optional[int] = None

    def check(self, prefix: str = "model") -> None:
        require(self.init in ("auto", "random"), f"{prefix}.init", f"got {self.init!r}, expected auto or random")
        require(self.num_layers is None or self.num_layers >= 1, f"{prefix}.num_layers",
                f"must be >= 1 or null, got {self.num_layers}")
        require(self.num_layers is None or self.init == "random", f"{prefix}.num_layers",
                "sets the depth of a randomly initialised model: needs model.init=random")
        require(self.init != "random" or not self.path, f"{prefix}.init",
                f"random builds the preset without weights, and model.path={self.path!r} names weights to load; "
                f"drop one of them (model.path=null for a random-init run)")
        require(self.dtype in ("float32", "bfloat16", "float16"), f"{prefix}.dtype",
                f"got {self.dtype!r}, expected float32, bfloat16 or float16")
        require(self.lm_head_kernel in HEAD_KERNELS, f"{prefix}.lm_head_kernel",
                f"got {self.lm_head_kernel!r}, expected one of {', '.join(HEAD_KERNELS)}")
        require(self.fp32_lm_head or self.lm_head_kernel == "logits", f"{prefix}.lm_head_kernel",
                f"{self.lm_head_kernel!r} computes a float32 head: needs model.fp32_lm_head: true")


# Inference precisions of the rollout engine (trainers.quant.PRECISION_DTYPES holds their parameter dtypes).
ROLLOUT_PRECISIONS = ("fp32", "bf16", "fp16", "int8", "fp8", "fp8_weight", "int4")


# Bits of a weight in each rollout precision (logged as rollout/precision_bits).
PRECISION_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "fp8": 8, "fp8_weight": 8, "int4": 4}


@dataclass
class PrecisionPhase:
    # This phase's rollouts run for the steps before this one (0-based loop step); null: to the end of the run.
    until_step: Optional[int] = None
    # Inference precision of the rollout engine in this phase (one of ROLLOUT_PRECISIONS).
    precision: str = "fp32"


@dataclass
class TorchEngineConfig:
    # int4: input columns per weight scale; must divide the input dimension of every quantised matmul.
    int4_group_size: int = 32
    # Quantised precisions: also quantise the LM head (its weight; for fp8 its input too). Off, as in serving.
    quantize_lm_head: bool = False
    # Finished rows leave the decode batch (no compute after EOS); off feeds them padding.
    drop_finished: bool = True
    # Decode attention reads grouped KV heads in place (SDPA enable_gqa; bitwise the same values).
    gqa_decode: bool = True
    # Decode with the trainer's own parameters instead of a copy: one set of weights in memory (Qwen3-8B's 16 GB in
    # bf16 on one GPU) and no weight sync. Needs the rollout precision to be the trainer's parameter dtype (bf16
    # with optim.precision=bf16_*, fp32 otherwise), no quantisation, no precision schedule, no async rollouts.
    share_weights: bool = False
    # KV cache of a rollout: dynamic (grows by one position per decode step) | static (P + max_new_tokens positions
    # allocated once and written in place: the fixed shapes a captured decode graph needs).
    kv_cache: str = "dynamic"
    # kv_cache=static on CUDA, dense models: decode steps compiled with torch.compile(mode="reduce-overhead") and
    # replayed as CUDA graphs (finished rows are then fed padding instead of leaving the batch). Ignored elsewhere.
    decode_graphs: bool = False
    # KV-token budget of one decode: the rows of a rollout are decoded in sub-batches whose cache (rows x (P +
    # max_new_tokens) positions) stays within this many tokens, with the same tokens as one batch. 0: one batch on the
    # CPU, on CUDA the budget that fits in KV_FREE_FRACTION of the free device memory (trainers.engines.torch_engine).
    kv_tokens: int = 0

    def check(self, prefix: str = "rollout.torch") -> None:
        require(self.kv_tokens >= 0, f"{prefix}.kv_tokens", f"must be >= 0 (0: from free memory), got {self.kv_tokens}")
        require(self.int4_group_size >= 1, f"{prefix}.int4_group_size", f"must be >= 1, got {self.int4_group_size}")
        require(self.kv_cache in ("dynamic", "static"), f"{prefix}.kv_cache",
                f"must be dynamic or static, got {self.kv_cache!r}")
        require(not self.decode_graphs or self.kv_cache == "static", f"{prefix}.decode_graphs",
                "needs rollout.torch.kv_cache=static (a captured graph reads a cache of fixed shape)")


@dataclass
class VllmEngineConfig:
    # Tensor-parallel size (under torchrun: the world size).
    tensor_parallel_size: int = 1
    # Disable CUDA graphs / torch.compile (faster start, used on CPU; R3 on vLLM's router hooks needs it).
    # null: eager on the CPU (where R3's routes come from router hooks), CUDA graphs on GPUs (where vLLM returns
    # the routes itself).
    enforce_eager: Optional[bool] = True
    # Fraction of accelerator memory the engine may take.
    gpu_memory_utilization: float = 0.5

    def check(self, prefix: str = "rollout.vllm") -> None:
        require(self.tensor_parallel_size >= 1, f"{prefix}.tensor_parallel_size", "must be >= 1")
        require(0 < self.gpu_memory_utilization <= 1, f"{prefix}.gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class RolloutConfig:
    # Rollout engine: torch (embedded, default) | vllm.
    engine: str = "torch"
    # Inference precision of the rollout engine: fp32 | bf16 | fp16 | int8 (W8A16, per channel) | fp8 (W8A8 e4m3:
    # per-channel weights, dynamic per-token activations) | fp8_weight (W8A16 e4m3, per channel) | int4 (W4A16,
    # symmetric, per group of torch.int4_group_size inputs). See trainers.quant.
    precision: str = "fp32"
    # Precision by training step, e.g. [{until_step: 20, precision: fp32}, {until_step: 60, precision: int4},
    # {precision: fp8}]: the engine re-quantises from its full-precision weights at each switch. The first phase's
    # precision must equal `precision` (the engine starts in it); the last has no until_step. Empty: `precision`.
    precision_schedule: list[PrecisionPhase] = field(default_factory=list)
    # Stress knob, not a deployment format: std of seeded Gaussian noise added to the rollout engine's logits
    # (after the LM head, before temperature and top-p); log mu is that of the noised distribution sampled
    # from. 0 disables. torch engine only.
    logit_noise: float = 0.0
    # Sampling temperature; the trainer scores the same tempered distribution.
    temperature: float = 1.0
    # Nucleus sampling mass; 1.0 samples from the full tempered distribution.
    top_p: float = 1.0
    # Maximum number of generated tokens per response.
    max_new_tokens: int = 8
    # Knobs of the torch engine (read when engine=torch).
    torch: TorchEngineConfig = field(default_factory=TorchEngineConfig)
    # Knobs of the vLLM engine (read when engine=vllm).
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)

    def check(self, prefix: str = "rollout") -> None:
        require(self.precision in ROLLOUT_PRECISIONS, f"{prefix}.precision",
                f"got {self.precision!r}, expected one of {', '.join(ROLLOUT_PRECISIONS)}")
        require(0 <= self.logit_noise < float("inf"), f"{prefix}.logit_noise",
                f"must be a finite std >= 0, got {self.logit_noise}")
        require(self.temperature > 0, f"{prefix}.temperature", f"must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"{prefix}.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        self.torch.check(f"{prefix}.torch")
        self.vllm.check(f"{prefix}.vllm")
        sched = self.precision_schedule
        for i, phase in enumerate(sched):
            key = f"{prefix}.precision_schedule[{i}]"
            require(phase.precision in ROLLOUT_PRECISIONS, f"{key}.precision",
                    f"got {phase.precision!r}, expected one of {', '.join(ROLLOUT_PRECISIONS)}")
            last = i == len(sched) - 1
            require((phase.until_step is None) == last, f"{key}.until_step",
                    "the last phase runs to the end (no until_step); every other phase needs one")
            require(phase.until_step is None or phase.until_step > (sched[i - 1].until_step if i else 0),
                    f"{key}.until_step", f"must be above the previous phase's (and above 0), got {phase.until_step}")
        require(not sched or sched[0].precision == self.precision, f"{prefix}.precision",
                f"the engine starts in precision_schedule[0].precision={sched[0].precision if sched else ''!r}; "
                f"set {prefix}.precision to it (got {self.precision!r})")

    def precision_at(self, step: int) -> str:
        """The rollout precision of loop step ``step`` (0-based): the first schedule phase whose until_step is above
        it, ``precision`` without a schedule."""
        for phase in self.precision_schedule:
            if phase.until_step is None or step < phase.until_step:
                return phase.precision
        return self.precision


@dataclass
class CurriculumPhase:
    # This phase's training prompts are drawn for the steps before this one (0-based loop step); null: to the end.
    until_step: Optional[int] = None
    # task.digits of this phase's prompts.
    digits: int = 2
    # task.min_digits of this phase's prompts (long_addition); null: task.min_digits.
    min_digits: Optional[int] = None


@dataclass
class TaskConfig:
    # Task name: addition | sorting | long_addition | program_trace | list_ops | math | jsonl (your data and reward;
    # docs/custom_tasks.md). See trainers.tasks.TASKS and docs/tasks.md.
    name: str = "addition"
    # Largest operand / list element has this many digits (generated tasks).
    digits: int = 2
    # Shortest operand has this many digits (long_addition draws each length uniformly in [min_digits, digits]).
    min_digits: int = 1
    # Number of items (sorting), operands (addition) or digits in the list (list_ops).
    items: int = 2
    # Size of the held-out evaluation set: a fixed sample per task config that training never draws (at most
    # half of the prompt space of a generated task).
    eval_size: int = 256
    # JSONL file with prompts and reference answers (task `math`), or with prompts and what the reward needs (task
    # `jsonl`).
    path: Optional[str] = None
    # Held-out JSONL file for tasks `math` and `jsonl`; defaults to the last `eval_size` lines of `path`.
    eval_path: Optional[str] = None
    # Reward function of task `jsonl`: `module:function` (importable, the working directory included) or
    # `path/to/file.py:function`, called as function(prompt, completion, example) -> float.
    reward: Optional[str] = None
    # Training prompts by step, e.g. [{until_step: 50, digits: 3}, {until_step: 100, digits: 5}, {digits: 8}]: each
    # phase draws with its digits (generated tasks); evaluation and the cold start keep `digits` / `min_digits`.
    curriculum: list[CurriculumPhase] = field(default_factory=list)
    # Seconds one call of the `jsonl` reward function may take; a call that runs longer counts as a reward error
    # (reward/errors) and the sample gets 0.
    reward_timeout: float = 30.0
    # Seconds the `jsonl` reward's worker process may take to start and import the reward module (when the config is
    # checked, and at each start of a worker); past it the import counts as failed.
    reward_load_timeout: float = 60.0
    # MiB of resident memory the `jsonl` reward's worker process, with the processes it starts, may hold; past it the
    # worker is killed (a new one serves the next call) and the sample counts as a reward error. 0: no limit.
    reward_memory_mib: int = 1024

    def check(self, prefix: str = "task") -> None:
        require(0 < self.reward_timeout < float("inf"), f"{prefix}.reward_timeout",
                f"must be a finite number of seconds > 0, got {self.reward_timeout}")
        require(0 < self.reward_load_timeout <= 3600, f"{prefix}.reward_load_timeout",
                f"must be a number of seconds in (0, 3600], got {self.reward_load_timeout}")
        require(self.reward_memory_mib == 0 or 64 <= self.reward_memory_mib <= 1 << 20, f"{prefix}.reward_memory_mib",
                f"must be 0 (no limit) or in [64, 1048576] MiB (a Python process alone holds about 10), got "
                f"{self.reward_memory_mib}")
        require(self.digits >= 1, f"{prefix}.digits", f"must be >= 1, got {self.digits}")
        require(1 <= self.min_digits <= self.digits, f"{prefix}.min_digits",
                f"must be in [1, digits={self.digits}], got {self.min_digits}")
        require(self.items >= 1, f"{prefix}.items", f"must be >= 1, got {self.items}")
        require(self.eval_size >= 1, f"{prefix}.eval_size", f"must be >= 1, got {self.eval_size}")
        require(self.reward is None or self.name == "jsonl", f"{prefix}.reward",
                f"only task 'jsonl' takes a reward function; task {self.name!r} scores with its own")
        for i, phase in enumerate(self.curriculum):
            key = f"{prefix}.curriculum[{i}]"
            last = i == len(self.curriculum) - 1
            require((phase.until_step is None) == last, f"{key}.until_step",
                    "the last phase runs to the end (no until_step); every other phase needs one")
            prev = self.curriculum[i - 1].until_step if i else 0
            require(phase.until_step is None or phase.until_step > prev, f"{key}.until_step",
                    f"must be above the previous phase's (and above 0), got {phase.until_step}")
            require(phase.digits >= 1, f"{key}.digits", f"must be >= 1, got {phase.digits}")
            low = self.min_digits if phase.min_digits is None else phase.min_digits
            require(1 <= low <= phase.digits, f"{key}.min_digits",
                    f"must be in [1, digits={phase.digits}], got {low}"
                    f"{' (task.min_digits; set the phase its own)' if phase.min_digits is None else ''}")

    def phase_at(self, step: int) -> Optional[CurriculumPhase]:
        """The curriculum phase of loop step ``step`` (0-based); None without a curriculum."""
        for phase in self.curriculum:
            if phase.until_step is None or step < phase.until_step:
                return phase
        return None


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
        require(self.steps >= 0, f"{prefix}.steps", f"must be >= 0, got {self.steps}")
        require(self.batch_size >= 1, f"{prefix}.batch_size", "must be >= 1")
        require(self.lr > 0, f"{prefix}.lr", "must be > 0")
        require(self.target_accuracy is None or 0 < self.target_accuracy <= 1, f"{prefix}.target_accuracy",
                f"must be in (0, 1] or null, got {self.target_accuracy}")
        require(self.check_every >= 1, f"{prefix}.check_every", "must be >= 1")


# Sequence masks composable with every IS mode (trainers.losses applies them).
SEQ_MASK_MODES = ("none", "prod", "geo")

# Keys that were replaced, with what replaces them: dcmdp.config names the replacement when an old key is used.
RENAMED_KEYS = {
    "rollout.int4_group_size": "rollout.torch.int4_group_size",
    "rollout.quantize_lm_head": "rollout.torch.quantize_lm_head",
    "rollout.drop_finished": "rollout.torch.drop_finished",
    "rollout.gqa_decode": "rollout.torch.gqa_decode",
    "rollout.tensor_parallel_size": "rollout.vllm.tensor_parallel_size",
    "rollout.enforce_eager": "rollout.vllm.enforce_eager",
    "rollout.gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "algo.is_cap": "algo.tis.cap (is_mode=tis) or algo.seq_tis.cap (is_mode=seq_tis)",
    "algo.is_low": "algo.icepop.low (is_mode=icepop) or algo.seq_mask.geo.low (what is_mode=seq_mis was)",
    "algo.is_high": "algo.icepop.high (is_mode=icepop) or algo.seq_mask.geo.high (what is_mode=seq_mis was)",
    "algo.clip_low": "algo.ppo_clip.low (loss=ppo_clip), algo.minirl.low (loss=minirl) or algo.gspo.low (loss=gspo; "
                     "it clips a length-normalised sequence ratio, default 3e-4)",
    "algo.clip_high": "algo.ppo_clip.high (loss=ppo_clip), algo.minirl.high (loss=minirl) or algo.gspo.high "
                      "(loss=gspo; it clips a length-normalised sequence ratio, default 4e-4)",
}


@dataclass
class Band:
    # Lower end of the kept band (inclusive; 0: no lower bound).
    low: float
    # Upper end of the kept band (inclusive; inf: no upper bound).
    high: float

    def check(self, prefix: str) -> None:
        require(0 <= self.low <= 1 <= self.high, prefix, f"need 0 <= low <= 1 <= high, got [{self.low}, {self.high}]")


@dataclass
class ClipConfig:
    # Lower clip range eps_low: the ratio is clipped to [1 - low, 1 + high].
    low: float
    # Upper clip range eps_high (DAPO-style asymmetric clip when above low).
    high: float

    def check(self, prefix: str) -> None:
        require(0 <= self.low < 1, f"{prefix}.low", f"must be in [0, 1), got {self.low}")
        require(self.high >= 0, f"{prefix}.high", f"must be >= 0, got {self.high}")


@dataclass
class CapConfig:
    # Truncation cap C of the IS weight, w = min(ratio, C).
    cap: float = 5.0

    def check(self, prefix: str) -> None:
        require(self.cap >= 1, f"{prefix}.cap", f"must be >= 1, got {self.cap}")


@dataclass
class M2Config:
    # Threshold tau on the mean (log rho)^2 of the kept tokens (the M2PO paper's 0.04, read second-hand).
    threshold: float = 0.04

    def check(self, prefix: str) -> None:
        require(self.threshold > 0, f"{prefix}.threshold", f"must be > 0, got {self.threshold}")


@dataclass
class SeqMaskConfig:
    # Sequence mask on top of any is_mode: none | prod (drop a sequence whose prod_t rho_t leaves prod's band) |
    # geo (drop a sequence whose geometric mean exp(mean_t log rho_t) leaves geo's band).
    mode: str = "none"
    # Band of prod_t rho_t for mode prod (verl's sequence-level rejection: [0.5, 2]).
    prod: Band = field(default_factory=lambda: Band(low=0.5, high=2.0))
    # Band of the geometric mean for mode geo (Liu, Li et al. 2025 and verl's geometric preset: [0.999, 1.001]).
    geo: Band = field(default_factory=lambda: Band(low=0.999, high=1.001))

    def check(self, prefix: str) -> None:
        require(self.mode in SEQ_MASK_MODES, f"{prefix}.mode",
                f"got {self.mode!r}, expected one of {', '.join(SEQ_MASK_MODES)}")
        self.prod.check(f"{prefix}.prod")
        self.geo.check(f"{prefix}.geo")


@dataclass
class VetoConfig:
    # Drop a whole sequence if any of its tokens has rho below this (verl's rollout_token_veto_threshold; e.g.
    # 1e-4); null: off.
    threshold: Optional[float] = None

    def check(self, prefix: str) -> None:
        require(self.threshold is None or 0 < self.threshold < 1, f"{prefix}.threshold",
                f"must be in (0, 1) or null, got {self.threshold}")


@dataclass
class RejectConfig:
    # Token rejection: drop tokens whose per-token divergence d_t(pi_old, mu) exceeds ``bound``. none | a token
    # measure of constraints.measures (abs_prob_diff | kl_k1 | kl_k3 | chi2 | abs_log_ratio).
    measure: str = "none"
    # Bound on d_t, in the measure's unit; required with a measure (no default fits every measure's scale).
    bound: Optional[float] = None

    def check(self, prefix: str) -> None:
        if self.measure == "none":
            return
        from constraints.measures import MEASURES  # the registry; constraints imports nothing from trainers

        token_measures = [n for n, m in MEASURES.items() if m.kind == "token"]
        require(self.measure in token_measures, f"{prefix}.measure",
                f"got {self.measure!r}, expected none or a token measure: {', '.join(token_measures)}")
        require(self.bound is not None and self.bound >= 0, f"{prefix}.bound",
                f"reject.measure={self.measure} needs a bound >= 0 on its per-token value, got {self.bound}")


@dataclass
class AlgoConfig:
    # Policy loss: ppo_clip | minirl | gspo (see trainers.losses.POLICY_LOSSES).
    loss: str = "ppo_clip"
    # ppo_clip: clip range of the token ratio r = pi_theta / pi_old (DAPO's asymmetric 0.2 / 0.28).
    ppo_clip: ClipConfig = field(default_factory=lambda: ClipConfig(low=0.2, high=0.28))
    # minirl: a token whose ratio r leaves [1 - low, 1 + high] against its advantage is masked (the paper: 0.2 / 0.27).
    minirl: ClipConfig = field(default_factory=lambda: ClipConfig(low=0.2, high=0.28))
    # gspo: clip range of the length-normalised sequence ratio s_i (the GSPO paper, arXiv 2507.18071: 3e-4 / 4e-4).
    gspo: ClipConfig = field(default_factory=lambda: ClipConfig(low=3e-4, high=4e-4))
    # Dual-clip c (Ye et al. 2020, arXiv 1912.09729; verl's clip_ratio_c): with A < 0 a ratio r > c gets no
    # gradient (ppo_clip: the surrogate is bounded by c A; minirl: the token is masked). null: off. gspo ignores it.
    clip_ratio_c: Optional[float] = 3.0
    # Training-inference IS weight of rho = pi_old / mu: none | tis | icepop | seq_tis | m2po
    # (trainers.losses.IS_MODES).
    is_mode: str = "tis"
    # tis: w_t = min(rho_t, cap) (Yao et al. 2025; MiniRL truncates at 5).
    tis: CapConfig = field(default_factory=lambda: CapConfig(cap=5.0))
    # seq_tis: w = min(prod_t rho_t, cap) for every token of the sequence (verl's sequence IS: 2-10).
    seq_tis: CapConfig = field(default_factory=lambda: CapConfig(cap=5.0))
    # icepop: w_t = rho_t inside [low, high], the token dropped outside (Ring-1T: [0.5, 5]).
    icepop: Band = field(default_factory=lambda: Band(low=0.5, high=5.0))
    # m2po: drop the tokens with the largest (log rho)^2 until the rest's mean is below this (M2PO, arXiv 2510.01161).
    m2po: M2Config = field(default_factory=M2Config)
    # Scale each mini-batch step's learning rate by sqrt(min(1, ESS/n)) of its sequence IS weights (VCPO, arXiv
    # 2602.17616; trainers.losses.ess_lr_scale).
    ess_lr_scale: bool = False
    # Sequence mask, composable with every is_mode.
    seq_mask: SeqMaskConfig = field(default_factory=SeqMaskConfig)
    # Outlier veto, composable with every is_mode.
    veto: VetoConfig = field(default_factory=VetoConfig)
    # Token rejection on a divergence, composable with every is_mode.
    reject: RejectConfig = field(default_factory=RejectConfig)
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
    # Token budget of one training forward: rows sorted by length into micro-batches of at most this many padded
    # positions, each cut to its longest row (verl's dynamic batch size); 0: one forward per mini-batch. The loss
    # and its normalisation are unchanged; each micro-batch has its own backward, the gradients accumulate (memory
    # bounded by one micro-batch). Under torchrun every rank runs as many micro-batches as the rank that needs most.
    micro_batch_tokens: int = 4096
    # MoE routing replay: none | r2 (training engine's routes) | r3 (rollout engine's routes).
    routing_replay: str = "none"
    # Entropy bonus coefficient (0 disables).
    entropy_coef: float = 0.0
    # Where log pi_old comes from: recompute (a training-engine forward before the updates) | rollout (bypass:
    # log mu is taken as log pi_old, no forward; the clip then acts on pi_theta / mu and the IS weight is 1).
    old_logp: str = "recompute"

    def check(self, prefix: str = "algo") -> None:
        self.ppo_clip.check(f"{prefix}.ppo_clip")
        self.minirl.check(f"{prefix}.minirl")
        self.gspo.check(f"{prefix}.gspo")
        require(self.clip_ratio_c is None or self.clip_ratio_c > 1, f"{prefix}.clip_ratio_c",
                f"must be > 1 or null, got {self.clip_ratio_c}")
        require(self.is_mode != "seq_mis", f"{prefix}.is_mode",
                "seq_mis is now a sequence mask that composes with every is_mode: use is_mode=none "
                "seq_mask.mode=geo (band algo.seq_mask.geo.low / .high) for what seq_mis did")
        self.tis.check(f"{prefix}.tis")
        self.seq_tis.check(f"{prefix}.seq_tis")
        self.icepop.check(f"{prefix}.icepop")
        self.m2po.check(f"{prefix}.m2po")
        self.seq_mask.check(f"{prefix}.seq_mask")
        self.veto.check(f"{prefix}.veto")
        self.reject.check(f"{prefix}.reject")
        require(self.prompts_per_step >= 1, f"{prefix}.prompts_per_step", "must be >= 1")
        require(self.samples_per_prompt >= 2, f"{prefix}.samples_per_prompt",
                f"group baselines need >= 2 samples per prompt, got {self.samples_per_prompt}")
        require(self.minibatches >= 1, f"{prefix}.minibatches", "must be >= 1")
        require(self.micro_batch_tokens >= 0, f"{prefix}.micro_batch_tokens", "must be >= 0 (0: one forward)")
        total = self.prompts_per_step * self.samples_per_prompt
        require(total % self.minibatches == 0, f"{prefix}.minibatches",
                f"{self.minibatches} mini-batches do not divide the rollout batch of "
                f"{self.prompts_per_step} x {self.samples_per_prompt} = {total} samples")
        require(self.routing_replay in ("none", "r2", "r3"), f"{prefix}.routing_replay",
                f"got {self.routing_replay!r}, expected none, r2 or r3")
        require(self.old_logp in ("recompute", "rollout"), f"{prefix}.old_logp",
                f"got {self.old_logp!r}, expected recompute or rollout")
        require(not (self.old_logp == "rollout" and self.routing_replay == "r2"), f"{prefix}.routing_replay",
                "r2 replays the routes of the pi_old forward, which old_logp=rollout skips; use r3 (the rollout "
                "engine's routes) or old_logp=recompute")


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
    # Parameter and AdamW-state precision: fp32 | bf16_stochastic | bf16_kahan (trainers.optim.PRECISIONS).
    precision: str = "fp32"

    def check(self, prefix: str = "optim") -> None:
        require(self.lr > 0, f"{prefix}.lr", f"must be > 0, got {self.lr}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{prefix}.betas",
                f"need two values in [0, 1), got {list(self.betas)}")
        require(self.grad_clip >= 0, f"{prefix}.grad_clip", "must be >= 0")
        require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
        # precision names the registry trainers.optim.PRECISIONS, which imports torch: dcmdp.config checks it with
        # the other registry names, after every bound (a bound's error comes before torch is imported)
