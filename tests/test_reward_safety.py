"""A user's reward function that hangs, edits its example, returns numpy scalars or out-of-range numbers, or exits:
each is bounded, isolated, accepted or named, and never hangs or silently ends a run. No training here."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from trainers import tasks
from trainers.config import TaskConfig
from trainers.tasks import JsonlTask, RewardRangeError, call_with_timeout, score_completions

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


@pytest.mark.parametrize("fn", ["hang", "sleepy", "stubborn"])
def test_a_reward_that_never_returns_times_out_and_counts_as_an_error(tmp_path, monkeypatch, caplog, fn):
    """A busy loop, a sleep, and a loop that swallows every Exception: each call stops after task.reward_timeout,
    and after three timeouts in a row the rest of the batch is not called, so a hung reward costs 3 timeouts."""
    task = _task(tmp_path, monkeypatch, fn, timeout=0.2)
    examples = task.eval_set() * 4
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        rewards, errors = score_completions(task, ["7"] * len(examples), examples)
    assert time.monotonic() - t0 < 3 * 0.2 + 1.5
    assert rewards == [0.0] * 8 and errors == 8
    assert "(first: timed out after 0.2 s (task.reward_timeout) on prompt" in caplog.records[-1].getMessage()
    # the previous SIGALRM handler is back
    assert signal.getsignal(signal.SIGALRM) is before


def test_the_timeout_works_off_the_main_thread():
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", _timed()))
    thread.start()
    thread.join(5)
    assert out["r"] == "timeout"


def _timed() -> str:
    try:
        call_with_timeout(time.sleep, (1000,), 0.1)
    except tasks.RewardTimeout:
        return "timeout"
    return "returned"


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


MORE_REWARDS = '''
import decimal, os, signal

async def coro(prompt, completion, example):
    return 1.0

def gen(prompt, completion, example):
    yield 1.0

def exact(prompt, completion, example):
    return decimal.Decimal("0.25")

def wanders(prompt, completion, example):
    os.chdir("/")
    return 1.0

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
        tasks.load_reward(f"more.py:{fn}")


def _more(tmp_path, monkeypatch, fn):
    task = _task(tmp_path, monkeypatch, "np_float")
    (tmp_path / "more.py").write_text(MORE_REWARDS)
    task._reward, task.reward_name = tasks.load_reward(f"more.py:{fn}"), f"more.py:{fn}"
    return task


def test_a_decimal_reward_is_a_number(tmp_path, monkeypatch):
    task = _more(tmp_path, monkeypatch, "exact")
    assert score_completions(task, ["7"], task.eval_set()[:1]) == ([0.25], 0)


def test_a_reward_that_changes_the_working_directory_or_the_signal_handlers_is_undone(tmp_path, monkeypatch, caplog):
    """A reward that chdirs would move every relative path of the run (checkpoints, outputs); one that ignores
    SIGINT / SIGTERM would make the run deaf. Both are restored after each call, with one warning each."""
    task = _more(tmp_path, monkeypatch, "wanders")
    with caplog.at_level(logging.WARNING):
        assert score_completions(task, ["7", "7"], task.eval_set()) == ([1.0, 1.0], 0)
    assert Path.cwd() == tmp_path
    assert caplog.text.count("reward more.py:wanders changed the process's working directory (os.chdir)") == 1
    # start from the default handlers: a process launched in the background inherits SIGINT ignored, and a reward
    # that ignores it would then change nothing
    before = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        task = _more(tmp_path, monkeypatch, "deafens")
        with caplog.at_level(logging.WARNING):
            assert score_completions(task, ["7", "7"], task.eval_set()) == ([1.0, 1.0], 0)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    assert "changed the process's SIGINT handler (signal.signal)" in caplog.text
    assert "changed the process's SIGTERM handler (signal.signal)" in caplog.text
