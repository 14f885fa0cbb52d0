"""Kill -9 a real training process mid-run, resume it, and compare with an uninterrupted run.

Every per-step metric after the resume equals the uninterrupted run's bitwise (CPU, one thread, fixed
seeds; per-step randomness is derived from (seed, step), and model, optimiser, dual state and RNG states
come back from the checkpoint). Wall-clock timings are the only metrics left out.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint

STEPS = 30


def _args(out: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dcmdp.cli", "train", "model.preset=tiny-moe", "rollout.precision=int8",
            "cold_start.steps=5", f"cold_start.cache_dir={cache}", "algo.prompts_per_step=4",
            "algo.samples_per_prompt=2", "algo.minibatches=2", "task.eval_size=8", f"steps={STEPS}",
            "checkpoint.every=2", "checkpoint.keep=2", "threads=1", "progress=false", f"output_dir={out}", *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _history(out: Path) -> list[dict]:
    state = load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))
    assert state["step"] == STEPS
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))} for h in state["history"]]


@pytest.mark.slow  # kill -9 and resume also runs by default in test_run_folder.py
def test_kill9_and_resume_matches_uninterrupted_run(tmp_path):
    cache = tmp_path / "cache"
    ref = tmp_path / "ref"
    subprocess.run(_args(ref, cache), check=True, env=_env(), timeout=300, capture_output=True)

    run = tmp_path / "run"
    proc = subprocess.Popen(_args(run, cache), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step_00000006").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed_at = load_checkpoint(find_resume_checkpoint(run / "checkpoints", "auto"))["step"]
    assert 6 <= killed_at < STEPS

    done = subprocess.run(_args(run, cache, "checkpoint.resume=auto"), env=_env(), timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step {killed_at}" in done.stderr
    assert f"first step after resume (step {killed_at + 1}): discrepancy/" in done.stderr
    ref_hist, run_hist = _history(ref), _history(run)
    assert len(run_hist) == len(ref_hist) == STEPS
    for step, (a, b) in enumerate(zip(ref_hist, run_hist), start=1):
        assert a == b, f"step {step} differs after resuming at step {killed_at}"


def test_resume_from_missing_path_is_a_clear_error(tmp_path):
    out = subprocess.run(_args(tmp_path / "x", tmp_path / "cache", f"checkpoint.resume={tmp_path}/nope"),
                         env=_env(), timeout=300, capture_output=True, text=True)
    assert out.returncode != 0
    assert "nope" in out.stderr
