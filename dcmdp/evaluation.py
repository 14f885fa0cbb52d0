"""Held-out accuracy of a checkpoint: ``dcmdp eval CONFIG [key=value ...] --checkpoint PATH|auto``.

The checkpoint's weights are loaded into a model built from the config (``dcmdp.policy.build_policy``, which
writes it to a temporary Hugging Face directory for the engines that load from disk, vLLM), and scored by
``dcmdp.policy.held_out_accuracy``: the same eval prompts, rollout engine settings and sampling seed as the
evaluation at the end of training, so the checkpoint written at the end of a run reproduces that run's final
held-out accuracy. Nothing is logged to MLflow.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
from dcmdp.config import ConfigError, RunConfig, resume_conflicts
from dcmdp.cpu import apply_threads


@dataclass
class EvalResult:
    accuracy: float
    prompts: int
    checkpoint: str
    step: int

    def line(self) -> str:
        return (f"held-out accuracy: {self.accuracy:.1%} on {self.prompts} prompts, checkpoint {self.checkpoint} "
                f"(step {self.step})")


def resolve_checkpoint(cfg: RunConfig, checkpoint: str) -> Path:
    """``auto``: the newest valid checkpoint in ``<output_dir>/checkpoints``; else the given directory."""
    path = find_resume_checkpoint(Path(cfg.output_dir) / "checkpoints", checkpoint, purpose="evaluating")
    if path is None:
        raise FileNotFoundError(f"no valid checkpoint in {Path(cfg.output_dir) / 'checkpoints'} (--checkpoint auto); "
                                f"pass the run's output_dir=... or a checkpoint path")
    return path


def evaluate_checkpoint(cfg: RunConfig, checkpoint: str = "auto") -> EvalResult:
    from dcmdp.device import local_rank, resolve_device
    from dcmdp.distributed import Dist
    from dcmdp.policy import build_policy, held_out_accuracy, held_out_examples, seed_everything

    path = resolve_checkpoint(cfg, checkpoint)
    state = load_checkpoint(path)
    # the model the checkpoint's weights need, named before a model is built (a mismatch would end in a raw
    # load_state_dict traceback listing hundreds of keys)
    model_conflicts = [c for c in resume_conflicts(state.get("config") or {}, cfg) if c.startswith("model.")]
    if model_conflicts:
        raise ConfigError(f"checkpoint {path} holds weights of another model than the config's: "
                          f"{'; '.join(model_conflicts)}; evaluate it with the checkpoint's values (e.g. the run's "
                          f"config.yaml)")
    if "model" not in state:
        raise ConfigError(f"checkpoint {path} holds sharded weights (a torchrun run): evaluate it under torchrun with "
                          f"the same world size")
    seed_everything(cfg.seed)
    logging.getLogger("dcmdp").info("%s", apply_threads(cfg.threads))
    device, why = resolve_device(cfg.device, local_rank())
    logging.getLogger("dcmdp").info("evaluating on %s", why)
    with tempfile.TemporaryDirectory(prefix="dcmdp_eval_") as tmp:
        policy = build_policy(cfg, Path(tmp), d=Dist(device=device), weights=state["model"])
        try:
            policy.engine.load_weights(policy.model.state_dict(), version=int(state["engine_version"]))
            accuracy = held_out_accuracy(policy, held_out_examples(policy), cfg.rollout.max_new_tokens, cfg.seed)
        finally:
            policy.engine.close()
    return EvalResult(accuracy, len(policy.task.eval_set()), str(path), int(state["step"]))
