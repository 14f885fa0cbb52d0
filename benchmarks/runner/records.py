"""A run as the page sees it (``Run``): read from its finished folder, written to and read back from the page's
record (``<prefix>.json.gz``), and the collapse rule."""

from __future__ import annotations

import csv
import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmarks._page import machine_kind, rel
from benchmarks.runner.experiment import Experiment

DIAGNOSTICS = ("policy/approx_kl", "policy/entropy", "clip/frac", "routing/mismatch", "penalty/loss",
               "is/weight_max_raw", "async/bound", "async/staleness_mean", "time/trainer_idle_frac",
               "time/rollout_idle_frac")
# what a scenario changes within a run, drawn under lambda: the first of these that varies over the run
SCHEDULE_KEYS = {"rollout/precision_bits": "rollout bits", "task/digits": "training digits",
                 "async/staleness_forced": "forced staleness", "async/bound": "staleness bound",
                 "response/length_mean": "response length"}

# a finished cell's machine kind (a run resumed on another kind lists both)
MACHINE_FILE = "machine.txt"


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
               d.get("measured", []), d.get("tolerance", []), d.get("lambda", []), d.get("abs_prob_diff", []),
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
