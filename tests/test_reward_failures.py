"""A user's reward that fails every time stops the run (exit 2, checkpoint kept, MLflow run FAILED); its import runs
only in its worker process, bounded in time, and a worker that holds too much memory is killed and replaced."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dcmdp import cli
from dcmdp.config import GuardConfig
from dcmdp.reward_stop import failing_steps
from trainers.config import TaskConfig
from trainers.reward_worker import RewardWorker, resident_mib
from trainers.tasks import JsonlTask, check_reward, last_failure, reward_alone_command, score_completions

REWARDS = '''
import os, time

def nan(prompt, completion, example):
    return float("nan")

def half(prompt, completion, example):
    return float("nan") if int(prompt.split("+")[0]) % 2 else 1.0

def exits(prompt, completion, example):
    os._exit(0)

def leaks(prompt, completion, example):
    global kept
    kept = bytearray(200 << 20)
    for i in range(0, len(kept), 4096):  # touched: resident, not only reserved
        kept[i] = 1
    return 1.0

def grows(prompt, completion, example):
    chunks = []
    while True:
        chunks.append(bytearray(16 << 20))
        for i in range(0, len(chunks[-1]), 4096):
            chunks[-1][i] = 1
        time.sleep(0.01)
'''

RUN = ["model.preset=tiny-dense", "task.name=jsonl", "task.path=sums.jsonl", "task.eval_size=16", "cold_start.steps=0",
       "algo.prompts_per_step=4", "algo.samples_per_prompt=4", "rollout.max_new_tokens=3", "threads=1",
       "progress=false"]


def _files(d: Path) -> None:
    (d / "rewards.py").write_text(REWARDS)
    with open(d / "sums.jsonl", "w") as f:
        for a in range(10):
            for b in range(10):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


@pytest.mark.parametrize("errors, samples, share, steps, stops", [
    # 9 of 16 > 0.5 * 16 = 8 on each of the last 2 steps
    ([0, 9, 9], 16, 0.5, 2, True),
    # exactly half is not more than half
    ([9, 8, 16], 16, 0.5, 2, False),
    # a good step in between resets the count
    ([16, 0, 16], 16, 0.5, 2, False),
    # fewer steps so far than the window
    ([16], 16, 0.5, 2, False),
    # share 1 never stops (more than every sample cannot fail)
    ([16, 16, 16], 16, 1.0, 1, False),
    # share 0 stops on one failure per step
    ([1], 16, 0.0, 1, True),
])
def test_failing_steps_counts_consecutive_steps_above_the_share(errors, samples, share, steps, stops):
    guard = GuardConfig(reward_fail_share=share, reward_fail_steps=steps)
    assert failing_steps(errors, samples, guard) is stops


def test_a_reward_that_returns_nan_on_every_sample_stops_the_run_with_exit_2_and_a_kept_checkpoint(
        tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from dcmdp.checkpoint import load_checkpoint

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    rc = cli.main(["train", *RUN, "task.reward=rewards.py:nan", "steps=6", "guard.reward_fail_steps=2",
                   f"output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2
    ckpt = out / "checkpoints" / "step_00000002"
    assert "reward rewards.py:nan failed on more than 50% of the 16 samples of each of 2 consecutive steps up to " \
           "step 2" in err
    assert "at step 2 it failed on 16 of 16, first: returned nan on prompt" in err
    assert f"checkpoint of step 2 written to {ckpt}" in err and "MLflow run ended FAILED" in err
    assert "Traceback" not in err
    state = load_checkpoint(ckpt)
    assert state["step"] == 2 and [h["reward/errors"] for h in state["history"]] == [16.0, 16.0]
    client = MlflowClient(json.loads((out / "run.json").read_text())["tracking_uri"])  # the store run.json names
    run = client.search_runs(client.get_experiment_by_name("dcmdp").experiment_id)[0]
    assert run.info.status == "FAILED"
    # the command it names runs the reward alone on the failing sample and shows the failure
    command = err.split("Run it alone on that sample: ", 1)[1].split("; checkpoint of step", 1)[0]
    alone = subprocess.run(command.replace("python", sys.executable, 1), shell=True, capture_output=True, text=True,
                           cwd=tmp_path, timeout=60)
    assert alone.returncode == 0 and alone.stdout.strip() == "nan"


def test_a_reward_failing_on_half_the_samples_or_less_trains_on(tmp_path, monkeypatch):
    """Odd first operands fail: under half of each batch most steps, never above 0.5 for all 3 steps of a row (the
    default window); the run finishes."""
    from dcmdp.config import load_config
    from dcmdp.loop import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [*RUN, "task.reward=rewards.py:half", "steps=3", "guard.reward_fail_share=0.9",
                             f"output_dir={tmp_path / 'out'}", "tracking.enabled=false"])
    summary = train(cfg)
    assert summary.steps == 3


def test_check_and_train_refuse_a_reward_whose_import_exits_or_hangs(tmp_path, monkeypatch, capsys):
    """The reward is imported only in its worker: ``os._exit(0)`` at import ends the worker (never ``dcmdp check``
    with exit 0), and an import that hangs is killed after task.reward_load_timeout."""
    _files(tmp_path)
    (tmp_path / "exits_on_import.py").write_text("import os\nos._exit(0)\ndef score(p, c, e):\n    return 1.0\n")
    (tmp_path / "hangs_on_import.py").write_text("import os, time\nopen('hung', 'a').write(f'{os.getpid()}\\n')\n"
                                                 "time.sleep(1000)\ndef score(p, c, e):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["check", *RUN, "task.reward=exits_on_import.py:score"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "config error at 'task.reward': 'exits_on_import.py:score': importing it ended the worker process (exit " \
           "code 0)" in err
    rc = cli.main(["train", *RUN, "task.reward=hangs_on_import.py:score", "task.reward_load_timeout=2",
                   f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "importing it did not finish within 2 s (task.reward_load_timeout; the worker was killed)" in err
    assert not (tmp_path / "out").exists()
    hung = [int(pid) for pid in (tmp_path / "hung").read_text().split()]
    assert hung and not any(_running(pid) for pid in hung)  # the worker stuck in the import is gone


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie waiting to be reaped has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_a_reward_import_is_never_run_in_the_trainer_process(tmp_path, monkeypatch):
    """A module whose import writes a marker with its process id: the marker names the worker's pid, not ours."""
    _files(tmp_path)
    (tmp_path / "marks.py").write_text("import os\nopen('imported_by', 'a').write(f'{os.getpid()}\\n')\n"
                                       "def score(p, c, e):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    import os

    check_reward(TaskConfig(name="jsonl", path="sums.jsonl", reward="marks.py:score"))
    task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_size=4, reward="marks.py:score"), 0)
    pids = (tmp_path / "imported_by").read_text().split()
    assert len(pids) == 2 and str(os.getpid()) not in pids
    assert "marks" not in sys.modules and not any("dcmdp_reward_" in m for m in sys.modules)
    task.close()


@pytest.mark.parametrize("fn", ["leaks", "grows"])
def test_a_reward_past_its_memory_limit_is_killed_counted_and_replaced(tmp_path, monkeypatch, caplog, fn):
    """``leaks`` keeps 200 MiB after returning (found after the call); ``grows`` allocates until stopped (found while
    the trainer waits). Limit 128 MiB: each call fails, names the limit, and the next call gets a new worker."""
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_size=4, reward=f"rewards.py:{fn}",
                                reward_memory_mib=128), 0)
    with caplog.at_level(logging.WARNING):
        assert score_completions(task, ["x", "x"], task.eval_set()[:2]) == ([0.0, 0.0], 2)
    assert f"reward rewards.py:{fn} failed on 2 of 2 samples (first: held " in caplog.text
    assert "above task.reward_memory_mib=128: its worker process was killed and a new one serves the next call" \
        in caplog.text
    assert task._worker.starts == 2  # the start with the task, then a new one for the call after the first kill
    task.close()
    # without a limit the same reward is scored (grows never returns: not run here)
    if fn == "leaks":
        task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_size=4, reward="rewards.py:leaks",
                                    reward_memory_mib=0), 0)
        assert score_completions(task, ["x"], task.eval_set()[:1]) == ([1.0], 0)
        task.close()


def test_resident_mib_counts_the_processes_below_the_worker(tmp_path):
    """A child holding 100 MiB under a small parent: the tree's resident memory includes it."""
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'b = bytearray(100 << 20)\\n"
            "for i in range(0, len(b), 4096): b[i] = 1\\nprint(1, flush=True)\\nimport time; time.sleep(60)'], "
            "stdout=subprocess.PIPE)\n"
            "child.stdout.readline(); print('ready', flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        assert resident_mib(parent.pid) > 100
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
        parent.wait()


def test_the_command_that_runs_a_reward_alone_reproduces_a_module_rewards_failure(tmp_path, monkeypatch):
    """``module:function`` rewards and examples without a file line (held-out records built in code) too."""
    (tmp_path / "modreward.py").write_text("def score(p, c, e):\n"
                                           "    return float('inf') if e['answer'] == '3' else 1\n")
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_size=4, reward="modreward:score"), 0)
    example = next(ex for ex in task.train_set() if ex.answer == "3")
    assert score_completions(task, ["it's \"3\""], [example]) == ([0.0], 1)
    failure = last_failure(task)
    assert failure.why == "returned inf" and failure.completion == "it's \"3\""
    task.close()
    for ex in (failure.example, type(failure.example)(example.prompt, example.answer, record=example.record)):
        command = reward_alone_command(type(failure)(**{**failure.__dict__, "example": ex}), "modreward:score")
        alone = subprocess.run(command.replace("python", sys.executable, 1), shell=True, capture_output=True,
                               text=True, cwd=tmp_path, timeout=60)
        assert alone.returncode == 0 and alone.stdout.strip() == "inf", alone.stderr


def test_a_worker_started_alone_reports_an_exit_at_import_as_an_exit(tmp_path, monkeypatch):
    from trainers.reward_worker import RewardExited

    (tmp_path / "bye.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.chdir(tmp_path)
    worker = RewardWorker("bye.py:score", 5.0, load_timeout=30)
    with pytest.raises(RewardExited) as info:
        worker.start()
    assert info.value.died == "exit code 3"
    worker.close()
