"""The ``dcmdp`` command: train, check, calibrate, tune, eval, report, ui, sync."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from dcmdp.config import ConfigError, load_config, never_reached
from dcmdp.cpu import machine, passive_wait_policy
from dcmdp.errors import InputError
from dcmdp.redact import attach_written, filter_log_handlers, written_field


def _split_config_args(args: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """``[CONFIG] [key=value ...]``: the first argument is a YAML path unless it is an override; a YAML file that
    exists wins over an override of the same spelling (``my=cfg.yaml``), since no config key ends in ``.yaml``."""
    if args and ("=" not in args[0] or (args[0].endswith((".yaml", ".yml")) and os.path.isfile(args[0]))):
        return args[0], list(args[1:])
    return None, list(args)


def _at_least(low: float, kind: type = float):
    """An argparse type: an integer (``kind=int``) or a finite number >= ``low``, so a bad value exits 2 with the
    option's name before torch loads (nan and inf are refused: ``nan >= 0`` is false only by accident)."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} >= {low:g}, got {text!r}") from None
        if not math.isfinite(value) or value < low:
            finite = "" if kind is int else "a finite number "
            raise argparse.ArgumentTypeError(f"must be {finite}>= {low:g}, got {text if kind is float else value}")
        return value
    return parse


def _non_empty(text: str) -> str:
    """An argparse type: a path that is not blank (an empty one would write into, or read, the working directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; give a value (a path, or a URI for --tracking-uri)")
    return text


def default_run_name(path: Optional[str], output_dir: str) -> str:
    """The MLflow run name when tracking.run_name is unset: the config file's stem and the output folder,
    ``default/outputs-default`` (``defaults`` without a config file)."""
    stem = Path(path).stem if path else "defaults"
    return f"{stem}/{str(Path(output_dir)).strip('/').replace('/', '-') or 'root'}"


def _load(ns: argparse.Namespace, kind: str = ""):
    """The config of ``ns.args``, with the default MLflow run name (``/kind`` appended for a run that is not training)."""
    path, overrides = _split_config_args(ns.args)
    cfg = load_config(path, overrides)
    if not cfg.tracking.run_name:
        suffix = f"/{kind}" if kind else ""
        cfg.tracking.run_name = default_run_name(path, cfg.output_dir) + suffix
        if (folder := written_field(cfg, "output_dir")) is not None:
            # an output folder read from the environment: the records name the run after the interpolation
            attach_written(cfg, {"tracking.run_name": default_run_name(path, folder) + suffix})
    return cfg


def _cmd_train(ns: argparse.Namespace) -> int:
    from dcmdp.check import exit_code, find_problems, report

    path, overrides = _split_config_args(ns.args)
    problems = find_problems(path, overrides, run_folder=False, text_first=True)  # before the trainer's imports
    if problems:
        print("\n".join(report(problems, path or "the config")), file=sys.stderr)
        return exit_code(problems)
    cfg = _load(ns)
    for line in never_reached(cfg):
        logging.getLogger("dcmdp").warning("%s", line)
    from dcmdp.device import local_rank, resolve_device

    resolve_device(cfg.device, local_rank())  # device=cuda without CUDA: exit 2 before the model is built
    from dcmdp.loop import finished_run, train  # after the config is checked: a typo is reported before torch imports

    done = finished_run(cfg)
    if done is not None:  # resume=auto on a finished run: nothing to train, and no reason to refuse
        print(done)
        return 0
    summary = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print("\n".join(summary.lines()))
    return 0


def _cmd_check(ns: argparse.Namespace) -> int:
    """Exit code 2 when any problem is found (each printed with its key and fix), 0 otherwise."""
    from dcmdp.check import find_problems, folder_line, report

    t0 = time.perf_counter()
    path, overrides = _split_config_args(ns.args)
    problems = find_problems(path, overrides)
    what = path or "the config"
    elsewhere = []
    if ns.rehearse:  # a rehearsal runs before the launch's machine exists: its files and packages are checked there
        from dcmdp.check import not_here

        problems, elsewhere = not_here(path, overrides, problems)
        for p in elsewhere:
            print(f"dcmdp: not here, to check on the launch's machine: {p.message}", file=sys.stderr)
    if problems:
        print("\n".join(report(problems, what, listed=True)), file=sys.stderr)
        return 2
    from dcmdp.check import memory_plan

    lines, unfit = memory_plan(path, overrides, ns.gpus, ns.gpu_memory)
    print("\n".join(lines))
    if ns.rehearse and lines:
        from dcmdp.check import rehearsal

        print("\n".join(rehearsal(path, overrides, ns.gpus, ns.gpu_memory)), flush=True)
    if unfit is not None:
        print(unfit.line(), file=sys.stderr)
        return 2
    for line in never_reached(load_config(path, overrides, check=False)):
        print(f"dcmdp: warning: {line}", file=sys.stderr)
    folder = folder_line(path, overrides)
    print(f"{what}: no problem found (config and tolerances, task files and split, reward, tokenizer and model, "
          f"engine, device, output folder, tracking) in {time.perf_counter() - t0:.1f} s"
          + (f"; {folder}" if folder else "")
          + (f"; not here, so not checked: {', '.join(p.key for p in elsewhere)}" if elsewhere else ""))
    return 0


def _cmd_calibrate(ns: argparse.Namespace) -> int:
    cfg = _load(ns, "calibrate")
    from constraints.measures import _NOT_A_CONSTRAINT, MEASURES
    from dcmdp.calibrate import calibrate
    from dcmdp.config import config_error, nearest, require
    measures = [m.strip() for m in ns.measures.split(",") if m.strip()] if ns.measures else []
    for m in measures:  # checked before the measuring, which takes minutes on a real model
        require(m in MEASURES, "--measures", f"unknown {m!r}{nearest(m, list(MEASURES))}")
        if m in _NOT_A_CONSTRAINT:
            raise config_error("--measures", f"{m!r} cannot be a constraint: {_NOT_A_CONSTRAINT[m]}")
    require(not ns.out or (not Path(ns.out).is_dir() and Path(ns.out).resolve().parent.is_dir()), "--out",
            f"{ns.out} is a folder, or its folder does not exist; name a file in an existing folder for the snippet")
    result = calibrate(cfg, batches=ns.batches, slack=ns.slack, measures=measures)
    print(result.table())
    snippet = result.snippet()
    if ns.out:
        Path(ns.out).write_text(snippet)
        print(f"\nconstraints with the proposed c written to {ns.out} (use it as a config file or paste it)")
    else:
        print("\n" + snippet)
    return 0


def _cmd_tune(ns: argparse.Namespace) -> int:
    from dcmdp.tune import run_tune_file

    trials, best = run_tune_file(ns.tune_file, ns.overrides, workers=ns.workers)
    return 0 if best is not None else 3


def _cmd_eval(ns: argparse.Namespace) -> int:
    if ns.checkpoint != "auto" and not Path(ns.checkpoint).exists():
        raise ConfigError(f"--checkpoint {ns.checkpoint} does not exist; name a checkpoint folder "
                          f"(<output_dir>/checkpoints/step_N), or auto for the newest one in output_dir")
    cfg = _load(ns)
    from dcmdp.evaluation import evaluate_checkpoint
    print(evaluate_checkpoint(cfg, ns.checkpoint).line())
    return 0


def _cmd_report(ns: argparse.Namespace) -> int:
    from dcmdp.report import KINDS, write_report

    out = write_report(ns.runs, ns.out, tracking_uri=ns.tracking_uri, kinds=KINDS if ns.kind == "all" else (ns.kind,))
    print(f"report written to {out}")
    return 0


def _cmd_ui(ns: argparse.Namespace) -> int:
    """Print the link to the experiment's runs as charts, training layout, and become ``mlflow ui`` on the config's
    local store (a tracking server serves its own UI: the link alone)."""
    from dcmdp.report import existing_store
    from dcmdp.tracking import UI_DEFAULT, experiment_link, resolve_tracking_uri, sqlite_store_file, ui_base

    path, overrides = _split_config_args(ns.args)
    cfg = load_config(path, overrides)
    uri = ns.tracking_uri or resolve_tracking_uri(cfg.tracking, cfg.output_dir)
    existing_store(uri, "--tracking-uri" if ns.tracking_uri else f"the store of output_dir {cfg.output_dir}")
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(tracking_uri=uri).get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        raise FileNotFoundError(f"the store {uri} holds no experiment {cfg.tracking.experiment!r} yet: train first, "
                                f"or name the experiment with tracking.experiment=NAME")
    local = sqlite_store_file(uri) is not None
    base = ui_base(uri, f"http://{ns.host}:{ns.port}" if local else UI_DEFAULT)
    print(f"MLflow: lambda, its cap, D-hat and c of every run of experiment {exp.name!r} side by side (section 0_dual "
          f"first) at {experiment_link(base, exp.experiment_id)}", flush=True)
    if not local:
        return 0
    mlflow = str(Path(sys.executable).parent / "mlflow")
    os.execv(mlflow, [mlflow, "ui", "--backend-store-uri", uri, "--host", ns.host, "--port", str(ns.port)])


def _cmd_sync(ns: argparse.Namespace) -> int:
    """Exit code 0 only when nothing is left unsent; otherwise 1, with one line per buffer file that remains; 2 for a
    buffer folder that is missing or a file (a mistyped argument, not a failed send)."""
    from dcmdp.tracking import check_tracking_uri, sync_report

    if not Path(ns.buffer_dir).is_dir():
        state = "is a file, not a folder" if Path(ns.buffer_dir).exists() else "does not exist"
        raise ConfigError(f"tracking buffer folder {ns.buffer_dir} {state} (the folder is named in the warning "
                          f"printed when buffering started; default <output_dir>/tracking_buffer)")
    if ns.tracking_uri:
        check_tracking_uri(ns.tracking_uri, "--tracking-uri")
    report = sync_report(ns.buffer_dir, tracking_uri=ns.tracking_uri)
    print(f"sent {report.sent} buffered metric values")
    if report.remaining:
        print(f"dcmdp: {len(report.remaining)} buffer file(s) in {ns.buffer_dir} still hold records that were not "
              f"sent:", file=sys.stderr)
        for line in report.remaining:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcmdp", description="RL for LLMs under a training-inference discrepancy "
                                "constraint (Lagrangian dual control of lambda).")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a config: dcmdp train [CONFIG.yaml] [key=value ...]")
    t.add_argument("args", nargs="*", help="a YAML config file and/or dotlist overrides (algo.minibatches=4)")
    t.set_defaults(func=_cmd_train)

    k = sub.add_parser("check", help="find every problem of a config at once (keys, values, tolerances, task files, "
                       "tokenizer, model directory, device, output folder), each with its key and fix; exit code 2 "
                       "if any: dcmdp check [CONFIG.yaml] [key=value ...]")
    k.add_argument("args", nargs="*", help="a YAML config file and/or dotlist overrides, as for train")
    k.add_argument("--gpus", type=_at_least(1, int), default=1, help="GPUs of the memory plan (> 1: torchrun, one "
                   "rank per GPU; default 1)")
    k.add_argument("--gpu-memory", type=_at_least(1), default=None, metavar="GiB", help="memory of each GPU in GiB "
                   "(default: the detected GPU's; without one the plan is shown for 80 GiB and refuses nothing)")
    k.add_argument("--rehearse", action="store_true", help="also run one training step on fake tensors at the "
                   "config's shapes and world (dcmdp.rehearse): its traced peak by phase and category beside the "
                   "plan's, the largest tensors at the peak, a roofline time estimate")
    k.set_defaults(func=_cmd_check)

    c = sub.add_parser("calibrate", help="measure the discrepancy floor with identical weights and propose c: "
                       "dcmdp calibrate [CONFIG.yaml] [key=value ...]")
    c.add_argument("args", nargs="*", help="a YAML config file and/or dotlist overrides")
    c.add_argument("--batches", type=_at_least(1, int), default=8, help="rollout batches to measure (default: 8)")
    c.add_argument("--slack", type=_at_least(0.0), default=0.25, help="c = floor x (1 + slack) (default: 0.25)")
    c.add_argument("--measures", default="", help="comma-separated measures for the snippet (default: the "
                   "config's dual.constraints)")
    c.add_argument("--out", type=_non_empty, default=None, help="write the YAML snippet here (default: print it)")
    c.set_defaults(func=_cmd_calibrate)

    u = sub.add_parser("tune", help="sweep dual settings in an Optuna study (grid, TPE or GP; pruning) as nested "
                       "MLflow runs and select by held-out accuracy within tolerance: dcmdp tune TUNE.yaml "
                       "[key=value ...] (exit code 3: no trial met the selection rule)")
    u.add_argument("tune_file", help="tune file: base, overrides, space, sampler, trials, study, storage, select, "
                   "prune, workers, output_dir (see dcmdp/tune.py)")
    u.add_argument("overrides", nargs="*", help="dotlist overrides of the base run config, after the tune file's")
    u.add_argument("--workers", type=_at_least(1, int), default=None, help="trials at once (default: the tune file's workers)")
    u.set_defaults(func=_cmd_tune)

    e = sub.add_parser("eval", help="held-out accuracy of a checkpoint: dcmdp eval [CONFIG.yaml] [key=value ...] "
                       "--checkpoint PATH|auto")
    e.add_argument("args", nargs="*", help="the run's YAML config and/or dotlist overrides (output_dir=... for auto)")
    e.add_argument("--checkpoint", type=_non_empty, default="auto", help="a checkpoint directory, or auto: the newest valid one in "
                   "<output_dir>/checkpoints (default: auto)")
    e.set_defaults(func=_cmd_eval)

    r = sub.add_parser("report", help="compare MLflow runs: tables + plots of lambda, discrepancy, accuracy")
    r.add_argument("runs", nargs="+", help="run ids or an experiment name")
    r.add_argument("--out", type=_non_empty, default="report", help="output folder (default: ./report)")
    r.add_argument("--tracking-uri", type=_non_empty, default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    r.add_argument("--kind", choices=("train", "calibrate", "tune", "all"), default="train",
                   help="which runs of an experiment to report: training runs (default), dcmdp calibrate's, dcmdp "
                        "tune's (study and trials), or all; a run named by its id is always reported")
    r.set_defaults(func=_cmd_report)

    w = sub.add_parser("ui", help="MLflow's UI on the store a config's runs log to, opening on every run of its "
                       "experiment as charts, lambda first: dcmdp ui [CONFIG.yaml] [key=value ...]")
    w.add_argument("args", nargs="*", help="a YAML config file and/or dotlist overrides: its output_dir and tracking "
                   "settings name the store (default: outputs/mlflow.db)")
    w.add_argument("--tracking-uri", type=_non_empty, default=None, help="the store instead (default: the config's)")
    w.add_argument("--host", default="127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    w.add_argument("--port", type=_at_least(1, int), default=5000, help="port to serve on (default: 5000)")
    w.set_defaults(func=_cmd_ui)

    y = sub.add_parser("sync", help="send metrics buffered while the tracking server was unreachable")
    y.add_argument("buffer_dir", help="the run's buffer folder (printed in the warning when buffering started)")
    y.add_argument("--tracking-uri", type=_non_empty, default=None, help="MLflow tracking URI (default: the buffered run's)")
    y.set_defaults(func=_cmd_sync)
    return p


# The positional list of each command that key=value overrides join wherever they stand on the command line.
_OVERRIDE_DEST = {"train": "args", "check": "args", "calibrate": "args", "eval": "args", "tune": "overrides",
                  "ui": "args"}


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse with ``key=value`` overrides accepted anywhere, also after an option (``--batches 4 steps=3``):
    argparse stops a positional list at the first option, so what it leaves over joins the command's overrides."""
    ns, extra = parser.parse_known_args(argv)
    dest = _OVERRIDE_DEST.get(getattr(ns, "command", None))
    unknown = [a for a in extra if dest is None or a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        setattr(ns, dest, [*getattr(ns, dest), *extra])
    return ns


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(build_parser(), argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("urllib3", "alembic", "mlflow.store", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    filter_log_handlers()  # a library's log line may repeat a URI's credentials
    if not ns.verbose:
        # it logs every failed query with its traceback (a full disk: one per call) before raising the error the
        # tracker reports in one line, naming the store and where the metrics are buffered
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    # before a command imports torch and its OpenMP runtime. It changes only how idle threads wait, nothing the user
    # decides on, so it is no line before every command (-v shows it)
    waiting = passive_wait_policy(machine()[1])
    if waiting:
        logging.getLogger("dcmdp").debug("%s", waiting)
    try:
        return ns.func(ns)
    except ConfigError as exc:
        print(f"dcmdp: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        code = _exit_code(exc)
        if code is None:
            raise
        print(f"dcmdp: training stopped: {exc}" if code == 4 else f"dcmdp: error: {exc}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        # the training loop turns SIGINT into a checkpoint and a clean stop; before it (cold start, setup) there is
        # nothing to save, and a traceback would only hide this line
        print(f"dcmdp: interrupted (SIGINT) during dcmdp {ns.command}: stopped; finished checkpoints and cold-start "
              f"cache entries are kept", file=sys.stderr)
        return 130


def _exit_code(exc: Exception) -> Optional[int]:
    """2 for bad input the user gave (``InputError``: a file, path or folder named that is missing, malformed or
    holds what the run must not touch), 4 for the non-finite guard's stop, 1 for a failure at run time (OSError
    such as a full disk, another ValueError, CheckpointError such as a folder locked by a live run), None for a
    bug. The classes are looked up only in modules already imported (an exception cannot come from one that is
    not), so reporting a config typo does not wait for torch to import."""
    guards, checkpoint = sys.modules.get("trainers.guards"), sys.modules.get("dcmdp.checkpoint")
    if isinstance(exc, InputError):
        return 2
    if guards is not None and isinstance(exc, guards.TooManyBadStepsError):
        return 4
    if isinstance(exc, (OSError, ValueError)) or (checkpoint is not None and isinstance(exc, checkpoint.CheckpointError)):
        return 1
    return None


def entry() -> None:
    """The ``dcmdp`` command and ``python -m dcmdp.cli``: under ``torchrun`` (WORLD_SIZE > 1) each worker ends
    with :func:`dcmdp.distributed.exit_worker` once the command has returned."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from dcmdp.distributed import exit_worker

        exit_worker(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
