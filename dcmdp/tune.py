"""Sweeps of the dual controller's settings: ``dcmdp tune TUNE.yaml``.

A tune file (YAML)::

    base: configs/tiny-dense.yaml        # run config; a relative path is tried next to the tune file, then in cwd
    overrides: [steps=40, progress=false] # dotlist applied to every trial
    space:                               # grid = cartesian product of the value lists
      dual.constraints[0].tolerance: [0.001, 0.002, 0.005]
      dual.constraints[0].lr: [0.5, 1.0]
    refine:                              # optional: bounded 1-D refinement of one key around the best grid point
      key: dual.constraints[0].tolerance
      bounds: [0.001, 0.005]             # default: the best grid value's neighbours on that key
      budget: 4                          # trials (evaluations of minimize_scalar(method="bounded"))
    select:                              # the selection rule (defaults shown)
      min_inside_frac: 0.9
      warmup_steps: 0
      collapse_window: 5
      collapse_drop_frac: 0.5
      collapse_metric: reward/accuracy
    workers: 2                           # trials running at once (separate processes)
    prime_cold_start: true               # run the first trial alone so the others reuse its cached cold start
    output_dir: outputs/tune

Keys of ``space`` and ``refine.key`` are OmegaConf paths into the run config; list elements are
addressed with ``[i]`` (or ``.i``): ``dual.constraints[0].tolerance`` (c), ``dual.constraints[0].lr``
(η), ``dual.constraints[0].lambda_init`` (λ_0), and any other key such as ``optim.lr``. Tables and plots
abbreviate ``dual.constraints[i].`` to ``c[i].``.

Selection rule. A trial is *eligible* when it finished, did not collapse, and kept the constrained
discrepancy inside the tolerance (every constraint's D-hat <= c, ``dual/measured/<c>`` <= ``dual/tolerance/<c>``)
on at least ``min_inside_frac`` of its steps after warm-up (steps ``warmup_steps + 1 .. steps``). A trial
*collapsed* when any ``loss/`` metric was non-finite at some step, or when the mean of ``collapse_metric``
over its last ``collapse_window`` steps fell below ``collapse_drop_frac`` x its peak ``collapse_window``-step
mean. The selected trial is the eligible one with the highest held-out accuracy after training (ties: larger
inside share, then smaller mean discrepancy, then the earlier trial); none is selected when no trial is
eligible.

Every trial is ``python -m dcmdp.cli train <trial>/run.yaml`` in its own output directory
``<output_dir>/trials/<id>`` (grid trials ``g000``.., refinement trials ``r000``..), at most ``workers`` at
once, logging a child MLflow run nested under one parent run (tag ``mlflow.parentRunId``) in the base
config's tracking store. Per-step values are read back from the child run. A sweep that is run again with
the same ``output_dir`` reuses the parent run and skips trials whose ``summary.json`` exists; failed
trials are reported as failed and run again. Outputs, all logged as parent-run artifacts: ``table.txt``
(also printed), ``results.csv``, ``tune.png`` (accuracy and mean discrepancy against the first space key,
λ trajectories) and ``best.yaml`` (the winning ``dual.constraints`` block, plus any other swept key).
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dcmdp.config import ConfigError, RunConfig, TrackingConfig, load_config, to_yaml, validate
from dcmdp.tracking import LOCAL_ID_PREFIX, Tracker, resolve_tracking_uri

log = logging.getLogger("dcmdp.tune")

_MISSING = object()


@dataclass
class SelectRule:
    # Least share of post-warm-up steps with every constraint inside its tolerance.
    min_inside_frac: float = 0.9
    # Steps 1..warmup_steps are left out of the inside-tolerance share.
    warmup_steps: int = 0
    # Steps in the moving mean that detects a collapse.
    collapse_window: int = 5
    # Collapsed when the last window's mean < collapse_drop_frac x the peak window mean.
    collapse_drop_frac: float = 0.5
    # Per-step metric watched for a collapse.
    collapse_metric: str = "reward/accuracy"

    def describe(self) -> str:
        return (f"selection: highest held-out accuracy among finished trials that did not collapse and kept every "
                f"constraint's D-hat <= c on >= {self.min_inside_frac:.0%} of steps after warm-up "
                f"(steps > {self.warmup_steps}); collapsed = a non-finite loss/ value, or the mean {self.collapse_metric} "
                f"of the last {self.collapse_window} steps < {self.collapse_drop_frac:g} x its peak "
                f"{self.collapse_window}-step mean")


@dataclass
class RefineSpec:
    # Space key refined around the best grid point.
    key: str
    # Search interval (default: the best grid value's neighbours on this key).
    bounds: Optional[list[float]] = None
    # Number of refinement trials.
    budget: int = 4


@dataclass
class TuneConfig:
    base: str
    overrides: list[str] = field(default_factory=list)
    space: dict[str, list[Any]] = field(default_factory=dict)
    refine: Optional[RefineSpec] = None
    select: SelectRule = field(default_factory=SelectRule)
    workers: int = 1
    prime_cold_start: bool = True
    output_dir: str = "outputs/tune"


@dataclass
class Trial:
    """One trial's outcome; ``lambda_history`` holds λ per step (steps 1..N) of every constraint."""

    trial: str
    settings: dict[str, Any]
    status: str = "ok"
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
    lambda_history: dict[str, list[float]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# The tune file.


def load_tune_config(path: str | Path) -> TuneConfig:
    """Parse and check a tune file; ``base`` is resolved to an existing path."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tune file not found: {path}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:
        raise ConfigError(f"cannot parse tune file {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"tune file {path} must hold a mapping")
    _only_keys(raw, TuneConfig, "")
    if "base" not in raw:
        raise ConfigError(f"tune file {path}: 'base' (the run config) is required")
    base = Path(str(raw["base"]))
    if not base.is_absolute() and (path.parent / base).is_file():
        base = path.parent / base
    space = raw.get("space") or {}
    if not isinstance(space, dict) or not space:
        raise ConfigError("tune config error at 'space': give at least one key with a list of values")
    for k, v in space.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"tune config error at 'space.{k}': must be a non-empty list of values")
    select = raw.get("select") or {}
    _only_keys(select, SelectRule, "select.")
    refine = raw.get("refine")
    if refine is not None:
        _only_keys(refine, RefineSpec, "refine.")
        refine = RefineSpec(**refine)
    cfg = TuneConfig(base=str(base), overrides=[str(o) for o in raw.get("overrides") or []],
                     space={str(k): list(v) for k, v in space.items()}, refine=refine, select=SelectRule(**select),
                     workers=int(raw.get("workers", 1)), prime_cold_start=bool(raw.get("prime_cold_start", True)),
                     output_dir=str(raw.get("output_dir", "outputs/tune")))
    _check(cfg)
    return cfg


def _only_keys(raw: Any, cls: type, prefix: str) -> None:
    if not isinstance(raw, dict):
        raise ConfigError(f"tune config error at '{prefix[:-1] or 'top level'}': must be a mapping")
    valid = set(cls.__dataclass_fields__)
    for k in raw:
        if k not in valid:
            raise ConfigError(f"unknown tune config key '{prefix}{k}'; valid keys: {', '.join(sorted(valid))}")


def _check(cfg: TuneConfig) -> None:
    s = cfg.select
    if cfg.workers < 1:
        raise ConfigError(f"tune config error at 'workers': must be >= 1, got {cfg.workers}")
    if not 0 <= s.min_inside_frac <= 1:
        raise ConfigError(f"tune config error at 'select.min_inside_frac': must be in [0, 1], got {s.min_inside_frac}")
    if s.warmup_steps < 0 or s.collapse_window < 1 or not 0 <= s.collapse_drop_frac <= 1:
        raise ConfigError("tune config error at 'select': need warmup_steps >= 0, collapse_window >= 1 and "
                          "collapse_drop_frac in [0, 1]")
    if cfg.refine is not None:
        r = cfg.refine
        if r.key not in cfg.space:
            raise ConfigError(f"tune config error at 'refine.key': {r.key!r} is not a key of 'space' "
                              f"({', '.join(cfg.space)})")
        if r.budget < 1:
            raise ConfigError(f"tune config error at 'refine.budget': must be >= 1, got {r.budget}")
        if r.bounds is not None and (len(r.bounds) != 2 or not r.bounds[0] < r.bounds[1]):
            raise ConfigError(f"tune config error at 'refine.bounds': need [low, high] with low < high, "
                              f"got {r.bounds}")
    base = load_config(cfg.base, cfg.overrides)
    for key in cfg.space:
        apply_settings(base, {key: cfg.space[key][0]})  # raises on a key the run config does not have


def grid(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Cartesian product of the value lists, the last key varying fastest."""
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def apply_settings(cfg: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """A copy of ``cfg`` with each ``key: value`` set (OmegaConf paths, ``[i]`` for list elements), checked."""
    node = OmegaConf.structured(cfg)
    for key, value in settings.items():
        if OmegaConf.select(node, key, default=_MISSING) is _MISSING:
            raise ConfigError(f"tune: the run config has no key '{key}' (list elements: dual.constraints[0].tolerance)")
        try:
            OmegaConf.update(node, key, value, merge=False)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"tune: cannot set '{key}' to {value!r}: {exc}") from exc
    out: RunConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    validate(out)
    return out


def _param_key(key: str) -> str:
    """MLflow names allow no brackets: dual.constraints[0].lr -> dual.constraints.0.lr."""
    return key.replace("[", ".").replace("]", "")


def label(key: str) -> str:
    return key.replace("dual.constraints[", "c[").replace("dual.constraints.", "c.")


# --------------------------------------------------------------------------------------------------
# The selection rule, on finished trials.


def assess(trial: Trial, history: dict[str, list[float]], names: Sequence[str], rule: SelectRule) -> Trial:
    """Fill the per-step derived fields of ``trial`` from ``history`` (metric key -> values of steps 1..N).

    inside_frac = share of steps t > warmup_steps with measured_c(t) <= tolerance_c(t) for every constraint c;
    a non-finite D-hat counts as outside, a run without constraints is inside on every step, and a run with
    no step after warm-up gets NaN (and is not eligible).
    """
    n = max((len(v) for v in history.values()), default=0)
    inside = []
    for t in range(rule.warmup_steps, n):
        ok = True
        for c in names:
            d, tol = _at(history, f"dual/measured/{c}", t), _at(history, f"dual/tolerance/{c}", t)
            ok = ok and math.isfinite(d) and d <= tol
        inside.append(ok)
    trial.inside_frac = sum(inside) / len(inside) if inside else math.nan
    trial.mean_discrepancy = {c: _finite_mean(history.get(f"dual/measured/{c}", [])) for c in names}
    trial.lambda_history = {c: list(history.get(f"dual/lambda/{c}", [])) for c in names}
    trial.final_lambda = {c: v[-1] for c, v in trial.lambda_history.items() if v}
    trial.nonfinite_loss = any(not math.isfinite(v) for k, vs in history.items() if k.startswith("loss/") for v in vs)
    watched = history.get(rule.collapse_metric, [])
    means = [sum(watched[i:i + rule.collapse_window]) / rule.collapse_window
             for i in range(len(watched) - rule.collapse_window + 1)] or ([_finite_mean(watched)] if watched else [])
    trial.peak_window_mean = max(means) if means else math.nan
    trial.final_window_mean = means[-1] if means else math.nan
    trial.collapsed = trial.nonfinite_loss or (bool(means) and trial.final_window_mean < rule.collapse_drop_frac
                                               * trial.peak_window_mean)
    return trial


def select(trials: list[Trial], rule: SelectRule) -> Optional[Trial]:
    """Mark eligible trials and the selected one (see the module docstring); return it or None."""
    for t in trials:
        t.selected = False
        t.eligible = (t.status == "ok" and not t.collapsed and math.isfinite(t.accuracy_after)
                      and t.inside_frac >= rule.min_inside_frac)
    eligible = [(i, t) for i, t in enumerate(trials) if t.eligible]
    if not eligible:
        return None
    mean_d = lambda t: sum(t.mean_discrepancy.values()) if t.mean_discrepancy else 0.0  # noqa: E731
    _, best = max(eligible, key=lambda it: (it[1].accuracy_after, _nan_low(it[1].inside_frac), -mean_d(it[1]), -it[0]))
    best.selected = True
    return best


def _at(history: dict[str, list[float]], key: str, t: int) -> float:
    values = history.get(key, [])
    return float(values[t]) if t < len(values) else math.nan


def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x


# --------------------------------------------------------------------------------------------------
# Running trials.


class _Sweep:
    """State of one ``tune`` call: the base config, the parent run and the trial runner."""

    def __init__(self, cfg: TuneConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.base = load_config(cfg.base, cfg.overrides)
        from constraints.penalties import constraint_names

        self.names = constraint_names(self.base.dual.constraints)
        self.tracking_uri = resolve_tracking_uri(self.base.tracking, self.out)
        self.parent_id: Optional[str] = None
        self.tracker: Optional[Tracker] = None
        self.started = 0  # trials launched by this call
        self.stopping = False  # set on an interrupt: no new trial starts

    def start_parent(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state_path = self.out / "tune_state.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        tcfg = TrackingConfig(uri=self.tracking_uri, experiment=self.base.tracking.experiment,
                              run_name=f"tune-{self.out.name}", buffer_dir=str(self.out / "tracking_buffer"))
        self.tracker = Tracker(tcfg, self.out)
        params = {"tune.base": self.cfg.base, "tune.overrides": " ".join(self.cfg.overrides),
                  "tune.workers": str(self.cfg.workers), "tune.refine": str(self.cfg.refine),
                  **{f"tune.space.{_param_key(k)}": str(v) for k, v in self.cfg.space.items()},
                  **{f"tune.select.{k}": str(v) for k, v in asdict(self.cfg.select).items()}}
        self.parent_id = self.tracker.start(params, run_id=state.get("parent_run_id"), tags={"dcmdp.tune": "parent"})
        if self.parent_id.startswith(LOCAL_ID_PREFIX):
            log.warning("MLflow at %s is unreachable: trials are not nested under a parent run", self.tracking_uri)
        else:
            state_path.write_text(json.dumps({"parent_run_id": self.parent_id}))

    def trial_dir(self, trial_id: str) -> Path:
        return self.out / "trials" / trial_id

    def run(self, trial_id: str, settings: dict[str, Any]) -> Trial:
        """Run one trial (or read it back when its summary.json exists) and assess it."""
        d = self.trial_dir(trial_id)
        d.mkdir(parents=True, exist_ok=True)
        settings_path = d / "settings.json"
        if settings_path.is_file():
            stored = json.loads(settings_path.read_text())
            if stored != settings:
                raise ConfigError(f"tune: {d} holds trial {trial_id} with settings {stored}, now {settings}: the "
                                  f"tune file changed; use a new output_dir")
        else:
            settings_path.write_text(json.dumps(settings))
        cached = d / "trial.json"
        if (d / "summary.json").is_file() and cached.is_file():
            return Trial(**json.loads(cached.read_text()))
        trial = Trial(trial_id, settings)
        if self.stopping:
            trial.status, trial.error = "failed", "not started: the sweep was interrupted"
            return trial
        if not (d / "summary.json").is_file():
            overrides = {"output_dir": str(d.resolve()), "tracking.uri": self.tracking_uri,
                         "tracking.run_name": f"{self.out.name}-{trial_id}", "tracking.buffer_dir": None,
                         "tracking.parent_run_id": None if self.parent_id is None or self.parent_id.startswith(
                             LOCAL_ID_PREFIX) else self.parent_id, "progress": False,
                         # a trial interrupted with the sweep continues from its last checkpoint, same child run
                         "checkpoint.resume": "auto"}
            try:
                run_cfg = apply_settings(self.base, {**overrides, **settings})
            except ConfigError as exc:
                trial.status, trial.error = "failed", str(exc)
                log.warning("trial %s: %s", trial_id, exc)
                return trial
            (d / "run.yaml").write_text(to_yaml(run_cfg))
            self.started += 1
            log.info("trial %s: %s", trial_id, _fmt_settings(settings))
            with open(d / "train.log", "ab") as logf:
                rc = subprocess.run([sys.executable, "-m", "dcmdp.cli", "train", str(d / "run.yaml")],
                                    stdout=logf, stderr=subprocess.STDOUT).returncode
            if rc != 0 or not (d / "summary.json").is_file():
                trial.status, trial.error = "failed", f"exit code {rc}: {_last_line(d / 'train.log')}"
                log.warning("trial %s failed (%s); log in %s", trial_id, trial.error, d / "train.log")
                return trial
        try:
            summary = json.loads((d / "summary.json").read_text())
            trial.accuracy_before, trial.accuracy_after = summary["accuracy_before"], summary["accuracy_after"]
            trial.run_id, trial.seconds = summary["run_id"], summary["seconds"]
            history = self.history(summary["run_id"], summary["tracking_uri"], d)
            assess(trial, history, self.names, self.cfg.select)
        except Exception as exc:  # a trial whose results cannot be read is a failed trial, not a failed sweep
            trial.status, trial.error = "failed", f"cannot read results: {exc}"
            log.warning("trial %s: %s", trial_id, trial.error)
            return trial
        cached.write_text(json.dumps(asdict(trial)))
        return trial

    def history(self, run_id: str, uri: str, trial_dir: Path) -> dict[str, list[float]]:
        """Per-step values (steps 1..N) of the keys the rule needs, from the child MLflow run; the trial's
        last checkpoint when the store cannot answer."""
        keys = [f"dual/{kind}/{c}" for c in self.names for kind in ("measured", "tolerance", "lambda")]
        keys.append(self.cfg.select.collapse_metric)
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            keys += [k for k in client.get_run(run_id).data.metrics if k.startswith("loss/")]
            out = {}
            for key in keys:
                by_step = {m.step: m.value for m in client.get_metric_history(run_id, key) if m.step >= 1}
                out[key] = [by_step[s] for s in sorted(by_step)]
            return out
        except Exception as exc:
            log.warning("reading run %s from %s failed (%s); using the trial's checkpoint", run_id, uri, exc)
        from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint

        steps = load_checkpoint(find_resume_checkpoint(trial_dir / "checkpoints", "auto"))["history"]
        keys += sorted({k for h in steps for k in h if k.startswith("loss/")})
        return {k: [float(h.get(k, math.nan)) for h in steps] for k in keys}

    def run_many(self, jobs: list[tuple[str, dict[str, Any]]]) -> list[Trial]:
        """At most ``workers`` trials at once; the first runs alone when it must fill the cold-start cache."""
        if not jobs:
            return []
        pending = [j for j in jobs if not (self.trial_dir(j[0]) / "summary.json").is_file()]
        first: list[Trial] = []
        if (self.cfg.prime_cold_start and self.cfg.workers > 1 and len(pending) > 1
                and self.base.cold_start.steps > 0 and not self.base.model.path):
            first = [self.run(*pending[0])]
        done = {t.trial: t for t in first}
        pool = ThreadPoolExecutor(max_workers=self.cfg.workers)
        try:
            rest = list(pool.map(lambda j: self.run(*j), [j for j in jobs if j[0] not in done]))
        except BaseException:
            # Ctrl-C reaches the trials too (same process group): they checkpoint and exit; start no new one
            self.stopping = True
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
        done.update({t.trial: t for t in rest})
        return [done[j[0]] for j in jobs]


def tune(cfg: TuneConfig) -> tuple[list[Trial], Optional[Trial]]:
    """Run the grid (and the refinement), select, write and log the outputs; return (trials, selected)."""
    sweep = _Sweep(cfg)
    sweep.start_parent()
    assert sweep.tracker is not None
    status = "FAILED"
    try:
        t0 = time.perf_counter()
        trials = sweep.run_many([(f"g{i:03d}", s) for i, s in enumerate(grid(cfg.space))])
        select(trials, cfg.select)
        if cfg.refine is not None:
            trials += refine(trials, cfg.refine, cfg.space[cfg.refine.key], cfg.select, sweep.run)
        best = select(trials, cfg.select)
        seconds = time.perf_counter() - t0
        paths = write_outputs(cfg, sweep, trials, best, seconds)
        for p in paths:
            sweep.tracker.log_artifact(p)
        sweep.tracker.log_metrics({"tune/trials": len(trials), "tune/started": sweep.started,
                                   "tune/failed": sum(t.status != "ok" for t in trials),
                                   "tune/selected_accuracy": best.accuracy_after if best else math.nan,
                                   "tune/seconds": seconds}, step=0)
        status = "FINISHED"
        return trials, best
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        sweep.tracker.finish(status)


def refine(grid_trials: list[Trial], spec: RefineSpec, grid_values: Sequence[Any], rule: SelectRule,
           run_trial: Callable[[str, dict[str, Any]], Trial]) -> list[Trial]:
    """Bounded 1-D search of ``spec.key`` around the best grid trial, the other keys fixed at its values.

    Minimises score(x) = -held-out accuracy of an eligible trial, +1 for an ineligible or failed one (worse
    than any accuracy), with ``scipy.optimize.minimize_scalar(method="bounded")`` (Brent's method on
    [low, high]); each new point is one trial ``run_trial("r<j>", settings)``, at most ``spec.budget`` of
    them. Points already evaluated (grid points on the same line included) are not run again; integer grids
    are searched on integers. The grid trial to refine around is the selected one, else the best finished.
    """
    from scipy.optimize import minimize_scalar

    ranked = [t for t in grid_trials if t.eligible] or [t for t in grid_trials if t.status == "ok"]
    if not ranked:
        log.warning("refine: no grid trial finished; nothing to refine around")
        return []
    best = max(ranked, key=lambda t: t.accuracy_after)
    x0 = float(best.settings[spec.key])
    if spec.bounds is not None:
        lo, hi = float(spec.bounds[0]), float(spec.bounds[1])
    else:
        values = sorted({float(v) for v in grid_values})
        i = values.index(x0)
        lo, hi = values[max(i - 1, 0)], values[min(i + 1, len(values) - 1)]
    if not lo < hi:
        log.warning("refine: the interval around %s=%g is empty; give refine.bounds", spec.key, x0)
        return []
    as_int = all(isinstance(v, int) and not isinstance(v, bool) for v in grid_values)

    def score(t: Trial) -> float:
        select([t], rule)
        return -t.accuracy_after if t.eligible else 1.0

    others = {k: v for k, v in best.settings.items() if k != spec.key}
    seen: dict[Any, float] = {t.settings[spec.key]: score(t) for t in grid_trials
                              if {k: v for k, v in t.settings.items() if k != spec.key} == others}
    select(grid_trials, rule)  # score() marked single trials; restore the grid's own marks
    out: list[Trial] = []

    class _Spent(Exception):
        pass

    def objective(x: float) -> float:
        value = int(round(x)) if as_int else float(x)
        if value in seen:
            return seen[value]
        if len(out) >= spec.budget:
            raise _Spent
        trial = run_trial(f"r{len(out):03d}", {**best.settings, spec.key: value})
        out.append(trial)
        seen[value] = score(trial)
        return seen[value]

    try:
        # xatol far below any useful resolution: the budget, not the tolerance, ends the search
        minimize_scalar(objective, bounds=(lo, hi), method="bounded", options={"maxiter": 10 * spec.budget,
                                                                             "xatol": 1e-12})
    except _Spent:
        pass
    return out


# --------------------------------------------------------------------------------------------------
# Outputs.


def _fmt_settings(settings: dict[str, Any]) -> str:
    return " ".join(f"{label(k)}={v:g}" if isinstance(v, float) else f"{label(k)}={v}" for k, v in settings.items())


def _fmt(x: float, spec: str = ".4g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(trials: list[Trial], names: Sequence[str], rule: SelectRule) -> str:
    """The printed table; the rule is stated above it."""
    head = ["trial", "settings", "acc before", "acc after", *[f"mean D {c}" for c in names], "inside",
            *[f"final λ {c}" for c in names], "collapsed", "selected", "status"]
    rows = [head]
    for t in trials:
        rows.append([t.trial, _fmt_settings(t.settings), _fmt(t.accuracy_before, ".1%"), _fmt(t.accuracy_after, ".1%"),
                     *[_fmt(t.mean_discrepancy.get(c, math.nan)) for c in names], _fmt(t.inside_frac, ".0%"),
                     *[_fmt(t.final_lambda.get(c, math.nan)) for c in names],
                     "-" if t.status != "ok" else ("yes" if t.collapsed else "no"), "*" if t.selected else "",
                     t.status if t.status == "ok" else f"failed: {t.error[:60]}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([rule.describe(), "", *lines])


def write_outputs(cfg: TuneConfig, sweep: _Sweep, trials: list[Trial], best: Optional[Trial],
                  seconds: float) -> list[Path]:
    out, names = sweep.out, sweep.names
    text = table(trials, names, cfg.select)
    text += f"\n\n{len(trials)} trials ({sweep.started} run now, {sum(t.status != 'ok' for t in trials)} failed) " \
            f"in {seconds:.0f} s with {cfg.workers} worker(s)"
    text += f"\nselected: {best.trial} ({_fmt_settings(best.settings)})" if best else "\nselected: none (no eligible trial)"
    print(text)
    (out / "table.txt").write_text(text + "\n")
    csv_path = out / "results.csv"
    keys = list(cfg.space)
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", "status", *keys, "accuracy_before", "accuracy_after",
                    *[f"mean_discrepancy/{c}" for c in names], "inside_frac", *[f"final_lambda/{c}" for c in names],
                    "nonfinite_loss", "peak_window_mean", "final_window_mean", "collapsed", "eligible", "selected",
                    "run_id", "seconds", "error"])
        for t in trials:
            w.writerow([t.trial, t.status, *[t.settings.get(k, "") for k in keys], t.accuracy_before, t.accuracy_after,
                        *[t.mean_discrepancy.get(c, math.nan) for c in names], t.inside_frac,
                        *[t.final_lambda.get(c, math.nan) for c in names], int(t.nonfinite_loss), t.peak_window_mean,
                        t.final_window_mean, int(t.collapsed), int(t.eligible), int(t.selected), t.run_id, t.seconds,
                        t.error])
    paths = [out / "table.txt", csv_path]
    png = out / "tune.png"
    plot_tune(trials, keys[0], names, png)
    paths.append(png)
    if best is not None:
        snippet = out / "best.yaml"
        snippet.write_text(best_snippet(sweep.base, best))
        paths.append(snippet)
        print(f"winning settings written to {snippet}")
    return paths


def best_snippet(base: RunConfig, best: Trial) -> str:
    """The winner's ``dual.constraints`` block (and any other swept key) as YAML, ready to paste."""
    cfg = apply_settings(base, best.settings)
    node = OmegaConf.create({"dual": {"constraints": OmegaConf.to_container(
        OmegaConf.structured(cfg).dual.constraints)}})
    for key, value in best.settings.items():
        if not key.startswith("dual.constraints"):
            OmegaConf.update(node, key, value, force_add=True)
    acc = f"{best.accuracy_before:.1%} -> {best.accuracy_after:.1%}"
    return (f"# dcmdp tune: selected trial {best.trial} ({_fmt_settings(best.settings)}); held-out accuracy {acc}, "
            f"inside tolerance on {_fmt(best.inside_frac, '.0%')} of steps after warm-up\n" + OmegaConf.to_yaml(node))


def plot_tune(trials: list[Trial], key: str, names: Sequence[str], path: Path) -> None:
    """Accuracy and mean discrepancy against ``key`` (one line per setting of the other keys); λ trajectories."""
    from matplotlib.figure import Figure

    ok = [t for t in trials if t.status == "ok"]
    fig = Figure(figsize=(15, 4.2))
    ax_acc, ax_d, ax_lam = fig.subplots(1, 3)
    groups: dict[str, list[Trial]] = {}
    for t in ok:
        groups.setdefault(_fmt_settings({k: v for k, v in t.settings.items() if k != key}), []).append(t)
    for name, members in groups.items():
        members.sort(key=lambda t: float(t.settings[key]))
        xs = [float(t.settings[key]) for t in members]
        ax_acc.plot(xs, [t.accuracy_after for t in members], "o-", label=name or "after")
        for c in names:
            ax_d.plot(xs, [t.mean_discrepancy.get(c, math.nan) for t in members], "o-",
                      label=f"{c} {name}".strip())
    for t in ok:
        x = float(t.settings[key])
        if t.collapsed:
            ax_acc.plot([x], [t.accuracy_after], "kx", ms=10)
        if t.selected:
            ax_acc.plot([x], [t.accuracy_after], "r*", ms=14, label="selected")
        for c in names:
            lam = t.lambda_history.get(c, [])
            ax_lam.plot(range(1, len(lam) + 1), lam, label=f"{t.trial} {_fmt_settings(t.settings)}"[:40])
    if ok:
        ax_acc.axhline(ok[0].accuracy_before, color="gray", ls="--", lw=1, label="before")
    if key.endswith(".tolerance") and ok:
        xs = sorted({float(t.settings[key]) for t in ok})
        ax_d.plot(xs, xs, "k:", lw=1, label="D = c")
    xs_all = [float(t.settings[key]) for t in ok]
    for ax in (ax_acc, ax_d):
        ax.set_xlabel(label(key))
        if xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) > 10:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_acc.set_ylabel("held-out accuracy after training")
    ax_d.set_ylabel("mean measured D-hat")
    ax_lam.set_xlabel("step")
    ax_lam.set_ylabel("λ")
    ax_lam.grid(alpha=0.3)
    if ok:
        ax_lam.legend(fontsize=6)
    fig.suptitle("dcmdp tune (x: collapsed, *: selected)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-200:] if lines else ""


def run_tune_file(path: str | Path, workers: Optional[int] = None) -> tuple[list[Trial], Optional[Trial]]:
    cfg = load_tune_config(path)
    if workers is not None:
        cfg.workers = workers
        _check(cfg)
    return tune(cfg)
