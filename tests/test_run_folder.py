"""A run folder holds one run: an exclusive lock while a run is live, a fresh run refuses an earlier run's folder,
a resume onto an incompatible config changes nothing, a killed run's repeated steps are logged once, and a
checkpoint whose payload does not load is skipped by ``resume=auto``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.checkpoint import (LOCK_FILE, MANIFEST_FILE, STATE_FILE, find_resume_checkpoint, load_checkpoint,
                              load_resume_checkpoint, save_checkpoint)
from dcmdp.tracking import local_store_uri

torch.set_num_threads(1)

BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=4", "threads=1", "progress=false", "rollout.max_new_tokens=4"]


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return {**env, "OMP_NUM_THREADS": "1"}


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dcmdp.cli", "train", *BASE, f"output_dir={out}", *extra]


def _snapshot(root: Path) -> dict[str, str]:
    """Every file's sha256 except the lock file (whose holder line each attempt rewrites)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def _runs(out: Path) -> list[tuple[str, str]]:
    client = MlflowClient(local_store_uri(out))
    exp = client.get_experiment_by_name("dcmdp")
    return sorted((r.info.run_id, r.info.status) for r in client.search_runs(exp.experiment_id))


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_second_run_on_a_live_folder_names_the_holder_and_a_killed_holder_leaves_no_stale_lock(tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(_cmd(out, "steps=100000", "checkpoint.every=1"), env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (out / "checkpoints" / "step_00000002").is_dir(), holder, "its second checkpoint")
        assert f"pid {holder.pid} " in (out / LOCK_FILE).read_text()
        rc = cli.main(["train", *BASE, f"output_dir={out}", "steps=3", "checkpoint.resume=auto"])
        err = capsys.readouterr().err
        assert rc == 1
        assert f"output_dir {out} is in use by another run (pid {holder.pid} on " in err, err
        # the holder's command: its override keys, not their values (a value may be a secret)
        assert "steps, checkpoint.every)" in err and "100000" not in err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    # the kernel released the dead holder's lock: the folder is usable at once
    step = load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))["step"]
    rc = cli.main(["train", *BASE, f"output_dir={out}", f"steps={step + 1}", "checkpoint.resume=auto"])
    assert rc == 0, capsys.readouterr().err
    assert f"pid {os.getpid()} " in (out / LOCK_FILE).read_text()


def test_fresh_run_refuses_a_folder_with_a_run_unless_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=2"]) == 0
    capsys.readouterr()
    before, runs = _snapshot(out), _runs(out)
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=3", "seed=5"]) == 2
    err = capsys.readouterr().err
    assert (f"output_dir {out} already holds a run (checkpoints up to step 2 and summary.json): continue it with "
            f"checkpoint.resume=auto, start afresh there with overwrite=true") in err
    assert _snapshot(out) == before and _runs(out) == runs
    # overwrite=true: the old checkpoints are gone, so a later resume=auto cannot mix the two runs
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=1", "seed=5", "overwrite=true"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert len(_runs(out)) == 2 and all(status == "FINISHED" for _, status in _runs(out))


@pytest.mark.parametrize("change, needles", [
    (["model.preset=tiny-moe"], ["model.preset: 'tiny-dense' in the checkpoint, 'tiny-moe' now"]),
    (["dual.constraints=[{measure: abs_prob_diff}, {measure: kl_k3, tolerance: 0.01}]"],
     ["dual.constraints: 1 constraint(s) in the checkpoint, 2 now"]),
    (["dual.constraints=[{measure: chi2}]", "task.name=sorting"],
     ["dual.constraints.0.measure: 'abs_prob_diff' in the checkpoint, 'chi2' now",
      "task.name: 'addition' in the checkpoint, 'sorting' now"]),
])
def test_resume_onto_an_incompatible_config_names_the_keys_and_changes_nothing(tmp_path, capsys, change, needles):
    out = tmp_path / "out"
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=2"]) == 0
    capsys.readouterr()
    before, runs = _snapshot(out), _runs(out)
    rc = cli.main(["train", *BASE, f"output_dir={out}", "steps=4", "checkpoint.resume=auto", *change])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"cannot resume from {out / 'checkpoints' / 'step_00000002'}: the config differs" in err
    for needle in needles:
        assert needle in err, err
    # config.yaml, checkpoints, summary, plots and the MLflow run are as the finished run left them
    assert _snapshot(out) == before and _runs(out) == runs == [(runs[0][0], "FINISHED")]
    # a compatible change (steps) resumes; a learning rate the restored optimiser would ignore is refused
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=3", "optim.lr=0.002",
                     "checkpoint.resume=auto"]) == 2
    assert "optim.lr: '0.001' in the checkpoint, '0.002' now" in capsys.readouterr().err
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=3", "checkpoint.resume=auto"]) == 0


def _metric_rows(db: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT key, step FROM metrics").fetchall()


def test_kill9_then_resume_logs_each_metric_step_once(tmp_path):
    """Killed after logging steps beyond its last checkpoint, the resumed run repeats those steps: each (metric,
    step) is stored once, and the values from before the kill are the ones kept (CPU, bitwise the same)."""
    out = tmp_path / "out"
    db = tmp_path / "mlflow.db"  # the store beside the run folder
    proc = subprocess.Popen(_cmd(out, "steps=100000", "checkpoint.every=4"), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def logged_past_checkpoint() -> bool:
        ckpt = find_resume_checkpoint(out / "checkpoints", "auto") if (out / "checkpoints").is_dir() else None
        if ckpt is None or not db.exists():
            return False
        try:
            steps = [s for k, s in _metric_rows(db) if k == "reward/mean"]
        except sqlite3.OperationalError:  # locked or not created yet
            return False
        return bool(steps) and max(steps) >= int(ckpt.name.split("_")[1]) + 2

    try:
        _wait_for(logged_past_checkpoint, proc, "two steps logged past a checkpoint")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    step = load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))["step"]
    logged = max(s for k, s in _metric_rows(db) if k == "reward/mean")
    assert logged > step
    done = subprocess.run(_cmd(out, f"steps={logged + 1}", "checkpoint.every=4", "checkpoint.resume=auto"),
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"already holds metrics of steps {step + 1}..{logged}" in done.stderr
    rows = _metric_rows(db)
    assert len(rows) == len(set(rows)), sorted(r for r in rows if rows.count(r) > 1)[:10]
    assert sorted(s for k, s in rows if k == "reward/mean") == list(range(1, logged + 2))
    assert sorted(s for k, s in rows if k == "eval/accuracy") == [0, logged + 1]
    history = load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))["history"]
    client = MlflowClient(f"sqlite:///{db.resolve()}")
    run_id = _runs(out)[0][0]
    stored = {m.step: m.value for m in client.get_metric_history(run_id, "reward/mean")}
    assert [stored[s] for s in range(1, logged + 2)] == [h["reward/mean"] for h in history]


def test_resume_auto_skips_a_truncated_state_with_a_consistent_manifest(tmp_path, caplog):
    ckpt_dir = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(ckpt_dir, step, {"step": step, "w": torch.arange(1000.0)}, keep=5)
    newest = ckpt_dir / "step_00000002"
    data = (newest / STATE_FILE).read_bytes()[:300]
    (newest / STATE_FILE).write_bytes(data)
    manifest = json.loads((newest / MANIFEST_FILE).read_text())
    manifest["files"][STATE_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (newest / MANIFEST_FILE).write_text(json.dumps(manifest))
    path, state = load_resume_checkpoint(ckpt_dir, "auto")
    assert path == ckpt_dir / "step_00000001" and state["step"] == 1
    assert f"skipping checkpoint {newest}: checkpoint {newest} verified but could not be loaded" in caplog.text
    with pytest.raises(Exception, match="verified but could not be loaded"):
        load_resume_checkpoint(ckpt_dir, str(newest))
    assert newest.is_dir()  # left for inspection
