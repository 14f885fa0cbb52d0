"""``dcmdp eval`` scores a checkpoint with the end-of-training evaluation: the checkpoint written at the end
of a real run reproduces that run's final held-out accuracy exactly (same prompts, engine and seed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcmdp.config import load_config
from dcmdp.evaluation import evaluate_checkpoint


def _overrides(out, cache) -> list[str]:
    return ["model.preset=tiny-moe", "rollout.precision=int8", "cold_start.steps=20", f"cold_start.cache_dir={cache}",
            "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "task.eval_size=32", "steps=3", "threads=1",
            "progress=false", f"output_dir={out}"]


def test_eval_of_the_final_checkpoint_reproduces_the_final_accuracy(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "dcmdp.cli", "train", *_overrides(out, cache)], check=True, env=env,
                   timeout=300, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())

    result = evaluate_checkpoint(load_config(None, _overrides(out, cache)), "auto")
    assert result.step == 3 and result.prompts == 32
    assert result.accuracy == summary["accuracy_after"]

    cli = subprocess.run([sys.executable, "-m", "dcmdp.cli", "eval", *_overrides(out, cache), "--checkpoint",
                          "auto"], env=env, timeout=300, capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert f"held-out accuracy: {summary['accuracy_after']:.1%} on 32 prompts" in cli.stdout
    # an evaluation reads the checkpoint, it does not resume a run; and the torch engine needs no model on disk
    assert f"evaluating {result.checkpoint}" in cli.stderr and "resuming" not in cli.stderr
    assert "Writing model shards" not in cli.stderr


def test_eval_without_a_checkpoint_is_a_clear_error(tmp_path):
    cfg = load_config(None, _overrides(tmp_path / "empty", tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="no valid checkpoint"):
        evaluate_checkpoint(cfg, "auto")


def test_eval_of_a_checkpoint_path_that_does_not_exist_exits_2_naming_the_option(tmp_path):
    # this tree's code in the subprocess; exit 2 before torch loads (1 is for a checkpoint that fails to load)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dcmdp.cli", "eval", f"output_dir={tmp_path}", "--checkpoint",
                           str(tmp_path / "nope")], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 2 and f"--checkpoint {tmp_path / 'nope'} does not exist" in proc.stderr, proc.stderr
    assert "resume checkpoint" not in proc.stderr
