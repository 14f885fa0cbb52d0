"""Summaries of finished runs read back from MLflow: report.md, report.csv and report.png.

Per run and constraint ``<n>`` (found from the keys ``dual/lambda/<n>`` and ``dual/measured/<n>``):
final and mean multiplier λ, mean and final measured discrepancy D, the tolerance c (last logged
``dual/tolerance/<n>``) and the share of steps with D ≤ c; per run the final ``eval/accuracy`` (if
logged), the number of distinct steps with a training metric logged and the MLflow status. Means skip NaN values.
Runs that logged the mismatch by source (``mismatch/<n>/...``, ``dcmdp.mismatch``) also get ``mismatch.png``: per run
and constraint, the parts stacked over the steps with D̂ drawn over them.

An experiment holds the runs of every command: its training runs are reported, and the runs of ``dcmdp calibrate``
(tag ``dcmdp.kind=calibrate``) and ``dcmdp tune`` (its parent run, tag ``dcmdp.tune``, and the trials nested under it)
only when ``kinds`` asks for them (``run_kind``); report.md counts what it left out. A run named by its id is always
reported.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlparse

from dcmdp.errors import InputError, InputFileNotFoundError, InputNotADirectoryError
from dcmdp.plots import plot_runs
from dcmdp.redact import public_uri

ACCURACY_KEY = "eval/accuracy"
CSV_COLUMNS = ["run_id", "run_name", "status", "steps", "eval_accuracy_final", "constraint", "tolerance",
               "lambda_final", "lambda_mean", "measured_mean", "measured_final", "within_tolerance_frac"]


@dataclass
class ConstraintSummary:
    name: str
    tolerance: Optional[float]
    lambda_final: Optional[float]
    lambda_mean: Optional[float]
    measured_mean: Optional[float]
    measured_final: Optional[float]
    within_tolerance_frac: Optional[float]


@dataclass
class RunSummary:
    run_id: str
    run_name: str
    status: str
    steps: int
    eval_accuracy_final: Optional[float]
    constraints: list[ConstraintSummary]
    history: dict[str, list[tuple[int, float]]] = field(repr=False)


def _mean(values: list[float]) -> Optional[float]:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else None


def _final(points: list[tuple[int, float]]) -> Optional[float]:
    return points[-1][1] if points else None


# What each command's runs are called in ``run_kind``, ``--kind`` and report.md.
KINDS = ("train", "calibrate", "tune")
TUNE_TAG = "dcmdp.tune"


def run_kind(run: Any, parent_of: Any = None) -> str:
    """``train``, ``calibrate`` or ``tune`` for an MLflow run, from its tags: ``dcmdp.kind=calibrate`` (dcmdp
    calibrate), ``dcmdp.tune`` (a tune study's parent run) or a parent run (``mlflow.parentRunId``) that is a tune
    study's, looked up with ``parent_of(run_id) -> run`` (None: a parent is taken to be one); else ``train``."""
    from dcmdp.tracking import PARENT_RUN_TAG

    tags = run.data.tags
    if tags.get("dcmdp.kind") == "calibrate":
        return "calibrate"
    if TUNE_TAG in tags:
        return "tune"
    parent = tags.get(PARENT_RUN_TAG)
    if parent:
        if parent_of is None:
            return "tune"
        try:
            return "tune" if TUNE_TAG in parent_of(parent).data.tags else "train"
        except Exception:  # a parent no longer in the store: nested under something that is not a training run
            return "tune"
    return "train"


@dataclass
class Selection:
    """The runs to report, and how many of each other kind an experiment held (left out)."""

    runs: list[Any]
    left_out: dict[str, int] = field(default_factory=dict)


def _expand(client: Any, items: list[str], kinds: tuple[str, ...] = ("train",)) -> Selection:
    """Experiment names become their runs of ``kinds`` (oldest first); anything else must be a run id, reported
    whatever its kind."""
    runs, seen, left_out = [], set(), {}
    parents: dict[str, Any] = {}

    def parent_of(run_id: str) -> Any:
        if run_id not in parents:
            parents[run_id] = client.get_run(run_id)
        return parents[run_id]

    for item in items:
        exp = client.get_experiment_by_name(item)
        if exp is not None:
            found, token = [], None
            while True:
                page = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"],
                                          page_token=token)
                found += list(page)
                token = page.token
                if not token:
                    break
            parents.update((r.info.run_id, r) for r in found)
            kept = []
            for run in found:
                kind = run_kind(run, parent_of)
                if kind in kinds:
                    kept.append(run)
                elif run.info.run_id not in seen:
                    left_out[kind] = left_out.get(kind, 0) + 1
            found = kept
        else:
            try:
                found = [client.get_run(item)]
            except Exception as exc:
                raise InputError(f"{item!r} is neither an experiment name nor a run id in the store "
                                 f"{public_uri(client.tracking_uri)} (pass the store the run logged to with "
                                 f"--tracking-uri: its run.json and summary.json name it)") from exc
        for run in found:
            if run.info.run_id not in seen:
                seen.add(run.info.run_id)
                runs.append(run)
    return Selection(runs, left_out)


def existing_store(tracking_uri: Optional[str], source: str = "--tracking-uri") -> str:
    """``tracking_uri`` (default: MLflow's own resolution), checked to name a store that exists: reading from a
    sqlite file or a store folder that is not there would create an empty one and report that nothing is found.
    ``source`` names where the URI came from, for the error."""
    import mlflow

    from dcmdp.tracking import check_tracking_uri, sqlite_store_file

    uri = tracking_uri or mlflow.get_tracking_uri()
    check_tracking_uri(uri, source if tracking_uri else "MLFLOW_TRACKING_URI")
    parsed = urlparse(uri)
    path = sqlite_store_file(uri)
    if path is None and parsed.scheme in ("", "file"):
        path = Path(unquote(parsed.path) if parsed.scheme else uri)
    if path is not None and not path.exists():
        how = source if tracking_uri else "the default store (pass --tracking-uri)"
        raise InputFileNotFoundError(f"no MLflow store at {path} ({how}: {uri}); a run's local store is mlflow.db "
                                     f"in the folder that holds its output_dir (outputs/default: "
                                     f"sqlite:///outputs/mlflow.db), as its run.json names it")
    return uri


def _summarise(client: Any, run: Any) -> RunSummary:
    history: dict[str, list[tuple[int, float]]] = {}
    for key in run.data.metrics:
        # One value per step: if a step was logged twice (a resumed run), the later one counts.
        by_step = {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                    key=lambda m: (m.step, m.timestamp))}
        history[key] = sorted(by_step.items())
    names = sorted({k.split("/", 2)[2] for k in history
                    if k.startswith(("dual/lambda/", "dual/measured/")) and k.count("/") >= 2})
    constraints = []
    for name in names:
        lam = history.get(f"dual/lambda/{name}", [])
        measured = history.get(f"dual/measured/{name}", [])
        tol = history.get(f"dual/tolerance/{name}", [])
        tol_at = dict(tol)
        judged = [v <= tol_at[s] for s, v in measured if s in tol_at and not math.isnan(v)]
        constraints.append(ConstraintSummary(
            name=name, tolerance=_final(tol), lambda_final=_final(lam), lambda_mean=_mean([v for _, v in lam]),
            measured_mean=_mean([v for _, v in measured]), measured_final=_final(measured),
            within_tolerance_frac=sum(judged) / len(judged) if judged else None))
    # the evaluations (before training at step 0, after it at step N) are not steps of their own
    steps = len({s for key, points in history.items() if key != ACCURACY_KEY for s, _ in points})
    return RunSummary(run_id=run.info.run_id, run_name=run.info.run_name or "", status=run.info.status,
                      steps=steps, eval_accuracy_final=_final(history.get(ACCURACY_KEY, [])),
                      constraints=constraints, history=history)


def _fmt(x: Optional[float], pct: bool = False) -> str:
    if x is None:
        return "–"
    if pct:
        return f"{100 * x:.0f}%"
    return f"{x:.4g}"


def _markdown(summaries: list[RunSummary], tracking_uri: str, left_out: Optional[dict[str, int]] = None) -> str:
    lines = ["# dcmdp report", "", f"Tracking URI: `{tracking_uri}`", ""]
    if left_out:
        counted = ", ".join(f"{n} {kind} run{'s' if n > 1 else ''}" for kind, n in sorted(left_out.items()))
        lines += [f"Left out: {counted} of the experiment (`dcmdp report ... --kind all` reports them too).", ""]
    lines += [f"| run | run id | status | steps | final {ACCURACY_KEY} |", "|---|---|---|---:|---:|"]
    for r in summaries:
        lines.append(f"| {r.run_name} | `{r.run_id}` | {r.status} | {r.steps} | {_fmt(r.eval_accuracy_final)} |")
    lines += ["", "![λ, discrepancy and accuracy over steps](report.png)", ""]
    for r in summaries:
        lines += [f"## {r.run_name or r.run_id}", "",
                  f"Run `{r.run_id}`: {r.status}, {r.steps} steps, final {ACCURACY_KEY} {_fmt(r.eval_accuracy_final)}.",
                  ""]
        if not r.constraints:
            lines += ["No dual metrics (`dual/lambda/*`) were logged.", ""]
            continue
        lines += ["D̂ is `dual/measured/<c>`, what the dual step constrains (at the updates under `dual.measure_at: "
                  "updates`); the run's `summary.json` (`constraints`) and console summary give the same mean.", "",
                  "| constraint | final c | final λ | mean λ | mean D̂ | final D̂ | steps with D̂ ≤ c |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for c in r.constraints:
            lines.append(f"| {c.name} | {_fmt(c.tolerance)} | {_fmt(c.lambda_final)} | {_fmt(c.lambda_mean)} | "
                         f"{_fmt(c.measured_mean)} | {_fmt(c.measured_final)} | "
                         f"{_fmt(c.within_tolerance_frac, pct=True)} |")
        lines.append("")
    return "\n".join(lines)


def _csv_rows(summaries: list[RunSummary]) -> list[dict[str, Any]]:
    rows = []
    for r in summaries:
        base = {"run_id": r.run_id, "run_name": r.run_name, "status": r.status, "steps": r.steps,
                "eval_accuracy_final": r.eval_accuracy_final}
        for c in r.constraints or [None]:
            row = dict(base, constraint="")
            if c is not None:
                row.update(constraint=c.name, tolerance=c.tolerance, lambda_final=c.lambda_final,
                           lambda_mean=c.lambda_mean, measured_mean=c.measured_mean, measured_final=c.measured_final,
                           within_tolerance_frac=c.within_tolerance_frac)
            rows.append({k: ("" if row.get(k) is None else row[k]) for k in CSV_COLUMNS})
    return rows


MISMATCH_NOTE = ("\n![the mismatch by source: engine floor, staleness and drift stacked, D̂ at the updates over them, "
                 "and MoE routing flips](mismatch.png)\n\nmismatch.png: per run and constraint, the engines' floor "
                 "(π_old vs μ on the rows the current weights sampled), the part stale rows add and the drift of the "
                 "updates (π_θ vs π_old) stacked, and D̂ at the updates (π_θ vs μ) drawn over them; a part not "
                 "measured at a step (NaN) is drawn as 0 there. docs/metrics.md says how each is measured.\n")


def plot_mismatch(series: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> Optional[Path]:
    """One stacked figure of the ``mismatch/`` metrics (``dcmdp.mismatch``): a panel per run and constraint with
    engine, staleness and drift stacked over the steps and the total (D̂ at the updates) as a line, and a panel per
    run of its MoE routing flips (router's own vs replayed); None, and no file, when no run logged them."""
    from matplotlib.figure import Figure

    from constraints.sources import PARTS
    from dcmdp.mismatch import SECTION
    from dcmdp.plots import path_ready

    panels: list[tuple[str, str, Optional[str]]] = []  # (run label, history key prefix, constraint or None)
    for label, history in series.items():
        names = sorted({k.split("/")[1] for k in history if k.startswith(f"{SECTION}/") and k.endswith("/total")})
        panels += [(label, f"{SECTION}/{n}", n) for n in names]
        if any(k.startswith(f"{SECTION}/routing/") for k in history):
            panels.append((label, f"{SECTION}/routing", None))
    if not panels:
        return None
    fig = Figure(figsize=(7.5, 2.8 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (label, prefix, name) in zip(axes, panels):
        history = series[label]
        if name is None:
            for part, style in (("router", "-"), ("replayed", "--")):
                points = sorted(history.get(f"{prefix}/{part}", []))
                if points:
                    ax.plot(*zip(*points), ls=style, label=f"{part} vs engine")
            ax.set_title(f"{label}: MoE routing flips (share of token x layer pairs)", fontsize=9)
        else:
            steps = sorted({s for part in (*PARTS, "total") for s, _ in history.get(f"{prefix}/{part}", [])})
            by_part = {part: dict(history.get(f"{prefix}/{part}", [])) for part in PARTS}
            stacked = [[v if math.isfinite(v := by_part[part].get(s, math.nan)) else 0.0 for s in steps]
                       for part in PARTS]
            ax.stackplot(steps, stacked, labels=PARTS, alpha=0.75)
            total = sorted(history.get(f"{prefix}/total", []))
            ax.plot(*zip(*total), color="k", lw=1.2, label="D̂ at the updates (total)")
            ax.set_title(f"{label}: {name} by source", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7, loc="upper right")
    fig.savefig(path_ready(path), dpi=110)
    return path


def write_report(run_ids_or_experiment: list[str], out_dir: str | Path, tracking_uri: Optional[str] = None,
                 kinds: tuple[str, ...] = ("train",)) -> Path:
    """Write report.md, report.csv and report.png (and mismatch.png) for the given runs into out_dir; return
    report.md.

    Each entry is an MLflow experiment name (expanded to its runs of ``kinds``, see ``run_kind``) or a run id.
    tracking_uri defaults to MLflow's own resolution ($MLFLOW_TRACKING_URI, else its default store).
    """
    from mlflow.tracking import MlflowClient

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputNotADirectoryError(f"--out {out_dir} is a file: the report is a folder (report.md, report.csv, "
                                      f"report.png); give a folder path")
    client = MlflowClient(tracking_uri=existing_store(tracking_uri))
    selection = _expand(client, list(run_ids_or_experiment), kinds)
    if not selection.runs:
        others = f" (only {', '.join(f'{n} {k}' for k, n in sorted(selection.left_out.items()))} runs: --kind all " \
                 f"reports them)" if selection.left_out else ""
        raise InputError(f"no {'/'.join(kinds)} runs found for {list(run_ids_or_experiment)}{others}")
    summaries = [_summarise(client, run) for run in selection.runs]
    out_dir.mkdir(parents=True, exist_ok=True)

    md_path = out_dir / "report.md"
    md_path.write_text(_markdown(summaries, public_uri(client.tracking_uri), selection.left_out) + "\n")
    with open(out_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(_csv_rows(summaries))

    mismatch = plot_mismatch({f"{r.run_name} ({r.run_id[:8]})": r.history for r in summaries}, out_dir / "mismatch.png")
    if mismatch is not None:
        md_path.write_text(md_path.read_text() + MISMATCH_NOTE)
    names = sorted({c.name for r in summaries for c in r.constraints})
    keys = [f"dual/lambda/{n}" for n in names] + [f"dual/measured/{n}" for n in names] + [ACCURACY_KEY]
    labels = {r.run_id: f"{r.run_name} ({r.run_id[:8]})" for r in summaries}
    plot_runs({labels[r.run_id]: r.history for r in summaries}, keys, out_dir / "report.png",
              overlays={f"dual/measured/{n}": f"dual/tolerance/{n}" for n in names},
              ncols=len(names) if len(names) > 1 else 3)  # rows: λ | D | accuracy
    return md_path
