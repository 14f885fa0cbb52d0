"""The experiment files of ``benchmarks/experiments/``: levels, methods, profiles, the ``compare`` block and its
bar, read and checked (a malformed file is an ``ExperimentError`` naming the file and the key)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from benchmarks._page import rel

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "benchmarks" / "experiments"
# plumbing every cell gets last: one thread, resumable checkpoints
CELL_PLUMBING = ("threads=1", "progress=false", "checkpoint.every=25", "checkpoint.keep=1", "checkpoint.resume=auto")


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
    """The YAML of an experiment file, read by the one bounded reader of every YAML file a user names
    (``dcmdp.config.read_yaml_file``: at most 1 MiB, 32 levels, 100,000 values once aliases are expanded) before
    anything recursive builds from it."""
    from dcmdp.config import read_yaml_file

    return read_yaml_file(path, ExperimentError, kind="experiment file", name=where,
                          size_hint="an experiment file is a few KiB", shape_hint=False, plain=True,
                          not_yaml="{name}: not a readable YAML file: {one_line}")[0]


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
