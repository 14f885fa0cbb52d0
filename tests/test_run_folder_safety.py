"""What a run does to its folder and how it ends: ``overwrite=true`` removes only what the folder's own run wrote (its
run.json proves the run was there; anything else is kept and named), a closed terminal (SIGHUP) stops the run like
SIGTERM (checkpoint, MLflow run KILLED, exit 129) unless it was started under ``nohup``, and every path the run will
write is probed before the cold start (exit 2 naming the path).

Tests run as root, where a permission bit stops nothing: an unwritable ``checkpoints/`` is made as a symbolic link to
``/sys``, in which the kernel refuses new files to root too (``Permission denied``)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.checkpoint import (MANIFEST_FILE, RunFolderInputError, SignalCheckpointer, clear_run_folder,
                              find_resume_checkpoint, load_checkpoint, probe_folder, read_run_file, save_checkpoint,
                              write_run_file)
from dcmdp.tracking import local_store_uri

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=4", "threads=1", "progress=false", "rollout.max_new_tokens=4"]


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _write(path: Path, text: str = "mine\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _statuses(out: Path) -> dict[str, str]:
    client = MlflowClient(local_store_uri(out))
    exp = client.get_experiment_by_name("dcmdp")
    return {r.info.run_id: r.info.status for r in client.search_runs(exp.experiment_id)} if exp else {}


# overwrite=true


def _checkpoint(ckpt_dir: Path, step: int, uid) -> Path:
    return save_checkpoint(ckpt_dir, step, {"run": {"uid": uid} if uid else {}, "w": torch.zeros(2)}, keep=100)


def test_clear_run_folder_removes_what_the_run_wrote_and_keeps_everything_else(tmp_path, caplog):
    """Each kind of file a run writes in its folder, with a file no run wrote beside it (and, for each name a run
    writes, something else under that name): only the run's own are removed, the rest kept and named in one line."""
    out = tmp_path / "out"
    ckpt = out / "checkpoints"
    out.mkdir()
    write_run_file(out, "u1", "mlflow-run-1")
    own = [_checkpoint(ckpt, 1, "u1"), _checkpoint(ckpt, 2, None)]  # this run's, and one written before identities
    other = _checkpoint(ckpt, 3, "u2")  # another run's checkpoint, copied in by hand
    (ckpt / ".tmp-step_00000004-x").mkdir()  # an interrupted write of this run
    _write(out / "summary.json", "{}")
    (out / "dual.png").mkdir()  # a folder under the plot's name: no run made it
    foreign = [_write(ckpt / "notes.txt"), _write(ckpt / "step_00000001" / "notes.txt"),
               _write(ckpt / "step_00000009" / "half.bin"), _write(out / "notes.md"),
               _write(out / "tracking_buffer" / "00000000000000000001-abcdef01.jsonl", '{"t": "header"}\n'),
               _write(out / "tracking_buffer" / "notes.txt"), _write(out / "mlflow.db", "a store"),
               _write(out / "mlartifacts" / "notes.txt"), _write(out / "config.yaml", "steps: 3\n")]
    (ckpt / "link").symlink_to(tmp_path)
    with caplog.at_level(logging.WARNING, "dcmdp.checkpoint"):
        kept = clear_run_folder(out)

    assert not (out / "summary.json").exists() and not (ckpt / ".tmp-step_00000004-x").exists()
    assert not (own[1]).exists() and sorted(p.name for p in own[0].iterdir()) == ["notes.txt"]
    assert all(p.read_text() in ("mine\n", '{"t": "header"}\n', "a store", "steps: 3\n") for p in foreign)
    assert (out / "dual.png").is_dir() and (other / MANIFEST_FILE).is_file() and (ckpt / "link").is_symlink()
    assert read_run_file(out)["uid"] == "u1"  # replaced by the next run, not removed
    names = sorted(str(p.relative_to(out)) for p in kept)
    assert names == ["checkpoints/link", "checkpoints/notes.txt", "checkpoints/step_00000001/notes.txt",
                     "checkpoints/step_00000003", "checkpoints/step_00000009", "dual.png"]
    [line] = [r.getMessage() for r in caplog.records if "overwrite=true" in r.getMessage()]
    assert line == (f"overwrite=true: removed checkpoints of steps 1, 2, summary.json of the earlier run u1 from {out}; "
                    f"kept what no run wrote: {', '.join(names)}")


def test_clear_run_folder_without_run_json_removes_nothing(tmp_path):
    out = tmp_path / "out"
    _checkpoint(out / "checkpoints", 1, "u1")
    _write(out / "summary.json", "{}")
    before = sorted(p for p in out.rglob("*"))
    with pytest.raises(RunFolderInputError, match=r"holds checkpoints up to step 1 and summary.json but no readable "
                                                  r"run.json naming a dcmdp run that wrote them"):
        clear_run_folder(out)
    assert sorted(p for p in out.rglob("*")) == before


def test_overwrite_removes_only_the_earlier_runs_files_and_names_the_rest(tmp_path, capsys, caplog):
    """A real run in a folder with its own MLflow store, a file beside each kind it wrote (summary, checkpoints, a
    checkpoint's folder, the plot, a tracking buffer, the store and its artifacts); overwrite=true removes the run's
    and keeps every other file as it was."""
    out = tmp_path / "out"
    _write(out / "mlflow.db", "")  # a store of the folder's own (dcmdp.tracking.local_store_folder)
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=2", "checkpoint.every=1", "checkpoint.keep=5"]) == 0
    first = read_run_file(out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert (out / "summary.json").is_file() and (out / "dual.png").is_file() and (out / "mlartifacts").is_dir()
    foreign = {_write(out / "checkpoints" / "notes.txt"): "mine\n",
               _write(out / "checkpoints" / "step_00000002" / "notes.txt"): "mine\n",
               _write(out / "my_summary.json"): "mine\n", _write(out / "my_plot.png"): "mine\n",
               _write(out / "tracking_buffer" / "00000000000000000001-abcdef01.jsonl"): "mine\n",
               _write(out / "tracking_buffer" / "notes.txt"): "mine\n",
               _write(out / "mlartifacts" / "notes.txt"): "mine\n"}
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        assert cli.main(["train", *BASE, f"output_dir={out}", "steps=1", "seed=5", "overwrite=true"]) == 0
    assert {p: p.read_text() for p in foreign} == foreign
    [line] = [r.getMessage() for r in caplog.records if "overwrite=true: removed" in r.getMessage()]
    assert line.endswith("kept what no run wrote: checkpoints/notes.txt, checkpoints/step_00000002/notes.txt")
    assert "checkpoints of steps 1, 2, summary.json, dual.png of the earlier run" in line
    # the new run's files only: its one checkpoint, its summary; both MLflow runs in the folder's store
    second = read_run_file(out)
    assert second["uid"] != first["uid"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["notes.txt", "step_00000001", "step_00000002"]
    assert load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))["run"]["uid"] == second["uid"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert _statuses(out) == {first["run_id"]: "FINISHED", second["run_id"]: "FINISHED"}


def test_overwrite_in_a_folder_without_run_json_keeps_the_users_files(tmp_path, capsys):
    """The user's summary.json and checkpoints/notes.txt, no run.json: no run was there, so overwrite=true removes
    nothing; the run would write over summary.json, so it refuses (exit 2), and so does check."""
    out = tmp_path / "x6"
    files = {_write(out / "summary.json", '{"mine": true}\n'): '{"mine": true}\n',
             _write(out / "checkpoints" / "notes.txt"): "mine\n"}
    for command in ("check", "train"):
        assert cli.main([command, *BASE, f"output_dir={out}", "steps=2", "overwrite=true"]) == 2
        err = capsys.readouterr().err
        assert (f"overwrite=true: output_dir {out} holds summary.json but no readable run.json naming a dcmdp run "
                f"that wrote them") in err and "nothing was changed" in err, err
        assert {p: p.read_text() for p in files} == files
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "run.lock", "summary.json"]


# SIGHUP


def test_sighup_is_a_stop_request_and_an_inherited_ignore_stays():
    previous = signal.getsignal(signal.SIGHUP)
    try:
        with SignalCheckpointer() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            deadline = time.monotonic() + 5
            while not stop.requested and time.monotonic() < deadline:
                time.sleep(0.001)
            assert (stop.requested, stop.signal_name) == (True, "SIGHUP")
        assert signal.getsignal(signal.SIGHUP) is previous
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
        with SignalCheckpointer() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
            assert not stop.requested
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _jsonl_task(d: Path) -> list[str]:
    """A task whose reward is the user's (run in a reward worker process): its overrides."""
    _write(d / "sums.jsonl", "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    _write(d / "my_reward.py", "def score(prompt, completion, example):\n"
                               "    return float(completion.strip() == example['answer'])\n")
    return ["task.name=jsonl", "task.path=sums.jsonl", "task.reward=my_reward.py:score"]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run exited with {proc.returncode} before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


def test_sighup_checkpoints_ends_the_mlflow_run_killed_and_exits_129(tmp_path):
    """A closed terminal: SIGHUP at step ~5 of a 2,000-step run (asynchronous rollouts, a reward of the user's in its
    worker process) writes a checkpoint at the next step boundary, ends the MLflow run KILLED, stops the rollout
    thread and the reward worker, and exits 128 + SIGHUP = 129, as SIGTERM exits 143."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "dcmdp.cli", "train", *BASE, *_jsonl_task(tmp_path), f"output_dir={out}",
            "steps=2000", "checkpoint.every=2", "async_rollout.enabled=true", "async_rollout.max_staleness=1"]
    proc = subprocess.Popen(args, env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for(out / "checkpoints" / "step_00000004", proc)
        workers = [p for p in _children(proc.pid)
                   if b"reward_worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGHUP == 129, err[-3000:]
    [line] = [x for x in err.splitlines() if "SIGHUP received: checkpoint written at step" in x]
    step = int(line.split("at step ")[1].split(",")[0])
    assert 4 <= step < 2000
    assert load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))["step"] == step
    run_id = read_run_file(out)["run_id"]
    assert _statuses(out) == {run_id: "KILLED"}
    assert workers, "no reward worker was running"
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{p}").exists() for p in workers), "the reward worker outlived the run"


@pytest.mark.skipif(shutil.which("nohup") is None, reason="no nohup here")
def test_a_run_started_under_nohup_outlives_a_sighup(tmp_path):
    out = tmp_path / "out"
    args = ["nohup", sys.executable, "-m", "dcmdp.cli", "train", *BASE, f"output_dir={out}", "steps=8",
            "checkpoint.every=2"]
    proc = subprocess.Popen(args, env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for(out / "checkpoints" / "step_00000002", proc)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "SIGHUP" not in err and json.loads((out / "summary.json").read_text())["steps"] == 8
    assert set(_statuses(out).values()) == {"FINISHED"}


# every path the run writes, probed at start


def _unwritable_checkpoints(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoints").symlink_to("/sys")  # root may write anywhere but here: sysfs refuses new files


@pytest.mark.parametrize("make, key, path, reason", [
    pytest.param(lambda out: _write(out / "checkpoints", ""), "output_dir", "checkpoints",
                 "{out}/checkpoints is a file, not a folder", id="checkpoints-a-file"),
    pytest.param(_unwritable_checkpoints, "output_dir", "checkpoints",
                 "cannot create a file in {out}/checkpoints: Permission denied [errno EACCES]",
                 id="checkpoints-not-writable",
                 marks=pytest.mark.skipif(probe_folder("/sys") is None, reason="/sys accepts new files here")),
    pytest.param(lambda out: _write(out.parent / "afile", ""), "tracking.buffer_dir",
                 "the tracking buffer (metrics kept while the server cannot be reached)",
                 "{out.parent}/afile is a file, not a folder", id="buffer-under-a-file"),
])
def test_a_path_the_run_cannot_write_exits_2_before_the_first_step(tmp_path, capsys, caplog, make, key, path, reason):
    out = tmp_path / "out"
    make(out)
    extra = [f"tracking.buffer_dir={out}/../afile/buffer"] if key == "tracking.buffer_dir" else []
    where = f"{out}/../afile/buffer" if extra else f"{out}/checkpoints"
    needle = f"cannot write {path} to {where}: {reason.format(out=out)}; fix it, or choose another {key}"
    assert cli.main(["check", *BASE, f"output_dir={out}", "steps=3", *extra]) == 2
    assert f"  {key}: {needle}" in capsys.readouterr().err
    with caplog.at_level(logging.INFO):
        assert cli.main(["train", *BASE, f"output_dir={out}", "steps=3", *extra]) == 2
    assert f"dcmdp: error: {needle}" in capsys.readouterr().err
    # before the cold start and the first evaluation: no MLflow run, no run.json, nothing left by the probe
    assert "held-out accuracy before RL" not in caplog.text and not (out / "run.json").exists()
    assert not _statuses(out) and not list(tmp_path.rglob(".dcmdp-probe-*"))


def test_the_probe_leaves_no_trace(tmp_path):
    assert probe_folder(tmp_path / "a" / "b") is None
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    assert probe_folder(tmp_path / "f" / "g") == f"{tmp_path / 'f'} is a file, not a folder"
