"""Rollout engines behind one small interface, chosen by ``rollout.engine``.

An engine knows token ids only. ``generate`` samples one response per prompt and returns a
``Rollout``; ``load_weights`` pushes the trainer's weights into the running engine.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from trainers.batch import Rollout
from trainers.config import RolloutConfig


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


def _build_torch(cfg: RolloutConfig, model: torch.nn.Module, model_dir: str | None, *, eos_id: int, pad_id: int):
    from trainers.engines.torch_engine import TorchEngine

    return TorchEngine(cfg, model, eos_id=eos_id, pad_id=pad_id)


def _build_vllm(cfg: RolloutConfig, model: torch.nn.Module, model_dir: str | None, *, eos_id: int, pad_id: int):
    from trainers.engines.vllm_engine import VllmEngine

    return VllmEngine(cfg, model, model_dir, eos_id=eos_id, pad_id=pad_id)


# name -> builder(cfg, model, model_dir, eos_id=, pad_id=) -> RolloutEngine
ENGINES: dict[str, Callable[..., RolloutEngine]] = {"torch": _build_torch, "vllm": _build_vllm}


def build_engine(cfg: RolloutConfig, model: torch.nn.Module, model_dir: str | None, *, eos_id: int,
                 pad_id: int) -> RolloutEngine:
    if cfg.engine not in ENGINES:
        raise ValueError(f"unknown rollout engine {cfg.engine!r}; available: {', '.join(ENGINES)}")
    return ENGINES[cfg.engine](cfg, model, model_dir, eos_id=eos_id, pad_id=pad_id)
