"""Reading a run config: YAML files and dotlist overrides composed over the schema, within the shape limits.

Unknown keys are errors that name the key and its nearest valid spelling (``RENAMED_KEYS``: an old key names its
replacement). Every YAML file a user names (a run config, a tune file, an experiment file) is read by one bounded
reader, ``read_yaml_file``: a regular file, at most ``MAX_CONFIG_BYTES``, UTF-8, at most ``MAX_CONFIG_DEPTH``
levels and ``MAX_CONFIG_NODES`` values, all checked in time linear in its size before anything recursive builds
from it.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from constraints.config import ConstraintConfig
from dcmdp import redact
from dcmdp.config.schema import RENAMED_KEYS, RunConfig, _get, nearest
from dcmdp.config.validate import validate
from trainers.errors import ConfigError, config_error, not_a_regular_file


def _valid_keys(node: Any) -> list[str]:
    return list(node.keys()) if isinstance(node, DictConfig) else []


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
                                     f"unknown config key '{path}'{nearest(str(key), valid)}"))
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
        raise ConfigError(f"unknown config key '{key}'{nearest(leaf, valid)}")
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


def read_yaml_file(path: str | Path, error: Callable[[str], Exception], *, kind: str, size_hint: str,
                   name: Optional[str] = None, shape_hint: bool = True, plain: bool = False,
                   not_yaml: str = "cannot parse {name}: {reason}") -> tuple[Any, int]:
    """The one bounded reader of a YAML file a user names (a run config, a tune file, an experiment file): (its
    YAML, built by OmegaConf, or as plain Python with ``plain``; its number of values). In order, each problem
    raising ``error(message)``: the path is not a regular file (a FIFO would block the reader, ``/dev/zero`` never
    ends: "<kind> not found: <path>", or "<kind> <path> is a directory, not a file; name a YAML file"), then
    ``read_yaml_text``'s bounds with ``name`` (default "<kind> <path>") in the message, then a text that is not YAML
    (``not_yaml``, formatted with ``name``, ``reason``: YAML's error with its line, and ``one_line``: the same on
    one line).

    An experiment file (``benchmarks/run.py``) is read as ``read_yaml_file(path, ExperimentError, kind="experiment
    file", name=where, size_hint="an experiment file is a few KiB", shape_hint=False, plain=True,
    not_yaml="{name}: not a readable YAML file: {one_line}")[0]``."""
    import yaml

    p = Path(path)
    if (why := not_a_regular_file(p)) is not None:
        raise error(f"{kind} not found: {p}" if why == "does not exist" else f"{kind} {p} {why}; name a YAML file")
    name = name or f"{kind} {p}"
    text, values = read_yaml_text(p, name, error, size_hint, shape_hint)
    try:
        data = yaml.safe_load(text) if plain else OmegaConf.load(io.StringIO(text))
    except Exception as exc:  # yaml errors carry line numbers
        raise error(not_yaml.format(name=name, reason=exc, one_line=" ".join(str(exc).split()))) from exc
    return data, values


def _read_config_file(path: str | Path) -> DictConfig:
    """The mapping of a config file (``read_yaml_file``): ConfigError naming the file when it is missing, cannot be
    read within the bounds, is empty (a config with no setting is a mistake, not a request for the default run), is
    not YAML, or is not a mapping."""
    p = Path(path)
    layer, values = read_yaml_file(p, ConfigError, kind="config file",
                                   size_hint="a config holds settings (a few KiB): name the right file")
    if values == 0:
        raise ConfigError(f"config file {p} holds no setting (it is empty or only comments); give a config with "
                          f"at least one key, or leave the file out to run the defaults")
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
                                   if path in RENAMED_KEYS else f"unknown config key '{path}'{nearest(part, valid)}")
            node, where = node._get_node(part), f"{where}{part}."
        if isinstance(value, dict):  # a block given whole (dual.pid={kp: 1}): its keys too
            found = _key_problems(OmegaConf.create(value), node, where)
            if found:
                return found[0]
        value = yaml_value(key, value)
        if isinstance(node, BooleanNode) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value not in (0, 1):
            return config_error(key, f"expected true or false, got {value!r}")
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
                found.append(config_error(f"{prefix}{key}", f"expected true or false, got {value!r}"))
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

