"""A memory plan per GPU, from the config alone: what a run will hold, term by term, before a GPU is rented.

``plan_memory(cfg, gpus, gpu_mem_gib)`` counts the model's parameters from its shapes (no weights, no torch
tensors) and adds up, per GPU (per rank under ``torchrun``; the single process at ``gpus = 1``):

- **weights, gradients, optimiser**: N bytes per parameter each, from ``optim.precision`` (``fp32``: float32
  master weights 4 + gradient 4 + AdamW moments 8; ``bf16_stochastic``: 2 + 2 + 4; ``bf16_kahan``: 2 + 2 + 6),
  divided by the world size when FSDP2 shards them (``gpus > 1``); the gradients of lower-precision parameters
  are 4 B when a mini-batch has several micro-batches (``trainers.optim.Float32Grads`` sums them in float32);
- **activations**: what one micro-batch of ``algo.micro_batch_tokens`` tokens saves for its backward (each layer's
  input with gradient checkpointing, plus the one layer being recomputed; every layer's saved tensors without it),
  and the gradient accumulation: with more than one micro-batch per mini-batch the gradients are alive while a
  micro-batch's activations are;
- **logits**: the LM head's float32 tensors: (tokens, vocab) logits and log-softmax saved for backward with
  ``model.lm_head_kernel: logits``; one (row chunk x vocab chunk) tile plus the float32 weight gradient with the
  fused kernels (``chunked``, ``bf16x3``);
- **kv_cache**: the torch engine's cache, 2 x layers x KV heads x head dim x bytes per token per row, for the rows of
  a rollout at P + max_new_tokens positions, or under ``rollout.torch.kv_tokens`` when set;
- **rollout_engine**: vLLM's reservation (``gpu_memory_utilization`` of the GPU, held for the run), or the torch
  engine's copy of the weights in the rollout precision (none with ``share_weights``);
- **routes**: the MoE routes of the rollout batch, ``[B, S, layers, k]`` in the smallest integer type that holds the
  expert count (R2/R3 and the routing measure);
- **transients**: the optimiser step's float32 temporaries for the largest parameter, FSDP2's unsharded layers, and
  the weight sync (one tensor at a time in the engine's dtype);
- **overhead**: CUDA context, NCCL buffers and allocator slack, assumed (``OVERHEAD_GIB``).

Phases: the persistent terms (weights, optimiser, engine, routes, overhead) plus the larger of the rollout phase (the
torch engine's KV cache) and the training phase (gradients + activations + logits + transients, or, when one
micro-batch makes up the mini-batch, the larger of its activations and of the gradients with the optimiser step's
temporaries: the backward frees the first while it fills the second).

Per-layer activation bytes per token (mask-free sdpa, nothing growing with S^2): the distinct storages autograd
saves, counted on the CPU by varying one width at a time (q = heads x head dim, kv = KV heads x head dim, I the MLP
width): 4 x (6 H + 4 q + 4 kv + 4 I) in float32, 2 x (8 H + 5 q + 5 kv + 4 I) in bfloat16 (the RMSNorms and the
rotary embedding keep float32 copies), each within 0.5% of the count at five shapes. An MoE layer's MLP adds
k (4 I_e + 2 H) + 2 E elements (I_e the expert width, E experts, k top-k), fitted to the saved tensors that
``benchmarks/real_shapes.py --activations`` counted at the real width (docs/scale.md; that count includes aliases,
so it bounds from above). Validated against peaks measured on the CPU (tests/test_memory_learner.py) and on one
H200 (docs/gpu.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from trainers.jsonfile import read_model_config

GIB = 1024 ** 3

# CUDA context, NCCL buffers and the caching allocator's slack: assumed, not derived (a CUDA context alone is
# ~0.5 GiB; fragmentation of a long run adds a few percent of what is allocated).
OVERHEAD_GIB = 3.0

# Bytes per parameter of (weights, gradients, optimiser state) for each ``optim.precision``.
PRECISION_BYTES = {"fp32": (4, 4, 8), "bf16_stochastic": (2, 2, 4), "bf16_kahan": (2, 2, 6)}

# Bytes of a weight in each rollout precision (the torch engine's copy, vLLM's weights).
ROLLOUT_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1, "fp8_weight": 1, "int4": 0.5}

# The fused LM head's tile (trainers.lm_head.ROW_CHUNK x VOCAB_CHUNK), float32, and how many tiles are alive at once
# in its backward (logits, probabilities, their gradient).
HEAD_ROW_CHUNK, HEAD_VOCAB_CHUNK, HEAD_TILES = 4096, 16384, 3

# Prompt length the plan assumes when the config does not bound it (the task's prompts are read only at run start).
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Shapes:
    """The shapes a plan needs; ``experts == 0`` for a dense model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, q/k norms, two RMSNorms, the MLP (dense: gate, up,
        down; MoE: router + every expert's gate, up, down)."""
        q, kv, H = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        attention = H * q + 2 * H * kv + q * H + 2 * self.head_dim + 2 * H
        if self.experts:
            return attention + H * self.experts + self.experts * 3 * H * self.expert_intermediate
        return attention + 3 * H * self.intermediate

    @property
    def params(self) -> int:
        """All parameters: decoder layers, final norm, embedding and (untied) LM head."""
        return self.layers * self.layer_params + self.hidden + 2 * self.vocab * self.hidden

    @property
    def largest_param(self) -> int:
        """Elements of the largest parameter tensor: the embedding / LM head, or an MoE layer's fused experts."""
        experts = self.experts * 2 * self.hidden * self.expert_intermediate if self.experts else 0
        return max(self.vocab * self.hidden, experts, self.hidden * self.intermediate)

    def layer_activation_bytes(self, dtype_bytes: int = 2) -> float:
        """Bytes one decoder layer saves for backward per token (the fit in the module docstring)."""
        q, kv, H = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        # bf16 keeps float32 copies inside the RMSNorms and the rotary embedding: more elements per width
        base = 6 * H + 4 * q + 4 * kv if dtype_bytes == 4 else 8 * H + 5 * q + 5 * kv
        if self.experts:
            mlp = self.top_k * (4 * self.expert_intermediate + 2 * H) + 2 * self.experts
        else:
            mlp = 4 * self.intermediate
        return dtype_bytes * (base + mlp)

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> float:
        """KV cache bytes per token of one row: K and V of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def model_shapes(cfg) -> Shapes:
    """The shapes of ``cfg.model``: the preset's, at ``model.num_layers`` when set, with the vocabulary of
    ``model.path``'s config.json when it has one (the character tokenizer's otherwise, which the real presets
    round up to their own 151,936)."""
    from trainers.models import get_preset
    from trainers.tokenizer import CHARACTERS, SPECIAL_TOKENS

    vocab = len(SPECIAL_TOKENS) + len(CHARACTERS)
    if cfg.model.path and cfg.model.init != "random":
        try:
            vocab = int(read_model_config(cfg.model.path)["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # ``dcmdp check`` names a model directory it cannot read on its own
    c = get_preset(cfg.model.preset).make_config(vocab)
    layers = cfg.model.num_layers or c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    experts = getattr(c, "num_experts", 0) or 0
    return Shapes(layers=layers, hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                  head_dim=head_dim, intermediate=c.intermediate_size, vocab=c.vocab_size, experts=experts,
                  top_k=getattr(c, "num_experts_per_tok", 0) if experts else 0,
                  expert_intermediate=getattr(c, "moe_intermediate_size", 0) if experts else 0)


def route_dtype_bytes(experts: int) -> int:
    """Bytes of a route as the engines store it (``trainers.routing.route_dtype``)."""
    from trainers.routing import route_dtype

    return route_dtype(experts).itemsize


@dataclass(frozen=True)
class Term:
    """One line of a plan: bytes per GPU, the formula, and the config key that shrinks it."""

    name: str
    bytes: float
    formula: str
    key: str

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of a run, term by term, and whether it fits ``gpu_mem_gib``."""

    gpus: int
    gpu_mem_gib: float
    # Where the GPU size came from: "--gpu-memory", or the detected device's name.
    gpu_source: str
    terms: tuple[Term, ...]
    # Peak bytes per GPU: persistent terms + the larger of the rollout and training phases (module docstring).
    total_bytes: float
    # Response tokens per row, prompt tokens per row, micro-batches per rank per mini-batch: what the plan assumed.
    response_tokens: int
    prompt_tokens: int
    micro_batches: int
    # The phases the total is made of (bytes): held for the whole run, the training phase, the rollout phase.
    persistent_bytes: float = 0.0
    train_bytes: float = 0.0
    rollout_bytes: float = 0.0
    # The config's values of the keys a refusal may propose (``FIX_SETTINGS``): a hint never proposes one already set.
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.gpu_mem_gib

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)

    def lines(self) -> list[str]:
        """The plan as ``dcmdp check`` prints it."""
        head = (f"memory plan per GPU ({self.gpus} x {self.gpu_mem_gib:g} GiB, {self.gpu_source}; rows of "
                f"{self.prompt_tokens} + {self.response_tokens} tokens, {self.micro_batches} micro-batch(es) per rank "
                f"per mini-batch):")
        rows = [f"  {t.name:<15} {t.gib:8.2f} GiB  {t.formula}" for t in self.terms]
        verdict = "fits" if self.fits else "does NOT fit"
        return [head, *rows, f"  {'total (peak)':<15} {self.total_gib:8.2f} GiB  of {self.gpu_mem_gib:g}: {verdict}"]

    def refusal(self) -> str:
        """Why the plan does not fit: the total, the largest term and the key that shrinks it."""
        t = self.largest
        fix = FIXES.get(t.name, "change " + t.key)
        setting = FIX_SETTINGS.get(t.name)
        if setting is not None and dict(self.settings).get(setting[0]) == setting[1]:
            fix = f"{setting[0]} is {setting[1]} already, the least this term can be on {self.gpus} GPU(s)"
        return (f"config error at '{t.key}': the memory plan needs {self.total_gib:.1f} GiB per GPU, above the "
                f"{self.gpu_mem_gib:g} GiB of {self.gpu_source}; the largest term is {t.name} ({t.gib:.1f} GiB: "
                f"{t.formula}): {fix}, or plan for more GPUs (--gpus, FSDP2 "
                f"shards weights, gradients and optimiser state) or for GPUs with more memory (a larger --gpu-memory)")


# What shrinks each term, for a refusal.
FIXES = {
    "weights": "optim.precision=bf16_stochastic keeps bfloat16 parameters (2 B each instead of 4)",
    "gradients": "optim.precision=bf16_stochastic keeps bfloat16 gradients (2 B each instead of 4)",
    "optimiser": "optim.precision=bf16_stochastic keeps bfloat16 AdamW moments (4 B per parameter instead of 8)",
    "activations": "lower algo.micro_batch_tokens (or set model.gradient_checkpointing=true)",
    "logits": "set model.lm_head_kernel=bf16x3 (or chunked): no (tokens, vocab) float32 tensors",
    "rollout_engine": "lower rollout.vllm.gpu_memory_utilization, or rollout.engine=torch with "
                      "rollout.torch.share_weights=true",
    "kv_cache": "set rollout.torch.kv_tokens (decode in sub-batches)",
    "routes": "lower rollout.max_new_tokens or algo.prompts_per_step",
    "overhead": "no key shrinks this fixed cost of any run on a GPU (the CUDA context and allocator slack): shrink "
                "the other terms",
}


# The (key, value) each FIXES entry proposes, where it proposes one: not proposed when the config has it already.
FIX_SETTINGS = {"weights": ("optim.precision", "bf16_stochastic"), "gradients": ("optim.precision", "bf16_stochastic"),
                "optimiser": ("optim.precision", "bf16_stochastic"), "logits": ("model.lm_head_kernel", "bf16x3"),
                "rollout_engine": ("rollout.torch.share_weights", "True")}


def plan_memory(cfg, gpus: int = 1, gpu_mem_gib: float = 80.0, *, gpu_source: str = "--gpu-memory",
                prompt_tokens: int = PROMPT_TOKENS, shapes: Optional[Shapes] = None,
                overhead_gib: float = OVERHEAD_GIB) -> MemoryPlan:
    """The per-GPU memory plan of the run config ``cfg`` on ``gpus`` GPUs of ``gpu_mem_gib`` GiB (module docstring).

    ``gpus > 1`` is the ``torchrun`` layout: FSDP2 shards weights, gradients and optimiser state over the ranks, each
    rank trains on 1/gpus of every mini-batch, one vLLM engine spans the GPUs at tensor parallel = gpus, and the torch
    engine decodes on rank 0 (the plan is rank 0's, the largest). ``shapes`` replaces the preset's; ``overhead_gib`` the
    assumed CUDA overhead (0 for a plan of the CPU)."""
    s = shapes or model_shapes(cfg)
    world = max(int(gpus), 1)
    sharded = world > 1
    N = s.params
    w_b, g_b, o_b = PRECISION_BYTES[cfg.optim.precision]
    compute_b = 2 if (cfg.model.dtype in ("bfloat16", "float16") or w_b == 2
                      or (sharded and cfg.dist.param_dtype == "bf16")) else 4
    # the residual stream between layers (what checkpointing keeps) is in the parameters' dtype under autocast
    stream_b = w_b if not sharded else compute_b
    terms: list[Term] = []

    def add(name: str, nbytes: float, formula: str, key: str) -> float:
        terms.append(Term(name, float(nbytes), formula, key))
        return float(nbytes)

    share = f" / {world}" if sharded else ""
    weights = add("weights", w_b * N / world, f"{w_b} B x {N / 1e9:.2f} B params{share}", "optim.precision")
    algo = cfg.algo
    rows = algo.prompts_per_step * algo.samples_per_prompt
    rows_rank = max(rows // algo.minibatches // world, 1)
    T = cfg.rollout.max_new_tokens
    seq = prompt_tokens + T
    budget = algo.micro_batch_tokens
    if budget > 0:
        rows_micro = max(budget // seq, 1)
        micro = math.ceil(rows_rank / rows_micro)
        rows_micro = min(rows_micro, rows_rank)
    else:
        rows_micro, micro = rows_rank, 1
    if micro > 1 and g_b < 4:  # trainers.optim.Float32Grads: the micro-batches' gradients summed in float32
        grads = add("gradients", 4 * N / world, f"4 B x params{share} (summed in float32 over {micro} micro-batches)",
                    "optim.precision")
    else:
        grads = add("gradients", g_b * N / world, f"{g_b} B x params{share}", "optim.precision")
    optim = add("optimiser", o_b * N / world, f"{o_b} B x params{share} (optim.precision={cfg.optim.precision})",
                "optim.precision")
    tokens = rows_micro * seq
    layer_b = s.layer_activation_bytes(compute_b)
    if cfg.model.gradient_checkpointing:
        act = s.layers * s.hidden * stream_b * tokens + layer_b * tokens
        act_formula = f"{tokens:,} tokens x ({s.layers} layer inputs x {s.hidden * stream_b:,} B + one layer " \
                      f"{layer_b:,.0f} B)"
    else:
        act = s.layers * layer_b * tokens
        act_formula = f"{tokens:,} tokens x {s.layers} layers x {layer_b:,.0f} B (no checkpointing)"
    activations = add("activations", act, act_formula, "algo.micro_batch_tokens")

    resp_tokens = rows_micro * T
    if cfg.model.lm_head_kernel == "logits" or not cfg.model.fp32_lm_head:
        saved = 3 if algo.entropy_coef > 0 else 2  # logits and log-softmax, and exp for the entropy's graph
        head = saved * 4 * s.vocab * resp_tokens
        head_formula = f"{resp_tokens:,} response tokens x {saved} x 4 B x {s.vocab:,} vocab (saved)"
        head_key = "model.lm_head_kernel"
    else:
        tile = HEAD_TILES * 4 * min(HEAD_ROW_CHUNK, resp_tokens) * min(HEAD_VOCAB_CHUNK, s.vocab)
        head = tile + 4 * s.vocab * s.hidden + 4 * resp_tokens * s.hidden
        head_formula = (f"{cfg.model.lm_head_kernel}: {HEAD_TILES} float32 tiles + float32 head gradient "
                        f"{s.vocab:,} x {s.hidden:,}")
        head_key = "algo.micro_batch_tokens"
    logits = add("logits", head, head_formula, head_key)

    r = cfg.rollout
    kv = 0.0
    engine_b = ROLLOUT_WEIGHT_BYTES.get(r.precision, 2)
    if r.engine == "vllm":
        # vLLM sizes its KV cache so that weights + KV reach gpu_memory_utilization of the GPU; its weights alone
        # (bf16, split over tensor parallel) plus one row's KV are the least it needs to start
        tp = max(r.vllm.tensor_parallel_size, 1)
        vllm_weights = 2 * N / tp
        vllm_kv_min = s.kv_bytes_per_token(2) * seq / tp
        share = r.vllm.gpu_memory_utilization * gpu_mem_gib * GIB
        need = vllm_weights + vllm_kv_min
        engine = add("rollout_engine", max(share, need),
                     f"vLLM: gpu_memory_utilization {r.vllm.gpu_memory_utilization:g} x {gpu_mem_gib:g} GiB = "
                     f"{share / GIB:.1f} GiB for its {vllm_weights / GIB:.1f} GiB of bf16 weights (/ TP {tp}) and its "
                     f"KV cache" + ("" if share >= need else f"; below its weights + one row's KV "
                                                             f"({need / GIB:.1f} GiB): vLLM cannot start"),
                     "rollout.vllm.gpu_memory_utilization")
    else:
        copy = 0.0 if r.torch.share_weights else engine_b * N
        engine = add("rollout_engine", copy, "share_weights: the trainer's parameters" if r.torch.share_weights
                     else f"a {r.precision} copy of the weights, {engine_b:g} B x params", "rollout.torch.share_weights")
        from trainers.engines.torch_engine import KV_FREE_FRACTION

        kv_row = s.kv_bytes_per_token(2 if r.precision != "fp32" else 4)
        want = rows * seq
        if r.torch.kv_tokens > 0:
            limit, why = r.torch.kv_tokens, f"rollout.torch.kv_tokens={r.torch.kv_tokens:,}"
        else:  # the engine's own budget (TorchEngine.kv_rows): a share of the memory free at the rollout
            free = gpu_mem_gib * GIB - (weights + optim + engine + overhead_gib * GIB)
            limit = int(KV_FREE_FRACTION * max(free, 0.0) // kv_row)
            why = f"kv_tokens=0: {KV_FREE_FRACTION:g} of the {max(free, 0.0) / GIB:.1f} GiB free at the rollout"
        kv_tokens = min(want, max(limit // seq, 1) * seq)
        kv = add("kv_cache", kv_row * kv_tokens,
                 f"{kv_tokens:,} tokens ({kv_tokens // seq} rows) x {kv_row / 1024:.0f} KiB ({why})",
                 "rollout.torch.kv_tokens")
    if s.experts:
        rb = route_dtype_bytes(s.experts)
        routes = add("routes", rows * seq * s.layers * s.top_k * rb,
                     f"{rows} rows x {seq:,} x {s.layers} layers x top-{s.top_k} x {rb} B", "rollout.max_new_tokens")
    else:
        routes = 0.0
    largest_b = s.largest_param
    opt_tmp = 2 * 4 * largest_b  # float32 parameter and update of the largest tensor
    trans = opt_tmp
    trans_formula = "optimiser step: float32 temporaries of the largest tensor"
    if sharded:
        # the root unit (embedding, final norm) is not resharded after its forward: its gathered embedding stays
        # whole until the backward has passed it
        trans += (2 * compute_b * s.layer_params + 4 * s.layer_params + 4 * s.vocab * s.hidden
                  + compute_b * s.vocab * s.hidden)
        trans_formula += ("; FSDP2: two unsharded layers, one layer's float32 gradient, the float32 LM head, the "
                          "root's unsharded embedding")
    if r.engine == "vllm" or not r.torch.share_weights:
        trans += engine_b * largest_b
        trans_formula += "; weight sync: one tensor in the engine's dtype"
    transients = add("transients", trans, trans_formula, "optim.precision")
    overhead = add("overhead", overhead_gib * GIB, "CUDA context, NCCL buffers, allocator slack (assumed)", "--gpu-memory")

    persistent = weights + optim + engine + routes + overhead
    forward = activations + logits + transients - opt_tmp  # the optimiser's temporaries come after the backward
    if micro > 1:  # the gradients accumulate while each micro-batch's activations are alive
        train = grads + max(forward, transients)
    else:  # the one backward frees the activations while it fills the gradients
        train = max(forward, grads + transients)
    total = persistent + max(train, kv)
    settings = (("optim.precision", cfg.optim.precision), ("model.lm_head_kernel", cfg.model.lm_head_kernel),
                ("rollout.torch.share_weights", str(r.engine == "torch" and r.torch.share_weights)))
    return MemoryPlan(world, float(gpu_mem_gib), gpu_source, tuple(terms), total, T, prompt_tokens, micro,
                      persistent, train, kv, settings)


def detected_gpu_gib() -> Optional[tuple[float, str]]:
    """(GiB, name) of CUDA device 0, or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.total_memory / GIB, f"detected {props.name}"
