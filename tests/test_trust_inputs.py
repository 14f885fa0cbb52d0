"""Inputs that a run must refuse at start, or honour, rather than act on silently: settings a resume cannot honour,
sizes no run can use, a reward timeout no run can wait for, numbers OmegaConf would read loosely, and the benchmark
runner's experiment files (docs/bad_inputs.md, "Round 3")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from dcmdp import cli
from dcmdp.config import ConfigError, flatten, load_config, resume_conflicts, to_yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=2", "threads=1", "progress=false", "rollout.max_new_tokens=3"]


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# ---------------------------------------------------------------------------------------------------- resume

@pytest.mark.parametrize("override, key", [
    ("optim.lr=0.5", "optim.lr"), ("optim.betas=[0.8,0.9]", "optim.betas"), ("optim.weight_decay=0.1",
                                                                              "optim.weight_decay"),
    ("optim.warmup_steps=3", "optim.warmup_steps"), ("seed=7", "seed"), ("cold_start.steps=3", "cold_start.steps"),
    ("dual.constraints[0].lambda_init=0.3", "dual.constraints.0.lambda_init"), ("model.init=random", "model.init"),
])
def test_a_key_a_resume_cannot_honour_is_a_conflict_naming_it(override, key):
    saved = flatten(load_config(None, []))
    lines = resume_conflicts(saved, load_config(None, [override]))
    assert len(lines) == 1 and lines[0].startswith(f"{key}: ") and "the new value would be ignored" in lines[0]


ANCHORED = ["dual.measure_at=updates", "dual.constraints[0].floor_slack=0.5", "dual.constraints[0].anchor=0.5",
            "dual.constraints[0].anchor_start=0", "dual.constraints[0].anchor_batches=1"]


@pytest.mark.parametrize("override, key", [
    ("dual.constraints[0].anchor=0.25", "dual.constraints.0.anchor"),
    ("dual.constraints[0].anchor=null", "dual.constraints.0.anchor"),
    ("dual.constraints[0].anchor_start=3", "dual.constraints.0.anchor_start"),
    ("dual.constraints[0].anchor_batches=2", "dual.constraints.0.anchor_batches"),
    ("dual.constraints[0].anchor_every=50", "dual.constraints.0.anchor_every"),
    ("dual.constraints[0].anchor_ratio=2", "dual.constraints.0.anchor_ratio"),
    ("dual.constraints[0].miss_rate=0.1", "dual.constraints.0.miss_rate"),
    ("dual.constraints[0].authority=1.0", "dual.constraints.0.authority"),
    ("dual.penalty=mean", "dual.penalty"),
])
def test_a_key_that_shapes_the_tolerance_or_the_dual_state_is_a_resume_conflict(override, key):
    """The anchored gap, its probe window and the multipliers live in the checkpoint's dual state: a new anchor (or
    none), window, miss rate or penalty would be written to config.yaml while the checkpoint's went on."""
    saved = flatten(load_config(None, ANCHORED))
    lines = resume_conflicts(saved, load_config(None, [*ANCHORED, override]))
    assert len(lines) == 1 and lines[0].startswith(f"{key}: ") and "the new value would be ignored" in lines[0], lines


def test_a_changed_measurement_point_is_a_resume_conflict():
    lines = resume_conflicts(flatten(load_config(None, [])), load_config(None, ["dual.measure_at=updates"]))
    assert len(lines) == 1, lines
    assert lines[0].startswith("dual.measure_at: 'rollout' in the checkpoint, 'updates' now ("), lines


def test_a_resume_with_a_new_anchor_or_none_is_refused_and_config_yaml_keeps_the_anchor(tmp_path, capsys):
    """A run anchored at 0.5 resumed with anchor=0.25 kept the checkpoint's c = F + g digit for digit while
    config.yaml said 0.25; anchor=null kept c = F + g while config.yaml said the anchor was off. Both exit 2 naming
    the key, and the folder is left as it was."""
    out = tmp_path / "out"
    argv = ["train", *TINY, *ANCHORED, "steps=1", f"output_dir={out}"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    for value, shown in (("0.25", "'0.25'"), ("null", "'None'")):
        assert cli.main([*argv, "steps=2", "checkpoint.resume=auto", f"dual.constraints[0].anchor={value}"]) == 2
        err = capsys.readouterr().err
        assert f"dual.constraints.0.anchor: '0.5' in the checkpoint, {shown} now (the anchored tolerance" in err, err
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before
    assert "anchor: 0.5" in (out / "config.yaml").read_text()


@pytest.mark.parametrize("override", ["cold_start.cache_dir=/elsewhere", "dual.constraints[0].tolerance=0.01",
                                      "algo.prompts_per_step=4", "optim.grad_clip=0.5", "steps=99"])
def test_a_key_a_resume_honours_may_change(override):
    assert resume_conflicts(flatten(load_config(None, [])), load_config(None, [override])) == []


def test_a_changed_lr_or_an_env_preset_is_refused_on_resume_and_nothing_changes(tmp_path, monkeypatch, capsys):
    """optim.lr changed on resume was ignored (the optimiser kept the checkpoint's) while config.yaml recorded the
    new value; an env-read model.preset resumed a dense run as MoE. Both now exit 2 naming the key, before the
    model is built, and the folder is left as it was."""
    monkeypatch.setenv("DCMDP_R_PRESET", "tiny-dense")
    out = tmp_path / "out"
    argv = ["train", *TINY, "steps=1", f"output_dir={out}", "model.preset=${oc.env:DCMDP_R_PRESET}"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert cli.main([*argv, "steps=2", "checkpoint.resume=auto", "optim.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr: '0.001' in the checkpoint, '0.5' now (the optimiser and its schedule continue" in err
    monkeypatch.setenv("DCMDP_R_PRESET", "tiny-moe")
    assert cli.main([*argv, "steps=2", "checkpoint.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "model.preset: 'tiny-dense' in the checkpoint, 'tiny-moe' now" in err
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before  # initial_model/, config.yaml, checkpoints: untouched
    assert "preset: ${oc.env:DCMDP_R_PRESET}" in (out / "config.yaml").read_text()


# ---------------------------------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("overrides, needle", [
    (["async_rollout.enabled=true", "rollout.engine=torch", "async_rollout.max_staleness=auto",
      "async_rollout.auto.max=1000000000"], "config error at 'async_rollout.auto.max': a staleness of 1000000000"),
    (["async_rollout.enabled=true", "rollout.engine=torch", "async_rollout.max_staleness=1000000000"],
     "config error at 'async_rollout.max_staleness': a staleness of 1000000000 is never reached"),
    (["task.digits=1000000000"], "config error at 'task.digits': 1000000000 digits do not fit the context"),
    (["algo.samples_per_prompt=100000000"], "config error at 'algo.prompts_per_step': 16 prompts x 100000000"),
    (["rollout.max_new_tokens=200", "model.preset=qwen3-8b", "model.init=random", "model.num_layers=1",
      "algo.prompts_per_step=4096", "algo.samples_per_prompt=256", "algo.minibatches=1"],
     "config error at 'rollout.max_new_tokens': 1048576 samples x 200 new tokens"),
    (["task.eval_size=100000000"], "config error at 'task.eval_size': 100000000 held-out prompts"),
    (["threads=100000"], "config error at 'threads': 100000 threads"),
    (["task.name=sorting", "task.items=1000000"], "config error at 'task.items': 1000000 items do not fit the context"),
    (["cold_start.batch_size=100000000"], "config error at 'cold_start.batch_size': 100000000 demonstrations"),
    (["task.reward_timeout=1e308"], "config error at 'task.reward_timeout': 1e+308 s per reward call is above 3600"),
    (["task.reward_timeout=7200"], "config error at 'task.reward_timeout': 7200 s per reward call"),
    (["task.reward_timeout=1e-9"], "config error at 'task.reward_timeout': 1e-09 s is too short for a call"),
])
def test_a_size_no_run_can_use_is_refused_at_start(overrides, needle):
    load_config(None, [])  # the imports it makes on its first call are no part of the check
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert needle in str(err.value), str(err.value)
    # refused before anything that size is made: about 0.5 MiB allocated (measured) where those sizes take gigabytes
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated while checking the config"


def test_threads_above_the_usable_cores_are_refused_naming_the_bound(monkeypatch):
    """The bound is the cores this process may run on (its affinity mask), not a constant: 3 threads on 2 usable
    cores are refused, 2 are accepted, for the trainer and the rollout worker alike."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    for key in ("threads", "async_rollout.threads"):
        with pytest.raises(ConfigError, match=rf"config error at '{key}': 3 threads, but this process may run on 2 "
                                              rf"core\(s\) .*use at most 2, or threads=auto"):
            load_config(None, [f"{key}=3"])
        load_config(None, [f"{key}=2"])


def test_check_and_train_refuse_threads_1000_with_the_machines_bound(tmp_path, capsys):
    from dcmdp.cpu import usable_cores

    cores = usable_cores()
    for command in ("check", "train"):
        assert cli.main([command, "threads=1000", f"output_dir={tmp_path / 'out'}"]) == 2
        err = capsys.readouterr().err
        assert f"config error at 'threads': 1000 threads, but this process may run on {cores} core(s)" in err, err
        assert f"use at most {cores}" in err
    assert not (tmp_path / "out").exists()


def test_a_curriculum_phase_longer_than_the_context_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"config error at 'task.curriculum\[1\].digits': prompts of 100 digits run "
                                          r"to \d+ characters, which with rollout.max_new_tokens=8 exceed the context"):
        load_config(None, ["model.preset=tiny-dense", "task.name=long_addition", "task.digits=4",
                           "task.curriculum=[{until_step: 5, digits: 4}, {digits: 100}]"])
    load_config(None, ["model.preset=tiny-dense", "task.name=long_addition", "task.digits=4",
                       "task.curriculum=[{until_step: 5, digits: 4}, {digits: 8}]"])


def test_every_shipped_config_still_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


# ------------------------------------------------------------------------------------------- loose readings

def test_a_boolean_given_a_number_other_than_0_or_1_is_refused():
    with pytest.raises(ConfigError, match="config error at 'algo.ess_lr_scale': expected true or false, got 2"):
        load_config(None, ["algo.ess_lr_scale=2"])
    assert load_config(None, ["algo.ess_lr_scale=1"]).algo.ess_lr_scale is True


def test_round_off_above_1_is_read_as_1_where_1_is_allowed():
    cfg = load_config(None, ["rollout.top_p=1.0000000000000002", "cold_start.target_accuracy=1.0000000000000002"])
    assert cfg.rollout.top_p == 1.0 and cfg.cold_start.target_accuracy == 1.0
    with pytest.raises(ConfigError, match="rollout.top_p"):
        load_config(None, ["rollout.top_p=1.000001"])


def test_too_stale_with_a_fixed_bound_is_refused():
    with pytest.raises(ConfigError, match="config error at 'async_rollout.too_stale': drop acts on batches staler"):
        load_config(None, ["async_rollout.enabled=true", "rollout.engine=torch", "async_rollout.max_staleness=2",
                           "async_rollout.too_stale=drop"])


def test_a_temperature_that_saturates_float32_sampling_is_refused():
    with pytest.raises(ConfigError, match="config error at 'rollout.temperature': 1e-30 is below 0.01"):
        load_config(None, ["rollout.temperature=1e-30"])
    load_config(None, ["rollout.temperature=0.05"])


def test_an_indexed_override_from_the_environment_is_recorded_as_written(monkeypatch):
    monkeypatch.setenv("DCMDP_TOL", "0.0123")
    cfg = load_config(None, ["dual.constraints[0].tolerance=${oc.env:DCMDP_TOL}"])
    assert cfg.dual.constraints[0].tolerance == 0.0123
    assert "tolerance: ${oc.env:DCMDP_TOL}" in to_yaml(cfg, public=True)


def test_an_env_tracking_uri_with_an_unreadable_password_is_refused_naming_the_variable(monkeypatch):
    from dcmdp.tracking import check_tracking_uri

    with pytest.raises(ConfigError) as err:
        check_tracking_uri("http://alice:QWxh/ZGRp+bg==@127.0.0.1:5000", "MLFLOW_TRACKING_URI")
    assert "config error at 'MLFLOW_TRACKING_URI': the tracking URI 'http://127.0.0.1:5000' cannot be used" in \
        str(err.value) and "QWxh" not in str(err.value)


def test_a_buffered_segment_is_sent_with_credentials_read_again_from_the_environment(monkeypatch):
    from dcmdp.tracking import _segment_uri

    header = {"uri": "http://h:5000/?x=1", "credentials_removed": True,
              "uri_as_written": "http://me:${oc.env:DCMDP_S_PW}@h:5000/?x=1"}
    monkeypatch.setenv("DCMDP_S_PW", "pw-now")
    assert _segment_uri(header, ()) == "http://me:pw-now@h:5000/?x=1"
    monkeypatch.delenv("DCMDP_S_PW")  # not set any more: a known URI of the same public form, else the header's
    assert _segment_uri(header, ("http://me:other@h:5000/?x=1",)) == "http://me:other@h:5000/?x=1"
    assert _segment_uri(header, ()) == "http://h:5000/?x=1"


def test_the_run_lock_records_override_keys_not_values():
    from dcmdp.checkpoint import public_command

    line = public_command(["/venv/bin/dcmdp", "train", "configs/default.yaml", "steps=2",
                           "tracking.uri=http://u:pw-4711@h/?token=t0k"])
    assert line == "dcmdp train configs/default.yaml (overrides, values not recorded: steps, tracking.uri)"


# ------------------------------------------------------------------------------------- the benchmark runner

EXPERIMENT = """about: x
base: {base}
levels: {{a: {{about: a, overrides: []}}}}
methods: {{m: {{about: m, overrides: [{override}]}}}}
profiles: {{quick: {{about: q, cells: [{{levels: [a], methods: [m], N: [{n}], seeds: [0]}}]}}}}
"""


@pytest.mark.parametrize("text, needle", [
    ("about: [unclosed\n", "bad.yaml: not a readable YAML file: "),
    (EXPERIMENT.format(base="configs/missing.yaml", override="steps=1", n=1),
     "bad.yaml.base: no config file 'configs/missing.yaml'"),
    (EXPERIMENT.format(base="configs/default.yaml", override="steps=1", n="two"),
     "bad.yaml.profiles.quick.cells[0].N[0]: expected an integer, got 'two'"),
    (EXPERIMENT.format(base="configs/default.yaml", override="algo.nosuch=1", n=1),
     "run a/m/N=1/seed=0 of profile 'quick' (base configs/default.yaml): unknown config key 'algo.nosuch'"),
])
def test_the_benchmark_runner_names_the_file_and_key_of_a_bad_experiment(tmp_path, text, needle):
    (tmp_path / "bad.yaml").write_text(text)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), str(tmp_path / "bad.yaml"),
                           "--no-train", "--bench-dir", str(tmp_path / "b"), "--results", str(tmp_path / "r")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert needle in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_full_disk_is_one_line_per_failure_naming_the_path_not_a_traceback_per_query(tmp_path):
    """A 1 MiB tmpfs as the output folder (in a private user+mount namespace): the local MLflow store and the
    checkpoint both hit ENOSPC. Each failure is one line; the last names the checkpoint folder."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            'mount -t tmpfs -o size=64k dcmdp_probe "$1"', "sh", str(mnt)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unprivileged user+mount namespaces are not available here")
    argv = [sys.executable, "-m", "dcmdp.cli", "train", *TINY, "steps=3", "checkpoint.every=2",
            f"output_dir={mnt / 'out'}"]
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           'mount -t tmpfs -o size=1m dcmdp_full "$1" && shift && exec "$@"', "sh", str(mnt), *argv],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"dcmdp: error: could not write checkpoint step 2 to {mnt / 'out' / 'checkpoints'}: No space left on device")
