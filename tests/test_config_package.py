"""The config fails one way (``require`` raising ``ConfigError``), asks its registries through one function and reads
every YAML file a user names through one bounded reader."""

from __future__ import annotations

import os

import pytest

from dcmdp.async_config import AsyncRolloutConfig
from dcmdp.config import ConfigError, DistConfig, PIDConfig, read_yaml_file, registry, require
from dcmdp.tune import load_tune_config
from trainers.config import ModelConfig, OptimConfig


def test_require_names_the_key_and_keeps_the_message_as_given():
    require(True, "steps", "never raised")
    with pytest.raises(ConfigError) as exc:
        require(0, "algo.minibatches", "must be >= 1, got 0")
    assert str(exc.value) == "config error at 'algo.minibatches': must be >= 1, got 0"
    with pytest.raises(ConfigError) as exc:
        require([], "space", "give at least one key", what="tune config")
    assert str(exc.value) == "tune config error at 'space': give at least one key"


@pytest.mark.parametrize("block, key", [
    (lambda: ModelConfig(dtype="float8"), "model.dtype"),
    (lambda: OptimConfig(precision="bf16", lr=-1.0), "optim.lr"),
    (lambda: DistConfig(backend="mpi"), "dist.backend"),
    (lambda: PIDConfig(delay=0), "dual.pid.delay"),
    (lambda: AsyncRolloutConfig(threads=-1), "async_rollout.threads"),
])
def test_a_block_out_of_bounds_raises_config_error_naming_its_key(block, key):
    """Every block's own check raises the config's error, not a bare ValueError, so each caller catches one type."""
    with pytest.raises(ConfigError, match=rf"^config error at '{key}': "):
        block().check()


def test_registry_is_the_registry_each_name_key_takes():
    from constraints.measures import MEASURES
    from constraints.penalties import PENALTIES
    from dcmdp.dual import DUAL_RULES
    from trainers.advantages import ADVANTAGES
    from trainers.config import SEQ_MASK_MODES
    from trainers.engines import ENGINES
    from trainers.losses import IS_MODES, POLICY_LOSSES
    from trainers.models import PRESETS
    from trainers.optim import PRECISIONS
    from trainers.tasks import TASKS

    expected = {"model.preset": PRESETS, "rollout.engine": ENGINES, "task.name": TASKS, "optim.precision": PRECISIONS,
                "algo.loss": POLICY_LOSSES, "algo.is_mode": IS_MODES, "algo.seq_mask.mode": SEQ_MASK_MODES,
                "algo.advantage": ADVANTAGES, "dual.rule": DUAL_RULES, "dual.penalty": PENALTIES,
                "dual.constraints[*].measure": MEASURES}
    for key, reg in expected.items():
        assert registry(key) is reg, key
    with pytest.raises(KeyError, match="seed"):
        registry("seed")


class _FileError(ValueError):
    pass


def test_the_one_reader_reads_a_file_as_each_kind_asks(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("a: 1\nb: [x, y]\n")
    data, values = read_yaml_file(good, _FileError, kind="experiment file", size_hint="", plain=True)
    assert data == {"a": 1, "b": ["x", "y"]} and type(data) is dict and values == 7
    layer, _ = read_yaml_file(good, _FileError, kind="config file", size_hint="")
    assert layer.b[1] == "y"
    bad = tmp_path / "bad.yaml"
    bad.write_text("about: [x\n")
    with pytest.raises(_FileError) as exc:
        read_yaml_file(bad, _FileError, kind="experiment file", name="bad.yaml", size_hint="", plain=True,
                       not_yaml="{name}: not a readable YAML file: {one_line}")
    assert str(exc.value).startswith("bad.yaml: not a readable YAML file: ") and "\n" not in str(exc.value)
    with pytest.raises(_FileError, match=f"^cannot parse config file {bad}: "):
        read_yaml_file(bad, _FileError, kind="config file", size_hint="")
    with pytest.raises(_FileError, match=f"^config file not found: {tmp_path / 'none.yaml'}$"):
        read_yaml_file(tmp_path / "none.yaml", _FileError, kind="config file", size_hint="")


def test_the_one_reader_refuses_a_fifo_and_a_folder_before_opening_them(tmp_path):
    """A FIFO would block the reader until a writer came: it is refused by its kind, never opened."""
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(_FileError, match=r"is not a regular file \(a FIFO, a named pipe\); name a YAML file"):
        read_yaml_file(fifo, _FileError, kind="config file", size_hint="")
    folder = tmp_path / "tune.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match=f"^tune file {folder} is a directory, not a file; name a YAML file$"):
        load_tune_config(folder)
    with pytest.raises(ConfigError, match=f"^tune file not found: {tmp_path / 'none.yaml'}$"):
        load_tune_config(tmp_path / "none.yaml")
