"""A checkpoint carries its run's identity: another run's checkpoint is refused unless named, and then starts a new
MLflow run linked to its parent; pruning never deletes another run's checkpoint; ``steps`` cannot go below the
checkpoint; a run never overwrites a config.yaml it did not write; a killed run's MLflow run does not stay
RUNNING. Runs: tiny-dense, 2 x 2 samples, 1-3 steps."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.checkpoint import CONFIG_HEADER, RunFolderError, read_run_file, save_checkpoint
from dcmdp.config import ConfigError, load_config
from dcmdp.loop import train
from dcmdp.tracking import local_store_uri

torch.set_num_threads(1)


def _overrides(out, *extra: str) -> list[str]:
    return ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
            "algo.minibatches=1", "task.eval_size=4", "steps=2", "threads=1", "progress=false",
            "rollout.max_new_tokens=4", "checkpoint.every=1", "checkpoint.keep=5", f"output_dir={out}", *extra]


def _client(out: Path) -> MlflowClient:
    return MlflowClient(local_store_uri(out))


def _runs(out: Path) -> dict[str, object]:
    client = _client(out)
    exp = client.get_experiment_by_name("dcmdp")
    return {r.info.run_id: r for r in client.search_runs(exp.experiment_id)}


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.suffix not in (".db", ".db-journal", ".lock")}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    import os

    old = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        out = tmp_path_factory.mktemp("a") / "out"
        train(load_config(None, _overrides(out)))
    finally:
        if old is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return out


def _copy_run(run: Path, out: Path) -> None:
    """A copy of the run folder with a copy of its store inside it: a folder with a store of its own logs there."""
    shutil.copytree(run, out)
    shutil.copy(run.parent / "mlflow.db", out / "mlflow.db")


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_a_run_records_its_identity_in_the_folder_and_every_checkpoint(run_a):
    owner = read_run_file(run_a)
    assert len(owner["uid"]) == 32 and owner["run_id"] in _runs(run_a)
    for ckpt in (run_a / "checkpoints").iterdir():
        assert json.loads((ckpt / "manifest.json").read_text())["run_uid"] == owner["uid"]
        state = torch.load(ckpt / "state.pt", weights_only=False)
        assert state["run"] == {"uid": owner["uid"], "output_dir": str(run_a.resolve())}
    assert (run_a / "config.yaml").read_text().startswith(CONFIG_HEADER)


def test_another_runs_checkpoint_copied_into_checkpoints_is_not_resumed_by_auto(run_a, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(run_a / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000002")
    (out / "run.json").write_text(json.dumps({"uid": "0" * 32, "run_id": None}))
    before = _digest(out)
    with pytest.raises(RunFolderError, match=r"belongs to another run .* not to the run of output_dir .*"
                                             r"checkpoint.resume=auto continues a folder's own run only"):
        train(load_config(None, _overrides(out, "checkpoint.resume=auto", "steps=3")))
    # named while it lies in checkpoints/: refused too (a new run there would prune among another run's files)
    with pytest.raises(RunFolderError, match="move it out of checkpoints/ and name it"):
        train(load_config(None, _overrides(out, f"checkpoint.resume={out / 'checkpoints' / 'step_00000002'}",
                                           "steps=3")))
    assert _digest(out) == before


def test_another_folders_checkpoint_named_explicitly_starts_a_new_linked_mlflow_run(run_a, tmp_path):
    """The metrics go to a run of this folder's store (not to the parent's id, which this store lacks), tagged with
    its parent; the parent's folder is not touched."""
    parent_before, parent_runs = _digest(run_a), _runs(run_a)
    out = tmp_path / "c"
    summary = train(load_config(None, _overrides(out, f"checkpoint.resume={run_a / 'checkpoints' / 'step_00000002'}",
                                                 "steps=3")))
    runs = _runs(out)
    assert list(runs) == [summary.run_id] and summary.run_id not in parent_runs
    run = runs[summary.run_id]
    [parent_id] = parent_runs
    assert run.info.status == "FINISHED" and run.data.tags["dcmdp.resumed_from_run"] == parent_id
    assert [m.step for m in _client(out).get_metric_history(summary.run_id, "reward/mean")] == [3]
    owner = read_run_file(out)
    assert owner["uid"] != read_run_file(run_a)["uid"] and owner["resumed_from"]["run_id"] == parent_id
    assert _digest(run_a) == parent_before and _runs(run_a).keys() == parent_runs.keys()


def test_pruning_keeps_another_runs_checkpoint_and_counts_only_its_own(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step, uid in ((1, "a"), (2, "a"), (9, "b")):
        save_checkpoint(ckpt, step, {"step": step, "run": {"uid": uid}}, keep=5)
    save_checkpoint(ckpt, 3, {"step": 3, "run": {"uid": "a"}}, keep=2)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000003", "step_00000009"]


def test_steps_below_the_checkpoint_is_a_config_error_that_changes_nothing(run_a, capsys):
    before = _digest(run_a)
    with pytest.raises(ConfigError, match=r"config error at 'steps': steps=1 is below the step of the checkpoint it "
                                          r"resumes \(2, "):
        train(load_config(None, _overrides(run_a, "checkpoint.resume=auto", "steps=1")))
    assert cli.main(["train", *_overrides(run_a, "checkpoint.resume=auto", "steps=1")]) == 2
    assert "config error at 'steps'" in capsys.readouterr().err
    assert _digest(run_a) == before


def test_overwrite_after_a_kill_marks_the_old_mlflow_run_killed_and_keeps_the_users_config(run_a, tmp_path):
    out = tmp_path / "d"
    _copy_run(run_a, out)
    [old_id] = _runs(out)
    _client(out).update_run(old_id, status="RUNNING")  # what kill -9 leaves behind
    mine = "# my settings\nsteps: 2  # keep this comment\n"
    (out / "config.yaml").write_text(mine)
    summary = train(load_config(None, _overrides(out, "overwrite=true", "steps=1")))
    runs = _runs(out)
    assert runs[old_id].info.status == "KILLED" and runs[summary.run_id].info.status == "FINISHED"
    assert (out / "config.yaml").read_text() == mine
    assert (out / "config.resolved.yaml").read_text().startswith(CONFIG_HEADER)


def test_another_runs_checkpoint_named_for_a_folder_with_its_own_run_needs_overwrite(run_a, tmp_path):
    state = torch.load(run_a / "checkpoints" / "step_00000002" / "state.pt", weights_only=False)
    state["run"] = {"uid": "f" * 32, "output_dir": "/elsewhere/out"}
    other = save_checkpoint(tmp_path / "other", 2, state, keep=1)
    out = tmp_path / "e"
    _copy_run(run_a, out)
    before = _digest(out)
    with pytest.raises(RunFolderError, match=rf"output_dir {out} already holds a run \(checkpoints up to step 2 and "
                                             rf"summary.json\), and checkpoint {other} belongs to another run "
                                             rf"f{{32}} \(MLflow run \w+, written in /elsewhere/out\)"):
        train(load_config(None, _overrides(out, f"checkpoint.resume={other}", "steps=3")))
    assert _digest(out) == before


def test_a_run_killed_before_its_first_checkpoint_is_marked_killed_by_the_next_run(run_a, tmp_path):
    """No checkpoint and no summary: the next run needs no overwrite, and the dead run's MLflow run is ended."""
    out = tmp_path / "f"
    _copy_run(run_a, out)
    shutil.rmtree(out / "checkpoints")
    (out / "summary.json").unlink()
    [old_id] = _runs(out)
    _client(out).update_run(old_id, status="RUNNING")
    summary = train(load_config(None, _overrides(out, "steps=1")))
    runs = _runs(out)
    assert runs[old_id].info.status == "KILLED" and runs[summary.run_id].info.status == "FINISHED"
