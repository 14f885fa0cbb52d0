"""The profile's page: ``<prefix>.md`` with its tables, ``<prefix>.csv``, the record ``<prefix>.json.gz`` and the
figures."""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks._page import machine_kind, md_table, rel
from benchmarks.runner.experiment import Experiment, page_compare
from benchmarks.runner.figures import front_figure, lambda_cap, plot
from benchmarks.runner.records import Run, machines_trained, run_record, write_record
from benchmarks.runner.statistics import (aggregate, bar_across, bar_across_lines, bar_rows, bar_table, compare_rows,
                                          compare_table, compute_rows, is_dcmdp, met_on_line, nanmean, placebo_rows,
                                          placebo_table, table, throughput_lines, throughput_rows, welch, welch_table)
from benchmarks.runner.workers import SHARED_WALL


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
                        r.collapse_reason, nanmean(r.abs_prob_diff), nanmean(r.kl_k3), r.lambdas[-1],
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
    plots = figure_lines(exp.name, profile_name, prefix, [p.name for p in pngs])
    prefix.with_suffix(".md").write_text("\n".join(header + lines + bar + test + diag + [""] + plots) + "\n")
    return lines + [""] + (compare_table(compared) + ([""] + bar_table(barred) if barred else []) if compared
                           else welch_table(rows))


# ------------------------------------------------------------------------------------------- main


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


def figure_lines(experiment: str, profile: str, prefix: Path, names: list[str]) -> list[str]:
    """The page's figures: the experiment's headline figure where this page has it (tracked), and the figures the
    record redraws (not tracked), named with the command that draws them."""
    headline = prefix.with_name(prefix.name + "_headline.png")
    return ([f"![{headline.stem}]({headline.name})", ""] if headline.exists() else []) + [
        f"Figures, drawn from this page's record (not tracked): `.venv/bin/python benchmarks/run.py {experiment} "
        f"--profile {profile} --figures` draws " + ", ".join(f"`{n}`" for n in names) + "."]
