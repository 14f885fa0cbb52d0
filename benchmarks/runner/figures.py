"""The page's figures, drawn from its runs and cells (a page's record holds both, so ``redraw`` draws them again
without the run folders)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmarks._page import rel, save_figure
from benchmarks.runner.experiment import Experiment, ExperimentError
from benchmarks.runner.records import SCHEDULE_KEYS, Run, read_record, record_path, run_from_record
from benchmarks.runner.statistics import is_dcmdp, varies


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
        ax.set_xticks(range(len(methods)), [exp.labels.get(m, m) for m in methods], rotation=25, ha="right", fontsize=8)
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
    if dual and any(r.lambdas for r in runs):  # a record from before the per-step series has none to draw
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
        key = next((k for k in SCHEDULE_KEYS if any(varies(r.schedule.get(k, ())) for r in here)), None)
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


def redraw(exp: Experiment, prefix: Path) -> list[Path]:
    """Draw the figures of the page at ``prefix`` again from its record alone (``<prefix>.json.gz``, or a plain
    ``<prefix>.json``), beside it: the figures are not tracked, the record is."""
    record = read_record(prefix)
    if not all("level" in d for d in record["runs"]):
        raise ExperimentError(f"{rel(record_path(prefix))}: the record is older than the runs' levels, which the figures "
                              "are drawn by; the page names the commit that holds its figures")
    runs = [run_from_record(d, exp.late_from) for d in record["runs"]]
    paths = plot(exp, runs, record["cells"], prefix)
    if record.get("throughput"):
        paths.append(front_figure(exp, record["throughput"], prefix.with_name(prefix.name + "_front.png")))
    return paths
