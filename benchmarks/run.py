"""Run one experiment of ``benchmarks/experiments/``: a matrix of training runs (level x method x N x seed).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py EXPERIMENT --profile PROFILE --workers 2

EXPERIMENT is a name under ``benchmarks/experiments/`` (``stress``, ``stability``) or a path to a YAML file. Every
run is the experiment's base config + its ``overrides`` + the profile's + the level's + the method's +
``algo.minibatches=N seed=S``. The missing cells train in long-lived worker processes (one torch thread each);
a cell whose ``summary.json`` and ``history.json`` exist is skipped and a killed run resumes from its last
checkpoint, so a folder of finished cells copied in renders without training; a run the page's record holds is not
trained again (``--retrain`` does). The page
``benchmarks/results/<experiment>_<profile>.md`` (with .csv, .json.gz and plots) is generated from the run folders
and the page's record: its .json.gz (gzipped JSON; a plain .json is read too) holds every run (accuracy curve, λ and
discrepancy per step, diagnostics, the overrides it was trained with), and a run the folder lacks is read from there
while the experiment file still gives it the same overrides. The folders are scratch; the committed record is the result.

Collapse, any of: a non-finite update; the final held-out accuracy below half of the run's peak (step 0
included); the mean reward accuracy over the last W = max(5, steps / 20) steps below half of the best W-step
running mean after the LR warm-up. Methods named ``dcmdp*`` are tested against the best other method of their
cell (Welch's t-test on final and on late accuracy). An experiment with a ``reference`` method also gets each
method's end-to-end tokens/s as a ratio to the reference's at the same seed, and a throughput-accuracy plot. An
experiment's ``compare`` block pre-registers its comparisons: each of its ``configs`` against each rival role (a
method list, or one per level; the candidate with the best late mean is the rival), with Welch's t-test on late and
final accuracy, and the run-minutes of each method and of each ``compute`` group (a tuned constant's sweep). Its
optional ``bar`` writes the pre-registered bar clause by clause per cell: each named role's reading ("level": level
or ahead; "ahead"), at most ``collapses`` collapses, D-hat inside c on at least ``inside_c`` of the steps and lambda
below its cap on at least ``below_cap`` of them; a cell whose runs did not all finish, or with one seed a side (its
reading "untested": Welch's test needs two), is "not decided", never met.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import gzip
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks._page import command, machine_kind, md_table, rel, save_figure  # noqa: E402
from benchmarks._page import fmt as _fmt  # noqa: E402

EXPERIMENTS = ROOT / "benchmarks" / "experiments"
# per-step metrics kept in history.json (the checkpoint's history has every metric)
KEEP_PREFIXES = ("reward/", "eval/", "discrepancy/", "dual/", "penalty/", "policy/", "guard/", "loss/", "routing/",
                 "async/", "is/", "clip/", "time/", "throughput/", "rollout/", "task/", "response/")
# plumbing every cell gets last: one thread, resumable checkpoints
CELL_PLUMBING = ("threads=1", "progress=false", "checkpoint.every=25", "checkpoint.keep=1", "checkpoint.resume=auto")
DIAGNOSTICS = ("policy/approx_kl", "policy/entropy", "clip/frac", "routing/mismatch", "penalty/loss",
               "is/weight_max_raw", "async/bound", "async/staleness_mean", "time/trainer_idle_frac",
               "time/rollout_idle_frac")
# what a scenario changes within a run, drawn under lambda: the first of these that varies over the run
SCHEDULE_KEYS = {"rollout/precision_bits": "rollout bits", "task/digits": "training digits",
                 "async/staleness_forced": "forced staleness", "async/bound": "staleness bound",
                 "response/length_mean": "response length"}


# ------------------------------------------------------------------------------------------- experiment files


class ExperimentError(ValueError):
    """A malformed experiment file; the message names the file and the key."""


@dataclass(frozen=True)
class Block:
    levels: tuple[str, ...]
    methods: tuple[str, ...]
    minibatches: tuple[int, ...]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Pooled:
    """One part of a pooled profile: another profile's runs, read from ``bench_dir``, their seeds shifted by
    ``seed_offset`` on the page (e.g. a second cold start's seeds 0-4 shown as 100-104)."""
    profile: str
    bench_dir: str  # relative to the repository root
    seed_offset: int


@dataclass(frozen=True)
class Profile:
    about: str
    overrides: tuple[str, ...]
    blocks: tuple[Block, ...]
    # a pooled profile trains nothing: its page holds the runs of these profiles' folders together
    pool: tuple[Pooled, ...] = ()
    # the profile's own pre-registered bar (e.g. a lever's), checked on its page in place of the compare block's
    bar: Optional["Bar"] = None


@dataclass(frozen=True)
class Bar:
    """A ``compare`` block's pre-registered bar, clause by clause (``None``: a clause the bar does not have)."""
    roles: dict[str, str]  # rival role -> the reading the config needs against it: "level" (or ahead) or "ahead"
    collapses: Optional[int] = None  # at most this many collapsed runs of the config
    inside_c: Optional[float] = None  # D-hat inside c on at least this share of steps
    below_cap: Optional[float] = None  # lambda below its cap on at least this share of steps
    acting: Optional[float] = None  # lambda above 0.01 (the dual acting, not slack) on at least this share of steps
    # roles the config must be ahead of on at least one level of the page (a clause across levels, e.g. "ahead of
    # the ESS rule alone on at least one task, for the dual to count")
    ahead_somewhere: tuple[str, ...] = ()
    # the roles' readings from the paired t-test over the seeds both sides ran (shared cold starts), not Welch's
    paired: bool = False
    # D-hat inside c on at least this share of steps more than each placebo arm, the paired mean over the seeds whose
    # config run's penalty reach exceeded its batch spread; with no such seed the clause does not apply (said so)
    placebo_margin: Optional[float] = None
    # at most as many collapsed runs as this role's candidate has (e.g. the ESS rule alone)
    collapses_vs: Optional[str] = None
    # the bar met on at least this many (level, N) cells of the page, per config (a clause across levels)
    met_on: Optional[int] = None


@dataclass(frozen=True)
class Compare:
    """An experiment's pre-registered comparisons (its ``compare`` block): each config against each rival role."""
    about: str
    configs: tuple[str, ...]
    # role -> level ("*": every level) -> candidate methods; the rival is the candidate with the best late mean
    rivals: dict[str, dict[str, tuple[str, ...]]]
    # label -> methods whose runs' time it sums per level (e.g. a tuned constant: its sweep and its extra seeds)
    compute: dict[str, tuple[str, ...]]
    bar: Optional[Bar] = None
    # config -> its placebo arms (the same config with lambda fixed at 0 and at lambda_max, the same c schedule)
    placebos: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def rival_candidates(self, role: str, level: str) -> tuple[str, ...]:
        by_level = self.rivals[role]
        return by_level.get(level, by_level.get("*", ()))


@dataclass(frozen=True)
class Experiment:
    name: str
    about: str
    base: Path
    overrides: tuple[str, ...]
    levels: dict[str, list[str]]
    methods: dict[str, list[str]]
    abouts: dict[str, str]
    labels: dict[str, str]
    profiles: dict[str, Profile]
    cell_name: str = "{level}__{method}__N{N}__seed{seed}"
    late_from: float = 0.6
    # the method whose end-to-end tokens/s the others' are a ratio to, seed by seed (empty: no throughput section)
    reference: str = ""
    # method -> level -> the method's extra overrides at that level (a method's ``at_level``), after its own
    method_levels: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    compare: Optional[Compare] = None

    def cells(self, profile: str) -> list[tuple[str, str, int, int]]:
        """(level, method, N, seed) of every run: per block, largest N first, then seed-major, without repeats (a
        pooled profile: its parts' cells, seeds shifted by each part's offset)."""
        out: list[tuple[str, str, int, int]] = []
        for part in self.profiles[profile].pool:
            out += [(lv, m, n, s + part.seed_offset) for lv, m, n, s in self.cells(part.profile)]
        for b in self.profiles[profile].blocks:
            for n in sorted(b.minibatches, reverse=True):
                for cell in ((lv, m, n, s) for s in b.seeds for lv in b.levels for m in b.methods):
                    if cell not in out:
                        out.append(cell)
        return out

    def cell_dir(self, bench_dir: Path, level: str, method: str, n: int, seed: int) -> Path:
        return bench_dir / self.cell_name.format(level=level, method=method, N=n, seed=seed)

    def run_config(self, profile: str, level: str, method: str, n: int, seed: int) -> list[str]:
        """What sets one run's training, on top of the base config (its page record carries it)."""
        return [*self.overrides, *self.profiles[profile].overrides, *self.levels[level], *self.methods[method],
                *self.method_levels.get(method, {}).get(level, []), f"algo.minibatches={n}", f"seed={seed}"]

    def cell_overrides(self, profile: str, level: str, method: str, n: int, seed: int, out: Path) -> list[str]:
        """The full dotlist of one run, on top of the base config."""
        return [*self.run_config(profile, level, method, n, seed), f"output_dir={out}", *CELL_PLUMBING]


def _int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExperimentError(f"{where}: expected an integer, got {value!r}")
    return value


def _ints(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ExperimentError(f"{where}: expected a non-empty list of integers, got {value!r}")
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))


def _strings(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ExperimentError(f"{where}: expected a list of dotlist strings, got {value!r}")
    return tuple(value)


def _entry(raw, where: str, allowed: set[str]) -> dict:
    if not isinstance(raw, dict):
        raise ExperimentError(f"{where}: expected a mapping, got {raw!r}")
    unknown = set(raw) - allowed
    if unknown:
        raise ExperimentError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: {sorted(allowed)})")
    if not isinstance(raw.get("about"), str):
        raise ExperimentError(f"{where}.about: every entry needs a one-line about")
    return raw


def _resolve_methods(raw: dict, where: str, levels: dict) -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """Each method's dotlist: its ``extends`` chain's overrides first, its own after (a later entry wins); and its
    per-level extras (``at_level: {level: [dotlist]}``), the chain's first, likewise."""
    out: dict[str, list[str]] = {}
    at: dict[str, dict[str, list[str]]] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> list[str]:
        if name in out:
            return out[name]
        if name in chain:
            raise ExperimentError(f"{where}.{name}: extends cycle {' -> '.join((*chain, name))}")
        if name not in raw:
            raise ExperimentError(f"{where}.{chain[-1]}.extends: no method {name!r} (known: {sorted(raw)})")
        m = _entry(raw[name], f"{where}.{name}", {"about", "label", "extends", "overrides", "at_level"})
        parent = resolve(m["extends"], (*chain, name)) if m.get("extends") else []
        out[name] = [*parent, *_strings(m.get("overrides"), f"{where}.{name}.overrides")]
        own = m.get("at_level") or {}
        if not isinstance(own, dict) or any(lv not in levels for lv in own):
            raise ExperimentError(f"{where}.{name}.at_level: expected a mapping of level names (known: "
                                  f"{sorted(levels)}) to dotlists, got {own!r}")
        inherited = at.get(m["extends"], {}) if m.get("extends") else {}
        at[name] = {lv: [*inherited.get(lv, []), *_strings(own.get(lv), f"{where}.{name}.at_level.{lv}")]
                    for lv in {*inherited, *own}}
        return out[name]

    for name in raw:
        resolve(name, ())
    return out, at


def _compare(raw, where: str, levels: dict, methods: dict) -> Optional[Compare]:
    """The ``compare`` block: ``{about, configs: [m], rivals: {role: [m] | {level: [m]}}, compute: {label: [m]}}``."""
    if raw is None:
        return None
    raw = _entry(raw, where, {"about", "configs", "rivals", "compute", "bar", "placebos"})

    def names(value, at: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ExperimentError(f"{at}: expected a non-empty list of method names, got {value!r}")
        missing = [v for v in value if v not in methods]
        if missing:
            raise ExperimentError(f"{at}: unknown method(s) {missing} (known: {sorted(methods)})")
        return tuple(value)

    rivals: dict[str, dict[str, tuple[str, ...]]] = {}
    for role, value in (raw.get("rivals") or {}).items():
        if isinstance(value, dict):
            unknown = [lv for lv in value if lv not in levels]
            if unknown:
                raise ExperimentError(f"{where}.rivals.{role}: unknown level(s) {unknown} (known: {sorted(levels)})")
            rivals[role] = {lv: names(v, f"{where}.rivals.{role}.{lv}") for lv, v in value.items()}
        else:
            rivals[role] = {"*": names(value, f"{where}.rivals.{role}")}
    if not rivals:
        raise ExperimentError(f"{where}.rivals: name at least one rival role")
    compute = {label: names(v, f"{where}.compute.{label}") for label, v in (raw.get("compute") or {}).items()}
    configs = names(raw.get("configs"), f"{where}.configs")
    placebos = raw.get("placebos") or {}
    if not isinstance(placebos, dict) or any(c not in configs for c in placebos):
        raise ExperimentError(f"{where}.placebos: expected a mapping of the configs ({list(configs)}) to their placebo "
                              f"methods, got {placebos!r}")
    placebos = {c: names(v, f"{where}.placebos.{c}") for c, v in placebos.items()}
    bar = _bar(raw["bar"], f"{where}.bar", rivals) if "bar" in raw else None
    if bar is not None and bar.placebo_margin is not None and set(placebos) != set(configs):
        raise ExperimentError(f"{where}.bar.placebo_margin: every config needs its placebos (compare.placebos)")
    return Compare(raw["about"], configs, rivals, compute, bar, placebos)


def page_compare(exp: Experiment, profile_name: str) -> Optional[Compare]:
    """The comparisons a profile's page checks: the experiment's ``compare`` block, its bar replaced by the
    profile's own where the profile has one."""
    bar = exp.profiles[profile_name].bar
    return exp.compare if exp.compare is None or bar is None else dataclasses.replace(exp.compare, bar=bar)


def _bar(raw, where: str, rivals: dict) -> Bar:
    """The bar: ``{roles: {role: level | ahead}, collapses: int, inside_c: share, below_cap: share, acting: share,
    ahead_somewhere: [role]}``."""
    if not isinstance(raw, dict):
        raise ExperimentError(f"{where}: expected a mapping, got {raw!r}")
    allowed = {"roles", "collapses", "inside_c", "below_cap", "acting", "ahead_somewhere", "paired", "placebo_margin",
               "collapses_vs", "met_on"}
    unknown = set(raw) - allowed
    if unknown:
        raise ExperimentError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: {', '.join(sorted(allowed))})")
    roles = raw.get("roles") or {}
    if not isinstance(roles, dict):
        raise ExperimentError(f"{where}.roles: expected a mapping of rival roles to level or ahead, got {roles!r}")
    for role, need in roles.items():
        if role not in rivals:
            raise ExperimentError(f"{where}.roles: {role!r} is not a rival role (known: {sorted(rivals)})")
        if need not in ("level", "ahead"):
            raise ExperimentError(f"{where}.roles.{role}: expected level or ahead, got {need!r}")
    collapses = raw.get("collapses")
    if collapses is not None and (isinstance(collapses, bool) or not isinstance(collapses, int) or collapses < 0):
        raise ExperimentError(f"{where}.collapses: expected an integer >= 0, got {collapses!r}")
    shares = {}
    for key in ("inside_c", "below_cap", "acting", "placebo_margin"):
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
            raise ExperimentError(f"{where}.{key}: expected a share in [0, 1], got {v!r}")
        shares[key] = None if v is None else float(v)
    somewhere = raw.get("ahead_somewhere") or []
    if not isinstance(somewhere, list) or not all(isinstance(r, str) for r in somewhere):
        raise ExperimentError(f"{where}.ahead_somewhere: expected a list of rival roles, got {somewhere!r}")
    for role in somewhere:
        if role not in rivals:
            raise ExperimentError(f"{where}.ahead_somewhere: {role!r} is not a rival role (known: {sorted(rivals)})")
    paired = raw.get("paired", False)
    if not isinstance(paired, bool):
        raise ExperimentError(f"{where}.paired: expected true or false, got {paired!r}")
    versus = raw.get("collapses_vs")
    if versus is not None and versus not in rivals:
        raise ExperimentError(f"{where}.collapses_vs: {versus!r} is not a rival role (known: {sorted(rivals)})")
    met_on = raw.get("met_on")
    if met_on is not None and (isinstance(met_on, bool) or not isinstance(met_on, int) or met_on < 1):
        raise ExperimentError(f"{where}.met_on: expected an integer >= 1, got {met_on!r}")
    if (not roles and collapses is None and all(v is None for v in shares.values()) and not somewhere
            and versus is None):
        raise ExperimentError(f"{where}: name at least one clause (roles, collapses, collapses_vs, inside_c, below_cap, "
                              "acting, placebo_margin, ahead_somewhere)")
    return Bar(dict(roles), collapses, **shares, ahead_somewhere=tuple(somewhere), paired=paired, collapses_vs=versus,
               met_on=met_on)


def _pool(p: dict, where: str, profiles: dict) -> tuple[Pooled, ...]:
    if set(p) & {"cells", "overrides"}:
        raise ExperimentError(f"{where}: a pooled profile takes no cells or overrides (its parts' apply)")
    parts = p["pool"]
    if not isinstance(parts, list) or not parts:
        raise ExperimentError(f"{where}.pool: expected a list of {{profile, bench_dir, seed_offset}}, got {parts!r}")
    out = []
    for i, part in enumerate(parts):
        at = f"{where}.pool[{i}]"
        if not isinstance(part, dict) or set(part) != {"profile", "bench_dir", "seed_offset"}:
            raise ExperimentError(f"{at}: expected exactly the keys profile, bench_dir, seed_offset; got {part!r}")
        target = profiles.get(part["profile"])
        if not isinstance(target, dict) or "pool" in target:
            raise ExperimentError(f"{at}.profile: {part['profile']!r} is not a profile with cells")
        out.append(Pooled(part["profile"], str(part["bench_dir"]), _int(part["seed_offset"], f"{at}.seed_offset")))
    seeds = [{(lv, m, n, s + q.seed_offset) for b in profiles[q.profile]["cells"] for lv in b["levels"]
              for m in b["methods"] for n in b["N"] for s in b["seeds"]} for q in out]
    if any(a & b for i, a in enumerate(seeds) for b in seeds[i + 1:]):
        raise ExperimentError(f"{where}.pool: two parts give the same (level, method, N, seed) on the page; set "
                              "seed_offset apart")
    return tuple(out)


def _read_experiment_file(path: Path, where: str) -> object:
    """The YAML of an experiment file, read with the config files' bounds (``dcmdp.config.read_yaml_text``: at most
    1 MiB, 32 levels, 100,000 values once aliases are expanded) before anything recursive builds from it."""
    import yaml

    from dcmdp.config import read_yaml_text

    text = read_yaml_text(path, where, ExperimentError, "an experiment file is a few KiB", shape_hint=False)[0]
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ExperimentError(f"{where}: not a readable YAML file: {' '.join(str(exc).split())}") from None


def load_experiment(spec: str | Path) -> Experiment:
    """An experiment by name (``benchmarks/experiments/<name>.yaml``) or path; ExperimentError names what is wrong,
    for a value of the wrong shape where no check names it too (the file and the Python error, not a traceback)."""
    path = Path(spec) if str(spec).endswith((".yaml", ".yml")) else EXPERIMENTS / f"{spec}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))
        state = "is not a file" if path.exists() else "no such experiment file"
        raise ExperimentError(f"{spec}: {state} (known: {known})")
    where = rel(path)
    text = _read_experiment_file(path, where)
    try:
        return _experiment(path, where, text)
    except ExperimentError:
        raise
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        raise ExperimentError(f"{where}: a value of the wrong shape ({type(exc).__name__}: {exc})") from None


def _cell_name(value: object, where: str) -> str:
    """An experiment's ``cell_name``: the template of one folder name in ``{level}``, ``{method}``, ``{N}`` and
    ``{seed}``."""
    try:
        name = value.format(level="L", method="M", N=1, seed=0) if isinstance(value, str) else None
    except (KeyError, IndexError, ValueError) as exc:
        raise ExperimentError(f"{where}: {value!r} is not a template in {{level}}, {{method}}, {{N}} and {{seed}} "
                              f"({type(exc).__name__}: {exc})") from None
    if name is None or not name.strip() or "/" in name or name in (".", ".."):
        raise ExperimentError(f"{where}: expected the template of one folder name in {{level}}, {{method}}, {{N}} and "
                              f"{{seed}} (e.g. \"{Experiment.cell_name}\"), got {value!r}")
    return value


def _late_from(value: object, where: str) -> float:
    """An experiment's ``late_from``: the share of the steps after which evaluations count as late, in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ExperimentError(f"{where}: expected the share of the steps after which evaluations count as late, a "
                              f"number in [0, 1] (e.g. 0.6), got {value!r}")
    return float(value)


def _experiment(path: Path, where: str, text: object) -> Experiment:
    """The experiment of an experiment file's YAML ``text``, its entries checked as they are read."""
    raw = _entry(text, where,
                 {"about", "base", "overrides", "levels", "methods", "profiles", "cell_name", "late_from",
                  "reference", "compare"})
    for key in ("base", "levels", "methods", "profiles"):
        if key not in raw:
            raise ExperimentError(f"{where}: missing key {key!r}")
    if not isinstance(raw["base"], str) or not (ROOT / raw["base"]).is_file():
        raise ExperimentError(f"{where}.base: no config file {raw['base']!r} (a path from the repository root, "
                              f"{ROOT})")
    for key in ("levels", "methods", "profiles"):
        if not isinstance(raw[key], dict) or not raw[key]:
            raise ExperimentError(f"{where}.{key}: expected a mapping of names to entries, got {raw[key]!r}")
    levels = {name: list(_strings(_entry(v, f"{where}.levels.{name}", {"about", "overrides"}).get("overrides"),
                                  f"{where}.levels.{name}.overrides")) for name, v in raw["levels"].items()}
    methods, method_levels = _resolve_methods(raw["methods"], f"{where}.methods", levels)
    profiles = {}
    for name, p in raw["profiles"].items():
        p = _entry(p, f"{where}.profiles.{name}", {"about", "overrides", "cells", "pool", "bar"})
        bar = None
        if "bar" in p:
            if raw.get("compare") is None:
                raise ExperimentError(f"{where}.profiles.{name}.bar: a bar needs the experiment's compare block (its "
                                      "configs and rival roles)")
            bar = _bar(p["bar"], f"{where}.profiles.{name}.bar", raw["compare"].get("rivals") or {})
        if "pool" in p:
            profiles[name] = Profile(p["about"], (), (), _pool(p, f"{where}.profiles.{name}", raw["profiles"]), bar)
            continue
        blocks = []
        for i, b in enumerate(p.get("cells") or []):
            at = f"{where}.profiles.{name}.cells[{i}]"
            if not isinstance(b, dict) or set(b) != {"levels", "methods", "N", "seeds"}:
                raise ExperimentError(f"{at}: expected exactly the keys levels, methods, N, seeds; got {b!r}")
            for key, known in (("levels", levels), ("methods", methods)):
                missing = [x for x in b[key] if x not in known]
                if missing:
                    raise ExperimentError(f"{at}.{key}: unknown {missing} (known: {sorted(known)})")
            blocks.append(Block(tuple(b["levels"]), tuple(b["methods"]), _ints(b["N"], f"{at}.N"),
                                _ints(b["seeds"], f"{at}.seeds")))
        if not blocks:
            raise ExperimentError(f"{where}.profiles.{name}.cells: a profile needs at least one block")
        profiles[name] = Profile(p["about"], _strings(p.get("overrides"), f"{where}.profiles.{name}.overrides"),
                                 tuple(blocks), bar=bar)
    abouts = {f"{kind}.{name}": v["about"] for kind in ("levels", "methods", "profiles")
              for name, v in raw[kind].items()}
    labels = {name: str(v.get("label", name)) for name, v in raw["methods"].items()}
    if raw.get("reference", "") and raw["reference"] not in methods:
        raise ExperimentError(f"{where}.reference: no method {raw['reference']!r} (known: {sorted(methods)})")
    return Experiment(path.stem, raw["about"], ROOT / raw["base"], _strings(raw.get("overrides"), f"{where}.overrides"),
                      levels, methods, abouts, labels, profiles, _cell_name(raw.get("cell_name", Experiment.cell_name),
                                                                             f"{where}.cell_name"),
                      _late_from(raw.get("late_from", Experiment.late_from), f"{where}.late_from"),
                      str(raw.get("reference", "")),
                      method_levels, _compare(raw.get("compare"), f"{where}.compare", levels, methods))


# ------------------------------------------------------------------------------------------- worker processes


def run_cell(out: Path) -> None:
    """Worker: train the run described by ``out/cell.json`` and write ``out/history.json``."""
    from dcmdp.config import load_config
    from dcmdp.loop import train

    if finished(out):  # finished meanwhile by another invocation on the same folder
        return
    spec = json.loads((out / "cell.json").read_text())
    if not (out / "summary.json").exists():
        train(load_config(spec["base"], spec["overrides"]))
    write_history(out)


def write_history(out: Path) -> None:
    """history.json from the final checkpoint (train() keeps the per-step history only there and in MLflow)."""
    from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint

    ckpt = find_resume_checkpoint(out / "checkpoints", "auto")
    if ckpt is None:
        raise FileNotFoundError(f"{out}: summary.json but no checkpoint to read the history from")
    kept = [{k: v for k, v in h.items() if k.startswith(KEEP_PREFIXES)} for h in load_checkpoint(ckpt)["history"]]
    tmp = out / "history.json.tmp"
    tmp.write_text(json.dumps(kept))
    tmp.replace(out / "history.json")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


class Worker:
    """A long-lived worker process (one torch thread) that trains the cells it is sent, one at a time.

    Importing torch / transformers / mlflow costs seconds per process, so cells share a process. Protocol:
    a cell folder per stdin line; the worker answers ``@@ok`` or ``@@fail`` on stdout (other stdout lines are
    ignored) and appends the run's log to ``<cell>/log.txt``.
    """

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    def run(self, out: Path) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], cwd=ROOT,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=open(self.log_path, "a"), text=True, bufsize=1)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{out}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line.strip() == "@@ok"
        return False  # the worker died; the next run starts a fresh one

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# a finished cell's machine kind (a run resumed on another kind lists both)
MACHINE_FILE = "machine.txt"


def note_machine(out: Path) -> None:
    """Add this machine's kind to the cell's ``MACHINE_FILE``."""
    path, here = out / MACHINE_FILE, machine_kind()
    kinds = path.read_text().strip().split(" then ") if path.exists() else []
    if not kinds or kinds[-1] != here:
        path.write_text(" then ".join([*kinds, here]) + "\n")


def serve() -> None:
    """Worker mode: train the cell folders read from stdin (see ``Worker``)."""
    import logging
    import traceback

    logging.basicConfig(level=logging.INFO)
    for line in sys.stdin:
        out = Path(line.strip())
        handler = logging.FileHandler(out / "log.txt")
        logging.getLogger().addHandler(handler)
        ok = False
        try:
            run_cell(out)
            note_machine(out)
            ok = True
        except Exception:  # a failed cell is reported and the matrix goes on
            logging.getLogger("benchmarks.run").error("run failed:\n%s", traceback.format_exc())
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        print("@@ok" if ok else "@@fail", flush=True)


def mlflow_template(bench_dir: Path) -> Path:
    """An empty MLflow sqlite store, created once: a fresh store runs its schema migrations (~5-20 s each)."""
    path = bench_dir / "mlflow_template.db"
    if not path.exists():
        from mlflow.tracking import MlflowClient

        tmp = bench_dir / "mlflow_template.tmp.db"
        tmp.unlink(missing_ok=True)
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()
        tmp.replace(path)
    return path


def finished(out: Path) -> bool:
    return (out / "summary.json").exists() and (out / "history.json").exists()


def prepare(out: Path, base: Path, overrides: list[str], template: Path) -> bool:
    """Write the cell's spec (base config + dotlist); False when the cell already finished."""
    if finished(out):
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / "cell.json").write_text(json.dumps({"base": str(base), "overrides": overrides}, indent=1))
    if not (out / "mlflow.db").exists():
        shutil.copyfile(template, out / "mlflow.db")
    return True


def warm_cold_starts(base: Path, configs: list, workers: int = 1) -> None:
    """Train (or find cached) each distinct cold start once, before the runs' workers could race on it: the
    distinct ones (by their cache key: model, task, seed, hyper-parameters) on up to ``workers`` processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from trainers.coldstart import cache_key, cold_start_for_run, verify_cache_entry
    from trainers.models import build_model
    from trainers.tasks import TASKS
    from trainers.tokenizer import build_char_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the key holds the thread count: computed as the worker (and the run) will train
    todo: dict[str, tuple[int, object]] = {}
    try:
        for seed, cfg in configs:
            if cfg.cold_start.steps == 0:
                continue
            cs_seed = seed if cfg.cold_start.seed is None else cfg.cold_start.seed
            tok = build_char_tokenizer()
            model = build_model(cfg.model, len(tok), seed=cs_seed)
            key = cache_key(model, tok, TASKS[cfg.task.name](cfg.task, seed), cfg.cold_start, cfg.model,
                            seed=cs_seed)
            if key not in todo and not verify_cache_entry(os.path.join(cfg.cold_start.cache_dir, key))[0]:
                todo[key] = (seed, cfg)
    finally:
        torch.set_num_threads(threads)
    if not todo:
        return
    print(f"{len(todo)} cold start(s) to train first, on {min(workers, len(todo))} process(es)", flush=True)
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(todo))),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for path in pool.map(cold_start_for_run, *zip(*todo.values())):
            print(f"cold start ready: {rel(Path(path))}", flush=True)


# a wall count's key when it is a folder's total over every profile trained there (counted before walls were kept
# per profile)
SHARED_WALL = " (every profile in the folder)"


def train_missing(todo: list[Path], bench_dir: Path, workers: int, wall_file: Path) -> list[Path]:
    """Train the cells in ``todo`` on ``workers`` worker processes; the cells that failed. ``wall_file`` holds the
    profile's training wall seconds in ``bench_dir``, brought up to date as each cell ends (an invocation killed
    midway keeps its count up to its last finished cell)."""
    pool_workers: queue.Queue[Worker] = queue.Queue()
    for k in range(max(1, workers)):
        pool_workers.put(Worker(bench_dir / f"worker{k}.log"))

    def one(out: Path) -> tuple[Path, bool]:
        worker = pool_workers.get()
        try:
            return out, worker.run(out)
        finally:
            pool_workers.put(worker)

    t0, failed = time.perf_counter(), []
    earlier = float(wall_file.read_text()) if wall_file.exists() else 0.0
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for i, fut in enumerate([pool.submit(one, out) for out in todo]):
            out, ok = fut.result()
            wall_file.write_text(f"{earlier + time.perf_counter() - t0:.1f}\n")
            if not ok:
                failed.append(out)
            print(f"[{i + 1}/{len(todo)}] {out.name}: {'done' if ok else 'FAILED, see ' + str(out / 'log.txt')} "
                  f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    while not pool_workers.empty():
        pool_workers.get().close()
    wall_file.write_text(f"{earlier + time.perf_counter() - t0:.1f}\n")
    return failed


# ------------------------------------------------------------------------------------------- analysis


@dataclass
class Run:
    level: str
    method: str
    n: int
    seed: int
    acc_before: float
    eval_steps: list[int]
    eval_acc: list[float]
    collapsed: bool
    collapse_reason: str
    # per step
    measured: list[float]
    tolerance: list[float]
    lambdas: list[float]
    abs_prob_diff: list[float]
    kl_k3: list[float]
    seconds: float
    final: float
    peak: float
    late: float  # mean of the evaluations from late_from of the steps on
    extra: dict[str, float] = field(default_factory=dict)
    finished: float = math.nan  # when the run finished (its summary's mtime, seconds since the epoch)
    schedule: dict[str, list[float]] = field(default_factory=dict)  # per-step values of the SCHEDULE_KEYS logged
    machine: str = ""  # the machine kind that trained it ('' where not recorded)


def collapse_check(eval_acc: Sequence[float], reward_acc: Sequence[float], nonfinite: int,
                   warmup: int) -> tuple[bool, str]:
    """(collapsed, reason) by the module docstring's rule: non-finite, held-out, running reward."""
    if nonfinite > 0:
        return True, f"{nonfinite} non-finite updates"
    if eval_acc and eval_acc[-1] < 0.5 * max(eval_acc):
        return True, f"held-out {eval_acc[-1]:.3f} < half of peak {max(eval_acc):.3f}"
    r = np.asarray(reward_acc, dtype=np.float64)
    w = max(5, len(r) // 20)
    if len(r) >= w + warmup:
        running = np.convolve(r, np.ones(w) / w, mode="valid")  # running[i] = mean of r[i : i + w]
        peak = running[warmup:].max()
        if running[-1] < 0.5 * peak:
            return True, f"reward accuracy {running[-1]:.3f} < half of peak {peak:.3f}"
    return False, ""


def machines_trained(runs: Sequence[Run]) -> str:
    """'' when every run was trained on this machine's kind, else the kinds that trained them, with counts."""
    kinds: dict[str, int] = {}
    for r in runs:
        if r.machine:
            kinds[r.machine] = kinds.get(r.machine, 0) + 1
    unknown = sum(not r.machine for r in runs)
    if set(kinds) <= {machine_kind()} and not unknown:
        return ""
    return "; the runs were trained on " + ", ".join(
        [f"{k} ({n} runs)" for k, n in kinds.items()] + ([f"a kind not recorded ({unknown} runs)"] if unknown else [])
    ) + " (the same config trains to other weights on another kind)"


def load_run(out: Path, level: str, method: str, n: int, seed: int, warmup: int, late_from: float) -> Run:
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "history.json").read_text())
    eval_steps, eval_acc = [0], [summary["accuracy_before"]]
    for i, h in enumerate(history):
        if "eval/accuracy" in h:
            eval_steps.append(i + 1), eval_acc.append(h["eval/accuracy"])
    eval_steps.append(summary["steps"]), eval_acc.append(summary["accuracy_after"])
    nonfinite = int(sum(h.get("guard/skipped_updates", h.get("guard/skipped_update", 0.0)) > 0 for h in history))
    collapsed, reason = collapse_check(eval_acc, [h["reward/accuracy"] for h in history], nonfinite, warmup)

    def series(key: str) -> list[float]:
        return [float(h.get(key, math.nan)) for h in history]

    extra = {k: float(np.nanmean(series(k))) for k in DIAGNOSTICS if any(k in h for h in history)}
    # the penalty's reach (the probes' log D_0 - log D_max) and the batch spread of log D-hat, from the summary (absent:
    # a run without probes, or from before the summary kept them)
    con = next(iter((summary.get("constraints") or {}).values()), {})
    for key in ("reach", "spread"):
        if con.get(key) is not None:
            extra[key] = float(con[key])
    if all("time/step" in h and "throughput/response_tokens_per_s" in h for h in history) and history:
        # end to end: the response tokens of every step over the steps' wall time (waits for rollouts included)
        step_s = np.asarray(series("time/step"))
        extra["tokens_per_s"] = float((np.asarray(series("throughput/response_tokens_per_s")) * step_s).sum()
                                      / step_s.sum())
    # the constraint's metric name: abs_prob_diff, or abs_prob_diff_p90 for a quantile constraint
    name = next((k.removeprefix("dual/lambda/") for h in history for k in h if k.startswith("dual/lambda/")),
                "abs_prob_diff")
    # lambda as the penalty carried it: the running mean under dual.average, else the iterate
    avg_key = f"dual/lambda_avg/{name}"
    lam_key = avg_key if any(avg_key in h for h in history) else f"dual/lambda/{name}"
    late = float(np.mean([a for s, a in zip(eval_steps, eval_acc) if s >= late_from * eval_steps[-1]]))
    return Run(level, method, n, seed, summary["accuracy_before"], eval_steps, eval_acc, collapsed, reason,
               series(f"dual/measured/{name}"), series(f"dual/tolerance/{name}"), series(lam_key),
               series("discrepancy/abs_prob_diff"), series("discrepancy/kl_k3"), float(summary["seconds"]),
               eval_acc[-1], max(eval_acc), late,
               extra, (out / "summary.json").stat().st_mtime,
               {k: series(k) for k in SCHEDULE_KEYS if any(k in h for h in history)},
               (out / MACHINE_FILE).read_text().strip() if (out / MACHINE_FILE).exists() else "")


def _sig(x: Sequence[float]) -> list[float]:
    return [float(f"{v:.4g}") for v in x]


def run_record(r: Run, config: Sequence[str]) -> dict:
    """One run on its page's JSON: everything the page is rendered from (per-step series to 4 significant
    digits), and ``config``, what set its training; ``run_from_record`` reads it back."""
    return {"level": r.level, "method": r.method, "N": r.n, "seed": r.seed, "config": list(config),
            "eval_steps": r.eval_steps, "eval_acc": r.eval_acc, "collapsed": r.collapsed,
            "collapse_reason": r.collapse_reason, "seconds": round(r.seconds, 1),
            "finished": round(r.finished) if np.isfinite(r.finished) else None,
            "lambda": _sig(r.lambdas), "measured": _sig(r.measured), "tolerance": _sig(r.tolerance),
            "abs_prob_diff": _sig(r.abs_prob_diff), "kl_k3": _sig(r.kl_k3),
            "extra": {k: float(f"{v:.6g}") for k, v in r.extra.items()},
            "schedule": {k: _sig(v) for k, v in r.schedule.items()}, "tokens_per_s": r.extra.get("tokens_per_s"),
            **({"machine": r.machine} if r.machine else {})}


def run_from_record(d: dict, late_from: float, seconds: float = math.nan) -> Run:
    """A page's run record as a Run. Records written before they carried the per-step discrepancy series and the
    diagnostics have empty series (the page keeps those cells' diagnostics, see ``page``) and take ``seconds``
    from the page's CSV."""
    steps, acc = d["eval_steps"], d["eval_acc"]
    late = float(np.mean([a for s, a in zip(steps, acc) if s >= late_from * steps[-1]]))
    extra = d.get("extra") or ({"tokens_per_s": d["tokens_per_s"]} if d.get("tokens_per_s") is not None else {})
    return Run(d["level"], d["method"], d["N"], d["seed"], acc[0], steps, acc, d["collapsed"], d["collapse_reason"],
               d.get("measured", []), d.get("tolerance", []), d["lambda"], d.get("abs_prob_diff", []),
               d.get("kl_k3", []), float(d.get("seconds", seconds)), acc[-1], max(acc), late, extra,
               float(d.get("finished") or math.nan), d.get("schedule", {}), d.get("machine", ""))


def record_path(prefix: Path) -> Path:
    """The page's record: a plain ``prefix.json`` where one exists (a runner that wrote plain JSON wrote it after
    the compressed one), else ``prefix.json.gz``, the form this runner writes."""
    plain = prefix.with_name(prefix.name + ".json")
    return plain if plain.exists() else prefix.with_name(prefix.name + ".json.gz")


def read_record(prefix: Path) -> dict:
    path = record_path(prefix)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def write_record(prefix: Path, text: str) -> Path:
    """Write the record gzipped (mtime 0: the same record gives the same bytes) and drop a plain one it replaces."""
    path = prefix.with_name(prefix.name + ".json.gz")
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    prefix.with_name(prefix.name + ".json").unlink(missing_ok=True)
    return path


def recorded_runs(exp: Experiment, profile_name: str, prefix: Path
                  ) -> tuple[dict[tuple[str, str, int, int], Run], dict[tuple[str, str, int], dict], dict[str, float],
                             bool]:
    """The runs on the committed page's record (``read_record``) that the experiment file would still train the same
    way (its record's config, or for a record without one its page's level, method and profile overrides), by
    (level, method, N, seed); the page's cells by (level, method, N); its wall seconds per run folder, and whether
    some of its runs' wall was not recorded."""
    path = record_path(prefix)
    if not path.exists():
        return {}, {}, {}, False
    page = read_record(prefix)
    seconds = {}
    if prefix.with_suffix(".csv").exists():
        for row in csv.DictReader(open(prefix.with_suffix(".csv"))):
            seconds[(row["level"], row["method"], int(row["N"]), int(row["seed"]))] = float(row["seconds"])
    cells = set(exp.cells(profile_name))
    runs, stale = {}, 0
    for d in page.get("runs", []):
        key = (d["level"], d["method"], d["N"], d["seed"])
        if key not in cells:
            continue
        if "config" in d:
            same = d["config"] == exp.run_config(profile_name, *key)
        else:
            same = (page["levels"].get(key[0]) == exp.levels[key[0]]
                    and page["methods"].get(key[1]) == exp.methods[key[1]] and page["overrides"] == list(exp.overrides)
                    and page["profile_overrides"] == list(exp.profiles[profile_name].overrides))
        if same:
            runs[key] = run_from_record(d, exp.late_from, seconds.get(key, math.nan))
        else:
            stale += 1
    if stale:
        print(f"{rel(path)}: {stale} recorded runs were trained with other overrides than the experiment "
              "file now gives; left off the page", flush=True)
    return (runs, {(c["level"], c["method"], c["N"]): c for c in page.get("cells", [])}, page.get("walls") or {},
            page.get("walls") is None or page.get("walls_partial", False))


def _nanmean(x: Sequence[float]) -> float:
    """Mean over the values that are not NaN; NaN (without numpy's warning) where there are none, e.g. a series a run
    recorded before the series were kept lacks."""
    a = np.asarray(x, dtype=np.float64)
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else math.nan


def _varies(x: Sequence[float]) -> bool:
    a = np.asarray(x, dtype=np.float64)
    return np.unique(a[np.isfinite(a)]).size > 1


def _mean_sd(x: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(x, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def aggregate(runs: list[Run], keys: list[tuple[str, str, int]], caps: Optional[dict[str, float]] = None) -> list[dict]:
    """One row per (level, method, N) in ``keys`` order: mean ± sd over seeds, collapses, the dual's course
    (``caps``: lambda_max per method, for the share of steps at the cap; NaN where a method has none)."""
    caps = caps or {}
    cells = []
    for level, method, n in keys:
        rs = [r for r in runs if (r.level, r.method, r.n) == (level, method, n)]
        if not rs:
            continue
        final, final_sd = _mean_sd([r.final for r in rs])
        peak, peak_sd = _mean_sd([r.peak for r in rs])
        late, late_sd = _mean_sd([r.late for r in rs])
        series = all(r.measured for r in rs)
        cells.append({
            "level": level, "method": method, "N": n, "seeds": len(rs), "seed_ids": [r.seed for r in rs],
            # per run, in seed_ids' order: what the paired tests and the placebo margins read
            "insides": [float(np.mean(np.asarray(r.measured) <= np.asarray(r.tolerance))) if r.measured else math.nan
                        for r in rs],
            "reaches": [r.extra.get("reach", math.nan) for r in rs],
            "spreads": [r.extra.get("spread", math.nan) for r in rs],
            "acc_before": float(np.mean([r.acc_before for r in rs])),
            "final": final, "final_sd": final_sd, "peak": peak, "peak_sd": peak_sd,
            "finals": [r.final for r in rs], "late": late, "late_sd": late_sd, "lates": [r.late for r in rs],
            "collapses": int(sum(r.collapsed for r in rs)),
            # NaN where a run recorded before the per-step series were kept lacks them (no mean over a part)
            "abs_prob_diff": _nanmean([_nanmean(r.abs_prob_diff) for r in rs]) if series else math.nan,
            # the discrepancy the level produces at the start (first 5 steps), as the x axis is read
            "kl_k3_start": _nanmean([_nanmean(r.kl_k3[:5]) for r in rs]) if series else math.nan,
            "inside_share": float(np.mean([np.mean(np.asarray(r.measured) <= np.asarray(r.tolerance)) for r in rs]))
                            if series else math.nan,
            "mean_lambda": float(np.nanmean([np.nanmean(r.lambdas) for r in rs])),
            "extreme_share": extreme_share([r.lambdas for r in rs]),
            "final_lambda": float(np.nanmean([r.lambdas[-1] for r in rs])),
            # the dual acting: lambda above 0.01 (a slack dual sits at 0); at its cap: within 1e-9 of lambda_max
            "acting_share": float(np.mean([np.mean(np.asarray(r.lambdas) > 0.01) for r in rs])),
            "cap_share": float(np.mean([np.mean(np.asarray(r.lambdas) >= caps[method] - 1e-9) for r in rs]))
                         if math.isfinite(caps.get(method, math.nan)) else math.nan,
            "extra": {k: float(np.nanmean([r.extra[k] for r in rs])) for k in sorted(set.intersection(
                *(set(r.extra) for r in rs)))},
        })
    return cells


def extreme_share(lambdas: Sequence[Sequence[float]], within: float = 0.01) -> float:
    """Share of steps whose λ lies within ``within`` of its run's range from the run's lowest or highest λ
    (how bang-bang the rule acts), over the runs whose λ moves; NaN when no run's λ moves."""
    shares = []
    for lam in lambdas:
        a = np.asarray(lam, dtype=np.float64)
        a = a[np.isfinite(a)]
        if a.size == 0 or a.max() == a.min():
            continue
        lo, hi = a.min(), a.max()
        margin = within * (hi - lo)
        shares.append(float(np.mean((a <= lo + margin) | (a >= hi - margin))))
    return float(np.mean(shares)) if shares else math.nan


def is_dcmdp(method: str) -> bool:
    return method.startswith("dcmdp")


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Welch's t-test p-value of two samples; NaN with fewer than two values on a side, or with no spread on either
    (the test is undefined there: two constant samples that differ would read p = 0)."""
    from scipy.stats import ttest_ind

    if len(a) < 2 or len(b) < 2 or (max(a) == min(a) and max(b) == min(b)):
        return math.nan
    return float(ttest_ind(a, b, equal_var=False).pvalue)


def by_seed(cell: dict, key: str) -> dict[int, float]:
    """A cell's per-run values (``key``: "finals", "lates", "insides", ...) by RL seed (cells from a page record
    written before seeds were kept: empty, so nothing pairs)."""
    return dict(zip(cell.get("seed_ids", []), cell.get(key, [])))


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """The paired comparison of two methods over the seeds both ran (a seed shares its cold start and its RL seed on
    both sides): n, the mean difference a - b, the paired t-test's p and the Wilcoxon signed-rank test's p
    (scipy.stats.ttest_rel, wilcoxon; two-sided). p is NaN with fewer than two pairs, the t-test's also with no spread
    in the differences (undefined), Wilcoxon's with every difference 0."""
    from scipy.stats import ttest_rel, wilcoxon

    seeds = [s for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
    d = np.asarray([a[s] - b[s] for s in seeds], dtype=np.float64)
    out = {"n": len(seeds), "diff": float(d.mean()) if d.size else math.nan, "p_t": math.nan, "p_wilcoxon": math.nan}
    if d.size >= 2 and np.ptp(d) > 1e-12:  # differences equal up to rounding: no spread, as in welch_p
        out["p_t"] = float(ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)
    if d.size >= 2 and np.any(d != 0):
        out["p_wilcoxon"] = float(wilcoxon(d).pvalue)
    return out


def welch(cells: list[dict]) -> list[dict]:
    """Per (level, N) and DCMDP config: against the best other method by mean final accuracy, and by late accuracy
    against the best by late accuracy."""
    out = []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = [c for c in cells if (c["level"], c["N"]) == key]
        others = [c for c in here if not is_dcmdp(c["method"])]
        if not others:
            continue
        best = max(others, key=lambda c: c["final"])
        best_late = max(others, key=lambda c: c["late"])
        for mine in (c for c in here if is_dcmdp(c["method"])):
            out.append({"level": key[0], "N": key[1], "method": mine["method"], "best_baseline": best["method"],
                        "dcmdp": mine["final"], "baseline": best["final"], "diff": mine["final"] - best["final"],
                        "p": welch_p(mine["finals"], best["finals"]), "best_late_baseline": best_late["method"],
                        "late_diff": mine["late"] - best_late["late"],
                        "p_late": welch_p(mine["lates"], best_late["lates"]),
                        "p_late_paired": paired(by_seed(mine, "lates"), by_seed(best_late, "lates"))["p_t"],
                        "seeds": f"{len(mine['finals'])} vs {len(best['finals'])}"})
    return out


def reading(diff: float, p: float, alpha: float = 0.05) -> str:
    """'ahead' / 'behind' where Welch's p < alpha, 'level' where p >= alpha, and 'untested' where p is undefined
    (fewer than two seeds on a side): one seed each can be neither level nor ahead by the test."""
    if not math.isfinite(p):
        return "untested"
    if not p < alpha:
        return "level"
    return "ahead" if diff > 0 else "behind"


def compare_rows(cmp: Compare, cells: list[dict]) -> list[dict]:
    """Per (level, N), config and rival role: the config against the role's candidate with the best late mean in
    that cell (late and final accuracy, Welch's t-test on each, collapses)."""
    out = []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = {c["method"]: c for c in cells if (c["level"], c["N"]) == key}
        for config in (m for m in cmp.configs if m in here):
            mine = here[config]
            for role in cmp.rivals:
                present = [here[m] for m in cmp.rival_candidates(role, key[0]) if m in here]
                if not present:
                    continue
                rival = max(present, key=lambda c: c["late"])
                p_late = welch_p(mine["lates"], rival["lates"])
                pair = paired(by_seed(mine, "lates"), by_seed(rival, "lates"))
                pair_final = paired(by_seed(mine, "finals"), by_seed(rival, "finals"))
                out.append({"level": key[0], "N": key[1], "config": config, "role": role, "rival": rival["method"],
                            "late": mine["late"], "late_sd": mine["late_sd"], "rival_late": rival["late"],
                            "rival_late_sd": rival["late_sd"], "late_diff": mine["late"] - rival["late"],
                            "p_late": p_late, "final_diff": mine["final"] - rival["final"],
                            "p_final": welch_p(mine["finals"], rival["finals"]),
                            "reading": reading(mine["late"] - rival["late"], p_late),
                            "paired_n": pair["n"], "paired_late_diff": pair["diff"], "p_late_paired": pair["p_t"],
                            "p_late_wilcoxon": pair["p_wilcoxon"], "p_final_paired": pair_final["p_t"],
                            "reading_paired": reading(pair["diff"], pair["p_t"]),
                            "collapses": f"{mine['collapses']}/{mine['seeds']} vs {rival['collapses']}/{rival['seeds']}"})
    return out


def compare_table(rows: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "config", "rival (role)", "config late", "rival late", "late difference", "late Welch p",
         "reading", "paired seeds", "late paired t p", "late Wilcoxon p", "paired reading", "final difference",
         "final Welch p", "final paired t p", "collapses"),
        [(r["N"], r["level"], r["config"], f"{r['rival']} ({r['role']})", f"{r['late']:.3f} ± {r['late_sd']:.3f}",
          f"{r['rival_late']:.3f} ± {r['rival_late_sd']:.3f}", f"{r['late_diff']:+.3f}", f"{r['p_late']:.3g}",
          r["reading"], r.get("paired_n", 0), _fmt(r.get("p_late_paired", math.nan)),
          _fmt(r.get("p_late_wilcoxon", math.nan)), r.get("reading_paired", "untested"), f"{r['final_diff']:+.3f}",
          f"{r['p_final']:.3g}", _fmt(r.get("p_final_paired", math.nan)), r["collapses"]) for r in rows])


def placebo_rows(cmp: Compare, cells: list[dict]) -> list[dict]:
    """Per (level, N), config and placebo arm: the share of steps inside c, paired per seed (config - placebo), over
    every seed both ran and over the seeds whose config run had authority (its penalty's reach above its batch
    spread, from the run's summary); the paired t-test of the margin; the config's mean reach and spread."""
    out = []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = {c["method"]: c for c in cells if (c["level"], c["N"]) == key}
        for config, arms in cmp.placebos.items():
            if config not in here:
                continue
            mine = here[config]
            reach, spread = by_seed(mine, "reaches"), by_seed(mine, "spreads")
            authority = {s for s in reach if reach[s] > spread.get(s, math.nan)}  # NaN compares False
            measured = {s for s in reach if math.isfinite(reach[s]) and math.isfinite(spread.get(s, math.nan))}
            for arm in arms:
                if arm not in here:
                    continue
                inside, other = by_seed(mine, "insides"), by_seed(here[arm], "insides")
                every = paired(inside, other)
                held = paired({s: v for s, v in inside.items() if s in authority}, other)
                out.append({"level": key[0], "N": key[1], "config": config, "placebo": arm,
                            "inside": _nanmean(list(inside.values())), "placebo_inside": _nanmean(list(other.values())),
                            "margin": every["diff"], "p_margin": every["p_t"], "n": every["n"],
                            "authority_seeds": held["n"], "measured_seeds": len(measured),
                            "margin_authority": held["diff"],
                            "p_margin_authority": held["p_t"], "reach": _nanmean(list(reach.values())),
                            "spread": _nanmean(list(spread.values()))})
    return out


def placebo_table(rows: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "config", "placebo", "config inside c", "placebo inside c", "paired margin", "paired t p",
         "seeds", "config reach", "config spread", "seeds with reach > spread", "margin there"),
        [(r["N"], r["level"], r["config"], r["placebo"], _fmt(r["inside"], ".0%"), _fmt(r["placebo_inside"], ".0%"),
          _fmt(100 * r["margin"], "+.1f") + " pts" if math.isfinite(r["margin"]) else "-", _fmt(r["p_margin"]), r["n"],
          _fmt(r["reach"]), _fmt(r["spread"]), f"{r['authority_seeds']} of {r['measured_seeds']}",
          _fmt(100 * r["margin_authority"], "+.1f") + " pts" if math.isfinite(r["margin_authority"]) else "-")
         for r in rows])


def bar_rows(cmp: Compare, cells: list[dict], compared: list[dict], missing: dict[tuple[str, int], int],
             expected: Optional[set[tuple[str, str, int]]] = None) -> list[dict]:
    """Per (level, N) and config: each clause of the pre-registered bar with its measured value and whether it is met,
    and the verdict: "met", "not met" (naming the clauses that fail) or "not decided" (``missing``: runs of the
    profile in that cell that have not finished; a clause with nothing to measure it). A (level, N) with runs missing
    and none finished gets a "not decided" row per config the profile runs there (``expected``: its (level, method,
    N) cells; every config where not given)."""
    bar = cmp.bar
    if bar is None:
        return []
    out = []
    placebos = placebo_rows(cmp, cells) if bar.placebo_margin is not None else []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = {c["method"]: c for c in cells if (c["level"], c["N"]) == key}
        for config in (m for m in cmp.configs if m in here):
            mine, clauses = here[config], []
            for role, need in bar.roles.items():
                row = next((r for r in compared if (r["level"], r["N"], r["config"], r["role"]) == (*key, config, role)),
                           None)
                if row is None:
                    clauses.append((f"vs {role} ({need})", "no run", None))
                else:
                    read, p, diff, how = ((row["reading_paired"], row["p_late_paired"], row["paired_late_diff"],
                                           f"paired over {row['paired_n']} seeds") if bar.paired else
                                          (row["reading"], row["p_late"], row["late_diff"], "Welch"))
                    ok = None if read == "untested" else read == "ahead" or (need == "level" and read == "level")
                    clauses.append((f"vs {role} ({need})", f"{read} vs {row['rival']}, {diff:+.3f}, {how} p = {p:.2g}",
                                    ok))
            if bar.collapses is not None:
                clauses.append((f"collapses (<= {bar.collapses})", f"{mine['collapses']}/{mine['seeds']}",
                                mine["collapses"] <= bar.collapses))
            if bar.collapses_vs is not None:
                present = [here[m] for m in cmp.rival_candidates(bar.collapses_vs, key[0]) if m in here]
                if not present:
                    clauses.append((f"collapses (<= {bar.collapses_vs})", "no run", None))
                else:
                    rival = max(present, key=lambda c: c["late"])
                    clauses.append((f"collapses (<= {bar.collapses_vs})", f"{mine['collapses']}/{mine['seeds']} vs "
                                    f"{rival['collapses']}/{rival['seeds']} ({rival['method']})",
                                    mine["collapses"] <= rival["collapses"]))
            if bar.placebo_margin is not None:
                for arm in cmp.placebos.get(config, ()):
                    row = next((r for r in placebos if (r["level"], r["N"], r["config"], r["placebo"])
                                == (*key, config, arm)), None)
                    name = f"inside c over {arm} (>= {100 * bar.placebo_margin:.0f} pts where reach > spread)"
                    if row is None:
                        clauses.append((name, "no run", None))
                    elif row["measured_seeds"] == 0:  # reach or spread not in the runs' summaries: not measured
                        clauses.append((name, "reach or spread not measured", None))
                    elif row["authority_seeds"] == 0:  # the penalty had no authority: the accuracy clause is judged
                        clauses.append((name, f"does not apply: reach <= spread on every seed "
                                        f"({row['measured_seeds']})", True))
                    else:
                        m = row["margin_authority"]
                        clauses.append((name, f"{100 * m:+.1f} pts paired over {row['authority_seeds']} of "
                                        f"{row['measured_seeds']} seeds", m >= bar.placebo_margin))
            if bar.inside_c is not None:
                v = mine["inside_share"]
                clauses.append((f"inside c (>= {bar.inside_c:.0%})", "-" if not math.isfinite(v) else f"{v:.0%}",
                                None if not math.isfinite(v) else v >= bar.inside_c))
            if bar.below_cap is not None:
                # a config without a finite cap is below it on every step
                v = 1.0 - mine["cap_share"] if math.isfinite(mine["cap_share"]) else 1.0
                clauses.append((f"λ below its cap (>= {bar.below_cap:.0%})", f"{v:.0%}", v >= bar.below_cap))
            if bar.acting is not None:
                # an idle dual meets the clauses above without doing anything: this one asks that it acts
                v = mine.get("acting_share", math.nan)
                clauses.append((f"λ > 0.01 (>= {bar.acting:.0%})", "-" if not math.isfinite(v) else f"{v:.0%}",
                                None if not math.isfinite(v) else v >= bar.acting))
            gone = missing.get(key, 0)
            failed = [name for name, _, ok in clauses if ok is False]
            if gone or any(ok is None for _, _, ok in clauses):
                verdict = (f"not decided ({gone} of the cell's runs not finished)" if gone
                           else "not decided (a clause has no run, or too few seeds, to measure it)")
            else:
                verdict = "met" if not failed else "not met: " + "; ".join(failed)
            out.append({"level": key[0], "N": key[1], "config": config, "verdict": verdict,
                        "clauses": [{"clause": n, "value": v, "met": ok} for n, v, ok in clauses]})
    # a level of the profile none of whose runs has finished: its row says so rather than leaving the level out
    for key, gone in missing.items():
        if not any((c["level"], c["N"]) == key for c in cells):
            out += [{"level": key[0], "N": key[1], "config": config, "clauses": [],
                     "verdict": f"not decided ({gone} of the cell's runs not finished)"} for config in cmp.configs
                    if expected is None or (key[0], config, key[1]) in expected]
    return out


def bar_across(cmp: Compare, compared: list[dict], missing: dict[tuple[str, int], int],
               configs: Optional[set[str]] = None) -> list[dict]:
    """The bar's clause across levels (``ahead_somewhere``), per config and role: met when the config reads ahead of
    the role's candidate on at least one level of the page; not decided while none does and a level has runs missing
    (or has no reading yet); else not met. Each entry keeps the per-level readings it was decided on. ``configs``:
    the configs the profile runs (every config of the block where not given)."""
    bar = cmp.bar
    if bar is None or not bar.ahead_somewhere:
        return []
    out = []
    for config in (c for c in cmp.configs if configs is None or c in configs):
        for role in bar.ahead_somewhere:
            rows = [r for r in compared if r["config"] == config and r["role"] == role]
            ahead = any(r["reading"] == "ahead" for r in rows)
            met = True if ahead else (None if missing or any(r["reading"] == "untested" for r in rows) else False)
            out.append({"config": config, "role": role, "met": met,
                        "readings": [{"level": r["level"], "N": r["N"], "reading": r["reading"],
                                      "late_diff": r["late_diff"], "p_late": r["p_late"]} for r in rows]})
    return out


def met_on_line(bar: Bar, rows: list[dict]) -> str:
    """The clause across levels ``met_on``: per config, the bar met on at least that many of its (level, N) cells;
    not decided while the cells still undecided could carry it over."""
    parts = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        met = sum(r["verdict"] == "met" for r in mine)
        open_ = sum(r["verdict"].startswith("not decided") for r in mine)
        state = ("met" if met >= bar.met_on else "not decided" if met + open_ >= bar.met_on else "**not met**")
        parts.append(f"{config}: met on {met} of {len(mine)} ({state})")
    return f"The bar met on at least {bar.met_on} cells: " + "; ".join(parts) + "."


def bar_across_lines(rows: list[dict]) -> list[str]:
    mark = {True: "met", False: "**not met**", None: "not decided (runs missing)"}
    return [f"- {r['config']} ahead of the {r['role']} on at least one level: {mark[r['met']]} ("
            + ("; ".join(f"{x['reading']} at {x['level']}, {x['late_diff']:+.3f}, p = {x['p_late']:.2g}"
                         for x in r["readings"]) or "no reading yet") + ")" for r in rows]


def bar_table(rows: list[dict]) -> list[str]:
    mark = {True: "met", False: "**not met**", None: "not decided"}
    names = list(dict.fromkeys(c["clause"] for r in rows for c in r["clauses"]))
    body = []
    for r in rows:
        by = {c["clause"]: c for c in r["clauses"]}
        body.append((r["N"], r["level"], r["config"],
                     *(f"{by[n]['value']} ({mark[by[n]['met']]})" if n in by else "-" for n in names), r["verdict"]))
    return md_table(("N", "level", "config", *names, "the bar"), body)


def compute_rows(cmp: Compare, runs: list[Run]) -> list[dict]:
    """Per level: the run-minutes of each config, each rival candidate, and each ``compute`` group (its methods'
    runs summed: a tuned constant's sweep counts toward it)."""
    out = []
    for level in dict.fromkeys(r.level for r in runs):
        groups = [(m, (m,)) for m in cmp.configs]
        groups += [(m, (m,)) for role in cmp.rivals for m in cmp.rival_candidates(role, level)]
        groups += list(cmp.compute.items())
        for label, ms in dict.fromkeys(groups):
            rs = [r for r in runs if r.level == level and r.method in ms]
            if rs:
                out.append({"level": level, "what": label, "methods": list(ms), "runs": len(rs),
                            "run_minutes": sum(r.seconds for r in rs) / 60})
    return out


def table(cells: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "kl_k3 at start", "method", "final held-out acc", "late held-out acc", "peak held-out acc",
         "collapses", "mean abs_prob_diff", "steps inside c", "mean λ", "final λ", "λ at its extremes", "λ > 0.01",
         "λ at its cap"),
        [(c["N"], c["level"], _fmt(c["kl_k3_start"], ".2e"), c["method"], f"{c['final']:.3f} ± {c['final_sd']:.3f}",
          f"{c['late']:.3f} ± {c['late_sd']:.3f}", f"{c['peak']:.3f} ± {c['peak_sd']:.3f}",
          f"{c['collapses']}/{c['seeds']}", _fmt(c["abs_prob_diff"], ".2e"), _fmt(c["inside_share"], ".0%"),
          f"{c['mean_lambda']:.3g}", f"{c['final_lambda']:.3g}", _fmt(c["extreme_share"], ".0%"),
          _fmt(c.get("acting_share", math.nan), ".0%"), _fmt(c.get("cap_share", math.nan), ".0%")) for c in cells])


def welch_table(rows: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "DCMDP config", "its final acc", "best baseline", "its final acc", "difference", "Welch p",
         "best by late acc", "late difference", "late Welch p", "late paired t p", "seeds"),
        [(r["N"], r["level"], r["method"], f"{r['dcmdp']:.3f}", r["best_baseline"], f"{r['baseline']:.3f}",
          f"{r['diff']:+.3f}", f"{r['p']:.3g}", r["best_late_baseline"], f"{r['late_diff']:+.3f}",
          f"{r['p_late']:.3g}", _fmt(r.get("p_late_paired", math.nan)), r["seeds"]) for r in rows])


def accuracy_figure(exp: Experiment, cells: list[dict], methods: Sequence[str], ns: Sequence[int], path: Path) -> Path:
    """Late held-out accuracy (the comparisons' measure; mean ± sd over seeds, a dot per seed) of ``methods``: one
    bar per level, one panel per N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in exp.levels if any(c["level"] == lv for c in cells)]
    by = {(c["level"], c["method"], c["N"]): c for c in cells}
    fig, axes = plt.subplots(1, len(ns), figsize=(max(6.5, 1.1 * len(methods)) * len(ns), 4.6), squeeze=False)
    width = 0.8 / len(levels)
    for ax, n in zip(axes[0], ns):
        for j, level in enumerate(levels):
            got = [by.get((level, m, n)) for m in methods]
            x = np.arange(len(methods)) + (j - (len(levels) - 1) / 2) * width
            ax.bar(x, [100 * c["late"] if c else np.nan for c in got], width,
                   yerr=[100 * c["late_sd"] if c else 0.0 for c in got], capsize=3, color=f"C{j}", alpha=0.75,
                   label=level)
            for xi, c in zip(x, got):  # one dot per seed
                if c and c.get("lates"):
                    ax.plot([xi] * len(c["lates"]), [100 * v for v in c["lates"]], "k.", ms=4)
        ax.set_xticks(range(len(methods)), [exp.labels[m] for m in methods], rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(f"late held-out accuracy, % (N = {n})"), ax.set_ylim(0, 100)
        # above the panel, where it covers no bar
        ax.grid(axis="y", alpha=0.3), ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0),
                                                 ncol=min(len(levels), 3), title="level (dots: seeds)",
                                                 title_fontsize=7, frameon=False)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return path


def plot(exp: Experiment, runs: list[Run], cells: list[dict], prefix: Path) -> list[Path]:
    """Final accuracy by level and N, the curves at the last level and largest N, and the dual there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in exp.levels if any(c["level"] == lv for c in cells)]
    methods = list(dict.fromkeys(c["method"] for c in cells))
    ns = sorted({c["N"] for c in cells})
    color = {m: f"C{k % 10}" for k, m in enumerate(methods)}  # one colour per method across the figures
    paths = [accuracy_figure(exp, cells, methods, ns, prefix.with_name(prefix.name + "_accuracy.png"))]

    # held-out accuracy over the run at the last level and largest N: mean over seeds with a ± sd band per method
    last, n = levels[-1], max(ns)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for method in methods:
        rs = [r for r in runs if (r.level, r.method, r.n) == (last, method, n)]
        if not rs or len({tuple(r.eval_steps) for r in rs}) != 1:
            continue
        acc = np.asarray([r.eval_acc for r in rs])
        mean, sd = acc.mean(0), acc.std(0, ddof=1) if len(rs) > 1 else np.zeros(acc.shape[1])
        ax.plot(rs[0].eval_steps, mean, marker="o", ms=3, color=color[method], lw=2.2 if is_dcmdp(method) else 1.0,
                label=f"{method} ({len(rs)} seeds)")
        ax.fill_between(rs[0].eval_steps, mean - sd, mean + sd, color=color[method], alpha=0.12)
    end = max(r.eval_steps[-1] for r in runs)
    ax.axvspan(exp.late_from * end, end, color="0.9", zorder=0, label="late window")
    ax.set_xlabel("RL step"), ax.set_ylabel("held-out accuracy of the deployed policy")
    ax.set_title(f"{last}, N = {n}: mean ± sd over seeds"), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_curves.png"))
    save_figure(fig, paths[-1], dpi=120)

    # the dual there: D-hat (5-step mean) against c, and lambda against its cap, per seed, a row per DCMDP config
    dual = [m for m in methods if is_dcmdp(m) and any((r.level, r.method, r.n) == (last, m, n) for r in runs)]
    if dual:
        fig, axes = plt.subplots(len(dual), 2, figsize=(11, 3.8 * len(dual)), squeeze=False)
        for (ax_d, ax_l), method in zip(axes, dual):
            rs = [r for r in runs if (r.level, r.method, r.n) == (last, method, n)]
            for k, r in enumerate(rs):
                steps = np.arange(1, len(r.lambdas) + 1)
                if r.measured:  # a run recorded before the series were kept has none
                    w = min(5, len(r.measured))
                    ax_d.plot(steps[w - 1:], np.convolve(r.measured, np.ones(w) / w, mode="valid"), color=f"C{k}",
                              label=f"D̂ seed {r.seed}")
                    ax_d.plot(steps, r.tolerance, color=f"C{k}", ls="--", lw=0.8)
                ax_l.plot(steps, r.lambdas, color=f"C{k}", lw=0.9, label=f"seed {r.seed}")
            cap = lambda_cap(exp, method)
            if math.isfinite(cap):
                ax_l.axhline(cap, color="0.3", ls="--", lw=1.0, label=f"cap lambda_max = {cap:g}")
            ax_d.set_yscale("log"), ax_d.set_xlabel("RL step"), ax_d.grid(alpha=0.3)
            if any(r.measured for r in rs):
                ax_d.legend(fontsize=7)
            ax_d.set_ylabel("D̂ to the dual (5-step mean)\ndashed: c in force", fontsize=8)
            ax_d.set_title(f"{method} at {last}, N = {n}", fontsize=9)
            ax_l.set_xlabel("RL step"), ax_l.set_ylabel("λ"), ax_l.grid(alpha=0.3), ax_l.legend(fontsize=7)
        fig.tight_layout()
        paths.append(prefix.with_name(prefix.name + "_dual.png"))
        save_figure(fig, paths[-1], dpi=110)
    if any(r.schedule for r in runs):
        paths.append(lambda_figure(runs, levels, methods, color, n, prefix.with_name(prefix.name + "_lambda.png")))
    return paths


def lambda_cap(exp: Experiment, method: str) -> float:
    """lambda_max of the method's first constraint (the experiment's and the method's overrides on its base
    config), NaN where the config does not load."""
    from dcmdp.config import ConfigError, load_config

    try:
        cfg = load_config(exp.base, [*exp.overrides, *exp.methods[method]])
    except (ConfigError, ValueError, KeyError):
        return math.nan
    return float(cfg.dual.constraints[0].lambda_max) if cfg.dual.constraints else math.nan


def lambda_figure(runs: list[Run], levels: Sequence[str], methods: Sequence[str], color: dict, n: int,
                  path: Path) -> Path:
    """Per level (a column): lambda over the steps, the D-hat the dual was fed and what the level changes within
    the run (the first of ``SCHEDULE_KEYS`` that varies in one of its runs), means over seeds per method, at the
    largest N."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(levels), figsize=(4.6 * len(levels), 8), sharex="col", squeeze=False)
    for j, level in enumerate(levels):
        ax_l, ax_d, ax_s = axes[:, j]
        here = [r for r in runs if (r.level, r.n) == (level, n)]
        key = next((k for k in SCHEDULE_KEYS if any(_varies(r.schedule.get(k, ())) for r in here)), None)
        for method in methods:
            rs = [r for r in here if r.method == method and r.lambdas]
            if not rs or len({len(r.lambdas) for r in rs}) != 1:
                continue
            steps = np.arange(1, len(rs[0].lambdas) + 1)
            width = 2.2 if is_dcmdp(method) else 1.0
            ax_l.plot(steps, np.nanmean([r.lambdas for r in rs], axis=0), color=color[method], lw=width, label=method)
            if all(len(r.measured) == len(steps) for r in rs):
                ax_d.plot(steps, np.nanmean([r.measured for r in rs], axis=0), color=color[method], lw=width)
            if key and all(len(r.schedule.get(key, ())) == len(steps) for r in rs):
                ax_s.plot(steps, np.nanmean([r.schedule[key] for r in rs], axis=0), color=color[method], lw=width)
        ax_l.set_title(level), ax_l.set_ylabel("λ (mean over seeds)"), ax_l.grid(alpha=0.3)
        ax_d.set_yscale("log"), ax_d.set_ylabel("D̂ fed to the dual"), ax_d.grid(alpha=0.3)
        ax_s.set_ylabel(SCHEDULE_KEYS[key] if key else "-")
        ax_s.set_xlabel("RL step"), ax_s.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return path


def throughput_rows(exp: Experiment, runs: list[Run]) -> list[dict]:
    """Per (level, method, N): end-to-end tokens/s as a ratio to ``exp.reference`` at the same level, N and seed
    (mean ± sd over the seeds both ran), idle shares, the mean bound and late accuracy; [] without a reference."""
    ref = {(r.level, r.n, r.seed): r.extra.get("tokens_per_s", math.nan) for r in runs if r.method == exp.reference}
    out = []
    for key in dict.fromkeys((r.level, r.method, r.n) for r in runs):
        rs = [r for r in runs if (r.level, r.method, r.n) == key]
        ratios = [r.extra.get("tokens_per_s", math.nan) / ref[(r.level, r.n, r.seed)] for r in rs
                  if (r.level, r.n, r.seed) in ref]
        if not exp.reference or not ratios:
            continue
        mean = {k: float(np.nanmean([r.extra.get(k, math.nan) for r in rs])) for k in
                ("tokens_per_s", "time/trainer_idle_frac", "time/rollout_idle_frac", "async/bound")}
        out.append({"level": key[0], "method": key[1], "N": key[2], "ratio": _mean_sd(ratios), "late":
                    _mean_sd([r.late for r in rs]), "collapses": sum(r.collapsed for r in rs), "seeds": len(rs), **mean})
    return out


def throughput_lines(exp: Experiment, rows: list[dict]) -> list[str]:
    def pm(x: tuple[float, float], fmt: str) -> str:
        return f"{x[0]:{fmt}} ± {x[1]:{fmt}}"

    return ["", f"End-to-end throughput (response tokens of every step over the steps' wall time, rollout waits "
            f"included) as a ratio to {exp.reference} at the same level, N and seed, mean ± sd over seeds; idle "
            "shares are means over steps (trainer: waiting for a batch; rollout worker: waiting for weights):", "",
            *md_table(("level", "N", "method", "tokens/s", f"ratio to {exp.reference}", "trainer idle",
                        "rollout idle", "mean bound", "late held-out acc", "collapses"),
                       [(r["level"], r["N"], r["method"], f"{r['tokens_per_s']:.0f}", pm(r["ratio"], ".2f"),
                         f"{r['time/trainer_idle_frac']:.0%}", f"{r['time/rollout_idle_frac']:.0%}",
                         f"{r['async/bound']:.2f}", pm(r["late"], ".3f"), f"{r['collapses']}/{r['seeds']}")
                        for r in rows])]


def front_figure(exp: Experiment, rows: list[dict], path: Path) -> Path:
    """Late accuracy against throughput (ratio to the reference), one point per method with ± sd bars, a panel
    per (level, N)."""
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["level"], r["N"]) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for k, r in enumerate(x for x in rows if (x["level"], x["N"]) == key):
            ax.errorbar(r["ratio"][0], 100 * r["late"][0], xerr=r["ratio"][1], yerr=100 * r["late"][1], fmt="o",
                        color=f"C{k % 10}", capsize=3, ms=7 if is_dcmdp(r["method"]) else 5,
                        label=exp.labels.get(r["method"], r["method"]))
        ax.set_xlabel(f"end-to-end tokens/s, ratio to {exp.reference}")
        ax.set_ylabel("late held-out accuracy, %"), ax.set_title(f"{key[0]}, N = {key[1]}")
        ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return path


# ------------------------------------------------------------------------------------------- the page


def _utc(t: float) -> str:
    return f"{datetime.datetime.fromtimestamp(t, datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def write_results(exp: Experiment, profile_name: str, runs: list[Run], cells: list[dict], prefix: Path, cmd: str,
                  walls: dict[str, float], configs: dict[tuple[str, str, int, int], list[str]],
                  expected: Optional[int] = None, carried: int = 0, walls_partial: bool = False) -> list[str]:
    import torch
    import transformers

    profile = exp.profiles[profile_name]
    levels = [lv for lv in exp.levels if any(c["level"] == lv for c in cells)]
    methods = list(dict.fromkeys(c["method"] for c in cells))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rows = welch(cells)
    compared = compare_rows(exp.compare, cells) if exp.compare else []
    placebo = placebo_rows(exp.compare, cells) if exp.compare and exp.compare.placebos else []
    compute = compute_rows(exp.compare, runs) if exp.compare else []
    finished = {(r.level, r.method, r.n, r.seed) for r in runs}
    missing: dict[tuple[str, int], int] = {}
    cmp, profile_cells = page_compare(exp, profile_name), exp.cells(profile_name)
    for lv, m, n, seed in profile_cells:
        if (lv, m, n, seed) not in finished:
            missing[(lv, n)] = missing.get((lv, n), 0) + 1
    barred = bar_rows(cmp, cells, compared, missing, {(lv, m, n) for lv, m, n, _ in profile_cells}) if cmp else []
    across = bar_across(cmp, compared, missing, {m for _, m, _, _ in profile_cells}) if cmp else []
    pngs = plot(exp, runs, cells, prefix)
    speed = throughput_rows(exp, runs)
    if speed:
        pngs.append(front_figure(exp, speed, prefix.with_name(prefix.name + "_front.png")))
    with open(prefix.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["level", "method", "N", "seed", "acc_before", "final", "late", "peak", "collapsed",
                    "collapse_reason", "mean_abs_prob_diff", "mean_kl_k3", "final_lambda", "seconds"])
        for r in runs:
            w.writerow([r.level, r.method, r.n, r.seed, r.acc_before, r.final, r.late, r.peak, r.collapsed,
                        r.collapse_reason, _nanmean(r.abs_prob_diff), _nanmean(r.kl_k3), r.lambdas[-1],
                        round(r.seconds, 1)])
    # the page's record: a run per line (a later invocation re-renders the page from it, run folders or not)
    head = json.dumps(
        {"experiment": exp.name, "profile": profile_name, "base": rel(exp.base), "overrides": list(exp.overrides),
         "profile_overrides": list(profile.overrides), "levels": {lv: exp.levels[lv] for lv in levels},
         "methods": {m: exp.methods[m] for m in methods}, "cells": cells, "welch": rows, "throughput": speed,
         "compare": compared, "placebo": placebo, "bar": barred, "bar_across": across, "compute": compute,
         "walls": walls,
         "walls_partial": walls_partial,
         "runs": []}, indent=1)
    records = [json.dumps(run_record(r, configs[(r.level, r.method, r.n, r.seed)]), separators=(",", ":"))
               for r in runs]
    write_record(prefix, head[:-len("[]\n}")] + "[\n" + ",\n".join(records) + "\n ]\n}\n")
    lines = table(cells) + (throughput_lines(exp, speed) if speed else [])
    # walls: wall seconds per run folder that trained runs of the page (walls_partial: some were not recorded)
    trained = (f"{sum(walls.values()) / 60:.0f} min wall over the invocations that trained the runs"
               f"{' whose wall was recorded' if walls_partial else ''}"
               f"{' and other profiles in the same folder' if any(k.endswith(SHARED_WALL) for k in walls) else ''}"
               "; " if walls
               else "no run trained here: every run folder was copied in; " if len(runs) > carried else "")
    if carried:
        trained += f"{carried} runs read from the page's earlier record, their folders not here; "
    if profile.pool:
        trained = "pooled, no run trained here: " + ", ".join(
            f"profile {q.profile} from `{q.bench_dir}` (seeds + {q.seed_offset}, its overrides "
            f"`{' '.join(exp.profiles[q.profile].overrides) or '-'}`)" for q in profile.pool) + "; "
    dated = [r.finished for r in runs if np.isfinite(r.finished)]
    header = [
        f"# {exp.name}, {profile_name} profile", "",
        f"- experiment: {exp.about} (`benchmarks/experiments/{exp.name}.yaml`)",
        f"- profile: {profile.about}",
        *([f"- in progress: {len(runs)} of the profile's {expected} runs have finished; the tables hold those"]
          if expected is not None and len(runs) < expected else []),
        f"- date: written {_utc(time.time())}" + (
            f"; run summaries dated {_utc(min(dated))} to {_utc(max(dated))} (a run folder copied without its dates "
            "carries the copy's)" if dated else "") + (
            f"; {len(runs) - len(dated)} runs recorded without their dates" if len(dated) < len(runs) else ""),
        f"- machine: {machine_kind()}, {os.cpu_count()} logical CPUs; every run one process with one torch thread"
        + machines_trained(runs),
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"- command: `{cmd}` ({trained}{sum(r.seconds for r in runs) / 60:.0f} run-minutes in all)",
        f"- base: `{rel(exp.base)}` + `{' '.join((*exp.overrides, *profile.overrides))}` + the level + the method "
        "+ `algo.minibatches=N seed=S`",
        "- collapse (any of): a non-finite update; final held-out accuracy < half the run's peak (step 0 included); "
        "mean reward accuracy over the last W = max(5, steps/20) steps < half the best W-step running mean after "
        "the LR warm-up",
        "- columns: held-out accuracy on the task's fixed eval set, sampled at temperature 1 by the rollout engine "
        f"(the deployed policy), final, late (the mean of the evaluations from {exp.late_from:.0%} of the steps on) "
        "and peak, mean ± sd over seeds; kl_k3 at start = pi_old vs mu over the first 5 steps; steps inside c = "
        "share of steps with the D̂ fed to the dual <= the tolerance in force; λ = the multiplier the penalty "
        "carried; λ at its extremes = share of steps with λ within 1% of its run's range from the run's lowest or "
        "highest λ (runs whose λ moves; - where none does); λ > 0.01 = share of steps with the dual acting (a slack "
        "dual sits at 0); λ at its cap = share of steps with λ at lambda_max (DCMDP configs)", "",
        *md_table(("level", "overrides", "about"), [(lv, f"`{' '.join(exp.levels[lv])}`" if exp.levels[lv] else "-",
                                                      exp.abouts[f"levels.{lv}"]) for lv in levels]), "",
        *md_table(("method", "overrides", "about"),
                   [(m, f"`{' '.join(exp.methods[m])}`" + "".join(
                       f"; at {lv}: `{' '.join(extra)}`" for lv, extra in sorted(exp.method_levels.get(m, {}).items())),
                     exp.abouts[f"methods.{m}"]) for m in methods]), ""]
    extra_keys = sorted({k for c in cells for k in c["extra"]})
    diag = ["", "Diagnostics (means over steps and seeds):", "", *md_table(
        ("N", "level", "method", *extra_keys),
        [(c["N"], c["level"], c["method"], *("-" if not np.isfinite(c["extra"].get(k, math.nan))
                                             else f"{c['extra'][k]:.3g}" for k in extra_keys)) for c in cells])]
    test = ["", "Each DCMDP config against the best method without the dual in its cell (Welch's t-test on final "
            "accuracy; and on late accuracy against the best method by late accuracy):", "", *welch_table(rows)]
    bar = []
    if exp.compare:
        bar = ["", f"Pre-registered comparisons: {exp.compare.about}. Each config against each rival role's candidate "
               "with the best late mean in the cell (Welch's t-test on late and on final accuracy, and beside it the "
               "paired t-test and the Wilcoxon signed-rank test over the seeds both ran, each seed sharing its cold "
               "start and RL seed; reading: ahead or behind where late p < 0.05, else level):", "",
               *compare_table(compared), "",
               *(["The placebo arms: each config against the same config with λ fixed at 0 and at λ_max (the same c "
                  "schedule), the share of steps inside c paired per seed; reach = the penalty's reach (log D₀ − log "
                  "D_max of the anchor's probes), spread = the sd of log D̂ after warm-up, both from each run's "
                  "summary; the margin counts as control only over the seeds whose reach exceeded their spread:", "",
                  *placebo_table(placebo), ""] if placebo else []),
               *(["The pre-registered bar, clause by clause (λ below its cap: share of all steps; a cell whose runs "
                  "have not all finished is not decided)" + (" - this profile's own bar, not the experiment's"
                                                             if profile.bar is not None else "") + ":", "",
                  *bar_table(barred), "",
                  f"The bar is met in {sum(r['verdict'] == 'met' for r in barred)} of {len(barred)} (level, config) "
                  f"cells; not decided in {sum(r['verdict'].startswith('not decided') for r in barred)}.", "",
                  *([met_on_line(cmp.bar, barred), ""] if cmp.bar is not None and cmp.bar.met_on else []),
                  *(["Its clause across levels:", "", *bar_across_lines(across), ""] if across else [])]
                 if barred or across else []),
               "Compute (run-minutes of the runs on this page; a group sums its methods' runs):", "",
               *md_table(("level", "what", "runs", "run-minutes"),
                         [(c["level"], c["what"] if c["methods"] == [c["what"]]
                           else f"{c['what']} ({', '.join(c['methods'])})", c["runs"], f"{c['run_minutes']:.0f}")
                          for c in compute])]
    plots = [f"![{p.stem}]({p.name})" for p in pngs]
    prefix.with_suffix(".md").write_text("\n".join(header + lines + bar + test + diag + [""] + plots) + "\n")
    return lines + [""] + (compare_table(compared) + ([""] + bar_table(barred) if barred else []) if compared
                           else welch_table(rows))


# ------------------------------------------------------------------------------------------- main


def run(exp: Experiment, profile_name: str, bench_dir: Path, results_prefix: Path, workers: int,
        cmd: str, train: bool = True, levels: Optional[Sequence[str]] = None,
        methods: Optional[Sequence[str]] = None, retrain: bool = False) -> list[dict]:
    """Train the profile's missing runs (those at ``levels`` and of ``methods`` only, when given; a run the page's
    record holds is missing only with ``retrain``) and write its page."""
    from dcmdp.config import ConfigError, load_config

    for kind, wanted, i in (("level", levels, 0), ("method", methods, 1)):
        unknown = sorted(set(wanted or ()) - {c[i] for c in exp.cells(profile_name)})
        if unknown:
            raise ExperimentError(f"profile {profile_name!r} has no {kind} {', '.join(unknown)}")
    cells_here = [c for c in exp.cells(profile_name)
                  if (levels is None or c[0] in levels) and (methods is None or c[1] in methods)]

    profile = exp.profiles[profile_name]
    if profile.pool:
        return render_pool(exp, profile_name, results_prefix, cmd, cells_here)
    bench_dir.mkdir(parents=True, exist_ok=True)
    jobs, configs = [], []
    for level, method, n, seed in cells_here:
        out = exp.cell_dir(bench_dir, level, method, n, seed)
        overrides = exp.cell_overrides(profile_name, level, method, n, seed, out)
        try:  # a bad override fails here, before anything trains
            configs.append((seed, load_config(exp.base, overrides)))
        except ConfigError as exc:
            raise ExperimentError(f"experiment {exp.name}: run {level}/{method}/N={n}/seed={seed} of profile "
                                  f"{profile_name!r} (base {rel(exp.base)}): {exc}") from None
        jobs.append(((level, method, n, seed), out, overrides))
    # the page's record is the result and the folders are scratch: a run the record holds (trained with the overrides
    # the experiment file gives now) is not trained again unless ``retrain``
    record, record_cells, record_walls, record_partial = recorded_runs(exp, profile_name, results_prefix)
    kept = [] if retrain else [out for key, out, _ in jobs if not finished(out) and key in record]
    todo = [out for key, out, _ in jobs if not finished(out) and out not in kept] if train else []
    # one wall count per profile: profiles that share a folder do not add up each other's wall
    wall_file = bench_dir / f"wall_seconds.{profile_name}.txt"
    if todo:
        warm_cold_starts(exp.base, configs, workers)
        template = mlflow_template(bench_dir)
        for _, out, ov in jobs:
            if out in todo:
                prepare(out, exp.base, ov, template)
        if kept and not wall_file.exists() and rel(bench_dir) in record_walls:
            # a fresh folder for a profile trained in part elsewhere: its wall goes on from the record's count
            wall_file.write_text(f"{record_walls[rel(bench_dir)]:.1f}\n")
    done = sum(finished(out) for _, out, _ in jobs)
    print(f"{done} of {len(jobs)} runs already finished"
          + (f", {len(kept)} more read from the page's record (--retrain trains them anew)" if kept else "")
          + f"; training {len(todo)} with {workers} workers", flush=True)
    failed = train_missing(todo, bench_dir, workers, wall_file) if todo else []
    shared = bench_dir / "wall_seconds.txt"  # a folder's count from before it was kept per profile
    wall_key, wall_from = (rel(bench_dir), wall_file) if wall_file.exists() or not shared.exists() else (
        rel(bench_dir) + SHARED_WALL, shared)
    # None: nothing ever trained in this folder for this profile (an assembled profile)
    wall: Optional[float] = float(wall_from.read_text()) if wall_from.exists() else None
    warmup = load_config(exp.base, [*exp.overrides, *exp.profiles[profile_name].overrides]).optim.warmup_steps
    # the page: the profile's runs this invocation covers, from their folders where finished, and every other run
    # of the profile that the page's earlier record holds (a profile trained in parts, or in another session)
    here = {key: load_run(out, *key, warmup=warmup, late_from=exp.late_from) for key, out, _ in jobs if finished(out)}
    every = exp.cells(profile_name)
    runs = [here[key] if key in here else record[key] for key in every if key in here or key in record]
    configs = {key: exp.run_config(profile_name, *key) for key in every}
    carried = sum(key not in here for key in every if key in record)
    walls = dict(record_walls) if carried else {}
    if wall is not None:
        walls[wall_key] = round(wall, 1)
    cells = page(exp, profile_name, runs, every, results_prefix, cmd, walls, len(every), f"see {bench_dir}/*/log.txt",
                 configs, record_cells, carried=carried, walls_partial=bool(carried) and record_partial)
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {', '.join(p.name for p in failed)}")
    return cells


def render_pool(exp: Experiment, profile_name: str, results_prefix: Path, cmd: str,
                cells_here: list[tuple[str, str, int, int]]) -> list[dict]:
    """A pooled profile's page: the finished runs of its parts' folders, else of their pages' records (beside
    ``results_prefix``), each part's seeds shifted by its offset; nothing trains."""
    from dcmdp.config import load_config

    runs, expected, configs, carried = [], 0, {}, 0
    for part in exp.profiles[profile_name].pool:
        sub = exp.profiles[part.profile]
        warmup = load_config(exp.base, [*exp.overrides, *sub.overrides]).optim.warmup_steps
        # a part's page lies beside the pooled one
        record, _, _, _ = recorded_runs(exp, part.profile, results_prefix.with_name(f"{exp.name}_{part.profile}"))
        for level, method, n, seed in exp.cells(part.profile):
            key = (level, method, n, seed + part.seed_offset)
            if key not in cells_here:
                continue
            expected += 1
            configs[key] = exp.run_config(part.profile, level, method, n, seed)
            out = exp.cell_dir(ROOT / part.bench_dir, level, method, n, seed)
            if finished(out):
                runs.append(load_run(out, *key, warmup=warmup, late_from=exp.late_from))
            elif (level, method, n, seed) in record:
                runs.append(dataclasses.replace(record[(level, method, n, seed)], seed=key[3]))
                carried += 1
    print(f"{len(runs)} of the pooled profile's {expected} runs have finished ({carried} read from their pages' "
          "records); training nothing", flush=True)
    return page(exp, profile_name, runs, cells_here, results_prefix, cmd, {}, expected,
                f"its parts' folders: {', '.join(p.bench_dir for p in exp.profiles[profile_name].pool)}", configs, {},
                carried=carried)


# the columns computed from the per-step discrepancy series, which runs recorded before the series were kept lack
SERIES_COLUMNS = ("abs_prob_diff", "kl_k3_start", "inside_share")


def page(exp: Experiment, profile_name: str, runs: list[Run], cells_here: list[tuple[str, str, int, int]],
         results_prefix: Path, cmd: str, walls: dict[str, float], expected: int, where: str,
         configs: dict[tuple[str, str, int, int], list[str]], record_cells: dict[tuple[str, str, int], dict],
         carried: int = 0, walls_partial: bool = False) -> list[dict]:
    """Aggregate the finished ``runs`` per (level, method, N), write the profile's page and print its tables. A cell
    whose runs all lack the per-step series keeps the series columns and diagnostics of ``record_cells`` (the page's
    earlier cells) where that cell holds the same runs."""
    if not runs:
        raise SystemExit(f"no run of {exp.name}/{profile_name} finished ({where})")
    caps = {m: lambda_cap(exp, m) for m in dict.fromkeys(r.method for r in runs) if is_dcmdp(m)}
    cells = aggregate(runs, list(dict.fromkeys((lv, m, n) for lv, m, n, _ in sorted(cells_here, key=lambda c: c[2]))),
                      caps)
    for c in cells:
        old = record_cells.get((c["level"], c["method"], c["N"]))
        if old and old["lates"] == c["lates"] and math.isnan(c["inside_share"]):  # aggregate: runs lack series
            c.update({k: old[k] for k in SERIES_COLUMNS}, extra={**old["extra"], **c["extra"]})
    print("\n" + "\n".join(write_results(exp, profile_name, runs, cells, results_prefix, cmd, walls, configs, expected,
                                          carried, walls_partial)))
    return cells


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count of worker processes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> list[dict] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiment", nargs="?", help="name under benchmarks/experiments/ or a path to a YAML file")
    ap.add_argument("-p", "--profile", default="quick")
    ap.add_argument("--workers", type=_positive_int, default=2,
                    help="runs in parallel, one process and one thread each")
    ap.add_argument("--bench-dir", default=None, help="run folders (default: outputs/<experiment>_<profile>)")
    ap.add_argument("--results", default=None,
                    help="results prefix (default: benchmarks/results/<experiment>_<profile>)")
    ap.add_argument("--headline", default=None, metavar="M1,M2,...",
                    help="render <results>_headline.png (one panel, these methods) from the page's JSON, and exit")
    ap.add_argument("--list", action="store_true", help="print the experiment's profiles with their about, and exit")
    ap.add_argument("--levels", default=None, metavar="L1,L2,...",
                    help="train only the profile's runs at these levels (a long profile run in parts: the page "
                         "keeps the runs its record holds, so each part adds its runs to it)")
    ap.add_argument("--methods", default=None, metavar="M1,M2,...",
                    help="train only the profile's runs of these methods (with --levels too: both must match)")
    ap.add_argument("--no-train", action="store_true",
                    help="train nothing: write the page from the runs that finished (a profile in progress)")
    ap.add_argument("--retrain", action="store_true",
                    help="train anew the runs the page's record holds but the run folder lacks (by default they "
                         "are read from the record)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # worker mode (see Worker)
    args = ap.parse_args(argv)
    if args.serve:
        serve()
        return None
    if args.experiment is None:
        ap.error(f"name an experiment: {sorted(p.stem for p in EXPERIMENTS.glob('*.yaml'))}")
    try:
        exp = load_experiment(args.experiment)
        if args.profile not in exp.profiles and not args.list:
            raise ExperimentError(f"{exp.name} has no profile {args.profile!r} (known: {sorted(exp.profiles)})")
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
    if args.list:
        for name, p in exp.profiles.items():
            print(f"{name}: {p.about} ({len(exp.cells(name))} runs)")
        return None
    stem = f"{exp.name}_{args.profile}"
    bench = Path(args.bench_dir) if args.bench_dir else ROOT / "outputs" / stem
    results = Path(args.results) if args.results else ROOT / "benchmarks" / "results" / stem
    if args.headline:
        cells = read_record(results)["cells"]
        print(accuracy_figure(exp, cells, args.headline.split(","), [max(c["N"] for c in cells)],
                              results.with_name(results.name + "_headline.png")))
        return None
    try:
        return run(exp, args.profile, bench.resolve(), results.resolve(), args.workers, command("run.py", argv),
                   train=not args.no_train, levels=args.levels.split(",") if args.levels else None,
                   methods=args.methods.split(",") if args.methods else None, retrain=args.retrain)
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
