"""What every task is: ``Example`` (a prompt and its reference answer) and the ``Task`` protocol the trainer and
the commands call (``sample``, ``eval_set``, ``reward``, ``demonstration``). The tasks are registered in
trainers/tasks.py."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from trainers.config import TaskConfig


@dataclass(frozen=True)
class Example:
    # What the model is given (raw problem text; no chat template).
    prompt: str
    # Reference answer, as a canonical string.
    answer: str


class Task(Protocol):
    name: str
    cfg: TaskConfig

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        """``n`` training examples drawn with ``rng`` (never from the evaluation set)."""
        ...

    def eval_set(self) -> list[Example]:
        """The held-out examples: deterministic, disjoint from training."""
        ...

    def reward(self, completion: str, example: Example) -> float:
        """1.0 if ``completion`` answers ``example`` correctly, else 0.0 (task ``jsonl``: what the user's function
        returns). Callers score through ``score_completions``, which turns a failure into 0.0 and counts it."""
        ...

    def demonstration(self, example: Example) -> str:
        """Target completion for the supervised cold start (gets reward 1.0)."""
        ...
