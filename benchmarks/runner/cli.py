"""Run one experiment of ``benchmarks/experiments/``: a matrix of training runs (level x method x N x seed).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py EXPERIMENT --profile PROFILE --workers 2

EXPERIMENT is a name under ``benchmarks/experiments/`` (``stress``, ``stability``) or a path to a YAML file. Every
run is the experiment's base config + its ``overrides`` + the profile's + the level's + the method's +
``algo.minibatches=N seed=S``. The missing cells train in long-lived worker processes (one torch thread each);
a cell whose ``summary.json`` and ``history.json`` exist is skipped and a killed run resumes from its last
checkpoint, so a folder of finished cells copied in renders without training; a run the page's record holds is not
trained again (``--retrain`` does). The page
``benchmarks/results/<experiment>/<experiment>_<profile>.md`` (with .csv, .json.gz and figures) is generated from the
run folders and the page's record: its .json.gz (gzipped JSON; a plain .json is read too) holds every run (accuracy curve, λ and
discrepancy per step, diagnostics, the overrides it was trained with), and a run the folder lacks is read from there
while the experiment file still gives it the same overrides. The folders are scratch; the committed record is the result.
The figures are not tracked: ``--figures`` draws them again from the record alone; the experiment's headline figure
(``--headline``, ``<page>_headline.png``) is.

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
import dataclasses
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks._page import command, rel
from benchmarks.runner.experiment import EXPERIMENTS, Experiment, ExperimentError, load_experiment
from benchmarks.runner.figures import accuracy_figure, redraw
from benchmarks.runner.page import page
from benchmarks.runner.records import load_run, read_record, recorded_runs
from benchmarks.runner.workers import (SHARED_WALL, finished, mlflow_template, prepare, serve, train_missing,
                                       warm_cold_starts)

ROOT = Path(__file__).resolve().parents[2]


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


def results_prefix(experiment: str, profile: str) -> Path:
    """Where a profile's page goes by default: the experiment's folder of ``benchmarks/results/``, which holds its pages,
    their records and its headline figure."""
    return ROOT / "benchmarks" / "results" / experiment / f"{experiment}_{profile}"


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
                    help="results prefix (default: benchmarks/results/<experiment>/<experiment>_<profile>)")
    ap.add_argument("--headline", default=None, metavar="M1,M2,...",
                    help="render <results>_headline.png (one panel, these methods) from the page's JSON, and exit")
    ap.add_argument("--figures", action="store_true",
                    help="draw the page's figures again from its record (<results>_*.png; they are not tracked), "
                         "and exit")
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
    results = Path(args.results) if args.results else results_prefix(exp.name, args.profile)
    try:
        if args.figures:
            for path in redraw(exp, results):
                print(rel(path))
            return None
        if args.headline:
            cells = read_record(results)["cells"]
            print(accuracy_figure(exp, cells, args.headline.split(","), [max(c["N"] for c in cells)],
                                  results.with_name(results.name + "_headline.png")))
            return None
        return run(exp, args.profile, bench.resolve(), results.resolve(), args.workers, command("run.py", argv),
                   train=not args.no_train, levels=args.levels.split(",") if args.levels else None,
                   methods=args.methods.split(",") if args.methods else None, retrain=args.retrain)
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
