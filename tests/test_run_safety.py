"""A run that meets a fatal error, a prompt too long for the context, or a signal while a step hangs: finished steps
are checkpointed, long prompts are screened at load, and the run stays interruptible. Runs use tiny-dense with a
few steps of 2 x 2 samples."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp.config import load_config
from dcmdp.loop import train
from dcmdp.policy import screen_task_prompts
from dcmdp.tracking import local_store_uri
from trainers.config import ModelConfig, TaskConfig
from trainers.models import build_model
from trainers.tasks import JsonlTask, RewardRangeError
from trainers.tokenizer import build_char_tokenizer

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


def _overrides(out, *extra: str) -> list[str]:
    return ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
            "algo.minibatches=1", "task.eval_size=4", "steps=3", "threads=1", "progress=false",
            "rollout.max_new_tokens=4", f"output_dir={out}", *extra]


def _runs(out: Path) -> list[str]:
    client = MlflowClient(local_store_uri(out))
    exp = client.get_experiment_by_name("dcmdp")
    return [r.info.status for r in client.search_runs(exp.experiment_id)]


def _jsonl_task(d: Path, prompts: list[str], reward: str) -> None:
    (d / "data.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    (d / "rewards.py").write_text(reward)


# Fine for the held-out evaluation (4 calls) and step 1 (4 calls), then out of range: a fatal error at step 2.
LATE_FAILURE = '''
calls = 0

def score(prompt, completion, example):
    global calls
    calls += 1
    return 0.0 if calls <= 8 else 7.0
'''


def test_a_fatal_error_after_a_finished_step_checkpoints_it_first(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _jsonl_task(tmp_path, [f"{i}+{i}=" for i in range(12)], LATE_FAILURE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(RewardRangeError, match="returned 7.0"):
        train(load_config(None, _overrides(out, "task.name=jsonl", "task.path=data.jsonl",
                                           "task.reward=rewards.py:score")))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert "RewardRangeError after step 1: checkpoint of step 1 written to" in caplog.text
    assert _runs(out) == ["FAILED"]


def _policy(task):
    """The task with the tiny-dense model (a context of 128 positions) and its character tokenizer."""
    tokenizer = build_char_tokenizer()
    model = build_model(ModelConfig(preset="tiny-dense"), len(tokenizer), seed=0)
    assert model.config.max_position_embeddings == 128
    return SimpleNamespace(task=task, tokenizer=tokenizer, model=model)


def test_training_and_held_out_prompts_too_long_for_the_context_are_skipped_at_load(tmp_path, monkeypatch, caplog):
    """A prompt of 150 characters (150 tokens) and one of 10 MB: both are skipped before the first step (the huge
    one by its length in characters, without tokenising it), counted in one warning per split."""
    prompts = [f"{i}+{i}=" for i in range(10)] + ["1" * 150, "2" * 10_000_000] + ["7+8=", "8" * 126]
    _jsonl_task(tmp_path, prompts, "def score(prompt, completion, example):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    task = JsonlTask(TaskConfig(name="jsonl", path="data.jsonl", eval_size=2, reward="rewards.py:score"), 0)
    with caplog.at_level(logging.WARNING):
        screen_task_prompts(_policy(task), max_new_tokens=4)
    assert len(task.train_set()) == 10 and all(len(ex.prompt) < 10 for ex in task.train_set())
    assert [ex.prompt for ex in task.eval_set()] == ["7+8="]
    assert "1 of 12 training prompts skipped: longer than" in caplog.text  # the 10 MB one, by characters
    assert ("1 of 12 training prompts skipped: with rollout.max_new_tokens=4 they need more than the model's "
            "context of 128 positions (the longest has 150 tokens)") in caplog.text
    assert "1 of 2 held-out prompts skipped: with rollout.max_new_tokens=4" in caplog.text


def test_a_split_with_no_prompt_that_fits_is_an_error_before_the_first_step(tmp_path, monkeypatch):
    _jsonl_task(tmp_path, ["1" * 200] * 4 + ["1+1="] * 2, "def score(prompt, completion, example):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    task = JsonlTask(TaskConfig(name="jsonl", path="data.jsonl", eval_size=2, reward="rewards.py:score"), 0)
    with pytest.raises(ValueError, match="every one of the 4 training prompts of task 'jsonl' is too long for the "
                                         "model's context of 128 positions"):
        screen_task_prompts(_policy(task), max_new_tokens=4)


HANG_AFTER_STEP_ONE = '''
import os, time
calls = 0

def score(prompt, completion, example):
    global calls
    calls += 1
    if calls == 9:
        open(os.environ["HANG_MARK"], "w").close()
    if calls > 8:
        while True:
            time.sleep(0.01)
    return 0.0
'''


def test_a_second_sigint_stops_a_run_whose_reward_hangs_with_a_checkpoint_and_a_killed_run(tmp_path):
    """The reward hangs at step 2 (timeout 600 s): a first SIGINT asks for a stop at the end of the step, which never
    comes; the second stops at once. Step 1 is checkpointed and the MLflow run ends KILLED."""
    _jsonl_task(tmp_path, [f"{i}+{i}=" for i in range(12)], HANG_AFTER_STEP_ONE)
    out, mark = tmp_path / "out", tmp_path / "hanging"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(OMP_NUM_THREADS="1", HANG_MARK=str(mark), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "train",
                             *_overrides(out, "task.name=jsonl", "task.path=data.jsonl",
                                         "task.reward=rewards.py:score", "task.reward_timeout=600")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not mark.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # the first one waits for the end of the step
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert _runs(out) == ["KILLED"]
