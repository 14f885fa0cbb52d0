"""What ``dcmdp tune`` writes of a study: the table that says why each trial was (not) selected, the rows of
results.csv, the figure (tune.png) and the winner's settings (best.yaml)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import optuna
from omegaconf import OmegaConf

from dcmdp.config import RunConfig, public_config
from dcmdp.tune_file import SelectRule, apply_settings, label
from dcmdp.tune_select import Trial, _fmt, clause


def _fmt_settings(settings: dict[str, Any]) -> str:
    return " ".join(f"{label(k)}={v:g}" if isinstance(v, float) else f"{label(k)}={v}" for k, v in settings.items())


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
