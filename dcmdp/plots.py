"""Plots of the dual controller and of runs side by side (matplotlib, Agg, no display).

Figures are built with ``matplotlib.figure.Figure`` instead of pyplot: no global figure state and
no backend switch, so plotting from a training process or a thread cannot open a window or leak.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

Series = list[tuple[int, float]]


def _series(history: list[dict[str, float]], steps: list[int], key: str) -> tuple[list[int], list[float]]:
    pairs = [(s, float(h[key])) for s, h in zip(steps, history) if key in h]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _spans(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive steps as (first, last), so long violations are one shaded band."""
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _draw_tolerance(ax, steps: list[int], values: list[float], color: str = "k") -> None:
    """A constant tolerance is a horizontal line; a tolerance that changed is drawn as steps."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    if max(finite) == min(finite):
        ax.axhline(finite[0], color=color, ls="--", lw=1.2, label=f"tolerance c = {finite[0]:.4g}")
    else:
        ax.plot(steps, values, color=color, ls="--", lw=1.2, drawstyle="steps-post", label="tolerance c")


def plot_dual(history: list[dict[str, float]], names: list[str], path: str | Path, *,
              lambda_init: Optional[dict[str, float]] = None, lambda_max: Optional[dict[str, float]] = None) -> Path:
    """One row per constraint: lambda over steps | measured discrepancy D with its tolerance c.

    history holds one metrics dict per step with keys ``dual/lambda/<n>``, ``dual/measured/<n>``,
    ``dual/tolerance/<n>``; the x value is the dict's ``step`` entry if present, else its index.
    Steps where D > c are shaded on the discrepancy panel. ``lambda_init`` (per name) is drawn at step 0, where
    the run starts, and a finite ``lambda_max`` as a dotted line: the cap the projection holds lambda under.
    """
    path = Path(path)
    dual_figure(history, names, lambda_init=lambda_init, lambda_max=lambda_max).savefig(path_ready(path), dpi=110)
    return path


def path_ready(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def dual_figure(history: list[dict[str, float]], names: list[str], *, lambda_init: Optional[dict[str, float]] = None,
                lambda_max: Optional[dict[str, float]] = None) -> Figure:
    """The figure of ``plot_dual``."""
    lambda_init, lambda_max = lambda_init or {}, lambda_max or {}
    steps = [int(h.get("step", i)) for i, h in enumerate(history)]
    n = max(len(names), 1)
    fig = Figure(figsize=(11, 2.6 * n + 0.6), layout="constrained")
    axes = fig.subplots(n, 2, squeeze=False, sharex=True)
    for row, name in enumerate(names):
        ax_lam, ax_d = axes[row]
        lam_steps, lam_vals = _series(history, steps, f"dual/lambda/{name}")
        if name in lambda_init and (not lam_steps or lam_steps[0] > 0):  # logged after each step's dual update
            lam_steps, lam_vals = [0, *lam_steps], [lambda_init[name], *lam_vals]
        ax_lam.plot(lam_steps, lam_vals, color="C0", lw=1.5,
                    label="λ (step 0: λ₀)" if name in lambda_init else "λ")
        if math.isfinite(lambda_max.get(name, math.inf)):
            ax_lam.axhline(lambda_max[name], color="C3", ls=":", lw=1.2, label=f"cap λ_max = {lambda_max[name]:g}")
        ax_lam.legend(loc="best", fontsize=8, frameon=False)
        ax_lam.set_ylabel(f"λ  ({name})")
        d_steps, d_vals = _series(history, steps, f"dual/measured/{name}")
        ax_d.plot(d_steps, d_vals, color="C1", lw=1.5, label="measured D")
        c_steps, c_vals = _series(history, steps, f"dual/tolerance/{name}")
        _draw_tolerance(ax_d, c_steps, c_vals)
        tol = dict(zip(c_steps, c_vals))
        over = [s for s, v in zip(d_steps, d_vals) if s in tol and v > tol[s]]
        for lo, hi in _spans(over):
            ax_d.axvspan(lo - 0.5, hi + 0.5, color="C3", alpha=0.12, lw=0)
        ax_d.set_ylabel(f"D  ({name})")
        ax_d.legend(loc="upper right", fontsize=8, frameon=False)
        for ax in (ax_lam, ax_d):
            ax.grid(alpha=0.3)
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    axes[0, 0].set_title("multiplier λ")
    axes[0, 1].set_title("discrepancy D vs tolerance c (shaded: D > c)")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 1].set_xlabel("step")
    return fig


def plot_runs(series: dict[str, dict[str, Series]], keys: list[str], path: str | Path, *,
              overlays: Optional[dict[str, str]] = None, ncols: int = 3) -> Path:
    """Compare runs: one panel per metric key, every run overlaid in its own colour.

    series maps a run label to {metric key: [(step, value), ...]}. ``overlays`` maps a panel's key
    to a second key drawn dashed in the same run colour (e.g. a tolerance under a discrepancy).
    A key no run logged gets an empty panel that says so.
    """
    path = Path(path)
    runs_figure(series, keys, overlays=overlays, ncols=ncols).savefig(path_ready(path), dpi=110)
    return path


# A series with fewer points than this is drawn as points only: a line between two evaluations 650 steps apart
# would show a trend nobody measured.
FEW_POINTS = 12


def runs_figure(series: dict[str, dict[str, Series]], keys: list[str], *, overlays: Optional[dict[str, str]] = None,
                ncols: int = 3) -> Figure:
    """The figure of ``plot_runs``."""
    overlays = overlays or {}
    ncols = max(1, min(ncols, len(keys)))
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig = Figure(figsize=(4.6 * ncols, 3.2 * nrows + 0.8), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(series)}
    for i, key in enumerate(keys):
        ax = axes[i // ncols, i % ncols]
        drawn = False
        for label, metrics in series.items():
            if metrics.get(key):
                s, v = zip(*sorted(metrics[key]))
                few = len(s) < FEW_POINTS  # e.g. eval/accuracy before and after RL (eval_every: 0)
                ax.plot(s, v, color=colors[label], lw=1.5, label=label, marker="o" if few else None, ms=5 if few else 3,
                        ls="none" if few else "-")
                drawn = True
            extra = overlays.get(key)
            if extra and metrics.get(extra):
                s, v = zip(*sorted(metrics[extra]))
                ax.plot(s, v, color=colors[label], lw=1.0, ls="--", drawstyle="steps-post")
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
        title = key + (f"\n(dashed: {overlays[key]})" if key in overlays else "")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    for j in range(len(keys), nrows * ncols):
        axes[j // ncols, j % ncols].set_visible(False)
    if series:
        handles = [Line2D([], [], color=colors[label], lw=2) for label in series]
        fig.legend(handles, list(series), loc="outside lower center", ncols=min(len(series), 4), fontsize=8,
                   frameon=False)
    return fig
