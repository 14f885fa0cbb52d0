"""TRL side of benchmarks/trl_throughput.py: one GRPOTrainer run, per-step timings printed as JSON.

Runs inside ``.venv-trl`` as a subprocess of the benchmark; imports only ``trainers.config`` and
``trainers.tasks`` from the repository, so the reward is the dcmdp run's ``Task.reward``. Reads ``--spec``
(written by the benchmark), writes ``--out`` with ``prompts_seen`` and one record per optimizer step: ``end``,
``tokens`` and the ``time/*`` phases (generate, score, loss_forward, backward, optimizer) timed by wrappers
around GRPOTrainer's methods.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trainers.config import TaskConfig  # noqa: E402
from trainers.tasks import TASKS, Example  # noqa: E402


class StepTimer(TrainerCallback):
    """Per optimizer step: phase times from the method wrappers, completion tokens, and the end time."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict[str, float] = {}

    def add(self, key: str, seconds: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + seconds

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        rec = dict(self.current)
        rec["time/optimizer"] = now - rec.pop("_training_step_end", now)
        rec["end"] = now
        self.steps.append(rec)
        self.current = {}
        return control


def _timed(timer: StepTimer, key: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            timer.add(key, time.perf_counter() - t0)
    return wrapper


def instrument(trainer: GRPOTrainer, timer: StepTimer) -> None:
    """Timing wrappers on the trainer instance (the class is untouched); phases as in the module docstring."""
    trainer._generate = _timed(timer, "_generate", trainer._generate)
    trainer._generate_and_score_completions = _timed(timer, "_gen_and_score", trainer._generate_and_score_completions)
    trainer._prepare_inputs = _timed(timer, "_prepare_inputs", trainer._prepare_inputs)
    trainer.compute_loss = _timed(timer, "time/loss_forward", trainer.compute_loss)
    inner = _timed(timer, "_training_step", trainer.training_step)

    def training_step(*a, **kw):
        out = inner(*a, **kw)
        timer.current["_training_step_end"] = time.perf_counter()
        return out
    trainer.training_step = training_step


def finish_record(rec: dict) -> dict:
    """Turn the raw wrapper times of one step into disjoint phases."""
    gen, gen_score = rec.pop("_generate", 0.0), rec.pop("_gen_and_score", 0.0)
    prep, step = rec.pop("_prepare_inputs", 0.0), rec.pop("_training_step", 0.0)
    rec["time/generate"] = gen
    rec["time/score"] = gen_score - gen
    rec["time/backward"] = step - prep - rec.get("time/loss_forward", 0.0)
    rec["time/prepare_other"] = prep - gen_score
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    torch.set_num_threads(spec["threads"])
    transformers.set_seed(spec["seed"])

    task = TASKS[spec["task"]["name"]](TaskConfig(**spec["task"]), spec["seed"])
    G, P = spec["samples_per_prompt"], spec["prompts_per_step"]
    timer = StepTimer()
    tokens: list[int] = []
    prompts_seen: list[list[str]] = []

    def reward(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        # called once per step on the whole generation batch (P x G completions)
        tokens.append(sum(len(c) for c in completion_ids))
        prompts_seen.append(sorted(set(prompts)))
        return [task.reward(c, Example(p, a)) for c, p, a in zip(completions, prompts, answer)]

    reward.__name__ = f"{task.name}_reward"
    rows = spec["prompts"]
    dataset = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    # the same kernels the dcmdp side runs (trainers.models.ATTN_IMPLEMENTATION / EXPERTS_IMPLEMENTATION)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, local_files_only=True,
                                                 attn_implementation="sdpa")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("grouped_mm")

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
            use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=spec["seed"],
            max_steps=spec["steps"], per_device_train_batch_size=P * G, gradient_accumulation_steps=1,
            steps_per_generation=1, num_iterations=1, num_generations=G, shuffle_dataset=False,
            max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"], top_p=1.0, top_k=0,
            beta=0.0, loss_type="dapo", epsilon=spec["clip_low"], epsilon_high=spec["clip_high"],
            scale_rewards="group" if spec["std_normalize"] else "none",
            learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
            adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], weight_decay=spec["weight_decay"],
            max_grad_norm=spec["grad_clip"] if spec["grad_clip"] > 0 else 0.0,
            use_vllm=False, log_completions=False, remove_unused_columns=False, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        instrument(trainer, timer)
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0

    steps = [finish_record(r) for r in timer.steps]
    for rec, n in zip(steps, tokens):
        rec["tokens"] = n
    result = {"steps": steps, "wall": wall, "prompts_seen": prompts_seen,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "trl": trl.__version__, "python": sys.version.split()[0]},
              "threads": torch.get_num_threads()}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
