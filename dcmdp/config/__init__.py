"""The run config: component dataclasses composed with OmegaConf, YAML files and dotlist overrides.

Unknown keys are errors that name the key and its nearest valid spelling; bounds are checked by each
component's ``check()``; checks that span components live in ``validate()`` and raise, never rewrite. A mode
(policy loss, IS mode, sequence mask, rejection measure, dual rule, ...) owns its knobs: a knob of a mode that is
not selected is an error naming both (``MODE_SELECTORS``, ``_validate_modes``).
"""

from __future__ import annotations

import difflib
import functools
import io
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from constraints.config import ConstraintConfig
from dcmdp import redact
from dcmdp.async_config import AsyncRolloutConfig
from dcmdp.dual_config import FLOOR_KINDS, DualConfig
from dcmdp.dual_config import CONTEXT_KINDS, ContextConfig, CouplingConfig, PIDConfig  # noqa: F401 (re-exported)
from dcmdp.errors import ConfigError  # re-exported: every caller catches it from here
from trainers.config import RENAMED_KEYS as TRAINER_RENAMED_KEYS
from trainers.errors import not_a_regular_file
from trainers.config import AlgoConfig, ColdStartConfig, ModelConfig, OptimConfig, RolloutConfig, TaskConfig

if TYPE_CHECKING:
    from trainers.engines import EngineCapabilities


# Keys that were replaced, with what replaces them: the error for an old key names its replacement.
RENAMED_KEYS = {
    **TRAINER_RENAMED_KEYS,
    "dual.enabled": "dual.rule=off (for dual.enabled=false; dual.enabled=true was the default, dual.rule=projected)",
    "dual.fixed": "dual.rule=fixed (for dual.fixed=true; lambda held at lambda_init)",
}


@dataclass
class TrackingConfig:
    # MLflow tracking URI; empty uses $MLFLOW_TRACKING_URI, else a local store under output_dir.
    uri: Optional[str] = None
    # MLflow experiment name.
    experiment: str = "dcmdp"
    # MLflow run name (empty: generated from the config).
    run_name: Optional[str] = None
    # Directory for metrics buffered while the tracking server is unreachable.
    buffer_dir: Optional[str] = None
    # MLflow run id of a parent run (``dcmdp tune``): the run is created nested under it.
    parent_run_id: Optional[str] = None
    # log_metrics hands the step's metrics to a sender thread and returns (dcmdp.tracking); off sends in the step.
    async_log: bool = True
    # Append each step's metrics as one JSON line to this file (``dcmdp tune`` follows, and may prune, a trial
    # through it); null: none.
    progress_file: Optional[str] = None
    # Log to MLflow; false: no MLflow run at all (the console, summary.json, dual.png and checkpoints still hold
    # everything), for throwaway speed runs or a machine without mlflow installed.
    enabled: bool = True


@dataclass
class CheckpointConfig:
    # Save a checkpoint every this many steps (0: only at the end and on signals).
    every: int = 0
    # Keep the last N checkpoints.
    keep: int = 2
    # Resume: empty (fresh run) | auto (latest valid checkpoint in output_dir) | a checkpoint path.
    resume: Optional[str] = None
    # Write a checkpoint after the last step; false only for throwaway speed runs (a real-size checkpoint is tens of
    # GB and minutes of disk time): such a run cannot be resumed or evaluated from its folder.
    at_end: bool = True


@dataclass
class GuardConfig:
    # Stop the run (after writing a checkpoint) after this many consecutive bad steps: every sample dropped
    # as non-finite, or a mini-batch update skipped for a non-finite loss or gradient norm.
    max_bad_steps: int = 5
    # Stop the run (exit 2, after writing a checkpoint; MLflow run FAILED) when the reward fails (raises, exits, times
    # out, passes its memory limit or returns no finite number) on more than this share of a step's samples for
    # reward_fail_steps consecutive steps: a run whose every reward is 0 trains on nothing.
    reward_fail_share: float = 0.5
    # Consecutive steps of reward failures above reward_fail_share that stop the run.
    reward_fail_steps: int = 3


@dataclass
class DistConfig:
    # Process-group backend under torchrun: auto (nccl when the run trains on CUDA, gloo on the CPU) | gloo | nccl.
    backend: str = "auto"
    # FSDP2 compute dtype of the sharded model (master weights stay float32): fp32 | bf16.
    param_dtype: str = "fp32"
    # FSDP2 dtype of the gradient reduce-scatter: fp32 | bf16.
    reduce_dtype: str = "fp32"
    # Under torchrun with ONE process, join a process group and shard with FSDP2 anyway: the distributed path (the
    # backend, FSDP2, sharded checkpoints) on a one-GPU machine. Without it world size 1 is the plain single-process
    # run.
    shard_one_process: bool = False

    def check(self, prefix: str = "dist") -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"config error at '{prefix}.backend': got {self.backend!r}, expected auto, gloo or nccl")
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(self, key) not in ("fp32", "bf16"):
                raise ValueError(f"config error at '{prefix}.{key}': got {getattr(self, key)!r}, expected fp32 or bf16")


@dataclass
class RunConfig:
    # Seed of everything (python, numpy, torch, task generators).
    seed: int = 0
    # RL steps (rollout batches).
    steps: int = 60
    # Evaluate on the held-out set every this many steps (0: only before and after).
    eval_every: int = 0
    # Output directory of this run (checkpoints, plots, local MLflow store).
    output_dir: str = "outputs/default"
    # torch intra-op threads: an int from 1 to the cores this process may run on, or auto (the cores free when the
    # run starts; see dcmdp.cpu).
    threads: Union[int, str] = "auto"
    # Where the model, optimiser, engine and batches live: auto (cuda:LOCAL_RANK when CUDA is available, else the
    # CPU; logged with the reason at start) | cpu | cuda | cuda:N. See dcmdp.device.
    device: str = "auto"
    # Show a progress bar; null: only when stdout and stderr are terminals. Without a bar, one line per log_every
    # steps goes to the log (step, reward, accuracy, lambda and D-hat per constraint, step time).
    progress: Optional[bool] = None
    # Steps between two console lines when no progress bar is shown.
    log_every: int = 10
    # Start a fresh run in an output_dir that holds an earlier run's checkpoints or summary.json, removing only what
    # the run its run.json names wrote (anything else stays, named; no run.json: refused, nothing removed; its MLflow
    # run stays). Without it such a folder is refused unless checkpoint.resume is set.
    overwrite: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dual: DualConfig = field(default_factory=DualConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)


def _valid_keys(node: Any) -> list[str]:
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _nearest(key: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _key_problems(user: Any, schema: Any, prefix: str = "", *, prune: bool = False) -> list[ConfigError]:
    """One ConfigError per key of ``user`` that the structured ``schema`` does not have, at any depth (list elements
    of dataclasses included), in the order they appear; ``prune``: those keys are also removed from ``user``, so the
    rest of it can be composed."""
    if not isinstance(user, DictConfig) or not isinstance(schema, DictConfig):
        return []
    valid = _valid_keys(schema)
    found, unknown = [], []
    for key in user.keys():
        path = f"{prefix}{key}"
        if key not in valid:
            unknown.append(key)
            found.append(ConfigError(f"config key '{path}' was replaced: use {RENAMED_KEYS[path]}"
                                     if path in RENAMED_KEYS else
                                     f"unknown config key '{path}'{_nearest(str(key), valid)}"))
            continue
        sub_schema = schema._get_node(key)
        sub_user = user._get_node(key)
        if isinstance(sub_schema, ListConfig) and isinstance(sub_user, ListConfig):
            elem = _list_element_schema(schema, key)
            if elem is not None:
                for i, item in enumerate(sub_user):
                    found += _key_problems(item, elem, f"{path}[{i}].", prune=prune)
        else:
            found += _key_problems(sub_user, sub_schema, f"{path}.", prune=prune)
    if prune:
        for key in unknown:
            del user[key]
    return found


def _list_element_schema(schema: DictConfig, key: str) -> Optional[DictConfig]:
    obj_type = OmegaConf.get_type(schema)
    if obj_type is None or not is_dataclass(obj_type):
        return None
    for f in fields(obj_type):
        if f.name == key:
            args = getattr(f.type, "__args__", None)
            if isinstance(f.type, str):
                if "ConstraintConfig" in f.type:
                    return OmegaConf.structured(ConstraintConfig)
                return None
            if args and is_dataclass(args[0]):
                return OmegaConf.structured(args[0])
    return None


def _set_list_element(cfg: DictConfig, key: str, value: str) -> None:
    """Apply one override whose path indexes a list (``dual.constraints[0].lr=50``); raise ConfigError naming
    the key when the element or the field does not exist."""
    parent_path, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_path, default=None) if parent_path else None
    if not isinstance(parent, DictConfig):
        list_path = key.split("[", 1)[0]
        items = OmegaConf.select(cfg, list_path, default=None)
        size = f"it has {len(items)} element(s)" if isinstance(items, ListConfig) else "it is not a list"
        raise ConfigError(f"unknown config key '{key}': no element '{parent_path or key}' ({list_path}: {size})")
    valid = _valid_keys(parent)
    if leaf not in valid:
        raise ConfigError(f"unknown config key '{key}'{_nearest(leaf, valid)}")
    # unresolved: an interpolation is set as written (resolved with the rest; recorded as written)
    OmegaConf.update(cfg, key, _override_value(f"{key}={value}")[1], merge=False)


# String fields with a value "off", which YAML 1.1 (OmegaConf's parser, for files and overrides alike) reads as the
# boolean false: ``dual.rule: off`` must stay the rule's name.
_OFF_KEYS = ("dual.rule",)


def yaml_value(key: str, value: Any) -> Any:
    """``value`` as parsed from YAML for the config key ``key``, with a YAML false read back as "off" where that is
    a name the key takes (``_OFF_KEYS``)."""
    return "off" if key in _OFF_KEYS and value is False else value


def _undo_yaml_false(layer: DictConfig) -> None:
    for key in _OFF_KEYS:
        value = OmegaConf.select(layer, key, default=None)
        if yaml_value(key, value) is not value:
            OmegaConf.update(layer, key, yaml_value(key, value), merge=False)


# Limits of what a config file or an override may hold, checked as it is read, in time linear in its size, before
# anything builds from it (OmegaConf and PyYAML's composer recurse once per level: 1,000 levels end in a
# RecursionError). The deepest key of RunConfig is 5 levels down (``dual.coupling.A[i][j]``); the shipped configs
# are a few KiB.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
# values of a config file once YAML aliases are expanded (ten nested aliases of ten items each are 10^10)
MAX_CONFIG_NODES = 100_000


def yaml_shape(text: str) -> tuple[Optional[str], int]:
    """(why the YAML ``text`` cannot be a config, its number of values): nested deeper than ``MAX_CONFIG_DEPTH``
    levels, or more than ``MAX_CONFIG_NODES`` values once its aliases are expanded; (None, -1) when it does not parse
    (the loader names that with its line). Reads PyYAML's parser events, which nest no Python calls, in one pass."""
    import yaml

    depth, nodes = 0, 0
    size: dict[str, int] = {}  # values under each anchor, aliases inside it expanded
    opened: list[tuple[Optional[str], int]] = []
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                nodes += size.get(event.anchor, 1)
            elif isinstance(event, yaml.ScalarEvent):
                nodes += 1
                if event.anchor:
                    size[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                nodes, depth = nodes + 1, depth + 1
                opened.append((event.anchor, nodes))
                if depth > MAX_CONFIG_DEPTH:
                    return (f"nested more than {MAX_CONFIG_DEPTH} levels deep (line {event.start_mark.line + 1}); a "
                            f"config's keys are at most 5 levels deep"), nodes
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
                anchor, start = opened.pop()
                if anchor:
                    size[anchor] = nodes - start + 1
            if nodes > MAX_CONFIG_NODES:
                return (f"more than {MAX_CONFIG_NODES:,} values once its aliases (*name) are expanded (line "
                        f"{event.start_mark.line + 1}); a config holds a few hundred"), nodes
    except yaml.YAMLError:
        return None, -1
    return None, nodes


def read_yaml_text(path: Path, name: str, error: Callable[[str], Exception], size_hint: str,
                   shape_hint: bool = True) -> tuple[str, int]:
    """(the text of a YAML file, its number of values), read in time and memory linear in its size with a config
    file's bounds (``MAX_CONFIG_BYTES``, ``yaml_shape``), checked before anything recursive builds from it. Every
    problem raises ``error(message)`` with ``name`` ("config file run.yaml") in the message: the file cannot be read,
    is larger than ``MAX_CONFIG_BYTES`` (``size_hint`` follows), is not UTF-8 (its line), or is too deep or too large
    (``yaml_shape``'s reason, with its hint about configs when ``shape_hint``)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise error(f"{name} is larger than {MAX_CONFIG_BYTES >> 20} MiB; {size_hint}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise error(f"cannot parse {name}: line {line} is not UTF-8 ({exc.reason} at byte {exc.start}); save the "
                    f"file as UTF-8") from None
    why, values = yaml_shape(text)
    if why is not None:
        raise error(f"cannot read {name}: {why if shape_hint else why.split(';')[0]}")
    return text, values


def _read_config_file(path: str | Path) -> DictConfig:
    """The mapping of a config file (``read_yaml_text``): ConfigError naming the file when it is missing, cannot be
    read within the bounds, is empty (a config with no setting is a mistake, not a request for the default run), is
    not YAML, or is not a mapping."""
    p = Path(path)
    if (why := not_a_regular_file(p)) is not None:
        raise ConfigError(f"config file not found: {p}" if why == "does not exist" else f"config file {p} {why}; "
                          f"name a YAML file")
    text, values = read_yaml_text(p, f"config file {p}", ConfigError,
                                  "a config holds settings (a few KiB): name the right file")
    if values == 0:
        raise ConfigError(f"config file {p} holds no setting (it is empty or only comments); give a config with "
                          f"at least one key, or leave the file out to run the defaults")
    try:
        layer = OmegaConf.load(io.StringIO(text))
    except Exception as exc:  # yaml errors carry line numbers
        raise ConfigError(f"cannot parse config file {p}: {exc}") from exc
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {p} must hold a mapping of keys at top level")
    return layer


def _override_shape_problem(override: str) -> Optional[ConfigError]:
    """An override without ``=``, or whose key or value nests deeper than a config can (``yaml_shape``)."""
    if "=" not in override:
        return ConfigError(f"override {override!r} is not of the form key=value")
    key, value = override.split("=", 1)
    if key.count(".") + key.count("[") >= MAX_CONFIG_DEPTH:
        return ConfigError(f"unknown config key '{key[:80]}...': nested more than {MAX_CONFIG_DEPTH} levels deep; a "
                           f"config's keys are at most 5 levels deep")
    # only brackets, braces, lines or aliases can nest or repeat a value: a plain scalar skips the YAML pass
    if (value.count("[") + value.count("{") >= MAX_CONFIG_DEPTH or "\n" in value or "*" in value) and \
            (why := yaml_shape(value)[0]) is not None:
        return ConfigError(f"bad value for '{key}': {why}")
    return None


def _as_config_error(exc: OmegaConfBaseException, key: Optional[str] = None) -> ConfigError:
    """OmegaConf's error of a composed or typed value as a one-line ConfigError naming the key (its own, else
    ``key``)."""
    # OmegaConf appends full_key / reference_type lines: keep the first, and say "list" in plain words
    msg = str(getattr(exc, "msg", None) or exc).splitlines()[0]
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        return ConfigError(f"unknown config key: {msg}")
    key = getattr(exc, "full_key", None) or key
    if "is not a ListConfig" in msg:
        msg = "expected a list"
    return ConfigError(f"bad value for '{key}': {msg}")


@functools.cache
def _yaml_loader() -> Any:
    from omegaconf.omegaconf import get_yaml_loader  # the loader of OmegaConf.from_dotlist (2.3 and 2.4)

    return get_yaml_loader()


def _override_value(override: str) -> tuple[str, Any]:
    """(key, value) of ``key=value``, the value read as ``OmegaConf.from_dotlist`` reads it (YAML; empty: None)."""
    import yaml

    key, text = override.split("=", 1)
    try:
        return key, yaml.load(text, Loader=_yaml_loader()) if text else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse override {override!r}: {exc}") from None


def _override_layer(plain: Sequence[str]) -> DictConfig:
    """The layer of dotted overrides, as ``OmegaConf.from_dotlist`` composes it (a later value replaces an earlier
    one; a block given whole merges into what is there), built as one nested dict: linear in the overrides."""
    tree: dict = {}
    for override in plain:
        key, value = _override_value(override)
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = _merged(node.get(leaf), value)
    try:
        return OmegaConf.create(tree)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse the overrides: {exc}") from exc


def _merged(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return new


def _screened_layer(layer: DictConfig, schema: DictConfig, *, prune: bool = False) -> list[ConfigError]:
    """The unknown keys and non-boolean numbers of a file or override layer (each a ConfigError; ``prune``: also
    removed from it), after YAML's false is read back as "off" where that is a name."""
    found = _key_problems(layer, schema, prune=prune)
    if found and not prune:
        return found  # the boolean check walks the schema along the layer's keys
    _undo_yaml_false(layer)
    return found + _bool_problems(layer, schema, prune=prune)


def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = (), *, check: bool = True) -> RunConfig:
    """Compose defaults <- YAML file <- dotlist overrides into a checked RunConfig (``check=False``: composed and
    typed, not validated). Raises the first ConfigError; ``compose_with_problems`` finds them all."""
    layer = _read_config_file(path) if path is not None else None
    for override in overrides:
        if (problem := _override_shape_problem(override)) is not None:
            raise problem
    cfg = _compose(OmegaConf.structured(RunConfig), layer, overrides)
    if check:
        validate(cfg)
    return cfg


def _compose(schema: DictConfig, layer: Optional[DictConfig], overrides: Sequence[str]) -> RunConfig:
    """The RunConfig of ``schema`` <- ``layer`` (a file's) <- ``overrides`` (each of the form key=value); raises the
    first ConfigError."""
    # list elements (dual.constraints[0].tolerance=...) are set on the composed config; the rest merge as a layer
    indexed = [o for o in overrides if "[" in o.split("=", 1)[0]]
    plain = [o for o in overrides if "[" not in o.split("=", 1)[0]]
    layers = [layer] if layer is not None else []
    if plain:
        layers.append(_override_layer(plain))
    for one in layers:
        found = _screened_layer(one, schema)
        if found:
            raise found[0]
    try:
        merged = OmegaConf.merge(schema, *layers)
        for override in indexed:
            _set_list_element(merged, *override.split("=", 1))
        # read before resolving: a value from the environment is recorded as its interpolation, never its value
        as_written = redact.interpolations(OmegaConf.to_container(merged, resolve=False))
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
        redact.attach_written(cfg, as_written)
        _accept_round_off(cfg)
    except OmegaConfBaseException as exc:
        raise _as_config_error(exc) from exc
    return cfg


def compose_with_problems(path: Optional[str | Path], overrides: Sequence[str]
                          ) -> tuple[Optional[RunConfig], list[tuple[str, ConfigError]]]:
    """The config of ``path`` + ``overrides`` without the parts that cannot be applied, and every problem found on
    the way as (the key or override it is about, the error): each unknown key of the file at any depth, each
    override that cannot be applied alone on the file (``dcmdp check`` lists them all). The config is None when the
    file itself cannot be read or typed, or when the applicable overrides fail together.

    Linear in the size of the file and the number of overrides: each distinct override is tried once, on one typed
    copy of the file's config, then the ones that apply are composed once."""
    schema = OmegaConf.structured(RunConfig)
    problems: list[tuple[str, ConfigError]] = []
    layer = None
    if path is not None:
        try:
            layer = _read_config_file(path)
        except ConfigError as exc:
            return None, [("config", exc)]
        problems += [("config", exc) for exc in _screened_layer(layer, schema, prune=True)]
    try:
        probe = OmegaConf.merge(schema, layer) if layer is not None else OmegaConf.merge(schema)
    except OmegaConfBaseException as exc:  # a value of the file of the wrong type
        return None, [*problems, ("config", _as_config_error(exc))]
    good: list[str] = []
    applies: dict[str, bool] = {}
    for override in overrides:
        if override not in applies:
            problem = _override_problem(probe, schema, override)
            applies[override] = problem is None
            if problem is not None:
                problems.append((override.split("=", 1)[0], problem))
        if applies[override]:
            good.append(override)
    try:
        return _compose(schema, layer, good), problems
    except ConfigError as exc:  # overrides that fail only together
        return None, [*problems, ("config", exc)]


def _override_problem(probe: DictConfig, schema: DictConfig, override: str) -> Optional[ConfigError]:
    """Why ``override`` cannot be applied, or None: the messages of ``load_config``, at the cost of one YAML value
    and one key path (no whole-config copy or merge per override). A value for one field is checked by that field's
    node; a block, a list or an interpolation is applied to ``probe`` (the typed config so far, changed in place)."""
    from omegaconf.nodes import BooleanNode, ValueNode

    if (problem := _override_shape_problem(override)) is not None:
        return problem
    try:
        if "[" in override.split("=", 1)[0]:
            _set_list_element(probe, *override.split("=", 1))
            return None
        key, value = _override_value(override)
        node, where = schema, ""
        for part in key.split("."):
            valid = _valid_keys(node)
            if part not in valid:
                path = f"{where}{part}"
                return ConfigError(f"config key '{path}' was replaced: use {RENAMED_KEYS[path]}"
                                   if path in RENAMED_KEYS else f"unknown config key '{path}'{_nearest(part, valid)}")
            node, where = node._get_node(part), f"{where}{part}."
        if isinstance(value, dict):  # a block given whole (dual.pid={kp: 1}): its keys too
            found = _key_problems(OmegaConf.create(value), node, where)
            if found:
                return found[0]
        value = yaml_value(key, value)
        if isinstance(node, BooleanNode) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value not in (0, 1):
            return ConfigError(f"config error at '{key}': expected true or false, got {value!r}")
        if isinstance(node, ValueNode) and not isinstance(value, (dict, list)) and \
                not (isinstance(value, str) and "${" in value):
            try:
                node.validate_and_convert(value)  # changes nothing
                return None
            except OmegaConfBaseException:
                pass  # applied below, for OmegaConf's message with the key and the value
        OmegaConf.update(probe, key, value, merge=True)
    except ConfigError as exc:
        return exc
    except OmegaConfBaseException as exc:
        return _as_config_error(exc, override.split("=", 1)[0])
    return None


def _bool_problems(layer: Any, schema: Any, prefix: str = "", *, prune: bool = False) -> list[ConfigError]:
    """A boolean key given a number other than 0 or 1 is an error (OmegaConf would read ``2`` as true); one per such
    key (``prune``: also removed from ``layer``)."""
    from omegaconf.nodes import BooleanNode

    if not isinstance(layer, DictConfig) or not isinstance(schema, DictConfig):
        return []
    found, bad = [], []
    for key in layer.keys():
        node = schema._get_node(key)
        value = layer._get_node(key)
        if isinstance(node, BooleanNode) and not isinstance(value, (DictConfig, ListConfig)):
            value = value._value()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
                found.append(ConfigError(f"config error at '{prefix}{key}': expected true or false, got {value!r}"))
                bad.append(key)
        if isinstance(node, DictConfig):
            found += _bool_problems(layer._get_node(key), node, f"{prefix}{key}.", prune=prune)
    if prune:
        for key in bad:
            del layer[key]
    return found


# Float fields whose valid range ends at 1 inclusive: a value a few ulps above 1 (1.0000000000000002, the round-off
# of a computed setting) is read as 1.0.
UNIT_CLOSED_KEYS = ("rollout.top_p", "cold_start.target_accuracy", "async_rollout.geometric.p",
                    "rollout.vllm.gpu_memory_utilization")
_ROUND_OFF_ULPS = 4


def _accept_round_off(cfg: RunConfig) -> None:
    for key in UNIT_CLOSED_KEYS:
        *path, leaf = key.split(".")
        obj = _get(cfg, ".".join(path))
        value = getattr(obj, leaf)
        if isinstance(value, float) and 1.0 < value <= 1.0 + _ROUND_OFF_ULPS * math.ulp(1.0):
            setattr(obj, leaf, 1.0)


# Float fields where +inf means "no bound" (a field NaN is never meaningful): the upper end of lambda's projection
# interval, the TIS caps C, the upper ends of the kept IS bands and the rejection bound. Constraint fields are named
# with ``[*]``.
INF_ALLOWED = frozenset({"dual.constraints[*].lambda_max", "algo.tis.cap", "algo.seq_tis.cap", "algo.icepop.high",
                         "algo.seq_mask.prod.high", "algo.seq_mask.geo.high", "algo.reject.bound"})


def check_finite(cfg: Any, prefix: str = "") -> None:
    """Raise ConfigError naming the first float field of ``cfg`` (a dataclass, walked recursively, list elements
    included) that is NaN, or +-inf outside ``INF_ALLOWED``."""
    for f in fields(cfg):
        _check_finite_value(getattr(cfg, f.name), f"{prefix}{f.name}")


def _check_finite_value(value: Any, key: str) -> None:
    if is_dataclass(value):
        check_finite(value, f"{key}.")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_finite_value(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            raise ConfigError(f"config error at '{key}': must be a finite number, got nan")
        generic = re.sub(r"\[\d+\]", "[*]", key)
        if value < 0 or generic not in INF_ALLOWED:
            raise ConfigError(f"config error at '{key}': must be a finite number, got {value}"
                              f"{' (inf is allowed only in ' + ', '.join(sorted(INF_ALLOWED)) + ')' if value > 0 else ''}")


def validate(cfg: RunConfig) -> None:
    """Check every component's bounds and the cross-component rules; raise ConfigError."""
    check_finite(cfg)
    try:
        cfg.model.check()
        cfg.rollout.check()
        cfg.task.check()
        cfg.cold_start.check()
        cfg.algo.check()
        cfg.optim.check()
        cfg.dual.pid.check()
        cfg.dual.context.check()
        cfg.dist.check()
        cfg.async_rollout.check()
        for i, c in enumerate(cfg.dual.constraints):
            c.check(f"dual.constraints[{i}]")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.steps < 0:
        raise ConfigError(f"config error at 'steps': must be >= 0, got {cfg.steps}")
    if cfg.seed < 0:  # numpy seeds only from non-negative integers
        raise ConfigError(f"config error at 'seed': must be >= 0, got {cfg.seed}")
    _check_run_basics(cfg)
    if cfg.tracking.uri and (why := redact.uri_problem(cfg.tracking.uri)):
        raise ConfigError(f"config error at 'tracking.uri': {redact.public_uri(cfg.tracking.uri)!r} cannot be used: "
                          f"{why}")
    if cfg.optim.weight_decay < 0:
        raise ConfigError(f"config error at 'optim.weight_decay': must be >= 0, got {cfg.optim.weight_decay}")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"config error at 'checkpoint.keep': must be >= 1, got {cfg.checkpoint.keep}")
    if cfg.log_every < 1:
        raise ConfigError(f"config error at 'log_every': must be >= 1, got {cfg.log_every}")
    if not (cfg.threads == "auto" or (type(cfg.threads) is int and cfg.threads >= 1)):
        raise ConfigError(f"config error at 'threads': must be auto or an integer >= 1, got {cfg.threads!r}")
    for key, value in (("eval_every", cfg.eval_every), ("checkpoint.every", cfg.checkpoint.every)):
        if value < 0:
            raise ConfigError(f"config error at '{key}': must be >= 0, got {value}")
    if cfg.guard.max_bad_steps < 1:
        raise ConfigError(f"config error at 'guard.max_bad_steps': must be >= 1, got {cfg.guard.max_bad_steps}")
    if not 0 <= cfg.guard.reward_fail_share <= 1:
        raise ConfigError(f"config error at 'guard.reward_fail_share': must be in [0, 1] (1: never stop), got "
                          f"{cfg.guard.reward_fail_share}")
    if cfg.guard.reward_fail_steps < 1:
        raise ConfigError(f"config error at 'guard.reward_fail_steps': must be >= 1, got {cfg.guard.reward_fail_steps}")
    if cfg.dual.relative:
        for i, c in enumerate(cfg.dual.constraints):
            if not c.tolerance > 0:
                raise ConfigError(f"config error at 'dual.constraints[{i}].tolerance': dual.relative=true divides the "
                                  f"violation by c, which must be > 0 (got {c.tolerance})")
    _validate_staleness_control(cfg)
    _check_sizes(cfg)
    if cfg.dual.context.by != "none" and cfg.dual.average:
        raise ConfigError("config error at 'dual.average': the running mean of the multipliers spans the run, not a "
                          "context; use dual.average=false with dual.context.by="
                          f"{cfg.dual.context.by}")
    if cfg.dual.floor_by not in FLOOR_KINDS:
        raise ConfigError(f"config error at 'dual.floor_by': unknown {cfg.dual.floor_by!r}; known: "
                          f"{', '.join(FLOOR_KINDS)}")
    if cfg.dual.floor_by != "none" and not any(c.floor_slack is not None for c in cfg.dual.constraints):
        raise ConfigError("config error at 'dual.floor_by': keeps the floor of an automatic tolerance per "
                          f"{cfg.dual.floor_by}; set a constraint's floor_slack, or dual.floor_by=none")
    ratchet = [i for i, c in enumerate(cfg.dual.constraints) if c.floor_ratchet]
    late = [i for i in ratchet if (cfg.dual.constraints[i].floor_steps or 0) < cfg.optim.warmup_steps]
    if late:
        raise ConfigError(f"config error at 'dual.constraints[{late[0]}].floor_steps': a ratcheted tolerance follows the "
                          f"lowest floor, and the drift during the learning-rate warm-up (optim.warmup_steps="
                          f"{cfg.optim.warmup_steps}) is near 0; set floor_steps >= {cfg.optim.warmup_steps} so the "
                          f"minimum starts after it")
    if cfg.dual.floor_by != "none" and ratchet:
        raise ConfigError(f"config error at 'dual.constraints[{ratchet[0]}].floor_ratchet': one lowest floor spans the "
                          f"run, not a {cfg.dual.floor_by}; use dual.floor_by=none or floor_ratchet: false")
    if cfg.dual.context.by == "staleness" and not cfg.async_rollout.enabled:
        raise ConfigError("config error at 'dual.context.by': staleness contexts need asynchronous rollouts "
                          "(async_rollout.enabled=true); every synchronous batch is fresh")
    if cfg.dual.coupling.A or cfg.dual.coupling.b:
        n = len(cfg.dual.constraints)
        if len(cfg.dual.coupling.A) != len(cfg.dual.coupling.b) or any(len(r) != n for r in cfg.dual.coupling.A):
            raise ConfigError(f"config error at 'dual.coupling': A must be {len(cfg.dual.coupling.b)} x {n} "
                              f"(rows = len(b), columns = number of constraints)")
    # the bounds above need no torch; what follows imports it (the device, the registries): a bound's error is
    # reported in well under a second
    from dcmdp.device import check_device_setting

    check_device_setting(cfg.device)
    _validate_registries(cfg)
    _validate_modes(cfg)
    _check_shared_weights(cfg)


# Bounds of size-like settings, checked at start (``_check_sizes``): beyond them a setting is either never used by a
# run or asks for memory or time no run has. A reward call may take up to an hour (its worker is killed after it).
MAX_REWARD_TIMEOUT = 3600.0
# Below this a reward call cannot even reach its worker process and back (a pipe round trip and unpickling): every
# call would time out, and every sample score 0.
MIN_REWARD_TIMEOUT = 0.01
# Samples of one rollout batch (prompts_per_step x samples_per_prompt), and samples per prompt.
MAX_BATCH_SAMPLES = 1 << 20
# Held-out prompts, and tokens per rollout batch (samples x max_new_tokens: ids and log-probs are kept per token).
MAX_EVAL_SIZE = 1 << 20
MAX_BATCH_TOKENS = 1 << 27
# Below this temperature float32 sampling saturates: the sampled token's probability rounds to 1 and every other's
# to 0 (a logit gap of 1 becomes exp(-100)), so the IS ratios, the entropy and the discrepancy measure nothing.
MIN_TEMPERATURE = 1e-2
# A staleness above the run's steps is never reached; up to this much is accepted whatever the steps.
STALENESS_SLACK = 64


def never_reached(cfg: RunConfig) -> list[str]:
    """Settings that a run of ``cfg.steps`` steps never reaches, each as the warning ``check`` and ``train`` print:
    an anchor whose first window of probed batches closes after the last step (the anchored c never comes into
    force), a learning-rate warm-up longer than the run (the rate never reaches optim.lr). Warnings, not errors: a
    short trial of a long config (``steps=2``) and a run to be resumed further are meant."""
    out = []
    for i, c in enumerate(cfg.dual.constraints):
        end = c.anchor_start + c.anchor_batches
        if c.anchor is not None and end > cfg.steps:
            out.append(f"dual.constraints[{i}].anchor: its first window (anchor_start={c.anchor_start}, "
                       f"anchor_batches={c.anchor_batches}) closes at step {end}, after the run's last (steps="
                       f"{cfg.steps}): the anchored c never comes into force and c stays (1 + floor_slack) x the "
                       f"floor for the whole run; lower anchor_start or anchor_batches, or train at least {end} steps")
    if cfg.optim.warmup_steps > cfg.steps:
        share = cfg.steps / cfg.optim.warmup_steps
        out.append(f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run (steps={cfg.steps}): the "
                   f"learning rate never reaches optim.lr (at the last step it is {share:.3g} of it); lower "
                   f"optim.warmup_steps to at most {cfg.steps}, or train longer")
    return out


def _check_sizes(cfg: RunConfig) -> None:
    """Refuse at start a size-like setting no run can use (``MAX_*`` above; task digits against the context:
    ``_check_task_fits``), and the reward timeout's upper end."""
    t, a, algo = cfg.task, cfg.async_rollout, cfg.algo
    if t.reward_timeout > MAX_REWARD_TIMEOUT:
        raise ConfigError(f"config error at 'task.reward_timeout': {t.reward_timeout:g} s per reward call is above "
                          f"{MAX_REWARD_TIMEOUT:g} s (an hour): a reward that hangs would hold the run that long "
                          f"per call; use a finite limit of at most {MAX_REWARD_TIMEOUT:g}")
    if 0 < t.reward_timeout < MIN_REWARD_TIMEOUT:
        raise ConfigError(f"config error at 'task.reward_timeout': {t.reward_timeout:g} s is too short for a call to "
                          f"reach the reward's worker process and come back: every call would time out; use at least "
                          f"{MIN_REWARD_TIMEOUT:g}")
    samples = algo.prompts_per_step * algo.samples_per_prompt
    if samples > MAX_BATCH_SAMPLES:
        raise ConfigError(f"config error at 'algo.prompts_per_step': {algo.prompts_per_step} prompts x "
                          f"{algo.samples_per_prompt} samples = {samples} samples per step, above {MAX_BATCH_SAMPLES}")
    if samples * cfg.rollout.max_new_tokens > MAX_BATCH_TOKENS:
        raise ConfigError(f"config error at 'rollout.max_new_tokens': {samples} samples x "
                          f"{cfg.rollout.max_new_tokens} new tokens = {samples * cfg.rollout.max_new_tokens} tokens "
                          f"per rollout batch, above {MAX_BATCH_TOKENS}; lower one of them")
    if t.eval_size > MAX_EVAL_SIZE:
        raise ConfigError(f"config error at 'task.eval_size': {t.eval_size} held-out prompts, above {MAX_EVAL_SIZE}")
    if t.items > MAX_EVAL_SIZE:
        raise ConfigError(f"config error at 'task.items': {t.items} items per prompt cannot fit any context")
    if cfg.cold_start.batch_size > MAX_BATCH_SAMPLES:
        raise ConfigError(f"config error at 'cold_start.batch_size': {cfg.cold_start.batch_size} demonstrations per "
                          f"step, above {MAX_BATCH_SAMPLES}")
    if cfg.rollout.temperature < MIN_TEMPERATURE:
        raise ConfigError(f"config error at 'rollout.temperature': {cfg.rollout.temperature:g} is below "
                          f"{MIN_TEMPERATURE:g}: float32 sampling is then greedy and every other token's probability "
                          f"underflows to 0, so the IS ratios and the discrepancy measure nothing; use >= "
                          f"{MIN_TEMPERATURE:g}")
    if a.enabled:
        key = "async_rollout.auto.max" if a.is_auto else "async_rollout.max_staleness"
        bound = max(cfg.steps, STALENESS_SLACK)
        if a.cap() > bound:
            raise ConfigError(f"config error at '{key}': a staleness of {a.cap()} is never reached in a run of "
                              f"steps={cfg.steps} (and every step keeps a histogram of that size); use at most {bound}")
    if not a.is_auto and a.too_stale != "wait":
        raise ConfigError(f"config error at 'async_rollout.too_stale': {a.too_stale} acts on batches staler than the "
                          f"bound the controller sets (max_staleness: auto); with the fixed max_staleness="
                          f"{a.max_staleness} no batch is ever staler; drop the key or set max_staleness: auto")
    from dcmdp.cpu import usable_cores  # light: no torch

    cores = usable_cores()
    for key, value in (("threads", cfg.threads), ("async_rollout.threads", a.threads)):
        if isinstance(value, int) and value > cores:
            raise ConfigError(f"config error at '{key}': {value} threads, but this process may run on {cores} "
                              f"core(s) (os.sched_getaffinity): more threads only wait for each other; use at most "
                              f"{cores}, or threads=auto")


def _validate_staleness_control(cfg: RunConfig) -> None:
    """``async_rollout.max_staleness: auto`` bounds the D-hat of one of the dual's constraints."""
    a = cfg.async_rollout
    if not a.is_auto:
        return
    n = len(cfg.dual.constraints)
    if not a.auto.constraint < n:
        raise ConfigError(f"config error at 'async_rollout.auto.constraint': {a.auto.constraint} names no constraint "
                          f"(dual.constraints has {n})")
    if a.auto.tolerance is None and not cfg.dual.constraints[a.auto.constraint].tolerance > 0:
        raise ConfigError(f"config error at 'async_rollout.auto.tolerance': the staleness step divides by c_s, and "
                          f"dual.constraints[{a.auto.constraint}].tolerance is not > 0; set async_rollout.auto.tolerance")


def _validate_registries(cfg: RunConfig) -> None:
    """Names chosen from a registry must exist; messages list the registry's names."""
    from constraints.measures import MEASURES
    from constraints.penalties import PENALTIES, check_penalty_constraints
    from trainers.advantages import ADVANTAGES
    from trainers.engines import ENGINES
    from trainers.losses import IS_MODES, POLICY_LOSSES
    from trainers.models import PRESETS
    from trainers.tasks import TASKS, check_task_config, generated_task_names

    from dcmdp.dual import DUAL_RULES

    def one_of(value: str, registry: Any, key: str) -> None:
        if value not in registry:
            raise ConfigError(f"config error at '{key}': unknown {value!r}{_nearest(value, list(registry))}")

    from trainers.optim import PRECISIONS

    if cfg.optim.precision not in PRECISIONS:
        raise ConfigError(f"config error at 'optim.precision': got {cfg.optim.precision!r}, expected one of "
                          f"{', '.join(PRECISIONS)}")
    one_of(cfg.model.preset, PRESETS, "model.preset")
    one_of(cfg.rollout.engine, ENGINES, "rollout.engine")
    one_of(cfg.task.name, TASKS, "task.name")
    try:
        check_task_config(cfg.task)  # task jsonl: its files exist and its reward function imports
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.task.curriculum and cfg.task.name not in generated_task_names():
        raise ConfigError(f"config error at 'task.curriculum': task {cfg.task.name!r} has no digits to grow; a "
                          f"curriculum needs a generated task ({', '.join(generated_task_names())})")
    one_of(cfg.algo.loss, POLICY_LOSSES, "algo.loss")
    one_of(cfg.algo.is_mode, IS_MODES, "algo.is_mode")
    one_of(cfg.algo.advantage, ADVANTAGES, "algo.advantage")
    one_of(cfg.dual.rule, DUAL_RULES, "dual.rule")
    _check_coupling_feasible(cfg, DUAL_RULES[cfg.dual.rule])
    _check_task_fits(cfg, _check_response_fits(cfg, PRESETS[cfg.model.preset]))
    one_of(cfg.dual.penalty, PENALTIES, "dual.penalty")
    one_of(cfg.dual.measure_at, ("rollout", "updates", "drift"), "dual.measure_at")
    anchored = [i for i, c in enumerate(cfg.dual.constraints) if c.anchor is not None]
    if anchored and cfg.dual.measure_at != "updates":
        raise ConfigError(f"config error at 'dual.constraints[{anchored[0]}].anchor': the anchor probes D-hat at the "
                          f"updates against mu; set dual.measure_at=updates (got {cfg.dual.measure_at})")
    for i, c in enumerate(cfg.dual.constraints):
        one_of(c.measure, MEASURES, f"dual.constraints[{i}].measure")
    penalizes = DUAL_RULES[cfg.dual.rule].penalizes
    if penalizes:
        try:
            check_penalty_constraints(cfg.dual.constraints)
        except ValueError as exc:
            raise ConfigError(f"config error at 'dual.constraints': {exc}") from exc
    engine = ENGINES[cfg.rollout.engine].capabilities
    _validate_rollout_quantization(cfg, PRESETS, engine)
    name = cfg.rollout.engine
    # vLLM returns its own routes on GPUs (compiled forwards and CUDA graphs keep them); on the CPU they come from
    # router hooks, which only eager forwards run
    hooks = engine.routes == "eager" or (engine.routes == "eager_on_cpu" and _runs_on_cpu(cfg.device))
    if hooks and cfg.algo.routing_replay == "r3" and getattr(cfg.rollout, name).enforce_eager is False:
        raise ConfigError(f"config error at 'rollout.{name}.enforce_eager': R3 with the {name} engine on the CPU "
                          f"records routes through router hooks that only run in eager mode; set "
                          f"rollout.{name}.enforce_eager=true")
    if cfg.async_rollout.enabled and not engine.async_worker:
        able = " | ".join(n for n, e in ENGINES.items() if e.capabilities.async_worker)
        raise ConfigError(f"config error at 'async_rollout.enabled': the rollout worker thread drives an engine in "
                          f"the trainer's process (the {able} engine), not the {cfg.rollout.engine} engine; use "
                          f"rollout.engine={able}, or async_rollout.enabled=false with "
                          f"rollout.engine={cfg.rollout.engine}")
    mismatch = [i for i, c in enumerate(cfg.dual.constraints) if c.measure == "routing_mismatch"]
    if penalizes and mismatch and cfg.algo.routing_replay == "r3":
        raise ConfigError(f"config error at 'dual.constraints[{mismatch[0]}].measure': routing_mismatch compares the "
                          f"two engines' expert choices, and algo.routing_replay=r3 trains on the rollout engine's "
                          f"choices, so it measures exactly 0 and its constraint can never act; drop the constraint "
                          f"or use routing_replay=r2 or none")
    if cfg.algo.routing_replay != "none" and not PRESETS[cfg.model.preset].is_moe:
        raise ConfigError(f"config error at 'algo.routing_replay': {cfg.algo.routing_replay} replays MoE routes, "
                          f"but model.preset={cfg.model.preset!r} is a dense model; use routing_replay=none")


def _no_shared(names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return {}


@dataclass(frozen=True)
class ModeSelector:
    """A config key that picks one mode from a registry, and the knobs each mode owns.

    Mode ``m`` owns the block named after it beside the key (``algo.is_mode=tis`` reads ``algo.tis``, ``dual.rule=pid``
    reads ``dual.pid``; the one-config-class-per-mode convention) and the ``shared`` knobs that name it among their
    readers (``algo.clip_ratio_c``: ppo_clip and minirl). A knob is foreign when no selected mode reads it.
    """

    # Dotted path of the selecting field.
    key: str
    # The registry's names (called at validation: the registries import torch, the dataclasses do not).
    names: Callable[[], tuple[str, ...]]
    # Knobs (a dotted leaf or block) outside the mode-named blocks -> the modes that read them, given the names.
    shared: Callable[[tuple[str, ...]], dict[str, tuple[str, ...]]] = _no_shared

    @property
    def kind(self) -> str:
        """How messages call a mode of this key: ``is_mode``, ``loss``, ``seq_mask.mode``, ``rule``, ..."""
        return self.key.split(".", 1)[1]


def _loss_names() -> tuple[str, ...]:
    from trainers.losses import POLICY_LOSSES
    return tuple(POLICY_LOSSES)


def _is_mode_names() -> tuple[str, ...]:
    from trainers.losses import IS_MODES
    return tuple(IS_MODES)


def _seq_mask_names() -> tuple[str, ...]:
    from trainers.config import SEQ_MASK_MODES
    return tuple(SEQ_MASK_MODES)


def _reject_names() -> tuple[str, ...]:
    from constraints.measures import MEASURES
    return ("none", *(n for n, m in MEASURES.items() if m.kind == "token"))


def _advantage_names() -> tuple[str, ...]:
    from trainers.advantages import ADVANTAGES
    return tuple(ADVANTAGES)


def _rule_names() -> tuple[str, ...]:
    from dcmdp.dual import DUAL_RULES
    return tuple(DUAL_RULES)


def _rule_shared(names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    from dcmdp.dual import DUAL_RULES
    # the coupling limits are part of the projection set, which only rules that project lambda read
    return {"dual.coupling": tuple(n for n in names if DUAL_RULES[n].projects)}


def _penalty_names() -> tuple[str, ...]:
    from constraints.penalties import PENALTIES
    return tuple(PENALTIES)


# Every key that picks a mode with knobs of its own. rollout.engine is not one: an engine's block holds a deployment's
# settings, and a recipe keeps its vllm block when a CPU run or a test switches it to rollout.engine=torch.
MODE_SELECTORS: tuple[ModeSelector, ...] = (
    ModeSelector("algo.loss", _loss_names, lambda names: {"algo.clip_ratio_c": ("ppo_clip", "minirl")}),
    ModeSelector("algo.is_mode", _is_mode_names),
    ModeSelector("algo.seq_mask.mode", _seq_mask_names),
    ModeSelector("algo.reject.measure", _reject_names,
                 lambda names: {"algo.reject.bound": tuple(n for n in names if n != "none")}),
    ModeSelector("algo.advantage", _advantage_names),
    ModeSelector("dual.rule", _rule_names, _rule_shared),
    ModeSelector("dual.penalty", _penalty_names),
)


def _leaves(node: Any, prefix: str) -> list[str]:
    if isinstance(node, DictConfig):
        return [leaf for k in node.keys() for leaf in _leaves(node._get_node(k), f"{prefix}.{k}")]
    return [prefix]


@functools.lru_cache(maxsize=None)
def mode_knobs(selector: ModeSelector, mode: str) -> tuple[str, ...]:
    """The dotted leaf keys mode ``mode`` of ``selector`` owns (``ModeSelector``)."""
    schema = OmegaConf.structured(RunConfig)
    parent = selector.key.rsplit(".", 1)[0]
    owned = []
    block = OmegaConf.select(schema, f"{parent}.{mode}", default=None)
    if isinstance(block, DictConfig):
        owned += _leaves(block, f"{parent}.{mode}")
    for knob, readers in selector.shared(selector.names()).items():
        if mode in readers:
            owned += _leaves(OmegaConf.select(schema, knob), knob)
    return tuple(owned)


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _check_shared_weights(cfg: RunConfig) -> None:
    """``rollout.torch.share_weights``: the engine decodes with the trainer's parameters, so they must be in the
    rollout precision's dtype, unquantised, the same for the whole run, and never updated while it samples."""
    if not cfg.rollout.torch.share_weights:
        return
    key = "config error at 'rollout.torch.share_weights'"
    trainer = "bf16" if cfg.optim.precision.startswith("bf16") else "fp32"
    if cfg.rollout.engine != "torch":
        raise ConfigError(f"{key}: only the torch engine decodes with the trainer's model; rollout.engine="
                          f"{cfg.rollout.engine} keeps its own weights")
    if cfg.rollout.precision_schedule:
        raise ConfigError(f"{key}: a precision schedule switches the engine to other weights; drop one of them")
    if cfg.rollout.precision != trainer:
        raise ConfigError(f"{key}: the trainer's parameters are {trainer} (optim.precision={cfg.optim.precision}) "
                          f"and the rollouts are asked in {cfg.rollout.precision}; set rollout.precision={trainer}, "
                          f"or share_weights=false for an engine copy in {cfg.rollout.precision}")
    if cfg.async_rollout.enabled:
        raise ConfigError(f"{key}: asynchronous rollouts sample while the trainer updates the same parameters; use "
                          f"async_rollout.enabled=false or share_weights=false")


def _validate_modes(cfg: RunConfig) -> None:
    """A knob of a mode that is not selected is an error naming the knob, its mode and the selected one.

    "Set" means: its value differs from the dataclass default. Whether a key was written in a file or an override
    cannot tell a choice apart: every run folder's config.yaml and every tune trial's run.yaml list all knobs of all
    modes at their resolved values, and must load again. A knob at its default does nothing under any mode, so an
    unselected mode's knob left at (or written at) its default is accepted; any other value would be silently
    ignored, which is what this check refuses. The same rule holds for a config built in python (``validate``).
    """
    default = RunConfig()
    for sel in MODE_SELECTORS:
        names = sel.names()
        selected = _get(cfg, sel.key)
        if selected not in names:  # _validate_registries names the bad value first
            continue
        read = set(mode_knobs(sel, selected))
        owners: dict[str, list[str]] = {}
        for mode in names:
            for knob in mode_knobs(sel, mode):
                owners.setdefault(knob, []).append(mode)
        for knob, modes in owners.items():
            if knob in read or _get(cfg, knob) == _get(default, knob):
                continue
            quoted = [f"'{m}'" for m in modes]
            who = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
            fix = f"{sel.key}={modes[0]}" if len(modes) == 1 else f"{sel.key} to one of them"
            raise ConfigError(f"config error at '{knob}': {knob} belongs to {sel.kind} {who}; the selected "
                              f"{sel.kind} is '{selected}' ({sel.key}), which does not read it; drop the key or set "
                              f"{fix}")


def _runs_on_cpu(device: str) -> bool:
    """Whether the ``device`` setting puts the run on the CPU (auto: when no CUDA device is visible)."""
    import torch

    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def _validate_rollout_quantization(cfg: RunConfig, presets: dict, engine: EngineCapabilities) -> None:
    """Rollout precisions (and logit noise) the chosen engine and model can run, refused at load, before anything is
    built."""
    import torch

    from trainers.models import model_from_config
    from trainers.quant import fp8_gemm_available, int4_group_error

    r = cfg.rollout
    if r.precision_schedule and engine.no_precision_switch:
        raise ConfigError(f"config error at 'rollout.precision_schedule': {engine.no_precision_switch}")
    used = {p.precision: f"rollout.precision_schedule[{i}].precision" for i, p in reversed(list(enumerate(
        r.precision_schedule)))}
    used[r.precision] = "rollout.precision"
    for precision, key in used.items():
        if precision in engine.unsupported_precisions:
            raise ConfigError(f"config error at '{key}': {engine.unsupported_precisions[precision]}")
        if precision == "fp8" and engine.fp8_needs_tensor_cores and not fp8_gemm_available():
            raise ConfigError(f"config error at '{key}': {engine.fp8_needs_tensor_cores}")
    if r.logit_noise > 0 and engine.no_logit_noise:
        raise ConfigError(f"config error at 'rollout.logit_noise': {engine.no_logit_noise}")
    if "int4" in used:
        # the preset's architecture on the meta device: shapes only, no memory, no weights
        with torch.device("meta"):
            shapes = model_from_config(presets[cfg.model.preset].make_config(128), seed=0)
        problem = int4_group_error(shapes, r.torch.int4_group_size, lm_head=r.torch.quantize_lm_head)
        if problem:
            raise ConfigError(f"config error at 'rollout.torch.int4_group_size': model.preset={cfg.model.preset!r}: "
                              f"{problem}")


# Config keys that hold a URI: records hold them without credentials (``redact.public_uri``).
URI_KEYS = ("tracking.uri",)


def _is_resume_key(key: str) -> bool:
    """A key a resume compares (``RESUME_KEYS``, ``NOT_ON_RESUME``): its records hold the resolved value."""
    generic = _generic(key)
    return generic in RESUME_KEYS or _not_on_resume(generic) is not None


def public_config(cfg: RunConfig, *, resume_keys_resolved: bool = False) -> dict:
    """The config as every record of it holds it (config.yaml, MLflow params, a checkpoint's config): a value
    written as an interpolation (``${oc.env:PW}``) stays that interpolation, URIs (``URI_KEYS``) lose their
    credentials, the rest is resolved. ``resume_keys_resolved``: the ``RESUME_KEYS`` resolved even when written as an
    interpolation (registry names, a dtype, a model folder: what a resume compares, never a secret)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return redact.public_container(cfg, data, URI_KEYS, keep=_is_resume_key if resume_keys_resolved else None)


def to_yaml(cfg: RunConfig, *, public: bool = False) -> str:
    """The resolved config as YAML; ``public``: as ``public_config`` has it (what a run writes to its folder and to
    MLflow), which ``load_config`` reads back to the same config in the same environment."""
    if public:
        return OmegaConf.to_yaml(OmegaConf.create(public_config(cfg)))
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Flattened ``public_config`` (dotted keys, the ``RESUME_KEYS`` resolved) for MLflow params and checkpoints."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list) and node and isinstance(node[0], dict):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")
        else:
            out[prefix[:-1]] = str(node)

    walk(public_config(cfg, resume_keys_resolved=True), "")
    return out


# Keys a resumed run must share with its checkpoint: the model's shape and weights, and the dual state's layout
# and meaning (number, order and measures of the constraints, the dual rule). Others (lr, steps, tolerances, ...)
# may change on resume. ``*`` stands for a constraint's index.
RESUME_KEYS = ("model.preset", "model.path", "model.dtype", "task.name", "dual.rule", "dual.constraints.*.measure",
               "dual.constraints.*.tau")


# The anchored tolerance's gap g, floor at anchoring and probe window live in the dual state: c = F + g stays the
# checkpoint's until the next anchoring, whatever the config now says.
_ANCHOR_STATE = "the anchored tolerance c = F + g continues from the checkpoint's dual state (its gap and probe window)"
# Keys whose value a resumed run takes from the checkpoint's state, not from the config: a change is refused (exit 2,
# naming the key) instead of being recorded in config.yaml while the old value trains. A key ending in "." is a
# block (every key under it but ``RESUMABLE_IN_BLOCKS``).
NOT_ON_RESUME = {
    "seed": "the random generators continue from the checkpoint's states",
    "optim.lr": "the optimiser and its schedule continue from the checkpoint's state",
    "optim.betas": "the optimiser continues from the checkpoint's state",
    "optim.weight_decay": "the optimiser continues from the checkpoint's state",
    "optim.warmup_steps": "the schedule continues from the checkpoint's state",
    "optim.precision": "the parameters and optimiser state continue in the checkpoint's precision",
    "dual.constraints.*.lambda_init": "the multipliers continue from the checkpoint's",
    "dual.constraints.*.anchor": _ANCHOR_STATE,
    "dual.constraints.*.anchor_start": _ANCHOR_STATE,
    "dual.constraints.*.anchor_batches": _ANCHOR_STATE,
    "dual.constraints.*.anchor_every": _ANCHOR_STATE,
    "dual.constraints.*.anchor_ratio": _ANCHOR_STATE,
    "dual.constraints.*.miss_rate": "the anchored gap g was set at the checkpoint's miss rate and the chance rule's "
                                    "multipliers were reached under it",
    "dual.measure_at": "the floor, the anchored gap and the multipliers in the checkpoint's dual state were measured "
                       "at its measurement point",
    "dual.penalty": "the multipliers in the checkpoint's dual state were reached under its penalty form",
    "model.init": "the weights come from the checkpoint",
    "model.num_layers": "the weights come from the checkpoint",
    "cold_start.": "the weights come from the checkpoint, not from a cold start",
}
# Keys inside a ``NOT_ON_RESUME`` block that a resume does honour.
RESUMABLE_IN_BLOCKS = frozenset({"cold_start.cache_dir"})


def _rule_of_old_keys(saved: dict[str, str]) -> dict[str, str]:
    """A flattened config saved before ``dual.rule`` named off and fixed: its ``dual.enabled=False`` is rule off and
    its ``dual.fixed=True`` rule fixed (see ``RENAMED_KEYS``)."""
    if saved.get("dual.enabled") == "False":
        return {**saved, "dual.rule": "off"}
    if saved.get("dual.fixed") == "True":
        return {**saved, "dual.rule": "fixed"}
    return saved


def resume_conflicts(saved: dict[str, str], cfg: RunConfig) -> list[str]:
    """One line per ``RESUME_KEYS`` or ``NOT_ON_RESUME`` key where ``cfg`` differs from the flattened config ``saved``
    with a checkpoint (``flatten``: these keys resolved, so a value read from the environment is compared as the
    value it is), the number of constraints first; empty when the run can continue from it."""
    saved = _rule_of_old_keys(saved)
    now = flatten(cfg)

    def count(flat: dict[str, str]) -> int:
        return len({k.split(".")[2] for k in flat if k.startswith("dual.constraints.")})

    out = []
    if count(saved) != count(now):
        out.append(f"dual.constraints: {count(saved)} constraint(s) in the checkpoint, {count(now)} now")
    for key in sorted(set(saved) | set(now)):
        generic = _generic(key)
        if key not in saved or key not in now or saved[key] == now[key]:
            continue
        if generic in RESUME_KEYS:
            out.append(f"{key}: {saved[key]!r} in the checkpoint, {now[key]!r} now")
        elif (why := _not_on_resume(generic)) is not None:
            out.append(f"{key}: {saved[key]!r} in the checkpoint, {now[key]!r} now ({why}: the new value would be "
                       f"ignored)")
    return out


def _generic(key: str) -> str:
    return re.sub(r"^dual\.constraints\.\d+\.", "dual.constraints.*.", key)


def _not_on_resume(generic: str) -> Optional[str]:
    """Why a resumed run cannot honour a new value of the key (``NOT_ON_RESUME``), or None."""
    for pattern, why in NOT_ON_RESUME.items():
        if generic == pattern or (pattern.endswith(".") and generic.startswith(pattern)
                                  and generic not in RESUMABLE_IN_BLOCKS):
            return why
    return None



# numpy's legacy seeding takes 32-bit seeds
MAX_SEED = 2**32 - 1


def _check_run_basics(cfg: RunConfig) -> None:
    if cfg.seed > MAX_SEED:
        raise ConfigError(f"config error at 'seed': must be <= {MAX_SEED} (2^32 - 1), got {cfg.seed}")
    if cfg.cold_start.seed is not None and not 0 <= cfg.cold_start.seed <= MAX_SEED:
        raise ConfigError(f"config error at 'cold_start.seed': must be in [0, {MAX_SEED}], got {cfg.cold_start.seed}")
    if not cfg.output_dir.strip():
        raise ConfigError("config error at 'output_dir': empty; name a folder for the run (an empty one would write "
                          "into the working directory)")
    long = [part for part in Path(cfg.output_dir).parts if len(part.encode()) > NAME_MAX]
    if long:  # the run would fail at its first mkdir with a bare "[Errno 36]"
        raise ConfigError(f"config error at 'output_dir': the folder name {long[0][:40]!r}... is "
                          f"{len(long[0].encode())} bytes long, above the {NAME_MAX} bytes a file system allows "
                          f"for one name; use a shorter name")
    # a file where the folder would be failed only after the model was built
    if (blocker := file_in_the_way(cfg.output_dir)) is not None:
        raise ConfigError(f"config error at 'output_dir': {str(blocker)!r} is a file, not a folder; name a "
                          f"folder for the run")


# Bytes in one file or folder name on Linux file systems (ext4, xfs, btrfs, tmpfs: NAME_MAX).
NAME_MAX = 255


def file_in_the_way(folder: str) -> Optional[Path]:
    """The first existing path on the way to ``folder`` (itself, then its parents) when it is a file, not a folder;
    None when that path is a folder, or cannot be searched (the writability check at start names it)."""
    for part in (Path(folder), *Path(folder).parents):
        try:
            exists, is_dir = part.exists(), part.is_dir()
        except OSError:
            return None
        if exists:
            return None if is_dir else part
    return None


def _check_coupling_feasible(cfg: RunConfig, rule: Any) -> None:
    """The coupled limits A lambda <= b must hold at lambda_init (where every run starts), checked before anything is
    built (the dual state is made after the model)."""
    import numpy as np

    c = cfg.dual.coupling
    if not c.A or not rule.projects or len(c.A) != len(c.b):
        return
    lam = rule.initial_lambda(cfg.dual).numpy()
    A, b = np.asarray(c.A, dtype=np.float64), np.asarray(c.b, dtype=np.float64)
    bad = np.flatnonzero(A @ lam > b + 1e-9)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(f"config error at 'dual.coupling.b[{i}]': the coupled limit row {i} (A[{i}] lambda <= "
                          f"b[{i}] = {b[i]:g}) fails at lambda_init {lam.tolist()} (A[{i}] lambda = "
                          f"{float(A[i] @ lam):g}): raise b[{i}] or lower the constraints' lambda_init")


def _check_response_fits(cfg: RunConfig, preset: Any) -> Optional[int]:
    """rollout.max_new_tokens must leave room for a prompt in the model's context (max_position_embeddings, from
    model.path's config.json or the preset), checked before anything is built. Returns the context (None when
    unknown)."""
    from trainers.jsonfile import read_model_config

    context = None
    if cfg.model.path:
        try:
            context = read_model_config(cfg.model.path).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            return None  # the model loader names a missing or bad model.path
    elif not preset.needs_path:
        context = preset.make_config(128).max_position_embeddings
    if isinstance(context, int) and cfg.rollout.max_new_tokens >= context:
        raise ConfigError(f"config error at 'rollout.max_new_tokens': {cfg.rollout.max_new_tokens} new tokens leave no "
                          f"room for a prompt in the context of model.preset={cfg.model.preset!r} ({context} "
                          f"positions); use at most {context - 1}, less the longest prompt")
    return context if isinstance(context, int) else None


# prompts drawn per digits setting to find the longest a generated task asks (its lengths vary with the draw)
_FIT_DRAWS = 64


def _check_task_fits(cfg: RunConfig, context: Optional[int]) -> None:
    """Every digits setting of a generated task (task.digits, each task.curriculum phase) must give prompts that fit
    the context with rollout.max_new_tokens, checked at start: a phase's prompts are otherwise drawn only when the
    phase begins, and a number of more digits than the context has positions cannot even be generated cheaply.
    Prompt length is counted in characters (one token each with the character tokenizer of the tiny presets; a
    subword tokenizer takes at most as many for these digit prompts), over ``_FIT_DRAWS`` draws."""
    import random as _random
    from dataclasses import replace

    from trainers.tasks import TASKS, generated_task_names

    t = cfg.task
    if context is None or t.name not in generated_task_names():
        return
    settings = [("task.digits", t.digits, t.min_digits)]
    settings += [(f"task.curriculum[{i}].digits", p.digits, t.min_digits if p.min_digits is None else p.min_digits)
                 for i, p in enumerate(t.curriculum)]
    room = context - cfg.rollout.max_new_tokens
    if t.items >= room:  # every item takes at least one position
        raise ConfigError(f"config error at 'task.items': {t.items} items do not fit the context of model.preset="
                          f"{cfg.model.preset!r} ({context} positions, {cfg.rollout.max_new_tokens} of them for the "
                          f"response); use fewer items")
    for key, digits, low in settings:
        if digits >= room:
            raise ConfigError(f"config error at '{key}': {digits} digits do not fit the context of model.preset="
                              f"{cfg.model.preset!r} ({context} positions, {cfg.rollout.max_new_tokens} of them for "
                              f"the response: rollout.max_new_tokens); use fewer digits")
        task = TASKS[t.name](replace(t, digits=digits, min_digits=low, eval_size=1, curriculum=[]), cfg.seed)
        longest = max(len(ex.prompt) for ex in task.sample(_random.Random(0), _FIT_DRAWS))
        if longest + cfg.rollout.max_new_tokens > context:
            raise ConfigError(f"config error at '{key}': prompts of {digits} digits run to {longest} characters, "
                              f"which with rollout.max_new_tokens={cfg.rollout.max_new_tokens} exceed the context of "
                              f"model.preset={cfg.model.preset!r} ({context} positions); use fewer digits or fewer new "
                              f"tokens")
