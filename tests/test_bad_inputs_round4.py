"""Round 4 of docs/bad_inputs.md: every input a user gives is read in time and memory linear in its size, with an
exit-2 error naming the file or key for what is too deep or too large, and no traceback.

``CATALOGUE`` holds one case per row of the "Round 4" table (the table names each case's id); ``test_catalogue``
runs each through ``dcmdp check`` and asserts exit 2, the expected line and no traceback, and
``test_the_round_4_table_and_the_catalogue_agree`` keeps the two in step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import DictConfig, OmegaConf

from dcmdp import cli
from dcmdp.config import load as config_module  # the module whose _override_problem the count wraps
from dcmdp.checkpoint import RunFolderError, find_resume_checkpoint, load_resume_checkpoint, save_checkpoint
from dcmdp.config import MAX_CONFIG_DEPTH, ConfigError, compose_with_problems, load_config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bad_inputs.md"
JSONL = ["task.name=jsonl", "task.path=sums.jsonl", "task.eval_size=4", "cold_start.steps=0"]


def _sums(d: Path) -> None:
    with open(d / "sums.jsonl", "w") as f:
        for a in range(10):
            f.write(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n")
    (d / "rewards.py").write_text("def score(p, c, e):\n    return 1.0\n")


def _deep_block_yaml(d: Path) -> list[str]:
    # 1,000 levels of block mappings: PyYAML's composer and OmegaConf recurse once per level
    (d / "run.yaml").write_text("".join(f"{'  ' * i}k{i}:\n" for i in range(1000)) + "  " * 1000 + "v: 1\n")
    return ["run.yaml"]


def _deep_flow_yaml(d: Path) -> list[str]:
    (d / "run.yaml").write_text("steps: 3\nalgo: {minibatches: " + "[" * 5000 + "]" * 5000 + "}\n")
    return ["run.yaml"]


def _alias_bomb(d: Path) -> list[str]:
    # 9 levels of 10 aliases each: 10^9 values once expanded, 100 lines of text
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    (d / "run.yaml").write_text("steps: 3\n" + "\n".join(lines) + "\n")
    return ["run.yaml"]


def _huge_file(d: Path) -> list[str]:
    (d / "run.yaml").write_text("steps: 3\n" + "# padding\n" * 200_000)
    return ["run.yaml"]


def _three_unknown_keys(d: Path) -> list[str]:
    (d / "run.yaml").write_text("stepz: 3\nalgo:\n  minibatchs: 2\n  loss: minirl\ndual:\n  constraints:\n"
                                "    - measure: kl_k3\n      tolerence: 0.01\n")
    return ["run.yaml"]


def _deep_override_value(d: Path) -> list[str]:
    return ["algo.minibatches=" + "[" * 1000 + "]" * 1000]


def _deep_override_key(d: Path) -> list[str]:
    return ["algo" + ".x" * 1000 + "=1"]


def _many_overrides_one_typo(d: Path) -> list[str]:
    return [f"seed={i}" for i in range(10_000)] + ["algo.minibatchs=4"]


def _deep_jsonl_line(d: Path) -> list[str]:
    _sums(d)
    with open(d / "sums.jsonl", "a") as f:
        f.write('{"prompt": "1+1=", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return [*JSONL, "task.reward=rewards.py:score"]


def _reward_import_exits(d: Path) -> list[str]:
    _sums(d)
    (d / "bye.py").write_text("import os\nos._exit(0)\ndef score(p, c, e):\n    return 1.0\n")
    return [*JSONL, "task.reward=bye.py:score"]


def _reward_import_hangs(d: Path) -> list[str]:
    _sums(d)
    (d / "slow.py").write_text("import time\ntime.sleep(1000)\ndef score(p, c, e):\n    return 1.0\n")
    return [*JSONL, "task.reward=slow.py:score", "task.reward_load_timeout=1"]


# case id -> (writes the inputs into a folder and returns the command's arguments, a line the error must hold)
CATALOGUE: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "deep-yaml-block": (_deep_block_yaml, f"cannot read config file run.yaml: nested more than {MAX_CONFIG_DEPTH} "
                                          f"levels deep (line {MAX_CONFIG_DEPTH + 1})"),
    "deep-yaml-flow": (_deep_flow_yaml, f"cannot read config file run.yaml: nested more than {MAX_CONFIG_DEPTH} "
                                        f"levels deep (line 2)"),
    "yaml-alias-bomb": (_alias_bomb, "cannot read config file run.yaml: more than 100,000 values once its aliases"),
    "huge-config-file": (_huge_file, "config file run.yaml is larger than 1 MiB"),
    "three-unknown-keys": (_three_unknown_keys, "unknown config key 'dual.constraints[0].tolerence'"),
    "deep-override-value": (_deep_override_value, "bad value for 'algo.minibatches': nested more than"),
    "deep-override-key": (_deep_override_key, "nested more than 32 levels deep; a config's keys are at most"),
    "10000-overrides-one-typo": (_many_overrides_one_typo, "unknown config key 'algo.minibatchs'; did you mean"),
    "deep-jsonl-line": (_deep_jsonl_line, "line 11: JSON nested too deep to read"),
    "reward-import-exits": (_reward_import_exits, "importing it ended the worker process (exit code 0)"),
    "reward-import-hangs": (_reward_import_hangs, "importing it did not finish within 1 s (task.reward_load_timeout"),
}


@pytest.mark.parametrize("case", sorted(CATALOGUE))
def test_catalogue(case, tmp_path, monkeypatch, capsys, caplog):
    """``dcmdp check`` on each case: exit 2, the line naming the file or key, no traceback."""
    write, expected = CATALOGUE[case]
    monkeypatch.chdir(tmp_path)
    args = write(tmp_path)
    rc = cli.main(["check", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert expected in err, err
    assert "Traceback" not in err + caplog.text


def test_the_round_4_table_and_the_catalogue_agree():
    """Every row of the Round 4 table names a catalogue case or a test of this repository that exists, and every
    catalogue case has its row."""
    text = DOC.read_text()
    table = text.split("## Round 4", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert rows
    cases = set(re.findall(r"test_catalogue\[([\w-]+)\]", table))
    assert cases == set(CATALOGUE)
    for file, name in re.findall(r"`(test_\w+\.py)::(test_\w+)", table):
        source = (ROOT / "tests" / file).read_text()
        assert f"def {name}(" in source, f"{file}::{name} named in docs/bad_inputs.md does not exist"
    assert all("test_" in row for row in rows)


def test_check_lists_every_unknown_key_of_a_config_file_at_any_depth(tmp_path, monkeypatch, capsys):
    """Three unknown keys at three depths (top level, a block, a list element) are all named at once, with the
    rest of the file still checked (``algo.loss: minirl`` is read)."""
    monkeypatch.chdir(tmp_path)
    _three_unknown_keys(tmp_path)
    rc = cli.main(["check", "run.yaml"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown config key 'stepz'; did you mean 'steps'?" in err
    assert "unknown config key 'algo.minibatchs'; did you mean 'minibatches'?" in err
    assert "unknown config key 'dual.constraints[0].tolerence'; did you mean 'tolerance'?" in err
    cfg, found = compose_with_problems("run.yaml", [])
    assert len(found) == 3 and cfg.algo.loss == "minirl" and cfg.dual.constraints[0].measure == "kl_k3"
    with pytest.raises(ConfigError, match="unknown config key 'stepz'"):  # a run names the first
        load_config("run.yaml")


def test_overrides_are_checked_in_linear_time_with_the_messages_of_a_run(monkeypatch):
    """10,000 overrides, each given twice, and one typo: the typo alone is named, each distinct override is tried
    once, and the whole-config work (merges, copies, typed objects) does not grow with the overrides: the same for
    5,000 as for 10,000 (the time itself: ``benchmarks/refusals.py``). Each problem names what a run names for that
    override alone (the same message but for how OmegaConf spells a type it cannot convert)."""
    calls: dict[str, int] = {}

    def counted(name: str, real: Callable) -> Callable:
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(config_module, "_override_problem", counted("tried", config_module._override_problem))
    for name in ("merge", "to_object", "to_container"):
        monkeypatch.setattr(OmegaConf, name, staticmethod(counted(name, getattr(OmegaConf, name))))
    monkeypatch.setattr(DictConfig, "__deepcopy__", counted("deepcopy", DictConfig.__deepcopy__))

    def work(n: int) -> dict[str, int]:
        calls.clear()
        cfg, found = compose_with_problems(None, [f"seed={i}" for i in range(n)] * 2 + ["algo.minibatchs=4"])
        assert cfg.seed == n - 1 and [k for k, _ in found] == ["algo.minibatchs"]
        assert calls.pop("tried") == n + 1
        return calls.copy()

    small, large = work(5_000), work(10_000)
    assert small["merge"] >= 1 and small == large, (small, large)
    bad = ["algo.std_normalize=maybe", "optim.betas=0.9", "algo.ess_lr_scale=2", "dual.constraints[3].lr=1",
           "steps", "dual.enabled=false", "algo.minibatches=[[[[" + "]" * 4, "seed=1"]
    cfg, found = compose_with_problems(None, bad)
    assert cfg.seed == 1 and len(found) == len(bad) - 1
    for (key, exc), override in zip(found, bad):
        with pytest.raises(ConfigError) as alone:
            load_config(None, [override], check=False)
        assert str(exc).split(":")[0] == str(alone.value).split(":")[0], override
        assert str(exc) == str(alone.value) or "could not be converted" in str(exc), override


def test_a_config_nested_too_deep_exits_2_from_check_and_train_without_a_traceback(tmp_path):
    """The command as a user runs it (a new process): 1,000-deep YAML is one line naming the file, exit 2."""
    _deep_block_yaml(tmp_path)
    for command in ("check", "train"):
        done = subprocess.run([sys.executable, "-m", "dcmdp.cli", command, "run.yaml"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600,
                              env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        assert done.returncode == 2, done.stderr
        assert "run.yaml: nested more than 32 levels deep (line 33)" in done.stderr
        assert "Traceback" not in done.stderr


def test_yaml_anchors_within_the_limits_still_load(tmp_path):
    """Aliases are counted, not refused: a config reusing one constraint's settings loads."""
    (tmp_path / "run.yaml").write_text("dual:\n  constraints:\n    - &c {measure: abs_prob_diff, tolerance: 0.01}\n"
                                       "    - {<<: *c, measure: kl_k3}\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert [c.measure for c in cfg.dual.constraints] == ["abs_prob_diff", "kl_k3"]
    assert cfg.dual.constraints[1].tolerance == 0.01


def _checkpoints(tmp_path: Path) -> Path:
    ckpt_dir = tmp_path / "out" / "checkpoints"
    for step in (1, 2):
        save_checkpoint(ckpt_dir, step, {"step": step, "run_uid": "own"}, keep=5)
    return ckpt_dir


def test_a_checkpoint_renamed_or_copied_into_checkpoints_is_refused_by_auto_and_changes_nothing(tmp_path):
    """A step_3 checkpoint copied in as step_00000009 (every file verifies, the manifest says step 3): resume=auto
    refuses naming it, instead of skipping it with a warning and resuming an older step; nothing is moved."""
    import shutil

    ckpt_dir = _checkpoints(tmp_path)
    other = save_checkpoint(tmp_path / "other", 3, {"step": 3, "run_uid": "another"}, keep=5)
    shutil.copytree(other, ckpt_dir / "step_00000009")
    before = sorted(p.name for p in ckpt_dir.iterdir())
    for find in (find_resume_checkpoint, load_resume_checkpoint):
        with pytest.raises(RunFolderError, match=r"holds step 3 \(its manifest; every file verifies\) under the name "
                                                 r"step_00000009: it was renamed or copied into"):
            find(ckpt_dir, "auto")
    assert sorted(p.name for p in ckpt_dir.iterdir()) == before


def test_a_checkpoint_whose_manifest_step_was_damaged_is_still_skipped(tmp_path):
    """The same mismatch from a damaged file (its state no longer matches the manifest) is a corrupt checkpoint:
    skipped with a warning, the next older one resumed."""
    ckpt_dir = _checkpoints(tmp_path)
    newest = ckpt_dir / "step_00000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["step"] = 7
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with open(newest / "state.pt", "r+b") as f:  # a flipped byte too: the files no longer verify
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    path, state = load_resume_checkpoint(ckpt_dir, "auto")
    assert path.name == "step_00000001" and state["step"] == 1


def test_an_output_dir_from_the_environment_is_as_written_in_summary_json_but_its_store_uri(tmp_path, monkeypatch):
    """``output_dir=${oc.env:OUT}``: summary.json holds the interpolation as written, and the local store's URI
    resolved, by design (docs/bad_inputs.md, Round 4): it is the address ``dcmdp report`` and ``mlflow ui`` open."""
    from dcmdp.loop import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("OUT", str(tmp_path / "run-folder"))
    cfg = load_config(None, ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2",
                             "algo.samples_per_prompt=2", "rollout.max_new_tokens=3", "task.eval_size=4", "steps=1",
                             "threads=1", "progress=false", "output_dir=${oc.env:OUT}"])
    train(cfg)
    summary = json.loads((tmp_path / "run-folder" / "summary.json").read_text())
    assert summary["output_dir"] == "${oc.env:OUT}"
    # the local store is shared by the runs of the folder that holds the run folder (dcmdp.tracking.local_store_folder)
    assert summary["tracking_uri"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert [k for k, v in summary.items() if isinstance(v, str) and str(tmp_path) in v] == ["tracking_uri"]


@pytest.mark.parametrize("body, why", [
    ("[" * 100_000 + "]" * 100_000, "manifest.json is nested more than 32 levels deep"),
    ('{"pad": "' + "x" * (2 << 20) + '"}', "manifest.json is larger than 1 MiB"),
])
def test_a_manifest_nested_too_deep_or_too_large_is_an_invalid_checkpoint_not_a_traceback(tmp_path, body, why):
    """Read in bounded time and memory: resume=auto skips it (the older one resumed), a named resume refuses it, the
    folder's run.json of the same shape reads as no owner."""
    from dcmdp.checkpoint import CheckpointError, read_run_file

    ckpt_dir = _checkpoints(tmp_path)
    (ckpt_dir / "step_00000002" / "manifest.json").write_text(body)
    path, state = load_resume_checkpoint(ckpt_dir, "auto")
    assert path.name == "step_00000001" and state["step"] == 1
    with pytest.raises(CheckpointError, match=f"is not valid: unreadable manifest.json: {why}"):
        find_resume_checkpoint(ckpt_dir, str(ckpt_dir / "step_00000002"))
    (tmp_path / "out" / "run.json").write_text(body)
    assert read_run_file(tmp_path / "out") == {}
