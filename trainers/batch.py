"""The rollout batch: what a rollout engine returns and the learner consumes.

Layout (the same for every engine): prompts left-padded to P tokens, responses right-padded to T
tokens, the model input is ``cat(prompt_ids_BP, response_ids_BT)`` of S = P + T positions.
Per-token response quantities are ``[B, T]``; MoE routes cover every input position ``[B, S, L, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Rollout:
    # (B, P) prompt token ids, left-padded with the pad id.
    prompt_ids_BP: Tensor
    # (B, P) True on real prompt tokens.
    prompt_mask_BP: Tensor
    # (B, T) generated token ids, right-padded with the pad id after EOS / max length.
    response_ids_BT: Tensor
    # (B, T) True on generated tokens (EOS included), False on padding.
    response_mask_BT: Tensor
    # (B, T) log mu(y_t): log-probability of each sampled token under the distribution the engine
    # actually sampled from (tempered; top-p renormalised). 0 on padding.
    rollout_logp_BT: Tensor
    # (B, S, L, K) experts the rollout engine routed each input position to, per MoE layer; -1 where
    # no route was computed (padding, and the last response token, which the engine never feeds back).
    # None for dense models or engines that cannot report routes.
    rollout_experts_BSLK: Optional[Tensor] = None
    # Policy version (trainer step) of the weights that produced this sample, per sequence (B,).
    version_B: Optional[Tensor] = None

    def __post_init__(self) -> None:
        """Check that every field describes the same B rows, P prompt and T response positions.

        An engine that returns, say, fewer log-probs than tokens fails here with the shapes named, instead
        of deep inside a loss or a measure. MoE routes are checked where they are replayed
        (``learner.ReplayError`` names misaligned positions).
        """
        B, P = tuple(self.prompt_ids_BP.shape) if self.prompt_ids_BP.dim() == 2 else (None, None)
        T = self.response_ids_BT.shape[1] if self.response_ids_BT.dim() == 2 else None
        expected = {"prompt_ids_BP": (B, P), "prompt_mask_BP": (B, P), "response_ids_BT": (B, T),
                    "response_mask_BT": (B, T), "rollout_logp_BT": (B, T)}
        got = {name: tuple(getattr(self, name).shape) for name in expected}
        if B is None or T is None or any(got[name] != shape for name, shape in expected.items()):
            raise ValueError("Rollout fields disagree on (B, P) / (B, T): " +
                             ", ".join(f"{name} {got[name]}" for name in expected) +
                             " (every response token needs exactly one rollout log-prob)")
        if self.version_B is not None and tuple(self.version_B.shape) != (B,):
            raise ValueError(f"Rollout version_B has shape {tuple(self.version_B.shape)}, expected ({B},)")

    @property
    def input_ids_BS(self) -> Tensor:
        return torch.cat([self.prompt_ids_BP, self.response_ids_BT], dim=1)

    @property
    def attention_mask_BS(self) -> Tensor:
        return torch.cat([self.prompt_mask_BP, self.response_mask_BT], dim=1)

    @property
    def num_prompt_positions(self) -> int:
        return self.prompt_ids_BP.shape[1]

    def __len__(self) -> int:
        return self.prompt_ids_BP.shape[0]

    def select(self, index: Tensor | slice) -> "Rollout":
        """Rows ``index`` of every per-sequence tensor."""
        kwargs = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kwargs[f.name] = v[index] if isinstance(v, Tensor) else v
        return Rollout(**kwargs)

    def to(self, device: torch.device | str) -> "Rollout":
        """Every tensor on ``device`` (the same object when they are all there already)."""
        device = torch.device(device)
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), Tensor) and getattr(self, f.name).device != device}
        return replace(self, **moved) if moved else self

    def with_(self, **changes) -> "Rollout":
        return replace(self, **changes)


def left_pad_prompts(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(prompt_ids_BP, prompt_mask_BP) of the Rollout layout: each prompt right-aligned in P = the longest prompt's
    length, ``pad_id`` and mask False before it."""
    B, P = len(prompts), max(len(p) for p in prompts)
    prompt_ids_BP = torch.full((B, P), int(pad_id), dtype=torch.long)
    prompt_mask_BP = torch.zeros((B, P), dtype=torch.bool)
    for b, p in enumerate(prompts):
        prompt_ids_BP[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask_BP[b, P - len(p):] = True
    return prompt_ids_BP, prompt_mask_BP
