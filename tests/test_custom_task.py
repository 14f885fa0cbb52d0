"""Task ``jsonl``: your data (a JSON-lines file) and your reward (a function the config names), defined entirely
outside the package; the reward's failures counted and survived, bad files and bad reward specs named."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcmdp import cli
from dcmdp.config import ConfigError, load_config
from trainers import tasks
from trainers.config import TaskConfig
from trainers.tasks import JsonlTask, score_completions

torch.set_num_threads(1)

DCMDP = Path(sys.executable).parent / "dcmdp"

# The reward module a user would write: it also records what it was called with, for the test to read.
REWARD_MODULE = '''
import json, os

def score(prompt, completion, example):
    if os.environ.get("REWARD_CALLS"):
        with open(os.environ["REWARD_CALLS"], "a") as f:
            f.write(json.dumps({"prompt": prompt, "completion": completion, "example": example,
                                "rank": os.environ.get("RANK")}) + "\\n")
    return 1.0 if completion.strip() == str(example["answer"]) else 0.0

def flaky(prompt, completion, example):
    if prompt.startswith("1"):
        raise RuntimeError("grader crashed")
    if prompt.startswith("2"):
        return float("nan")
    if prompt.startswith("3"):
        return "yes"
    return 1.0
'''


def _write_task(d: Path, n: int = 120, completions: bool = True, bom: bool = False) -> Path:
    """One-digit sums: {"prompt": "3+4=", "answer": 7, "completion": "7"}."""
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        record = {"prompt": f"{a}+{b}=", "answer": a + b, "topic": "sums"}
        if completions:
            record["completion"] = str(a + b)
        lines.append(json.dumps(record))
    path = d / "sums.jsonl"
    path.write_text(("\ufeff" if bom else "") + "\n".join(lines) + "\n", encoding="utf-8")
    (d / "my_reward.py").write_text(REWARD_MODULE)
    return path


# Small and fast: 30 cold-start steps, 3 RL steps of 4 prompts x 4 samples, 3 new tokens.
RUN = ["model.preset=tiny-dense", "task.name=jsonl", "task.path=sums.jsonl", "task.eval_size=16",
       "cold_start.steps=30", "cold_start.batch_size=16", "algo.prompts_per_step=4", "algo.samples_per_prompt=4",
       "rollout.max_new_tokens=3", "steps=3", "threads=1", "progress=false"]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_train_and_eval_on_a_task_defined_outside_the_package(tmp_path):
    """The ``dcmdp`` command (whose sys.path does not hold the working directory) imports ``my_reward:score`` from
    the working directory, trains on the file's prompts and demonstrations, and ``dcmdp eval`` scores the
    checkpoint with the same reward."""
    _write_task(tmp_path)
    calls = tmp_path / "calls.jsonl"
    out = tmp_path / "out"
    train = subprocess.run([str(DCMDP), "train", *RUN, "task.reward=my_reward:score", f"output_dir={out}",
                            f"cold_start.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path,
                           env=_env(REWARD_CALLS=str(calls)), capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "held-out accuracy:" in train.stdout
    summary = json.loads((out / "summary.json").read_text())
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    # the reward saw the prompt as given to the model, the decoded response and the whole record
    assert all(c["example"]["prompt"] == c["prompt"] and c["example"]["topic"] == "sums" for c in seen)
    assert {"answer", "completion"} <= set(seen[0]["example"])
    assert any(c["completion"].strip() == str(c["example"]["answer"]) for c in seen)  # the cold start taught it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["tracking_uri"])
    errors = client.get_metric_history(summary["run_id"], "reward/errors")
    assert [m.value for m in errors] == [0.0, 0.0, 0.0]
    assert client.get_run(summary["run_id"]).data.params["task.reward"] == "my_reward:score"

    evaluated = subprocess.run([str(DCMDP), "eval", *RUN, "task.reward=my_reward:score", f"output_dir={out}"],
                               cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"held-out accuracy: {summary['accuracy_after']:.1%} on 16 prompts" in evaluated.stdout


def test_every_torchrun_rank_imports_and_calls_the_reward(tmp_path):
    _write_task(tmp_path)
    calls = tmp_path / "calls.jsonl"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dcmdp.cli",
           "train", *RUN, "task.reward=my_reward.py:score", "cold_start.steps=0", "algo.minibatches=2", "steps=2",
           f"output_dir={out}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(REWARD_CALLS=str(calls)), capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert {json.loads(line)["rank"] for line in calls.read_text().splitlines()} == {"0", "1"}
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_dcmdp_tune_runs_its_trials_on_the_task(tmp_path):
    """Each trial is a ``dcmdp train`` process in the working directory of ``dcmdp tune``: the relative data path
    and the reward module resolve there."""
    import csv

    _write_task(tmp_path)
    (tmp_path / "run.yaml").write_text(
        "model: {preset: tiny-dense}\ntask: {name: jsonl, path: sums.jsonl, eval_size: 16, reward: my_reward:score}\n")
    (tmp_path / "tune.yaml").write_text(json.dumps({
        "base": "run.yaml", "overrides": [o for o in RUN if not o.startswith(("model.", "task."))] +
        ["cold_start.steps=0", f"cold_start.cache_dir={tmp_path / 'cache'}"],
        "space": {"dual.constraints[0].tolerance": [0.001, 0.01]},
        "select": {"warmup_steps": 0, "collapse_window": 1}, "output_dir": str(tmp_path / "sweep")}))
    done = subprocess.run([str(DCMDP), "tune", "tune.yaml"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=400)
    assert done.returncode in (0, 3), done.stderr[-3000:]  # 3: no trial met the selection rule
    with open(tmp_path / "sweep" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), rows


def test_a_failing_reward_gives_zero_is_counted_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    """Raising, NaN and a string: reward 0 for those samples, reward/errors counts them, one warning per step
    (the first with its traceback), and training finishes."""
    from dcmdp.loop import train

    _write_task(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [*RUN, "task.reward=my_reward.py:flaky", "cold_start.steps=0", "steps=2",
                             f"output_dir={tmp_path / 'out'}"])
    summary = train(cfg)
    assert summary.steps == 2
    state = torch.load(next((tmp_path / "out" / "checkpoints").glob("step_*")) / "state.pt", weights_only=False)
    assert all(h["reward/errors"] > 0 for h in state["history"])
    warnings = [r for r in caplog.records if r.getMessage().startswith("reward my_reward.py:flaky failed on")]
    assert warnings and "they get reward 0 (counted in reward/errors)" in warnings[0].getMessage()


def test_score_completions_zero_for_raise_nan_inf_and_non_numbers(tmp_path, monkeypatch, caplog):
    _write_task(tmp_path)
    monkeypatch.chdir(tmp_path)
    task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_size=4, reward="my_reward.py:flaky"), 0)
    ex = {p: next(e for e in task.eval_set() + task.sample(random.Random(0), 200) if e.prompt.startswith(p))
          for p in "1234"}
    monkeypatch.setattr(tasks, "_TRACEBACK_SHOWN", set())
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            rewards, errors = score_completions(task, ["x"] * 4, [ex["1"], ex["2"], ex["3"], ex["4"]])
            assert (rewards, errors) == ([0.0, 0.0, 0.0, 1.0], 3)
    first, second = [r for r in caplog.records if "failed on" in r.getMessage()]
    assert first.getMessage() == (f"reward my_reward.py:flaky failed on 3 of 4 samples (first: raised RuntimeError: "
                                  f"grader crashed on prompt {ex['1'].prompt!r}); they get reward 0 (counted in "
                                  f"reward/errors)")
    # the first failure in the process comes with its traceback, later ones in one line
    assert first.exc_info is not None and second.exc_info is None
    rewards, errors = score_completions(task, ["x"] * 2, [ex["2"], ex["3"]])
    assert errors == 2 and "(first: returned nan on prompt" in caplog.records[-1].getMessage()
    assert score_completions(task, ["x"], [ex["3"]]) == ([0.0], 1)
    assert "(first: returned str 'yes', not a number on prompt" in caplog.records[-1].getMessage()

    class Fixed:
        name = "fixed"

        def __init__(self, value):
            self.value = value

        def reward(self, completion, example):
            return self.value

    for value, ok in [(math.inf, False), (-math.inf, False), (None, False), (torch.tensor(1.0), False),
                      (True, True), (2, True), (-0.5, True)]:
        rewards, errors = score_completions(Fixed(value), ["x"], [ex["4"]])
        assert (errors == 0) is ok, value
        assert rewards == [float(value) if ok else 0.0]


@pytest.mark.parametrize("reward, message", [
    ("nowhere:score", "no module 'nowhere' in the working directory"),
    ("nowhere.py:score", "file not found: "),
    ("my_reward:missing", "'my_reward' has no 'missing' (its functions: flaky, score)"),
    ("my_reward", "expected 'module:function' or 'path/to/file.py:function'"),
    ("broken.py:score", "importing 'broken.py' failed: SyntaxError"),
    ("needs_dep.py:score", "importing 'needs_dep.py' failed: ModuleNotFoundError: No module named "
                           "'not_a_real_dependency'"),
    ("two_args.py:score", "the function must take (prompt, completion, example)"),
])
def test_a_reward_that_cannot_be_imported_is_a_config_error(tmp_path, monkeypatch, capsys, reward, message):
    _write_task(tmp_path)
    (tmp_path / "broken.py").write_text("def score(prompt, completion, example)\n    return 1.0\n")
    (tmp_path / "needs_dep.py").write_text("import not_a_real_dependency\n")
    (tmp_path / "two_args.py").write_text("def score(prompt, completion):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["train", *RUN, f"task.reward={reward}", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dcmdp: config error at 'task.reward': {reward!r}: ") and message in err, err
    assert not out.exists()  # found before the run folder is made


@pytest.mark.parametrize("override, message", [
    ("task.path=missing.jsonl", "config error at 'task.path': file not found: "),
    ("task.eval_path=missing.jsonl", "config error at 'task.eval_path': file not found: "),
    ("task.path=null", "config error at 'task.path': task 'jsonl' needs a JSON-lines file of prompts"),
])
def test_a_missing_data_file_is_a_config_error(tmp_path, monkeypatch, override, message):
    _write_task(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="^" + message):
        load_config(None, [*RUN, "task.reward=my_reward:score", override])
    with pytest.raises(ConfigError, match="^config error at 'task.reward': task 'jsonl' needs a reward function"):
        load_config(None, RUN)
    with pytest.raises(ConfigError, match="^config error at 'task.reward': only task 'jsonl' takes a reward"):
        load_config(None, ["task.name=addition", "task.reward=my_reward:score"])


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "1+1=", "answer": 2', "Expecting ',' delimiter"),
    ('["1+1=", 2]', "expected a JSON object, got list"),
    ('{"question": "1+1="}', "no 'prompt' (keys: ['question'])"),
    ('{"prompt": "  "}', "needs a non-empty string 'prompt'"),
    ('{"prompt": "1+1=", "completion": 2}', "'completion' must be a string, got int"),
])
def test_a_malformed_line_names_file_and_line(tmp_path, monkeypatch, line, why):
    path = _write_task(tmp_path, n=10)
    lines = path.read_text().splitlines()
    lines.insert(2, "")  # blank lines are skipped but counted
    lines.insert(3, line)
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    cfg = TaskConfig(name="jsonl", path="sums.jsonl", eval_size=2, reward="my_reward:score")
    with pytest.raises(ValueError) as info:
        JsonlTask(cfg, 0)
    assert str(info.value).startswith("sums.jsonl:4: malformed jsonl example: ") and why in str(info.value)


def test_the_cold_start_needs_a_completion_on_every_record(tmp_path, monkeypatch, capsys):
    _write_task(tmp_path, completions=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["train", *RUN, "task.reward=my_reward:score", f"output_dir={out}",
                     f"cold_start.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"config error at 'cold_start.steps': the cold start trains on demonstrations, and task 'jsonl' "
                     r"takes them from each record's \"completion\" string, which (\d+) of \1 records lack \(first: "
                     r"sums.jsonl:\d+\)", err), err
    assert "or set cold_start.steps=0" in err
    assert not (tmp_path / "cache").exists()  # said before any work


def test_held_out_split_and_sampling(tmp_path, monkeypatch):
    _write_task(tmp_path, n=30)
    monkeypatch.chdir(tmp_path)
    eval_path = tmp_path / "held_out.jsonl"
    eval_path.write_text(json.dumps({"prompt": "9+9=", "answer": 18}) + "\n")
    task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_path=str(eval_path), reward="my_reward:score"),
                     0)
    assert [ex.prompt for ex in task.eval_set()] == ["9+9="]
    assert all(ex.prompt != "9+9=" for ex in task.sample(random.Random(0), 500))
    task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_size=5, reward="my_reward:score"), 0)
    held = {ex.prompt for ex in task.eval_set()}
    assert len(task.eval_set()) == 5 and not held & {ex.prompt for ex in task.sample(random.Random(0), 500)}
    first = task.eval_set()[0]
    assert task.reward(str(first.record["answer"]), first) == 1.0 and task.demonstration(first) == first.completion


def test_a_byte_order_mark_is_read_in_jsonl_and_config_files(tmp_path, monkeypatch):
    _write_task(tmp_path, n=10, bom=True)
    monkeypatch.chdir(tmp_path)
    task = JsonlTask(TaskConfig(name="jsonl", path="sums.jsonl", eval_size=2, reward="my_reward:score"), 0)
    assert len(task.eval_set()) == 2 and all(not ex.prompt.startswith("\ufeff") for ex in task.eval_set())
    math_file = tmp_path / "math.jsonl"
    math_file.write_text('\ufeff{"problem": "1+1?", "answer": "2"}\n', encoding="utf-8")
    assert tasks.load_math_jsonl(math_file) == [tasks.Example("1+1?", "2")]
    config = tmp_path / "run.yaml"
    config.write_text("\ufeffsteps: 7\ntask:\n  name: jsonl\n  path: sums.jsonl\n  reward: my_reward:score\n",
                      encoding="utf-8")
    cfg = load_config(config)
    assert cfg.steps == 7 and cfg.task.reward == "my_reward:score"
