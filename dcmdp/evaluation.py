"""Held-out accuracy of a checkpoint: ``dcmdp eval CONFIG [key=value ...] --checkpoint PATH|auto``.

The checkpoint's weights are loaded into a model built from the config, written to a temporary Hugging
Face directory (engines that load from disk, vLLM, read it), and scored by ``dcmdp.loop.evaluate``: the
same eval prompts, rollout engine settings and sampling seed as the evaluation at the end of training,
so the checkpoint written at the end of a run reproduces that run's final held-out accuracy. Nothing is
logged to MLflow.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
from dcmdp.config import RunConfig


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
    path = find_resume_checkpoint(Path(cfg.output_dir) / "checkpoints", checkpoint)
    if path is None:
        raise FileNotFoundError(f"no valid checkpoint in {Path(cfg.output_dir) / 'checkpoints'} (--checkpoint auto); "
                                f"pass the run's output_dir=... or a checkpoint path")
    return path


def evaluate_checkpoint(cfg: RunConfig, checkpoint: str = "auto") -> EvalResult:
    from dcmdp.loop import _seed_everything, evaluate
    from trainers.engines import build_engine
    from trainers.models import PRESETS, build_model, save_model_dir
    from trainers.tasks import TASKS
    from trainers.tokenizer import build_char_tokenizer, load_tokenizer

    path = resolve_checkpoint(cfg, checkpoint)
    state = load_checkpoint(path)
    _seed_everything(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if cfg.model.path:
        tokenizer = load_tokenizer(cfg.model.path)
    elif PRESETS[cfg.model.preset].needs_path:
        raise FileNotFoundError(f"model.preset={cfg.model.preset!r} needs model.path (its tokenizer and config)")
    else:
        tokenizer = build_char_tokenizer()
    task = TASKS[cfg.task.name](cfg.task, cfg.seed)
    model = build_model(cfg.model, len(tokenizer), seed=cfg.seed)
    model.load_state_dict(state["model"])
    model.eval()
    with tempfile.TemporaryDirectory(prefix="dcmdp_eval_") as tmp:
        save_model_dir(model, tokenizer, Path(tmp) / "model")
        engine = build_engine(cfg.rollout, model, str(Path(tmp) / "model"), eos_id=tokenizer.eos_token_id,
                              pad_id=tokenizer.pad_token_id)
        try:
            engine.load_weights(model.state_dict(), version=int(state["engine_version"]))
            # evaluate() reads only these fields of a training Setup
            s = SimpleNamespace(cfg=cfg, tokenizer=tokenizer, task=task, model=model, engine=engine, worker=None,
                                eval_examples=None)
            accuracy = evaluate(s, seed=cfg.seed)  # type: ignore[arg-type]
        finally:
            engine.close()
    return EvalResult(accuracy, len(task.eval_set()), str(path), int(state["step"]))
