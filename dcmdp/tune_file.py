"""The tune file of ``dcmdp tune``: its settings as dataclasses with their defaults (the search space, the sampler,
the selection rule's and the pruner's knobs), reading and checking it, and a trial's settings applied to the run
config. dcmdp/tune.py describes the file and runs the sweep."""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import optuna
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dcmdp import redact
from dcmdp.config import (ConfigError, RunConfig, config_error, file_in_the_way, load_config, read_yaml_file, require,
                          validate, yaml_value)

SAMPLERS = ("grid", "tpe", "gp")
# Combinations a grid may hold: each is a training run (a larger study is a tpe or gp one with a trial budget).
MAX_GRID_TRIALS = 10_000
_MISSING = object()


@dataclass
class SelectRule:
    # Least share of post-warm-up steps with every constraint inside its tolerance.
    min_inside_frac: float = 0.7
    # Most share of steps with a constraint slack (lambda at its floor, D-hat < c): above it the dual was off.
    max_slack_frac: float = 0.5
    # Most share of steps with lambda at its cap: above it the penalty was a constant.
    max_cap_frac: float = 0.5
    # The tightest c among the eligible trials within this many standard errors of the best accuracy is selected.
    tolerance_se: float = 1.0
    # Steps 1..warmup_steps are left out of the inside-tolerance share.
    warmup_steps: int = 0
    # Steps in the moving mean that detects a collapse.
    collapse_window: int = 5
    # Collapsed when the last window's mean < collapse_drop_frac x the peak window mean.
    collapse_drop_frac: float = 0.5
    # Per-step metric watched for a collapse.
    collapse_metric: str = "reward/accuracy"

    def describe(self) -> str:
        return (f"selection: the tightest c within {self.tolerance_se:g} standard error(s) of the best held-out "
                f"accuracy among finished trials that did not collapse, kept every constraint's D-hat <= c on >= "
                f"{self.min_inside_frac:.0%} of steps after warm-up (steps > {self.warmup_steps}) where lambda "
                f"has authority (a fixed c, or an anchored one whose penalty reach is at least the batch spread; "
                f"below it, or not measured, inside c is not judged and the accuracy clause alone decides) and "
                f"whose dual acted (slack on <= {self.max_slack_frac:.0%} of steps, lambda at its cap on <= "
                f"{self.max_cap_frac:.0%}, lambda not one value on every step after warm-up); collapsed = a non-finite loss/ value, or the mean "
                f"{self.collapse_metric} of the last {self.collapse_window} steps < {self.collapse_drop_frac:g} x "
                f"its peak {self.collapse_window}-step mean")


@dataclass
class PruneSpec:
    # Stop trials that can no longer be selected (see RulePruner).
    enabled: bool = True
    # Steps in a row the collapse condition must hold before a trial is pruned (default: collapse_window).
    collapse_patience: Optional[int] = None


@dataclass
class TuneConfig:
    # Run config of every trial (a relative path is tried next to the tune file, then in cwd).
    base: str
    # Dotlist overrides of the base config for every trial, read as written, like the command line's: an interpolation
    # in one (${oc.env:PW}) is resolved in the run config and recorded (study, parent run, trial run.yaml) unresolved.
    overrides: list[str] = field(default_factory=list)
    # Run-config key -> a list of values, or {low, high, log, step} (tpe and gp only).
    space: dict[str, Any] = field(default_factory=dict)
    # grid | tpe | gp.
    sampler: str = "grid"
    # Trials in the study (tpe and gp; the grid runs every combination).
    trials: Optional[int] = None
    # Seed of the sampler.
    seed: int = 0
    # Optuna study name (default: the tune file's name without .yaml).
    study: Optional[str] = None
    # Optuna RDB URL (default: sqlite:///<output_dir>/study.db).
    storage: Optional[str] = None
    # The selection rule.
    select: SelectRule = field(default_factory=SelectRule)
    # The pruner.
    prune: PruneSpec = field(default_factory=PruneSpec)
    # Trials running at once in this process.
    workers: int = 1
    # Run the first trial alone so that the others reuse its cached cold start.
    prime_cold_start: bool = True
    # Tune folder: the sqlite study, trials/, table.txt, results.csv, tune.png, best.yaml.
    output_dir: str = "outputs/tune"



def load_tune_config(path: str | Path, overrides: Sequence[str] = ()) -> TuneConfig:
    """Parse and check a tune file; ``overrides`` (key=value of the run config) follow the file's own."""
    path = Path(path)
    # the hint about the shape of a run config does not apply
    raw = read_yaml_file(path, ConfigError, kind="tune file", size_hint="a tune file holds a few KiB of settings",
                         shape_hint=False)[0]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TuneConfig), raw)
        written = OmegaConf.to_container(merged, resolve=False)["overrides"]
        cfg: TuneConfig = OmegaConf.to_object(merged)  # type: ignore
    except OmegaConfBaseException as exc:
        raise ConfigError(f"tune config error at '{getattr(exc, 'full_key', '')}' in {path}: "
                          f"{_first_line(exc)}") from exc
    if not Path(cfg.base).is_absolute() and (path.parent / cfg.base).is_file():
        cfg.base = str(path.parent / cfg.base)
    # as written: load_config resolves an interpolation (${oc.env:PW}) itself and keeps it out of every record
    cfg.overrides = [str(o) for o in written] + list(overrides)
    cfg.study = cfg.study or path.stem
    _check(cfg)
    return cfg


def _require(cond: object, key: str, message: str) -> None:
    """``require`` for a key of the tune file: "tune config error at '<key>': <message>"."""
    require(cond, key, message, what="tune config")


def _error(key: str, message: str) -> ConfigError:
    """``config_error`` for a key of the tune file, where the message names what failed."""
    return config_error(key, message, what="tune config")


def _check(cfg: TuneConfig) -> None:
    s = cfg.select
    _require(cfg.space, "space", "give at least one key with a list of values or a range")
    _require(cfg.workers >= 1, "workers", f"must be >= 1, got {cfg.workers}")
    _require(cfg.output_dir.strip(), "output_dir", "empty; name a folder for the study")
    blocker = file_in_the_way(cfg.output_dir)
    _require(blocker is None, "output_dir", f"{str(blocker)!r} is a file, not a folder")
    _require(0 <= s.min_inside_frac <= 1, "select.min_inside_frac", f"must be in [0, 1], got {s.min_inside_frac}")
    _require(s.warmup_steps >= 0 and s.collapse_window >= 1 and 0 <= s.collapse_drop_frac <= 1, "select",
             "need warmup_steps >= 0, collapse_window >= 1 and collapse_drop_frac in [0, 1]")
    for key in ("max_slack_frac", "max_cap_frac"):
        _require(0 <= getattr(s, key) <= 1, f"select.{key}", f"must be in [0, 1], got {getattr(s, key)}")
    _require(0 <= s.tolerance_se < math.inf, "select.tolerance_se", "must be a finite value >= 0, got "
             f"{s.tolerance_se}")
    _require(cfg.prune.collapse_patience is None or cfg.prune.collapse_patience >= 1, "prune.collapse_patience",
             "must be >= 1")
    _require(cfg.sampler in SAMPLERS, "sampler", f"{cfg.sampler!r} is not one of {', '.join(SAMPLERS)}")
    _require(cfg.sampler != "grid" or cfg.trials is None, "trials",
             "the grid sampler runs every combination; leave it out")
    _require(cfg.sampler == "grid" or (cfg.trials or 0) >= 1, "trials", f"sampler {cfg.sampler} needs trials >= 1")
    if cfg.sampler == "gp":
        missing = [m for m in ("scipy", "torch") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(f"sampler 'gp' (optuna.samplers.GPSampler) needs {' and '.join(missing)}: "
                              f"pip install {' '.join(missing)}")
    dists = distributions(cfg.space, grid=cfg.sampler == "grid")
    if cfg.sampler == "grid" and (n := math.prod(len(d.choices) for d in dists.values())) > MAX_GRID_TRIALS:
        sizes = " x ".join(str(len(d.choices)) for d in dists.values())
        raise _error("space", f"the grid has {n:,} combinations ({sizes}), above {MAX_GRID_TRIALS:,}, each a "
                              f"training run; give fewer values, or sampler: tpe (or gp) with trials: N")
    base = load_config(cfg.base, cfg.overrides)
    for key, d in dists.items():  # every value alone on the base, before the first trial: a bad one fails here
        for value in (d.choices if hasattr(d, "choices") else (d.low, d.high)):
            try:
                apply_settings(base, {key: value})
            except ConfigError as exc:
                raise _error(f"space.{key}", f"the value {value!r} cannot be run: "
                                             f"{str(exc).removeprefix('tune: ')}") from None


def distributions(space: dict[str, Any], grid: bool = False) -> dict[str, optuna.distributions.BaseDistribution]:
    """A list becomes a categorical distribution, ``{low, high, log, step}`` a float (int) one."""
    out: dict[str, optuna.distributions.BaseDistribution] = {}
    for key, v in space.items():
        if isinstance(v, list) and v:
            out[key] = optuna.distributions.CategoricalDistribution(v)
        elif isinstance(v, dict) and not grid and {"low", "high"} <= set(v) <= {"low", "high", "log", "step"}:
            ints = all(isinstance(v[k], int) for k in ("low", "high"))
            kind = optuna.distributions.IntDistribution if ints else optuna.distributions.FloatDistribution
            try:
                out[key] = kind(v["low"], v["high"], log=bool(v.get("log", False)), step=v.get("step", 1 if ints
                                                                                                   else None))
            except ValueError as exc:
                raise _error(f"space.{key}", str(exc)) from exc
        else:
            what = "a non-empty list of values" + ("" if grid else " or {low, high, log, step}")
            raise _error(f"space.{key}", f"must be {what}, got {v!r}")
    return out


def grid(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Cartesian product of the value lists, the last key varying fastest."""
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def _set_keys(node: Any, settings: dict[str, Any]) -> None:
    for key, value in settings.items():
        if OmegaConf.select(node, key, default=_MISSING) is _MISSING:
            raise ConfigError(f"tune: the run config has no key '{key}' (list elements: dual.constraints[0].tolerance)")
        try:
            OmegaConf.update(node, key, yaml_value(key, value), merge=False)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"tune: cannot set '{key}' to {value!r}: {_first_line(exc)}") from exc


def _first_line(exc: OmegaConfBaseException) -> str:
    """OmegaConf's message without the ``full_key:`` / ``object_type=`` lines it appends."""
    return str(getattr(exc, "msg", None) or exc).splitlines()[0]


# The environment variable through which trials get the study's tracking URI.
TRIAL_URI_VARIABLE = "DCMDP_TUNE_TRACKING_URI"


def apply_settings(cfg: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """A copy of ``cfg`` with each ``key: value`` set (OmegaConf paths, ``[i]`` for list elements), checked."""
    node = OmegaConf.structured(cfg)
    _set_keys(node, settings)
    out: RunConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    # what was written as an interpolation stays so in the copy's records, unless a setting replaced it
    replaced = {re.sub(r"\[(\d+)\]", r".\1", key) for key in settings}
    redact.attach_written(out, {**{k: v for k, v in redact.written(cfg).items() if k not in replaced},
                                **redact.interpolations(OmegaConf.to_container(node, resolve=False))})
    validate(out)
    return out


def label(key: str) -> str:
    return key.replace("dual.constraints[", "c[").replace("dual.constraints.", "c.")

