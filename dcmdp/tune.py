"""Sweeps of the dual controller's settings on Optuna: ``dcmdp tune TUNE.yaml [key=value ...]``.

A tune file (YAML; defaults in the dataclasses below)::

    base: configs/tiny-dense.yaml        # run config; a relative path is tried next to the tune file, then in cwd
    overrides: [steps=40, eval_every=10] # dotlist for every trial (the command line's key=value come after)
    space:                               # run-config keys: a list of values, or a range (tpe and gp only)
      dual.constraints[0].tolerance: [0.001, 0.002, 0.005]
      dual.constraints[0].lr: {low: 0.1, high: 10, log: true}
    sampler: grid                        # grid (every combination of the lists) | tpe | gp, with `trials: N`
    storage: null                        # Optuna RDB URL (default: sqlite:///<output_dir>/study.db)
    select: {min_inside_frac: 0.7, max_slack_frac: 0.5, max_cap_frac: 0.5, tolerance_se: 1.0, warmup_steps: 0}
    prune: {enabled: true}
    workers: 2

``dual.constraints[0].tolerance`` is c, ``.lr`` η, ``.lambda_init`` λ_0; tables write ``c[i].`` for them.

What Optuna does, and what this module adds. Optuna holds the study: the samplers (grid, TPE, GP), the storage
several processes share, ask/tell, each trial's parameters, intermediate values, user attributes and constraint,
the heartbeat that fails a silent trial, and the retry of a failed trial with its intermediate values. None of
that is redone here. The supervisor adds what Optuna cannot do from inside one Python process:

- a trial is a ``dcmdp train`` process (the command a user runs; a crash, an OOM kill or a stuck trial cannot take
  the sweep down), so ``study.optimize`` cannot drive it: trials are claimed with ``ask``, their heartbeat recorded
  by the supervisor, their per-step metrics read from the progress file the trial appends to;
- pruning by the selection rule (``RulePruner``: a trial that can no longer be selected, collapsed or out of
  tolerance, stops), where Optuna's pruners rank intermediate values; the trial is stopped by SIGTERM so it
  writes its checkpoint and ends its MLflow run;
- the selection rule itself (eligible: finished, not collapsed, the dual active, D-hat <= c on most steps where the
  penalty can move D-hat across c; then the tightest c within one standard error of the best held-out accuracy),
  which ``study.best_trial`` cannot express;
  eligibility goes to TPE and GP as an Optuna constraint;
- the end of a grid shared by several processes: outside ``optimize`` Optuna's grid sampler neither stops nor
  avoids points other processes are running, so ``claim`` ends the sweep once every point has a trial;
- a lock file around study bookkeeping on sqlite (no row locks there; a server database locks rows itself);
- MLflow: one parent run, the trials nested under it as child runs tagged with their Optuna state;
- the outputs: the table that says why each trial was not selected, results.csv, tune.png and best.yaml.

One Optuna study per tune file (name: the file's stem, or ``study``), maximising held-out accuracy. Any
number of ``dcmdp tune`` processes, here or on other machines, may share it: each claims trials and none
runs twice (sqlite: claims are serialised by a lock file next to the database; a server database locks
rows itself). A trial is ``python -m dcmdp.cli train <trial>/run.yaml`` in ``<output_dir>/trials/t<number>``,
a child MLflow run nested under one parent run whose id is a study attribute. It appends each step's
metrics to ``progress.jsonl`` (``tracking.progress_file`` of its run.yaml); the tune process reads it
every ``POLL_S``, reports held-out accuracy (``eval/accuracy``, every ``eval_every`` steps) as the
intermediate value and asks ``RulePruner``. A pruned trial gets SIGTERM, writes its checkpoint, ends its
MLflow run KILLED and is tagged ``dcmdp.tune.state=PRUNED``.

Selection rule. A trial is *eligible* when it finished, did not collapse, kept every judged constraint's D-hat
<= c (``dual/measured/<c>`` <= ``dual/tolerance/<c>``) on at least ``min_inside_frac`` of its steps after
warm-up (steps ``warmup_steps + 1 .. steps``), and its dual acted: no constraint slack (lambda at its floor with
D-hat < c) on more than ``max_slack_frac`` of the steps, none with lambda at its cap on more than ``max_cap_frac``
(the run's summary.json), no lambda holding one value on every step after warm-up where its dual was in force (the
steps a dual with ``authority`` stood down, by its own measurement, are left out). A slack dual is a run without
the penalty, a pinned one a constant: "best accuracy among trials inside c" alone rewards the loosest c, where the
dual does nothing. A constraint is *judged* when its c is fixed (a bound the user set) or when its c is anchored and
the penalty's reach (median log D_0 - log D_max of its probed batches) is at least the batch spread (sd of log D-hat
after warm-up): below it lambda cannot move D-hat across c, the share inside is set by where the anchor placed c and
a placebo (lambda fixed at 0 or at lambda_max) meets it too, so it is not judged ("inside c not judged: reach X
under spread Y") and the accuracy clause alone decides; the placebos fail the dual-acted clauses. It *collapsed* when a ``loss/`` metric
was non-finite, or when the mean of ``collapse_metric`` over its last ``collapse_window`` steps fell below
``collapse_drop_frac`` x its peak window mean. The selected trial is the eligible one with the tightest tolerance
(mean c over its steps) among those whose held-out accuracy is within ``tolerance_se`` standard errors of the best
eligible accuracy (the binomial standard error sqrt(p (1 - p) / n) of the best, n its eval prompts): accuracy
differences inside the noise of the held-out set do not buy a looser c. Ties: higher accuracy, larger inside share,
smaller mean discrepancy, the earlier trial. The table says why it chose. tpe and gp see eligibility as an Optuna
constraint.

Resume: running the tune file again continues the study. Finished and pruned trials stay; failed ones (an
interrupted sweep, a crashed trial, a trial whose heartbeat stopped for ``GRACE_S``) run again as Optuna
retries in the first attempt's folder, so they continue from their checkpoint in the same child run.
Outputs of each call, also parent-run artifacts: ``table.txt`` (why each trial was not selected),
``results.csv``, ``tune.png`` and ``best.yaml`` (the winning ``dual.constraints`` block and swept keys).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import importlib.util
import itertools
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import optuna
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from dcmdp import redact
from dcmdp.config import (URI_KEYS, ConfigError, RunConfig, TrackingConfig, config_error, file_in_the_way, load_config,
                          public_config, read_yaml_file, require, to_yaml, validate, yaml_value)
from dcmdp.redact import public_uri
from dcmdp.tracking import LOCAL_ID_PREFIX, Tracker, resolve_tracking_uri

log = logging.getLogger("dcmdp.tune")
# heartbeats, fail_stale_trials and the retry callback are marked experimental; used here with ask/tell
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")

SAMPLERS = ("grid", "tpe", "gp")
# Combinations a grid may hold: each is a training run (a larger study is a tpe or gp one with a trial budget).
MAX_GRID_TRIALS = 10_000
POLL_S = 0.5  # how often the parent reads a running trial's progress
HEARTBEAT_S, GRACE_S = 20, 120  # Optuna heartbeat of running trials; a trial silent for GRACE_S is failed
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


@dataclass
class Trial:
    """One trial's outcome; ``lambda_history`` holds λ per step (steps 1..N) of every constraint."""

    trial: str
    settings: dict[str, Any]
    status: str = "ok"  # ok | pruned | failed | running
    error: str = ""
    accuracy_before: float = math.nan
    accuracy_after: float = math.nan
    mean_discrepancy: dict[str, float] = field(default_factory=dict)
    inside_frac: float = math.nan
    final_lambda: dict[str, float] = field(default_factory=dict)
    nonfinite_loss: bool = False
    peak_window_mean: float = math.nan
    final_window_mean: float = math.nan
    collapsed: bool = False
    eligible: bool = False
    selected: bool = False
    run_id: str = ""
    seconds: float = math.nan
    steps: int = 0
    number: int = -1
    reason: str = ""
    lambda_history: dict[str, list[float]] = field(default_factory=dict)
    # Per constraint with ``authority``: 1 on the steps its dual stood down (lambda held at 0 by its own measurement of
    # the reach against the spread, not by the config), 0 where it was in force.
    stood_down_history: dict[str, list[float]] = field(default_factory=dict)
    # The run's end-of-run warnings (summary.json: a constraint slack throughout, accuracy at chance level), and
    # held-out accuracy that ended below its start.
    warnings: list[str] = field(default_factory=list)
    # Largest share of steps over the constraints with the dual slack (lambda at its floor, D-hat < c), and with
    # lambda at its cap (summary.json; NaN: unknown).
    slack_frac: float = math.nan
    cap_frac: float = math.nan
    # Mean tolerance c over the steps, summed over the constraints (the tightness the rule prefers).
    mean_tolerance: float = math.nan
    # Held-out prompts behind accuracy_after (0: unknown; the standard error is then 0).
    eval_prompts: int = 0
    # Per constraint: the penalty's reach (median log D_0 - log D_max over the probed batches, dcmdp.dual.penalty_reach)
    # and the batch spread (sd of log D-hat after warm-up, dcmdp.dual.batch_spread); NaN: not measured.
    reach: dict[str, float] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)
    # Constraint -> why its inside share is not judged (an anchored c whose reach is under the spread, or not measured).
    unjudged: dict[str, str] = field(default_factory=dict)
    # Share of the post-warm-up steps with every judged constraint inside c (NaN: none judged).
    judged_inside_frac: float = math.nan


# --------------------------------------------------------------------------------------------------
# The tune file.


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


# --------------------------------------------------------------------------------------------------
# The selection rule, and the pruner that applies it while a trial runs.


def assess(trial: Trial, history: dict[str, list[float]], names: Sequence[str], rule: SelectRule,
           anchored: Optional[Sequence[bool]] = None) -> Trial:
    """Fill the per-step derived fields of ``trial`` from ``history`` (metric key -> values of steps 1..N).

    inside_frac = share of steps t > warmup_steps with measured_c(t) <= tolerance_c(t) for every constraint c;
    a non-finite D-hat counts as outside, a run without constraints is inside on every step, and a run with
    no step after warm-up gets NaN (and is not eligible). judged_inside_frac is the same share over the judged
    constraints (``authority``; ``anchored``: whether each constraint's c is anchored, by default whether it was
    probed).
    """
    inside = _inside(history, names, rule)
    trial.steps = max((len(v) for v in history.values()), default=0)
    trial.inside_frac = sum(inside) / len(inside) if inside else math.nan
    anchored = _anchored(history, names, anchored)
    trial.reach, trial.spread, trial.unjudged = {}, {}, {}
    for c, a in zip(names, anchored):
        trial.reach[c], trial.spread[c], note = authority(history, c, rule, a, live=False)
        if note:
            trial.unjudged[c] = note
    judged = [c for c in names if c not in trial.unjudged]
    inside_judged = _inside(history, judged, rule) if judged else []
    trial.judged_inside_frac = sum(inside_judged) / len(inside_judged) if inside_judged else math.nan
    trial.mean_discrepancy = {c: _finite_mean(history.get(f"dual/measured/{c}", [])) for c in names}
    trial.mean_tolerance = sum(_finite_mean(history.get(f"dual/tolerance/{c}", [])) for c in names) if names else 0.0
    trial.lambda_history = {c: list(history.get(f"dual/lambda/{c}", [])) for c in names}
    trial.stood_down_history = {c: list(history[f"dual/stood_down/{c}"]) for c in names
                                if f"dual/stood_down/{c}" in history}
    trial.final_lambda = {c: v[-1] for c, v in trial.lambda_history.items() if v}
    trial.nonfinite_loss = any(not math.isfinite(v) for k, vs in history.items() if k.startswith("loss/") for v in vs)
    means = _window_means(history.get(rule.collapse_metric, []), rule.collapse_window)
    trial.peak_window_mean = max(means) if means else math.nan
    trial.final_window_mean = means[-1] if means else math.nan
    trial.collapsed = trial.nonfinite_loss or (bool(means) and trial.final_window_mean < rule.collapse_drop_frac
                                               * trial.peak_window_mean)
    return trial


def authority(history: dict[str, list[float]], name: str, rule: SelectRule, anchored: bool,
              live: bool = True) -> tuple[float, float, str]:
    """(reach, spread, why not judged) of one constraint from ``history``: the reach from its probed batches
    (``dual/anchor_zero/<name>``, ``dual/anchor_max/<name>``; ``dcmdp.dual.penalty_reach``), the spread from
    ``dual/measured/<name>`` after warm-up (``dcmdp.dual.batch_spread``), NaN where not measured.

    The inside share of an anchored c is judged only where the reach is at least the spread: lambda in [0, lambda_max]
    shifts log D-hat by at most the reach while the batches scatter it by the spread, so below it the share is set by
    where the anchor placed c, and a placebo (lambda fixed at 0 or at lambda_max) meets it as well
    (``dcmdp.loop.control_sentence``). ``live`` (a running trial): the reach counts only once the first anchor window
    has closed (``dual/anchor_gap/<name>``). A fixed c, never probed, is a bound the user set: always judged."""
    from dcmdp.dual import batch_spread, penalty_reach

    measured = history.get(f"dual/measured/{name}", [])
    spread = batch_spread(measured[rule.warmup_steps:])
    reach = penalty_reach(history.get(f"dual/anchor_zero/{name}", []), history.get(f"dual/anchor_max/{name}", []))
    if live and not any(math.isfinite(v) for v in history.get(f"dual/anchor_gap/{name}", [])):
        reach = None
    reach_f, spread_f = (math.nan if x is None else x for x in (reach, spread))
    if not anchored or (reach is not None and spread is not None and reach >= spread):
        return reach_f, spread_f, ""
    if reach is None or spread is None:
        return reach_f, spread_f, f"inside c not judged: {'reach' if reach is None else 'spread'} not measured"
    return reach_f, spread_f, f"inside c not judged: reach {reach:.3g} under spread {spread:.3g}"


def _anchored(history: dict[str, list[float]], names: Sequence[str],
              anchored: Optional[Sequence[bool]]) -> list[bool]:
    return list(anchored) if anchored is not None else [f"dual/anchor_zero/{c}" in history for c in names]


def _inside(history: dict[str, list[float]], names: Sequence[str], rule: SelectRule) -> list[bool]:
    n = max((len(v) for v in history.values()), default=0)
    return [all(math.isfinite(d := _at(history, f"dual/measured/{c}", t))
                and d <= _at(history, f"dual/tolerance/{c}", t) for c in names) for t in range(rule.warmup_steps, n)]


def _window_means(watched: Sequence[float], window: int) -> list[float]:
    return [sum(watched[i:i + window]) / window for i in range(len(watched) - window + 1)] \
        or ([_finite_mean(watched)] if watched else [])


def live_state(history: dict[str, list[float]], names: Sequence[str], rule: SelectRule,
               anchored: Optional[Sequence[bool]] = None) -> dict[str, Any]:
    """What the pruner needs of a running trial: steps so far, post-warm-up steps outside the tolerance of a judged
    constraint (``authority`` on the history so far: an anchored c only once its first window closed and its reach
    is at least the running spread), a non-finite loss, and for how many trailing steps the collapse condition has
    held."""
    means = _window_means(history.get(rule.collapse_metric, []), rule.collapse_window)
    collapsed_for = 0
    for j in range(len(means) - 1, -1, -1):
        if not means[j] < rule.collapse_drop_frac * max(means[:j + 1]):
            break
        collapsed_for += 1
    judged = [c for c, a in zip(names, _anchored(history, names, anchored)) if not authority(history, c, rule, a)[2]]
    return {"live/steps": max((len(v) for v in history.values()), default=0),
            "live/outside": sum(not ok for ok in _inside(history, judged, rule)) if judged else 0,
            "live/nonfinite": any(not math.isfinite(v) for k, vs in history.items() if k.startswith("loss/")
                                  for v in vs),
            "live/collapsed_for": collapsed_for}


class RulePruner(optuna.pruners.BasePruner):
    """Prunes a trial that the selection rule can no longer pick, from the ``live/`` user attributes the
    tune process sets as the trial runs (``live_state``) and its ``steps_total``.

    Outside for good: more than (1 - min_inside_frac) x (steps_total - warmup_steps) post-warm-up steps with
    D-hat > c, so the inside share can no longer reach min_inside_frac; counted only for judged constraints, so a
    trial whose reach is under its running spread is never pruned for its inside share. Collapsed: a non-finite loss, or the
    collapse condition (last window mean < collapse_drop_frac x peak window mean) on ``patience`` steps in a
    row (a collapse that lasts is not expected to recover within the run).
    """

    def __init__(self, rule: SelectRule, patience: Optional[int] = None):
        self.rule, self.patience = rule, patience or rule.collapse_window

    def reason(self, attrs: dict[str, Any]) -> str:
        if not attrs.get("live/steps"):
            return ""
        allowed = (1 - self.rule.min_inside_frac) * max(attrs.get("steps_total", 0) - self.rule.warmup_steps, 0)
        if attrs.get("live/nonfinite"):
            return "non-finite loss"
        if attrs["live/outside"] > allowed + 1e-9:
            return (f"outside tolerance on {attrs['live/outside']} steps after warm-up, more than the "
                    f"{allowed:.3g} that {self.rule.min_inside_frac:.0%} inside allows")
        if attrs["live/collapsed_for"] >= self.patience:
            return f"collapsed ({self.rule.collapse_metric} window mean below {self.rule.collapse_drop_frac:g} x " \
                   f"its peak for {attrs['live/collapsed_for']} steps)"
        return ""

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return bool(self.reason(trial.user_attrs))


def accuracy_se(t: Trial) -> float:
    """Binomial standard error sqrt(p (1 - p) / n) of a trial's held-out accuracy (0 with n unknown)."""
    p = t.accuracy_after
    return math.sqrt(max(p * (1.0 - p), 0.0) / t.eval_prompts) if t.eval_prompts > 0 and math.isfinite(p) else 0.0


def select(trials: list[Trial], rule: SelectRule) -> Optional[Trial]:
    """Mark eligible trials, the selected one, why it was chosen and why every other was not; return it or None.

    Among the eligible trials (``_eligible``), the best accuracy p* and its standard error se (``accuracy_se``); the
    selected trial is the one with the smallest mean tolerance among those with accuracy >= p* - tolerance_se x se
    (ties: higher accuracy, larger inside share, smaller mean discrepancy, the earlier trial)."""
    for t in trials:
        t.selected = False
        t.eligible = _eligible(t, rule)
    eligible = [(i, t) for i, t in enumerate(trials) if t.eligible]
    if not eligible:
        for t in trials:
            t.reason = _why_not(t, None, rule)
        return None
    mean_d = lambda t: sum(t.mean_discrepancy.values()) if t.mean_discrepancy else 0.0  # noqa: E731
    top = max((t for _, t in eligible), key=lambda t: t.accuracy_after)
    floor = top.accuracy_after - rule.tolerance_se * accuracy_se(top)
    near = [(i, t) for i, t in eligible if t.accuracy_after >= floor]
    tight = lambda t: t.mean_tolerance if math.isfinite(t.mean_tolerance) else math.inf  # noqa: E731
    best = min(near, key=lambda it: (tight(it[1]), -it[1].accuracy_after, -_nan_low(it[1].inside_frac),
                                     mean_d(it[1]), it[0]))[1]
    for t in trials:
        t.reason = _why_not(t, best, rule, floor) if t is not best else _why_chosen(best, top, floor, len(near),
                                                                                   len(eligible), rule)
    best.selected = True
    return best


def _eligible(t: Trial, rule: SelectRule) -> bool:
    share = _judged_share(t)
    return (t.status == "ok" and not t.collapsed and math.isfinite(t.accuracy_after)
            and (share is None or share >= rule.min_inside_frac)
            and not t.slack_frac > rule.max_slack_frac and not t.cap_frac > rule.max_cap_frac  # NaN: unknown, passes
            and _fixed_lambda(t, rule) is None)


def _judged_share(t: Trial) -> Optional[float]:
    """The inside share the constraint clause judges: every constraint's (``inside_frac``) when each is judged, that
    of the judged ones when some are not, None (not required) when none is."""
    if not t.unjudged:
        return t.inside_frac
    return None if len(t.unjudged) >= len(t.reach) else t.judged_inside_frac


def _fixed_lambda(t: Trial, rule: SelectRule) -> Optional[tuple[str, float]]:
    """(constraint, value) of a lambda that held one value on every step after warm-up (at least 2) on which its dual
    was in force: a placebo (``dual.rule=fixed``, lambda at 0 or at lambda_max) or any constant, which no clause on
    D-hat tells from a dual; None when every lambda moved. The steps a dual with ``authority`` stood down are left
    out: its lambda 0 there is its own decision, taken at each anchor window from the reach it measured (a dual that
    stood down throughout is judged by the accuracy clause alone, as an unjudged c is), which no placebo logs."""
    for c, lam in t.lambda_history.items():
        down = t.stood_down_history.get(c, [])
        late = [v for k, v in enumerate(lam) if k >= rule.warmup_steps and math.isfinite(v)
                and not (k < len(down) and down[k] > 0.5)]
        if len(late) >= 2 and max(late) - min(late) <= 1e-12:
            return c, late[0]
    return None


def clause(t: Trial) -> str:
    """Which clause decides on the constraint: the inside share (judged), or the accuracy clause alone (not)."""
    if t.unjudged:
        many = len(t.reach) > 1
        return "; ".join(f"{note} ({c})" if many else note for c, note in t.unjudged.items())
    pairs = [(c, t.reach[c], t.spread.get(c, math.nan)) for c in t.reach if math.isfinite(t.reach[c])]
    if not pairs:
        return "inside c judged (a fixed c)" if t.reach else ""
    return "inside c judged: " + ", ".join(f"reach {r:.3g} >= spread {sp:.3g}" for _, r, sp in pairs)


def _why_chosen(best: Trial, top: Trial, floor: float, n_near: int, n_eligible: int, rule: SelectRule) -> str:
    decided = _decided(best, rule)
    if n_near == 1:
        return (f"selected: the best held-out accuracy ({best.accuracy_after:.1%}) of {n_eligible} eligible trial(s); "
                f"no other within {rule.tolerance_se:g} standard error(s) (>= {floor:.1%}){decided}")
    same = " (the best accuracy too)" if best is top else f" (best: {top.trial}, {top.accuracy_after:.1%})"
    return (f"selected: the tightest c (mean {best.mean_tolerance:.4g}) of the {n_near} eligible trials within "
            f"{rule.tolerance_se:g} standard error(s) of the best accuracy, >= {floor:.1%}; its accuracy "
            f"{best.accuracy_after:.1%}{same}{decided}")


def _decided(t: Trial, rule: SelectRule) -> str:
    """The clause that made ``t`` eligible on its constraint, as a tail of its reason ("" where nothing is known)."""
    what = clause(t)
    if not what:
        return ""
    if _judged_share(t) is None:
        return f"; eligible on the accuracy clause alone ({what})"
    return f"; {what}, inside on {_fmt(_judged_share(t), '.0%')} >= {rule.min_inside_frac:.0%}"


def _why_not(t: Trial, best: Optional[Trial], rule: SelectRule, floor: float = math.nan) -> str:
    if t.status != "ok":
        return f"{t.status}: {t.error}" if t.error else t.status
    if t.nonfinite_loss:
        return "collapsed: non-finite loss"
    if t.collapsed:
        return (f"collapsed: last {rule.collapse_window}-step mean {t.final_window_mean:.3g} < "
                f"{rule.collapse_drop_frac:g} x peak {t.peak_window_mean:.3g}")
    if not math.isfinite(t.accuracy_after):
        return "no held-out accuracy"
    if (share := _judged_share(t)) is not None and not share >= rule.min_inside_frac:
        return f"inside tolerance on {_fmt(share, '.0%')} of steps < {rule.min_inside_frac:.0%}"
    if t.slack_frac > rule.max_slack_frac:
        return (f"dual off: slack (lambda at its floor, D-hat < c) on {t.slack_frac:.0%} of steps > "
                f"{rule.max_slack_frac:.0%}")
    if t.cap_frac > rule.max_cap_frac:
        return f"lambda at its cap on {t.cap_frac:.0%} of steps > {rule.max_cap_frac:.0%}: a constant, not a controller"
    if (fixed := _fixed_lambda(t, rule)) is not None:
        return (f"lambda fixed at {fixed[1]:.4g} ({fixed[0]}) on every step after warm-up: a constant, not a "
                f"controller")
    assert best is not None
    if t.accuracy_after < floor:
        return (f"eligible, accuracy {t.accuracy_after:.1%} more than {rule.tolerance_se:g} standard error(s) under "
                f"the best (< {floor:.1%})")
    if t.mean_tolerance > best.mean_tolerance:
        return (f"eligible, within {rule.tolerance_se:g} standard error(s) of the best accuracy but a looser c than "
                f"{best.trial} (mean {_fmt(t.mean_tolerance)} > {_fmt(best.mean_tolerance)})")
    return f"eligible, same c as {best.trial}, lost the tie (accuracy, inside share, mean D, then order)"


def _at(history: dict[str, list[float]], key: str, t: int) -> float:
    values = history.get(key, [])
    return float(values[t]) if t < len(values) else math.nan


def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x


# --------------------------------------------------------------------------------------------------
# The study and the trials.


def read_progress(path: Path) -> tuple[dict[str, list[float]], str]:
    """(metric key -> values of steps 1..N, the trial's MLflow run id) from a trial's progress file; a step
    written twice (a trial resumed from an earlier checkpoint) keeps its last line."""
    by_step: dict[int, dict] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                rec = json.loads(line)
                by_step[int(rec.pop("step"))] = rec
    steps = range(1, max(by_step, default=0) + 1)
    keys = dict.fromkeys(k for r in by_step.values() for k in r if k != "run_id")
    history = {k: [float(by_step.get(s, {}).get(k, math.nan)) for s in steps] for k in keys}
    run_id = next((r["run_id"] for _, r in sorted(by_step.items(), reverse=True) if r.get("run_id")), "")
    return history, run_id


def root_number(trial: FrozenTrial) -> int:
    """The number of the first attempt of a retried trial (its folder), else the trial's own."""
    history = RetryHeartbeatStaleTrialCallback.retry_history(trial)
    return history[0] if history else trial.number


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid; ``_Sweep.claim`` ends the sweep when the grid is covered (``study.stop`` is for optimize)."""

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        pass


class _StudyLock:
    """Serialises study bookkeeping (create, retry, claim) between threads and, for sqlite, processes."""

    def __init__(self, storage_url: str):
        self._thread_lock = threading.Lock()
        path = storage_url.removeprefix("sqlite:///") if storage_url.startswith("sqlite:///") else None
        self._path = Path(path + ".lock") if path else None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._thread_lock:
            if self._path is None:
                yield
                return
            with open(self._path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                yield


class _Sweep:
    """One ``dcmdp tune`` call: the study, the parent MLflow run and the trials this process runs."""

    def __init__(self, cfg: TuneConfig):
        from constraints.penalties import constraint_names

        self.cfg, self.out = cfg, Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.base = load_config(cfg.base, cfg.overrides)
        # what the study, the parent run and its buffer record of the overrides: Optuna's attributes are plain text
        self.public_overrides = redact.public_overrides(cfg.overrides, URI_KEYS)
        self.names = constraint_names(self.base.dual.constraints)
        self.tracking_uri = resolve_tracking_uri(self.base.tracking, self.out)
        # trials read the URI (and any credential in it) from the environment they inherit, so that no trial's
        # run.yaml holds it
        os.environ[TRIAL_URI_VARIABLE] = self.tracking_uri
        self.dists = distributions(cfg.space, grid=cfg.sampler == "grid")
        self.pruner = RulePruner(cfg.select, cfg.prune.collapse_patience)
        url = cfg.storage or f"sqlite:///{(self.out / 'study.db').resolve()}"
        self.lock = _StudyLock(url)
        with self.lock():  # two processes creating one sqlite file's tables at once would collide
            try:
                self.storage = RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, engine_kwargs={
                    "connect_args": {"timeout": 120}} if url.startswith("sqlite") else None)
            except Exception as exc:  # sqlalchemy's errors: a damaged file, a wrong URL, a driver missing
                where = "storage" if cfg.storage else "storage (default <output_dir>/study.db)"
                raise _error(where, f"cannot open the study database {public_uri(url)}: {type(exc).__name__}: "
                                    f"{redact.redact(str(exc).splitlines()[0])}") from None
        self.started = 0
        self.stopping = False
        self.procs: set[subprocess.Popen] = set()
        self.study = self._open_study()
        parent = TrackingConfig(uri=self.tracking_uri, experiment=self.base.tracking.experiment,
                                run_name=f"tune-{cfg.study}", buffer_dir=str(self.out / "tracking_buffer"))
        if (uri_as_written := redact.written_field(self.base.tracking, "uri")) is not None:
            redact.attach_written(parent, {"uri": uri_as_written})  # its buffer names it, for `dcmdp sync`
        self.tracker = Tracker(parent, self.out)
        self.parent_id = self._start_parent()

    def _sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        if self.cfg.sampler == "grid":
            return _GridSampler(self.cfg.space, seed=seed)
        if self.cfg.sampler == "tpe":
            return optuna.samplers.TPESampler(seed=seed)
        return optuna.samplers.GPSampler(seed=seed)

    def _open_study(self) -> optuna.Study:
        spec = json.dumps({"base": self.cfg.base, "overrides": self.public_overrides, "space": self.cfg.space,
                           "sampler": self.cfg.sampler}, sort_keys=True)
        with self.lock():
            try:
                study = optuna.create_study(storage=self.storage, study_name=self.cfg.study, direction="maximize",
                                            sampler=self._sampler(self.cfg.seed), pruner=self.pruner)
                study.set_user_attr("dcmdp.spec", spec)
            except optuna.exceptions.DuplicatedStudyError:
                # another process may be sampling too: a seed of its own keeps tpe/gp from proposing the same
                # points (the grid's order depends on the seed: it stays the study's)
                seed = self.cfg.seed + (0 if self.cfg.sampler == "grid" else os.getpid())
                study = optuna.load_study(storage=self.storage, study_name=self.cfg.study, pruner=self.pruner,
                                          sampler=self._sampler(seed))
                stored = study.user_attrs.get("dcmdp.spec")
                if stored is not None and stored != spec:
                    raise ConfigError(f"tune: study {self.cfg.study!r} in {public_uri(str(self.storage.url))} was made "
                                      f"from another base, overrides, space or sampler ({stored}); set 'study' in the "
                                      f"tune file or use another output_dir")
            optuna.storages.fail_stale_trials(study)
            trials = study.get_trials(deepcopy=False)
            retried = {n for t in trials for n in RetryHeartbeatStaleTrialCallback.retry_history(t)}
            for t in trials:  # failed trials run again, from their checkpoint
                if t.state == TrialState.FAIL and t.number not in retried:
                    RetryHeartbeatStaleTrialCallback(max_retry=None, inherit_intermediate_values=True)(study, t)
        return study

    def _start_parent(self) -> Optional[str]:
        params = {"tune.base": self.cfg.base, "tune.overrides": " ".join(self.public_overrides),
                  "tune.sampler": self.cfg.sampler, "tune.trials": str(self.cfg.trials), "tune.study": self.cfg.study,
                  **{f"tune.space.{k.replace('[', '.').replace(']', '')}": str(v) for k, v in self.cfg.space.items()},
                  **{f"tune.select.{k}": str(v) for k, v in asdict(self.cfg.select).items()},
                  **{f"tune.prune.{k}": str(v) for k, v in asdict(self.cfg.prune).items()}}
        with self.lock():
            known = self.study.user_attrs.get("mlflow_parent")
            run_id = self.tracker.start({} if known else params, run_id=known, tags={"dcmdp.tune": "parent"})
            if run_id.startswith(LOCAL_ID_PREFIX):
                log.warning("MLflow at %s is unreachable: trials are not nested under a parent run",
                            public_uri(self.tracking_uri))
                return None
            self.study.set_user_attr("mlflow_parent", run_id)
        return run_id

    def claim(self) -> Optional[optuna.Trial]:
        """The next trial: a waiting retry first, then a new point while the grid or budget has room."""
        with self.lock():
            if self.stopping:
                return None
            trials = self.study.get_trials(deepcopy=False)
            if not any(t.state == TrialState.WAITING for t in trials):
                if self.cfg.sampler == "grid":
                    done = {json.dumps(t.params, sort_keys=True) for t in trials}
                    if all(json.dumps(p, sort_keys=True) in done for p in grid(self.cfg.space)):
                        return None
                elif len({root_number(t) for t in trials}) >= (self.cfg.trials or 0):
                    return None
            trial = self.study.ask(self.dists)
            self.storage.record_heartbeat(trial._trial_id)  # from now on a silent trial is found stale
            return trial

    def work(self, limit: Optional[int] = None) -> None:
        while (limit is None or limit > 0) and (trial := self.claim()) is not None:
            self.run(trial)
            limit = None if limit is None else limit - 1

    def run(self, trial: optuna.Trial) -> None:
        """Run one trial as a ``dcmdp train`` process, report and prune it, tell Optuna how it ended."""
        frozen = next(t for t in self.study.get_trials(deepcopy=False) if t.number == trial.number)
        d = self.out / "trials" / f"t{root_number(frozen):03d}"
        d.mkdir(parents=True, exist_ok=True)
        settings = {k: trial.params[k] for k in self.dists}
        overrides = {"output_dir": str(d.resolve()), "tracking.uri": f"${{oc.env:{TRIAL_URI_VARIABLE}}}",
                     "tracking.run_name": f"{self.cfg.study}-{d.name}", "tracking.buffer_dir": None,
                     "tracking.parent_run_id": self.parent_id, "tracking.progress_file": str(d / "progress.jsonl"),
                     "progress": False,
                     "checkpoint.resume": "auto"}  # a retried trial continues from its checkpoint, same child run
        try:
            run_cfg = apply_settings(self.base, {**overrides, **settings})
        except ConfigError as exc:
            log.warning("trial %s: %s", d.name, exc)
            return self._tell(trial, TrialState.FAIL, Trial(d.name, settings, status="failed", error=str(exc)))
        (d / "run.yaml").write_text(to_yaml(run_cfg, public=True))
        anchored = [c.anchor is not None for c in run_cfg.dual.constraints]
        trial.set_user_attr("steps_total", run_cfg.steps)
        trial.set_user_attr("process", f"{os.uname().nodename}:{os.getpid()}")
        self.started += 1
        log.info("trial %s (optuna #%d): %s", d.name, trial.number, _fmt_settings(settings))
        with open(d / "train.log", "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "train", str(d / "run.yaml")], stdout=logf,
                                    stderr=subprocess.STDOUT)
        self.procs.add(proc)
        reported, live, beat, pruned, interrupted = set(frozen.intermediate_values), {}, time.monotonic(), "", False
        try:
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=POLL_S)
                history, run_id = read_progress(d / "progress.jsonl")
                for step, acc in enumerate(history.get("eval/accuracy", []), start=1):
                    if math.isfinite(acc) and step not in reported:
                        trial.report(acc, step)
                        reported.add(step)
                state = live_state(history, self.names, self.cfg.select, anchored)
                if state != live:
                    live = state
                    for k, v in state.items():
                        trial.set_user_attr(k, v)
                    # a trial past its last step is finishing: pruning it would only cut its final evaluation
                    if (self.cfg.prune.enabled and proc.poll() is None and state["live/steps"] < run_cfg.steps
                            and trial.should_prune()):
                        pruned = self.pruner.reason({**state, "steps_total": run_cfg.steps})
                        log.info("trial %s pruned at step %d: %s", d.name, state["live/steps"], pruned)
                        proc.send_signal(signal.SIGTERM)  # the trial writes its checkpoint and ends its run KILLED
                        proc.wait()
                if proc.poll() is not None:
                    break
                if time.monotonic() - beat > HEARTBEAT_S:
                    self.storage.record_heartbeat(trial._trial_id)
                    beat = time.monotonic()
        except KeyboardInterrupt:
            self.stop()
            proc.wait()
            interrupted = True
        finally:
            self.procs.discard(proc)
        try:
            self._finish(trial, d, settings, proc.returncode, pruned, anchored)
        finally:
            if interrupted:
                raise KeyboardInterrupt

    def _finish(self, trial: optuna.Trial, d: Path, settings: dict[str, Any], returncode: int, pruned: str,
                anchored: Sequence[bool]) -> None:
        history, run_id = read_progress(d / "progress.jsonl")
        record = assess(Trial(d.name, settings), history, self.names, self.cfg.select, anchored)
        if pruned:
            record.status, record.error, record.run_id = "pruned", pruned, run_id
            self._tag_child(run_id, "PRUNED", trial.number, end="KILLED")
            return self._tell(trial, TrialState.PRUNED, record)
        summary_path = d / "summary.json"
        if returncode != 0 or not summary_path.is_file():
            why = "interrupted" if self.stopping else f"exit code {returncode}: {_last_line(d / 'train.log')}"
            log.warning("trial %s failed (%s); log in %s", d.name, why, d / "train.log")
            record.status, record.error, record.run_id = "failed", why, run_id
            self._tag_child(run_id, "FAIL", trial.number)
            return self._tell(trial, TrialState.FAIL, record)
        summary = json.loads(summary_path.read_text())
        record.accuracy_before, record.accuracy_after = summary["accuracy_before"], summary["accuracy_after"]
        record.run_id, record.seconds = summary["run_id"], summary["seconds"]
        record.warnings = list(summary.get("warnings", []))
        constraints = list((summary.get("constraints") or {}).values())
        record.slack_frac = max((c.get("slack_frac", math.nan) for c in constraints), default=math.nan)
        record.cap_frac = max((c.get("cap_frac", math.nan) for c in constraints), default=math.nan)
        with contextlib.suppress(OSError, ValueError, ConfigError):
            record.eval_prompts = int(load_config(d / "run.yaml", []).task.eval_size)
        if record.accuracy_after < record.accuracy_before:
            record.warnings.append(f"held-out accuracy fell below its start ({record.accuracy_before:.1%} -> "
                                   f"{record.accuracy_after:.1%})")
        select([record], self.cfg.select)
        self._tag_child(record.run_id, "COMPLETE", trial.number)
        self._tell(trial, TrialState.COMPLETE if math.isfinite(record.accuracy_after) else TrialState.FAIL, record)

    def _tell(self, trial: optuna.Trial, state: TrialState, record: Trial) -> None:
        """The record as a user attribute and eligibility as a constraint (tpe and gp model both), then the state."""
        trial.set_user_attr("record", {k: v for k, v in asdict(record).items()
                                       if k not in ("trial", "settings", "selected", "reason", "number")})
        trial.set_constraint("eligible", 0.0 if record.eligible else 1.0)
        self.study.tell(trial, record.accuracy_after if state == TrialState.COMPLETE else None, state=state)

    def _tag_child(self, run_id: str, state: str, number: int, end: str = "") -> None:
        """Tag the trial's MLflow run; with ``end``, also end it with that status if it is still RUNNING (a trial
        stopped after its last step, outside the loop that ends its run on SIGTERM)."""
        if not run_id or run_id.startswith(LOCAL_ID_PREFIX):
            return
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.tracking_uri)
            client.set_tag(run_id, "dcmdp.tune.state", state)
            client.set_tag(run_id, "optuna.trial", str(number))
            if end and client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, end)
        except Exception as exc:  # the trial's outcome is in Optuna; a tag is not worth failing the sweep
            log.warning("cannot tag MLflow run %s (%s)", run_id, exc)

    def stop(self) -> None:
        """No new trial starts; running ones get SIGINT, checkpoint and end (retried on the next call)."""
        self.stopping = True
        for p in list(self.procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)

    def records(self) -> list[Trial]:
        """The latest attempt of every trial in the study, as records."""
        latest: dict[int, FrozenTrial] = {}
        for t in self.study.get_trials(deepcopy=False):
            latest[root_number(t)] = t
        out = []
        for root, t in sorted(latest.items()):
            attrs = dict(t.user_attrs.get("record", {"status": "failed"}))
            if t.state in (TrialState.RUNNING, TrialState.WAITING):  # a retry carries its failed attempt's record
                attrs = {"status": t.state.name.lower()}
            out.append(Trial(f"t{root:03d}", {k: t.params.get(k) for k in self.dists}, number=t.number, **attrs))
        return out


def tune(cfg: TuneConfig) -> tuple[list[Trial], Optional[Trial]]:
    """Run this process's share of the study, select, write and log the outputs; return (trials, selected)."""
    sweep = _Sweep(cfg)
    status = "FAILED"
    try:
        t0 = time.perf_counter()
        prime = (cfg.prime_cold_start and cfg.workers > 1 and sweep.base.cold_start.steps > 0
                 and not sweep.base.model.path)
        if prime:
            sweep.work(limit=1)  # fills the cold-start cache the other trials reuse
        with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
            futures = [pool.submit(sweep.work) for _ in range(cfg.workers)]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                sweep.stop()
                raise
        trials = sweep.records()
        best = select(trials, cfg.select)
        seconds = time.perf_counter() - t0
        for p in write_outputs(cfg, sweep, trials, best, seconds):
            sweep.tracker.log_artifact(p)
        sweep.tracker.log_metrics({"tune/trials": len(trials), "tune/started": sweep.started,
                                   "tune/failed": sum(t.status == "failed" for t in trials),
                                   "tune/pruned": sum(t.status == "pruned" for t in trials),
                                   "tune/selected_accuracy": best.accuracy_after if best else math.nan,
                                   "tune/seconds": seconds}, step=0)
        status = "FINISHED"
        return trials, best
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        sweep.tracker.finish(status)


# --------------------------------------------------------------------------------------------------
# Outputs.


def _fmt_settings(settings: dict[str, Any]) -> str:
    return " ".join(f"{label(k)}={v:g}" if isinstance(v, float) else f"{label(k)}={v}" for k, v in settings.items())


def _fmt(x: Any, spec: str = ".4g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(trials: list[Trial], names: Sequence[str], rule: SelectRule) -> str:
    """The printed table; the rule is stated above it, and the last column says why a trial was (not) selected."""
    head = ["trial", "settings", "acc before", "acc after", *[f"mean D {c}" for c in names], "inside",
            *[f"reach {c}" for c in names], *[f"spread {c}" for c in names], *[f"final λ {c}" for c in names],
            "steps", "selected", "constraint clause", "why (not) selected"]
    rows = [head]
    for t in trials:
        rows.append([t.trial, _fmt_settings(t.settings), _fmt(t.accuracy_before, ".1%"), _fmt(t.accuracy_after, ".1%"),
                     *[_fmt(t.mean_discrepancy.get(c, math.nan)) for c in names], _fmt(t.inside_frac, ".0%"),
                     *[_fmt(t.reach.get(c, math.nan), ".3g") for c in names],
                     *[_fmt(t.spread.get(c, math.nan), ".3g") for c in names],
                     *[_fmt(t.final_lambda.get(c, math.nan)) for c in names], str(t.steps),
                     "*" if t.selected else "", clause(t), t.reason[:110]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([rule.describe(), "", *lines])


def write_outputs(cfg: TuneConfig, sweep: _Sweep, trials: list[Trial], best: Optional[Trial],
                  seconds: float) -> list[Path]:
    out, names = sweep.out, sweep.names
    count = {s: sum(t.status == s for t in trials) for s in ("pruned", "failed")}
    text = table(trials, names, cfg.select)
    text += (f"\n\n{len(trials)} trials in study {cfg.study!r} ({sweep.started} run now, {count['pruned']} pruned, "
             f"{count['failed']} failed) in {seconds:.0f} s with {cfg.workers} worker(s)")
    text += f"\nselected: {best.trial} ({_fmt_settings(best.settings)}): {best.reason}" if best else \
        "\nselected: none (no eligible trial)"
    for w in best.warnings if best else ():
        text += f"\nwarning: the selected trial {best.trial}: {w}"
        log.warning("the selected trial %s: %s", best.trial, w)
    print(text)
    (out / "table.txt").write_text(text + "\n")
    csv_path, keys = out / "results.csv", list(cfg.space)
    rows = [_csv_row(t) for t in trials]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    paths = [out / "table.txt", csv_path, out / "tune.png"]
    plot_tune(trials, keys[0], names, paths[-1], log_x=log_spaced(sweep.dists[keys[0]]))
    if best is not None:
        snippet = out / "best.yaml"
        snippet.write_text(best_snippet(sweep.base, best))
        paths.append(snippet)
        print(f"winning settings written to {snippet}")
    return paths


def _csv_row(t: Trial) -> dict[str, Any]:
    """One CSV row: settings, per-constraint values as ``<field>/<constraint>``, booleans as 0/1."""
    row: dict[str, Any] = {"trial": t.trial, "optuna_number": t.number, **t.settings}
    for k, v in asdict(t).items():
        if isinstance(v, dict) and k in ("mean_discrepancy", "final_lambda", "reach", "spread", "unjudged"):
            row.update({f"{k}/{c}": x for c, x in v.items()})
        elif k == "warnings":
            row[k] = "; ".join(v)
        elif not isinstance(v, dict) and k not in ("trial", "number", "error"):
            row[k] = int(v) if isinstance(v, bool) else v
    return row


def log_spaced(dist: optuna.distributions.BaseDistribution) -> bool:
    """A log axis: a log-scale range, or positive values spanning more than a decade that are closer to evenly
    spaced in log than in linear terms."""
    if getattr(dist, "log", False):
        return True
    xs = sorted({float(v) for v in getattr(dist, "choices", ()) if isinstance(v, (int, float))})
    if len(xs) < 2 or xs[0] <= 0 or xs[-1] / xs[0] <= 10:
        return False
    spread = lambda v: max(b - a for a, b in zip(v, v[1:])) / min(b - a for a, b in zip(v, v[1:]))  # noqa: E731
    return len(xs) == 2 or spread([math.log(x) for x in xs]) < spread(xs)


def best_snippet(base: RunConfig, best: Trial) -> str:
    """The winner's ``dual.constraints`` block (and any other swept key) as YAML, ready to paste."""
    cfg = apply_settings(base, best.settings)
    # as every record of a config: a value written as an interpolation stays one (public_config)
    node = OmegaConf.create({"dual": {"constraints": public_config(cfg)["dual"]["constraints"]}})
    for key, value in best.settings.items():
        if not key.startswith("dual.constraints"):
            OmegaConf.update(node, key, value, force_add=True)
    acc = f"{best.accuracy_before:.1%} -> {best.accuracy_after:.1%}"
    what = f"; {clause(best)}" if clause(best) else ""
    warned = "".join(f"# warning: {w}\n" for w in best.warnings)
    return (f"# dcmdp tune: selected trial {best.trial} ({_fmt_settings(best.settings)}); held-out accuracy {acc}, "
            f"inside tolerance on {_fmt(best.inside_frac, '.0%')} of steps after warm-up{what}\n{warned}"
            + OmegaConf.to_yaml(node))


def plot_tune(trials: list[Trial], key: str, names: Sequence[str], path: Path, log_x: bool = False) -> Any:
    """Accuracy and mean discrepancy against ``key`` (lines join the settings of the other keys; hollow: not
    eligible, x: collapsed, *: selected, dotted vertical line: pruned); λ trajectories (dashed: pruned)."""
    from matplotlib.figure import Figure

    shown = [t for t in trials if t.status in ("ok", "pruned") and isinstance(t.settings.get(key), (int, float))]
    fig = Figure(figsize=(15, 4.2))
    ax_acc, ax_d, ax_lam = fig.subplots(1, 3)
    groups: dict[str, list[Trial]] = {}
    for t in sorted(shown, key=lambda t: float(t.settings[key])):
        groups.setdefault(_fmt_settings({k: v for k, v in t.settings.items() if k != key}), []).append(t)
    for name, members in groups.items():
        done = [t for t in members if t.status == "ok"]
        ax_acc.plot([t.settings[key] for t in done], [t.accuracy_after for t in done], "-", alpha=0.4,
                    label=name or None)
        for c in names:
            ax_d.plot([t.settings[key] for t in members], [t.mean_discrepancy.get(c, math.nan) for t in members], "o-",
                      label=f"{c} {name}".strip())
    marks = {"selected": dict(marker="*", color="r", ms=14), "collapsed": dict(marker="x", color="k", ms=9),
             "eligible": dict(marker="o", color="C0", ms=8), "not eligible": dict(marker="o", mfc="none", color="gray",
                                                                                  ms=8)}
    for t in shown:
        kind = ("pruned" if t.status == "pruned" else "selected" if t.selected else "collapsed" if t.collapsed
                else "eligible" if t.eligible else "not eligible")
        if kind == "pruned":
            ax_acc.axvline(t.settings[key], color="C3", ls=":", lw=1, label=kind)
        else:
            ax_acc.plot([t.settings[key]], [t.accuracy_after], ls="none", label=kind, **marks[kind])
        for c in names:
            lam = t.lambda_history.get(c, [])
            ax_lam.plot(range(1, len(lam) + 1), lam, ls="--" if kind == "pruned" else "-",
                        label=f"{t.trial} {_fmt_settings(t.settings)}"[:40])
    before = [t.accuracy_before for t in shown if math.isfinite(t.accuracy_before)]
    if before:
        ax_acc.axhline(before[0], color="gray", ls="--", lw=1, label="before")
    if key.endswith(".tolerance") and shown:
        xs = sorted({float(t.settings[key]) for t in shown})
        ax_d.plot(xs, xs, "k:", lw=1, label="D = c")
    for ax, ylabel in ((ax_acc, "held-out accuracy after training"), (ax_d, "mean measured D-hat"), (ax_lam, "λ")):
        ax.set_xlabel("step" if ax is ax_lam else label(key))
        ax.set_ylabel(ylabel)
        if log_x and ax is not ax_lam:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        if unique:
            ax.legend(unique.values(), unique.keys(), fontsize=6 if ax is ax_lam else 7)
    fig.suptitle("dcmdp tune")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-200:] if lines else ""


def run_tune_file(path: str | Path, overrides: Sequence[str] = (), workers: Optional[int] = None
                  ) -> tuple[list[Trial], Optional[Trial]]:
    cfg = load_tune_config(path, overrides)
    if workers is not None:
        cfg.workers = workers
        _check(cfg)
    return tune(cfg)
