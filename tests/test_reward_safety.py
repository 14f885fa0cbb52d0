"""A user's reward function that hangs (even swallowing every exception), edits its example, returns numpy scalars or
out-of-range numbers, exits, kills its process or leaves a helper running: each is bounded, isolated, accepted or
named, and never hangs or silently ends a run. It runs in a worker process (trainers.reward_worker). No training
here."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dcmdp.tracking import local_store_uri
from trainers import tasks
from trainers.config import TaskConfig
from trainers.reward_fn import load_reward
from trainers.reward_worker import RewardWorker
from trainers.tasks import JsonlTask, RewardRangeError, score_completions

REWARDS = '''
import sys, time
import numpy as np

def hang(prompt, completion, example):
    while True:
        pass

def sleepy(prompt, completion, example):
    time.sleep(1000)

def stubborn(prompt, completion, example):
    while True:
        try:
            time.sleep(1000)
        except Exception:
            pass

def swallows(prompt, completion, example):
    while True:  # a retry loop around its work that catches everything, KeyboardInterrupt and SystemExit too
        try:
            time.sleep(1000)
        except:
            pass

def mutate(prompt, completion, example):
    example["meta"]["seen"].append(completion)
    example["answer"] = "changed"
    return float(len(example["meta"]["seen"]) == 1)

def np_bool(prompt, completion, example):
    return np.bool_(completion == "7")

def np_float(prompt, completion, example):
    return np.float32(0.5)

def seven(prompt, completion, example):
    return 7.0

def huge(prompt, completion, example):
    return 1e39

def negative(prompt, completion, example):
    return -0.5

def leaves(prompt, completion, example):
    sys.exit(3)
'''


def _task(tmp_path: Path, monkeypatch, fn: str, timeout: float = 30.0) -> JsonlTask:
    records = [{"prompt": f"{i}+3=", "answer": i + 3, "meta": {"seen": []}} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tasks, "_TRACEBACK_SHOWN", set())
    return JsonlTask(TaskConfig(name="jsonl", path="data.jsonl", eval_size=2, reward=f"rewards.py:{fn}",
                                reward_timeout=timeout), 0)


@pytest.mark.parametrize("fn", ["hang", "sleepy", "stubborn", "swallows"])
def test_a_reward_that_never_returns_times_out_and_counts_as_an_error(tmp_path, monkeypatch, caplog, fn):
    """A busy loop, a sleep, a loop that swallows every Exception and one whose bare except swallows everything: each
    call stops after task.reward_timeout (its worker killed), and after three timeouts in a row the rest of the batch
    is not called, so a hung reward costs 3 timeouts; the next batch starts a fresh worker and is scored again."""
    task = _task(tmp_path, monkeypatch, fn, timeout=0.5)
    examples = task.eval_set() * 4
    with caplog.at_level(logging.WARNING):
        rewards, errors = score_completions(task, ["7"] * len(examples), examples)
    # three timeouts, each killing the worker, and the next call starting another: three workers for eight samples
    assert task._worker.starts == tasks.MAX_TIMEOUTS_IN_A_ROW == 3
    assert rewards == [0.0] * 8 and errors == 8
    assert ("(first: timed out after 0.5 s (task.reward_timeout; its worker process was killed) on prompt"
            in caplog.records[-1].getMessage())
    assert task._worker._proc is None  # killed, not left spinning
    task.close()


def test_a_worker_that_hung_is_replaced_and_the_next_call_is_scored(tmp_path, monkeypatch):
    task = _task(tmp_path, monkeypatch, "np_float", timeout=0.5)
    ex = task.eval_set()[0]
    assert score_completions(task, ["7"], [ex]) == ([0.5], 0)
    first = task._worker._proc.pid
    task._worker.close()  # as a timeout does
    assert score_completions(task, ["7"], [ex]) == ([0.5], 0)
    assert task._worker._proc.pid != first and task._worker.starts == 2
    task.close()


def test_reward_timeout_is_a_checked_config_key():
    from dcmdp.config import ConfigError, load_config

    for bad in ("0", "-1", "inf"):
        with pytest.raises(ConfigError, match="task.reward_timeout"):
            load_config(None, [f"task.reward_timeout={bad}"])


def test_a_reward_that_edits_a_nested_value_of_its_example_changes_nothing(tmp_path, monkeypatch):
    task = _task(tmp_path, monkeypatch, "mutate")
    ex = task.eval_set()[0]
    for _ in range(3):  # each call sees the record as it is in the file
        assert score_completions(task, ["7"], [ex]) == ([1.0], 0)
    assert ex.record["meta"] == {"seen": []} and ex.record["answer"] != "changed"


def test_numpy_scalars_are_numbers(tmp_path, monkeypatch):
    task = _task(tmp_path, monkeypatch, "np_bool")
    ex = task.eval_set()
    assert score_completions(task, ["7", "x"], ex) == ([1.0, 0.0], 0)
    task = _task(tmp_path, monkeypatch, "np_float")
    assert score_completions(task, ["7"], ex[:1]) == ([0.5], 0)


@pytest.mark.parametrize("fn, shown", [("seven", "7.0"), ("huge", "1e+39"), ("negative", "-0.5")])
def test_a_reward_outside_0_1_is_an_error_naming_the_function_and_the_example(tmp_path, monkeypatch, fn, shown):
    task = _task(tmp_path, monkeypatch, fn)
    ex = task.eval_set()[0]
    with pytest.raises(RewardRangeError) as err:
        score_completions(task, ["7"], [ex])
    msg = str(err.value)
    assert f"reward rewards.py:{fn} returned {shown} for the example at {ex.source}" in msg
    assert "data.jsonl:" in msg and "must lie in [0, 1]" in msg


def test_a_reward_that_calls_sys_exit_is_reported_as_such(tmp_path, monkeypatch, caplog):
    task = _task(tmp_path, monkeypatch, "leaves")
    with caplog.at_level(logging.WARNING):
        assert score_completions(task, ["7", "7"], task.eval_set()) == ([0.0, 0.0], 2)
    assert "(first: exited (sys.exit(3)): a reward must return a number" in caplog.records[-1].getMessage()
    task.close()


MORE_REWARDS = '''
import decimal, os, signal

async def coro(prompt, completion, example):
    return 1.0

def gen(prompt, completion, example):
    yield 1.0

def exact(prompt, completion, example):
    return decimal.Decimal("0.25")

def wanders(prompt, completion, example):
    here = os.path.exists("data.jsonl")  # each call starts in the trainer's directory
    os.chdir("/")
    return 1.0 if here else 0.0

def dies(prompt, completion, example):
    os.kill(os.getpid(), signal.SIGKILL)

def helper(prompt, completion, example):
    import subprocess, sys
    # a helper that outlives the call and keeps every descriptor the worker has
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
    return 1.0

def raises(prompt, completion, example):
    raise KeyError("no such field")

def deafens(prompt, completion, example):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 1.0
'''


@pytest.mark.parametrize("fn, why", [("coro", "is an async function"), ("gen", "is a generator function")])
def test_an_async_or_generator_reward_is_a_config_error(tmp_path, monkeypatch, fn, why):
    (tmp_path / "more.py").write_text(MORE_REWARDS)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"config error at 'task.reward': 'more.py:{fn}': '{fn}' {why}"):
        load_reward(f"more.py:{fn}")


def _more(tmp_path, monkeypatch, fn):
    task = _task(tmp_path, monkeypatch, "np_float")
    (tmp_path / "more.py").write_text(MORE_REWARDS)
    task.close()
    task.reward_name = f"more.py:{fn}"
    task._worker = RewardWorker(f"more.py:{fn}", task.cfg.reward_timeout)
    return task


def test_a_decimal_reward_is_a_number(tmp_path, monkeypatch):
    task = _more(tmp_path, monkeypatch, "exact")
    assert score_completions(task, ["7"], task.eval_set()[:1]) == ([0.25], 0)


def test_a_reward_that_changes_the_working_directory_or_the_signal_handlers_changes_nothing_in_the_trainer(
        tmp_path, monkeypatch):
    """A reward that chdirs would move every relative path of the run (checkpoints, outputs); one that ignores
    SIGINT / SIGTERM would make the run deaf. Both act in the worker only; each call starts in the trainer's
    directory."""
    task = _more(tmp_path, monkeypatch, "wanders")
    assert score_completions(task, ["7", "7"], task.eval_set()) == ([1.0, 1.0], 0)
    assert Path.cwd() == tmp_path
    task.close()
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    task = _more(tmp_path, monkeypatch, "deafens")
    assert score_completions(task, ["7", "7"], task.eval_set()) == ([1.0, 1.0], 0)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    task.close()


def test_a_reward_that_kills_its_process_is_counted_and_the_next_call_gets_a_new_worker(tmp_path, monkeypatch,
                                                                                         caplog):
    task = _more(tmp_path, monkeypatch, "dies")
    with caplog.at_level(logging.WARNING):
        assert score_completions(task, ["7", "7"], task.eval_set()) == ([0.0, 0.0], 2)
    assert "(first: ended its worker process (killed by SIGKILL) on prompt" in caplog.records[-1].getMessage()
    assert task._worker.starts == 2
    task.close()


def test_a_raising_reward_shows_its_own_traceback(tmp_path, monkeypatch, caplog):
    task = _more(tmp_path, monkeypatch, "raises")
    with caplog.at_level(logging.WARNING):
        assert score_completions(task, ["7"], task.eval_set()[:1]) == ([0.0], 1)
    assert "(first: raised KeyError: 'no such field' on prompt" in caplog.records[-1].getMessage()
    # the traceback, from the worker
    assert 'more.py", line' in caplog.text and "in raises" in caplog.text and "reward's worker process" in caplog.text
    task.close()


def test_a_helper_the_reward_leaves_running_is_ended_with_its_worker(tmp_path, monkeypatch):
    """A helper process that keeps the worker's pipes open must neither block the trainer nor outlive the task."""
    task = _more(tmp_path, monkeypatch, "helper")
    assert score_completions(task, ["7"], task.eval_set()[:1]) == ([1.0], 0)
    pgid = task._worker._proc.pid
    task.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the reward's helper outlived its worker")


SWALLOWER = '''
import os, time

def score(prompt, completion, example):
    if os.path.exists(os.path.join(os.path.dirname(__file__), "hang")):
        while True:  # a retry loop that swallows everything, the timeout's and Ctrl-C's exceptions included
            try:
                time.sleep(1000)
            except:
                pass
    return 1.0 if completion.strip() == str(example.get("answer")) else 0.0
'''


def _jsonl_run(tmp_path: Path, fn: str, *extra: str) -> list[str]:
    records = [{"prompt": f"{i % 10}+{i // 10}=", "answer": i % 10 + i // 10} for i in range(40)]
    (tmp_path / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "swallow.py").write_text(SWALLOWER)
    return ["model.preset=tiny-dense", "task.name=jsonl", f"task.path={tmp_path / 'sums.jsonl'}", "task.eval_size=2",
            f"task.reward={tmp_path / 'swallow.py'}:{fn}", "cold_start.steps=0", "algo.prompts_per_step=2",
            "algo.samples_per_prompt=2", "rollout.max_new_tokens=3", "threads=1", "progress=false", "log_every=1",
            f"output_dir={tmp_path / 'out'}", *extra]


def _reward_workers(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_a_second_sigint_stops_a_run_whose_reward_swallows_every_exception(tmp_path):
    """The reward hangs in a loop whose bare except swallows everything. A first SIGINT asks for a stop after the step
    (which never ends), the second stops the wait on the worker: the worker is killed, the run exits 130 with the
    checkpoint of its last finished step and its MLflow run KILLED."""
    from mlflow.tracking import MlflowClient

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "OMP_NUM_THREADS": "1"}
    argv = _jsonl_run(tmp_path, "score", "steps=50", "checkpoint.every=1", "task.reward_timeout=600")
    proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "train", *argv], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "step 1/50" in line:
            (tmp_path / "hang").touch()
            break
    time.sleep(3.0)  # the next reward call is in its loop by now
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        _, rest = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("dcmdp train did not stop within 120 s of the second SIGINT")
    err = "".join(lines) + rest
    assert proc.returncode == 130, err[-3000:]
    out = tmp_path / "out"
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps and steps[-1] >= "step_00000001", steps
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert MlflowClient(local_store_uri(out)).get_run(run_id).info.status == "KILLED"
    assert _reward_workers(str(tmp_path / "swallow.py")) == []  # the worker did not outlive the run


LOCK_THEN_FORK = '''
import os, sys, time
from dcmdp.checkpoint import RunFolderLock
lock = RunFolderLock(sys.argv[1]).acquire()
if os.fork() == 0:  # a helper forked without exec, as a reward's library might: it outlives the run
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1), os.dup2(devnull, 2)
    time.sleep(30)
    os._exit(0)
print("locked", flush=True)
'''

LOCK_THEN_HAND_OVER = '''
import os, subprocess, sys
from dcmdp.checkpoint import RunFolderLock
lock = RunFolderLock(sys.argv[1]).acquire()
# a child given the lock's descriptor on purpose: it holds the lock after this process ends
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "tracking.uri=http://u:pw-4711@h"],
                         pass_fds=(lock._fh.fileno(),),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
'''


def test_a_forked_child_that_outlives_the_run_does_not_hold_the_run_lock(tmp_path):
    from dcmdp.checkpoint import RunFolderLock, lock_holders

    done = subprocess.run([sys.executable, "-c", LOCK_THEN_FORK, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "locked", done.stderr
    # the run is gone, its forked helper sleeps on: the folder is free, and no process holds the file
    assert lock_holders(tmp_path / "run.lock") == []
    RunFolderLock(tmp_path).acquire().release()


def test_a_lock_held_after_its_run_ended_names_the_live_holder_not_the_dead_pid(tmp_path):
    from dcmdp.checkpoint import RunFolderError, RunFolderLock

    done = subprocess.run([sys.executable, "-c", LOCK_THEN_HAND_OVER, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    holder = int(done.stdout.strip())
    try:
        dead = int((tmp_path / "run.lock").read_text().split()[1])
        with pytest.raises(RunFolderError) as err:
            RunFolderLock(tmp_path).acquire()
        msg = str(err.value)
        assert f"run pid {dead} has ended, but pid {holder} (" in msg and "still holds" in msg, msg
        assert "pw-4711" not in msg and "values not recorded: tracking.uri" in msg  # no override's value
    finally:
        os.kill(holder, signal.SIGKILL)
