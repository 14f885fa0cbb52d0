"""Round 5 of docs/bad_inputs.md: the cases a command line alone cannot make (a file only root could read, a
trained run's folder, a second process at the same time). Each asserts the line the user reads and its exit code
on real files and processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dcmdp import cli
from dcmdp.config import load_config
from tests.fsutil import unprivileged

TINY = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=4", "threads=1", "progress=false", "rollout.max_new_tokens=4"]


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def shared_dir():
    """A folder that the unprivileged user (nobody, when the tests run as root) can enter and write."""
    d = Path(tempfile.mkdtemp(prefix="dcmdp-r5-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_an_unreadable_task_file_is_a_config_error_naming_its_key(shared_dir, monkeypatch, capsys):
    """A task file without read permission: exit 2 naming task.path and the file, from check and train (it was a
    bare ``[Errno 13]`` with exit 1). Checked once readable first, so every module is imported before the uid drops
    (the interpreter's own files may be root's alone)."""
    monkeypatch.chdir(shared_dir)
    (shared_dir / "gsm.jsonl").write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n"
                                                  for i in range(10)))
    args = ["task.name=math", "task.path=gsm.jsonl", "task.eval_size=2", "cold_start.steps=0", "threads=1",
            f"output_dir={shared_dir / 'out'}"]
    assert cli.main(["check", *args]) == 0, capsys.readouterr().err
    (shared_dir / "gsm.jsonl").chmod(0)
    capsys.readouterr()
    with unprivileged():
        with pytest.raises(PermissionError):
            open(shared_dir / "gsm.jsonl", "rb")
        codes = [cli.main([command, *args]) for command in ("check", "train")]
    err = capsys.readouterr().err
    assert codes == [2, 2], err
    assert err.count(f"config error at 'task.path': cannot read {shared_dir / 'gsm.jsonl'}: Permission denied") == 2
    assert "Errno" not in err and "Traceback" not in err


def test_a_damaged_run_json_is_named_and_the_line_it_gives_restores_the_resume(tmp_path, capsys):
    """A run's own checkpoint with ``run.json`` damaged: the refusal names run.json and says what to write into it
    (it said the checkpoint belonged to another run); written as said, the resume continues the run."""
    from dcmdp.loop import train

    out = tmp_path / "out"
    train(load_config(None, [*TINY, "steps=2", "checkpoint.every=1", f"output_dir={out}"]))
    good = (out / "run.json").read_text()
    (out / "run.json").write_text(good[:20])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix != ".lock"}
    code = cli.main(["train", *TINY, "steps=3", "checkpoint.resume=auto", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{out / 'run.json'}, which names the run that owns output_dir, cannot be read" in err
    assert "belongs to another run" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix != ".lock"} == before
    restore = json.loads(err.split("restore run.json as ", 1)[1].split(" and resume again", 1)[0])
    assert restore == {k: json.loads(good)[k] for k in ("uid", "run_id")}
    (out / "run.json").write_text(json.dumps(restore))
    assert cli.main(["train", *TINY, "steps=3", "checkpoint.resume=auto", f"output_dir={out}"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def _jsonl_run(d: Path, reward: str) -> list[str]:
    """A tiny run of task jsonl on ten sums whose reward is ``reward`` (the body of ``score``)."""
    (d / "sums.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                          for i in range(10)))
    (d / "rw.py").write_text(f"def score(prompt, completion, example):\n    return {reward}\n")
    return [*TINY, "task.name=jsonl", "task.path=sums.jsonl", "task.reward=rw.py:score", "task.eval_size=2",
            f"output_dir={d / 'out'}"]


def test_a_reward_failing_on_every_step_of_a_run_shorter_than_the_rule_stops_it(tmp_path, monkeypatch, capsys):
    """NaN on every call in a 2-step run (the rule waits for 3 steps): it ended exit 0, FINISHED, without a word on
    the reward; now the rule reads the run's every step at its end: exit 2, a checkpoint, the MLflow run FAILED."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", *_jsonl_run(tmp_path, "float('nan')"), "steps=2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("reward rw.py:score failed on more than 50% of the 4 samples of every one of the run's 2 step(s), which "
            "ended before the 3 consecutive steps the rule waits for") in err
    assert "checkpoint of step 2 written to" in err and "MLflow run ended FAILED" in err
    run_id = json.loads((tmp_path / "out" / "run.json").read_text())["run_id"]
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "FAILED"


def test_a_reward_one_ulp_above_1_is_read_as_1(tmp_path, monkeypatch, capsys):
    """``(0.1 + 0.2) / 0.3`` is 1.0000000000000002: it stopped the run as outside [0, 1]; now round-off within
    ``REWARD_ROUND_OFF`` is clamped to the bound and the run trains to its end with every reward 1."""
    from trainers.tasks import REWARD_ROUND_OFF

    assert 1.0 < (0.1 + 0.2) / 0.3 <= 1.0 + REWARD_ROUND_OFF
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *_jsonl_run(tmp_path, "(0.1 + 0.2) / 0.3"), "steps=1"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 1
    assert cli.main(["train", *_jsonl_run(tmp_path, "1.001"), "steps=1", f"output_dir={tmp_path / 'out2'}"]) != 0
    assert "returned 1.001" in capsys.readouterr().err


RANGE_ERRORS = {
    "rollout.top_p=1.5": "config error at 'rollout.top_p': must be in (0, 1], got 1.5",
    "algo.minibatches=3": "3 mini-batches do not divide the rollout batch of 16 x 8 = 128 samples",
    "seed=-1": "config error at 'seed': must be >= 0, got -1",
    "dual.constraints[0].tolerance=-1": "config error at 'dual.constraints[0].tolerance': must be >= 0",
    "task.reward_timeout=0": "config error at 'task.reward_timeout': must be a finite number of seconds > 0",
    "threads=0": "config error at 'threads': must be auto or an integer >= 1, got 0",
    "checkpoint.keep=0": "config error at 'checkpoint.keep': must be >= 1, got 0",
    "guard.max_bad_steps=0": "config error at 'guard.max_bad_steps': must be >= 1, got 0",
    "optim.warmup_steps=-1": "config error at 'optim.warmup_steps': must be >= 0",
}


def test_a_value_out_of_range_is_reported_by_train_before_torch_is_imported(tmp_path):
    """Each bound's error from ``dcmdp train``, in one new process: exit 2, its line, and torch not yet in
    sys.modules when it was printed (the bounds ran after the torch import: 12-16 s on a loaded machine)."""
    code = ("import json, sys; from dcmdp import cli; "
            "out = [(cli.main(['train', o, 'output_dir=out']), 'torch' in sys.modules) "
            f"for o in {list(RANGE_ERRORS)!r}]; "
            "print(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])})
    assert json.loads(done.stdout) == [[2, False]] * len(RANGE_ERRORS), done.stdout + done.stderr
    for line in RANGE_ERRORS.values():
        assert line in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


CLIENTS_AT_ONCE = """
import sys, time
from pathlib import Path
from dcmdp.tracking import _Sender
start, uri, buffer = float(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
client = _Sender(uri, buffer)._client()
print(client.get_experiment_by_name("Default").name)
"""


def test_clients_opening_a_new_sqlite_store_at_once_all_find_its_tables(tmp_path):
    """Four processes open one new store at the same instant (two runs started at once beside each other share
    ``<folder>/mlflow.db``): MLflow creates its tables without a lock, so one of them failed (``table runs already
    exists``, ``duplicate column name``) and its run logged nothing live. The store's folder is locked while they are
    made: every process gets a client of a store with its tables."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start = __import__("time").time() + 8  # after the four interpreters have imported mlflow
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CLIENTS_AT_ONCE, str(start), uri, str(tmp_path / f"buf{i}")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-800:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["Default"] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]  # no lock file left beside the store


def test_a_store_folder_the_user_cannot_write_is_refused_at_start_naming_it(shared_dir, monkeypatch, capsys):
    """The run folder is writable, the folder that holds the shared local store is not: ``check`` and ``train`` exit
    2 naming that folder (a 2-step run retried the store silently for 217-236 s and then did not name it)."""
    import dcmdp.loop  # noqa: F401  (imported as root: the interpreter's own files may be root's alone)

    store_folder = shared_dir / "ro"
    (store_folder / "run").mkdir(parents=True)
    (store_folder / "run").chmod(0o777)
    store_folder.chmod(0o555)
    monkeypatch.chdir(shared_dir)
    args = [*TINY, "steps=2", f"output_dir={store_folder / 'run'}"]
    assert cli.main(["check", *TINY, f"output_dir={shared_dir / 'warm'}"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    with unprivileged():
        codes = [cli.main([command, *args]) for command in ("check", "train")]
    err = capsys.readouterr().err
    assert codes == [2, 2], err
    line = (f"config error at 'output_dir': the folder {store_folder} of the MLflow store {store_folder / 'mlflow.db'} "
            f"cannot be written (permission denied or a read-only file system)")
    assert err.count(line) == 2, err
    assert sorted(p.name for p in (store_folder / "run").iterdir()) == []


@pytest.mark.parametrize("size, last", [
    ("64k", "dcmdp: error: [Errno 28] cannot write {out}/run.json: No space left on device"),
    ("1m", "dcmdp: error: could not write checkpoint step 3 to {out}/checkpoints: No space left on device"),
])
def test_a_full_disk_names_the_path_and_counts_the_lost_metrics(tmp_path, size, last):
    """The output folder on a tmpfs of ``size`` (a private user+mount namespace): the run ended with a bare
    ``[Errno 28] No space left on device`` (the buffer's or run.json's close, where Python names no file) and the
    count of lost metrics it had promised never came. Now the last line names the path, the count comes before it,
    exit 1 (the machine's, not the user's input), no traceback."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64k x "$1"', "sh"]
    if subprocess.run([*probe, str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("unprivileged user+mount namespaces are not available here")
    out = mnt / "out"
    argv = [sys.executable, "-m", "dcmdp.cli", "train", *TINY, "steps=3", f"output_dir={out}"]
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           f'mount -t tmpfs -o size={size} dcmdp_full "$1" && shift && exec "$@"', "sh", str(mnt),
                           *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(last.format(out=out)), lines[-1]
    assert any(" tracking records of run local-" in line and "were lost" in line for line in lines), done.stderr[-3000:]


PEAK_RSS = """
import json, resource, sys
from dcmdp.check import find_problems
problems = find_problems(None, ["task.name=jsonl", f"task.path={sys.argv[1]}", "task.reward=rw.py:score",
                                "cold_start.steps=0", "threads=1"], run_folder=False)
print(json.dumps({"problems": [p.message for p in problems],
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_check_reads_a_large_task_file_in_memory_well_under_its_size(tmp_path):
    """``check`` of a 60 MB task file: it held the file, its lines and every parsed record at once (a 200 MB file
    took it to 3.3 GB). Now it reads a line at a time and keeps of each example only a digest of its prompt, whether
    it has a demonstration and where it is: its peak memory grows by less than the file's size over a check of a
    ten-line file (the records are the run's to hold)."""
    (tmp_path / "rw.py").write_text("def score(prompt, completion, example):\n    return 1.0\n")
    line = lambda i: json.dumps({"prompt": f"{i}+1= " + "x" * 200, "answer": str(i + 1), "meta": "y" * 300}) + "\n"
    (tmp_path / "small.jsonl").write_text("".join(line(i) for i in range(300)))
    with open(tmp_path / "big.jsonl", "w") as f:
        for i in range(110_000):
            f.write(line(i))
    size_kib = (tmp_path / "big.jsonl").stat().st_size / 1024
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    peaks = {}
    for name in ("small", "big"):
        done = subprocess.run([sys.executable, "-c", PEAK_RSS, f"{name}.jsonl"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["problems"] == [], out
        peaks[name] = out["peak_kib"]
    assert size_kib > 55_000
    assert peaks["big"] - peaks["small"] < size_kib, (peaks, size_kib)


def test_the_examples_check_keeps_are_light(tmp_path):
    """What ``check`` keeps of each example: a 32-character digest of the prompt, no record, no answer; a missing
    demonstration still counted and named by its line (the cold start's check)."""
    from dcmdp.check import _read_examples
    from trainers import tasks

    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2", "big": "z" * 1000}) + "\n"
                                      + json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    examples = _read_examples("task.path", str(tmp_path / "d.jsonl"), tasks.parse_jsonl_record, "jsonl", [])
    assert [len(ex.prompt) for ex in examples] == [32, 32] and examples[0].prompt != examples[1].prompt
    assert [(ex.record, ex.answer, ex.completion) for ex in examples] == [({}, "", None), ({}, "", "")]
    assert examples[0].source.endswith("d.jsonl:1")
