"""Round 5 of docs/bad_inputs.md: the cases a command line alone cannot make (a file only root could read, a
trained run's folder, a second process at the same time). Each asserts the line the user reads and its exit code
on real files and processes."""

from __future__ import annotations

import json
import shutil
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
