"""Asynchronous rollouts (dcmdp.async_rollout): the staleness bound, exact reproduction of the synchronous run
at max_staleness=0, bitwise resume, clean stops on SIGTERM, and a longer run that trains (slow).

Runs are tiny-moe with int8 rollouts (a real training-inference discrepancy), one torch thread, fixed seeds:
everything but wall-clock timings is then deterministic, so comparisons are exact (==), no tolerance.
"""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dcmdp.async_rollout import behaviour_version, screen_stale
from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
from dcmdp.config import ConfigError, load_config
from dcmdp.loop import train

REPO = Path(__file__).parents[1]


def _overrides(out: Path, cache: Path, steps: int, *extra: str) -> list[str]:
    return ["model.preset=tiny-moe", "rollout.precision=int8", "cold_start.steps=5", f"cold_start.cache_dir={cache}",
            "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "algo.minibatches=2", "task.eval_size=8",
            f"steps={steps}", "threads=1", "progress=false", f"output_dir={out}", *extra]


def _history(out: Path) -> list[dict]:
    return load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))["history"]


def _run(out: Path, cache: Path, steps: int, *extra: str) -> list[dict]:
    torch.set_num_threads(1)
    train(load_config(None, _overrides(out, cache, steps, *extra)))
    return _history(out)


def _drop(history: list[dict], *prefixes: str) -> list[dict]:
    """The history without wall-clock metrics (and any other ``prefixes``)."""
    skip = ("time/", "throughput/", *prefixes)
    return [{k: v for k, v in h.items() if not k.startswith(skip)} for h in history]


def test_config_checks_raise_with_the_key():
    with pytest.raises(ConfigError, match=r"async_rollout\.max_staleness.*>= 0"):
        load_config(None, ["async_rollout.enabled=true", "async_rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match=r"async_rollout\.max_staleness.*async_rollout\.enabled=true"):
        load_config(None, ["async_rollout.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"async_rollout\.threads"):
        load_config(None, ["async_rollout.enabled=true", "async_rollout.threads=-2"])
    with pytest.raises(ConfigError, match=r"async_rollout\.enabled.*torch engine"):
        load_config(None, ["async_rollout.enabled=true", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"did you mean 'max_staleness'"):
        load_config(None, ["async_rollout.max_stalenes=1"])
    assert load_config(None, []).async_rollout.enabled is False


def test_behaviour_version_and_stale_screen_by_hand():
    # v(k) = max(k0, k - s): from a start at 4 with s = 2, steps 4..8 sample with versions 4, 4, 4, 5, 6
    assert [behaviour_version(k, 4, 2) for k in range(4, 9)] == [4, 4, 4, 5, 6]
    assert [behaviour_version(k, 0, 0) for k in range(3)] == [0, 1, 2]
    # trainer at step 10, bound 2: staleness 0, 2, 3, 5 -> mean 2.5, max 5, two samples dropped
    keep_B, metrics = screen_stale(torch.tensor([10, 8, 7, 5]), step=10, max_staleness=2)
    assert keep_B.tolist() == [True, True, False, False]
    assert metrics == {"async/staleness_mean": 2.5, "async/staleness_max": 5.0, "async/dropped": 2.0}
    with pytest.raises(ValueError, match="newer than the trainer"):
        screen_stale(torch.tensor([10, 11]), step=10, max_staleness=2)
    with pytest.raises(ValueError, match="version_B"):
        screen_stale(None, step=10, max_staleness=2)


def test_staleness_zero_reproduces_the_synchronous_run_exactly(tmp_path):
    """The worker at max_staleness=0, with held-out evals and checkpoints (drains) mid-run, and R3 replay."""
    cache = tmp_path / "cache"
    extra = ("eval_every=3", "checkpoint.every=4", "algo.routing_replay=r3")
    sync = _run(tmp_path / "sync", cache, 9, *extra)
    worker = _run(tmp_path / "async0", cache, 9, *extra, "async_rollout.enabled=true")
    assert len(sync) == len(worker) == 9
    assert not any(k.startswith("async/") for k in sync[0])
    for step, (a, b) in enumerate(zip(_drop(sync), _drop(worker, "async/")), start=1):
        assert a == b, f"step {step} differs from the synchronous run"
    assert [h["eval/accuracy"] for h in sync if "eval/accuracy" in h] == \
           [h["eval/accuracy"] for h in worker if "eval/accuracy" in h]
    assert all(h["async/staleness_max"] == 0 and h["async/dropped"] == 0 for h in worker)


def test_staleness_two_is_bounded_resumes_exactly_and_evaluation_does_not_perturb_it(tmp_path):
    cache = tmp_path / "cache"
    on = ("async_rollout.enabled=true", "async_rollout.max_staleness=2", "checkpoint.every=4")
    full = _run(tmp_path / "full", cache, 10, *on)
    staleness = [h["async/staleness_max"] for h in full]
    # every consumed sample is at most 2 versions old; the schedule restarts at each checkpoint (4, 8)
    assert all(s <= 2 for s in staleness) and all(h["async/dropped"] == 0 for h in full)
    assert staleness == [0, 1, 2, 2, 0, 1, 2, 2, 0, 1]
    assert all(h["async/staleness_mean"] == h["async/staleness_max"] for h in full)
    # the run trains on stale samples: losses finite, the policy moved (clip and IS statistics are live)
    assert all(torch.isfinite(torch.tensor(h["loss/total"])) for h in full)
    assert any(h["guard/skipped_updates"] == 0 for h in full)

    # stop at a checkpoint (step 8) and resume: the continuation is the uninterrupted run, bitwise
    part = tmp_path / "part"
    _run(part, cache, 8, *on)
    resumed = _run(part, cache, 10, *on, "checkpoint.resume=auto")
    assert _drop(resumed) == _drop(full)

    # held-out evaluations between the worker's batches leave the training trajectory untouched
    evaluated = _run(tmp_path / "eval", cache, 10, *on, "eval_every=1", "async_rollout.threads=1")
    assert sum("eval/accuracy" in h for h in evaluated) == 9
    assert _drop(evaluated, "eval/") == _drop(full, "eval/")


def test_automatic_tolerance_takes_its_floor_only_from_batches_of_the_current_weights(tmp_path):
    """A stale batch's pi_old vs mu holds the policy's drift since its weights: only the fresh batches (staleness
    0: the first, and the first after each checkpoint's drain) move the floor F behind c = F (1 + s)."""
    slack, ema = 1.0, 0.5
    constraint = (f"dual.constraints=[{{measure: abs_prob_diff, tolerance: 0.005, floor_slack: {slack}, "
                  f"floor_ema: {ema}}}]")
    h = _run(tmp_path / "run", tmp_path / "cache", 10, "async_rollout.enabled=true", "async_rollout.max_staleness=2",
             "checkpoint.every=4", constraint, "dual.measure_at=rollout")
    staleness = [x["async/staleness_max"] for x in h]
    assert staleness == [0, 1, 2, 2, 0, 1, 2, 2, 0, 1]
    c = [x["dual/tolerance/abs_prob_diff"] for x in h]
    d = [x["dual/measured/abs_prob_diff"] for x in h]  # pi_old vs mu (measure_at=rollout): the floor measurement
    assert all(math.isfinite(v) and v > 0 for v in d)
    # reference in float64: F follows only the fresh batches; c of batch k is the floor after batch k-1
    floor, expected = None, []
    for k in range(len(h)):
        expected.append((1 + slack) * (d[0] if floor is None else floor))
        if staleness[k] == 0:
            floor = d[k] if floor is None else ema * floor + (1 - ema) * d[k]
    assert c == pytest.approx(expected, rel=1e-9)
    # the stale batches measured more than the floor (the drift), and left c where it was
    assert c[2] == c[3] == c[4] and c[6] == c[7] == c[8]
    assert c[5] != c[4] and c[9] != c[8]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run exited with {proc.returncode} before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


def test_sigterm_stops_an_async_run_with_a_checkpoint_and_it_resumes(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = [sys.executable, "-m", "dcmdp.cli", "train",
            *_overrides(out, cache, 14, "async_rollout.enabled=true", "async_rollout.max_staleness=2",
                        "checkpoint.every=2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out / "checkpoints" / "step_00000004", proc, 240)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM received: checkpoint written at step" in err
    stopped_at = load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))["step"]
    assert 4 <= stopped_at < 14

    done = subprocess.run([*args, "checkpoint.resume=auto"], env=env, cwd=REPO, timeout=300, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step {stopped_at}" in done.stderr
    history = _history(out)
    assert len(history) == 14 and all(h["async/staleness_max"] <= 2 for h in history)


@pytest.mark.slow
def test_async_run_with_staleness_two_trains_on_the_default_task(tmp_path):
    """The default config (tiny-moe, int8 rollouts, 2-digit addition, its cold start to 30% sampled accuracy)
    with max_staleness=2 trains: the batches' accuracy rises. (A fixed 950-step cold start, in the task's sharp
    transition, stopped giving RL signal when the kernels changed: 10.8% -> 11.1%.)

    The dual controller is off: its measure pi_old / mu includes two versions of policy drift here (mean
    abs_prob_diff ~0.03 against ~0.002 synchronously), so with the default tolerance 0.005 lambda climbs
    to ~6 in 200 steps and the penalty holds the policy at the stale behaviour policy (measured: held-out
    12.9% -> 9.4%, against 12.9% -> 14.8% for the synchronous run, with the former fixed tolerance). Measured
    with the dual off: batch accuracy 38.7% over the first 20 steps -> 54.5% over the last 50.
    """
    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "default.yaml", [
        f"cold_start.cache_dir={tmp_path / 'cache'}", "steps=200", "threads=1",
        "progress=false", f"output_dir={tmp_path / 'run'}", "async_rollout.enabled=true",
        "async_rollout.max_staleness=2", "dual.rule=off"])
    train(cfg)
    history = _history(tmp_path / "run")
    assert max(h["async/staleness_max"] for h in history) == 2
    first = sum(h["reward/accuracy"] for h in history[:20]) / 20
    last = sum(h["reward/accuracy"] for h in history[-50:]) / 50
    assert last > first + 0.05, (first, last)
