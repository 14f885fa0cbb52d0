"""Sweeps of the dual controller's settings on Optuna: ``dcmdp tune TUNE.yaml [key=value ...]``.

A tune file (YAML; defaults in the dataclasses of dcmdp/tune_file.py)::

    base: configs/tiny-dense.yaml        # run config; a relative path is tried next to the tune file, then in cwd
    overrides: [steps=40, eval_every=10] # dotlist for every trial (the command line's key=value come after)
    space:                               # run-config keys: a list of values, or a range (tpe and gp only)
      dual.constraints[0].tolerance: [0.001, 0.002, 0.005]
      dual.constraints[0].lr: {low: 0.1, high: 10, log: true}
    sampler: grid                        # grid (every combination of the lists) | tpe | gp, with `trials: N`
    storage: null                        # Optuna RDB URL (default: sqlite:///<output_dir>/study.db)
    select: {min_inside_frac: 0.7, max_slack_frac: 0.5, max_cap_frac: 0.5, tolerance_se: 1.0, warmup_steps: 0}
    prune: {enabled: true}
    workers: 2

``dual.constraints[0].tolerance`` is c, ``.lr`` η, ``.lambda_init`` λ_0; tables write ``c[i].`` for them.

What Optuna does, and what this module adds. Optuna holds the study: the samplers (grid, TPE, GP), the storage
several processes share, ask/tell, each trial's parameters, intermediate values, user attributes and constraint,
the heartbeat that fails a silent trial, and the retry of a failed trial with its intermediate values. None of
that is redone here. The supervisor adds what Optuna cannot do from inside one Python process:

- a trial is a ``dcmdp train`` process (the command a user runs; a crash, an OOM kill or a stuck trial cannot take
  the sweep down), so ``study.optimize`` cannot drive it: trials are claimed with ``ask``, their heartbeat recorded
  by the supervisor, their per-step metrics read from the progress file the trial appends to;
- pruning by the selection rule (``RulePruner``: a trial that can no longer be selected, collapsed or out of
  tolerance, stops), where Optuna's pruners rank intermediate values; the trial is stopped by SIGTERM so it
  writes its checkpoint and ends its MLflow run;
- the selection rule itself (eligible: finished, not collapsed, the dual active, D-hat <= c on most steps where the
  penalty can move D-hat across c; then the tightest c within one standard error of the best held-out accuracy),
  which ``study.best_trial`` cannot express;
  eligibility goes to TPE and GP as an Optuna constraint;
- the end of a grid shared by several processes: outside ``optimize`` Optuna's grid sampler neither stops nor
  avoids points other processes are running, so ``claim`` ends the sweep once every point has a trial;
- a lock file around study bookkeeping on sqlite (no row locks there; a server database locks rows itself);
- MLflow: one parent run, the trials nested under it as child runs tagged with their Optuna state;
- the outputs: the table that says why each trial was not selected, results.csv, tune.png and best.yaml.

One Optuna study per tune file (name: the file's stem, or ``study``), maximising held-out accuracy. Any
number of ``dcmdp tune`` processes, here or on other machines, may share it: each claims trials and none
runs twice (sqlite: claims are serialised by a lock file next to the database; a server database locks
rows itself). A trial is ``python -m dcmdp.cli train <trial>/run.yaml`` in ``<output_dir>/trials/t<number>``,
a child MLflow run nested under one parent run whose id is a study attribute. It appends each step's
metrics to ``progress.jsonl`` (``tracking.progress_file`` of its run.yaml); the tune process reads it
every ``POLL_S``, reports held-out accuracy (``eval/accuracy``, every ``eval_every`` steps) as the
intermediate value and asks ``RulePruner``. A pruned trial gets SIGTERM, writes its checkpoint, ends its
MLflow run KILLED and is tagged ``dcmdp.tune.state=PRUNED``.

Selection rule. A trial is *eligible* when it finished, did not collapse, kept every judged constraint's D-hat
<= c (``dual/measured/<c>`` <= ``dual/tolerance/<c>``) on at least ``min_inside_frac`` of its steps after
warm-up (steps ``warmup_steps + 1 .. steps``), and its dual acted: no constraint slack (lambda at its floor with
D-hat < c) on more than ``max_slack_frac`` of the steps, none with lambda at its cap on more than ``max_cap_frac``
(the run's summary.json), no lambda holding one value on every step after warm-up where its dual was in force (the
steps a dual with ``authority`` stood down, by its own measurement, are left out). A slack dual is a run without
the penalty, a pinned one a constant: "best accuracy among trials inside c" alone rewards the loosest c, where the
dual does nothing. A constraint is *judged* when its c is fixed (a bound the user set) or when its c is anchored and
the penalty's reach (median log D_0 - log D_max of its probed batches) is at least the batch spread (sd of log D-hat
after warm-up): below it lambda cannot move D-hat across c, the share inside is set by where the anchor placed c and
a placebo (lambda fixed at 0 or at lambda_max) meets it too, so it is not judged ("inside c not judged: reach X
under spread Y") and the accuracy clause alone decides; the placebos fail the dual-acted clauses. It *collapsed* when a ``loss/`` metric
was non-finite, or when the mean of ``collapse_metric`` over its last ``collapse_window`` steps fell below
``collapse_drop_frac`` x its peak window mean. The selected trial is the eligible one with the tightest tolerance
(mean c over its steps) among those whose held-out accuracy is within ``tolerance_se`` standard errors of the best
eligible accuracy (the binomial standard error sqrt(p (1 - p) / n) of the best, n its eval prompts): accuracy
differences inside the noise of the held-out set do not buy a looser c. Ties: higher accuracy, larger inside share,
smaller mean discrepancy, the earlier trial. The table says why it chose. tpe and gp see eligibility as an Optuna
constraint.

Resume: running the tune file again continues the study. Finished and pruned trials stay; failed ones (an
interrupted sweep, a crashed trial, a trial whose heartbeat stopped for ``GRACE_S``) run again as Optuna
retries in the first attempt's folder, so they continue from their checkpoint in the same child run.
Outputs of each call, also parent-run artifacts: ``table.txt`` (why each trial was not selected),
``results.csv``, ``tune.png`` and ``best.yaml`` (the winning ``dual.constraints`` block and swept keys).

Where the parts live: the tune file (its settings, reading and checking it, a trial's settings applied to the run
config) in dcmdp/tune_file.py; the trial record, the selection rule and ``RulePruner`` in dcmdp/tune_select.py; the
table, results.csv, tune.png and best.yaml in dcmdp/tune_outputs.py; the study, the trials and the sweep here.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from dcmdp import redact
from dcmdp.config import URI_KEYS, ConfigError, TrackingConfig, load_config, to_yaml
from dcmdp.redact import public_uri
from dcmdp.tracking import LOCAL_ID_PREFIX, Tracker, resolve_tracking_uri
# the parts, importable from here as before
from dcmdp.tune_file import (MAX_GRID_TRIALS, SAMPLERS, TRIAL_URI_VARIABLE, PruneSpec, SelectRule,  # noqa: F401
                             TuneConfig, _check, _error, apply_settings, distributions, grid, label, load_tune_config)
from dcmdp.tune_outputs import _csv_row, _fmt_settings, best_snippet, log_spaced, plot_tune, table  # noqa: F401
from dcmdp.tune_select import (RulePruner, Trial, accuracy_se, assess, authority, clause, live_state,  # noqa: F401
                               select)

log = logging.getLogger("dcmdp.tune")
# heartbeats, fail_stale_trials and the retry callback are marked experimental; used here with ask/tell
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")

POLL_S = 0.5  # how often the parent reads a running trial's progress
HEARTBEAT_S, GRACE_S = 20, 120  # Optuna heartbeat of running trials; a trial silent for GRACE_S is failed


def read_progress(path: Path) -> tuple[dict[str, list[float]], str]:
    """(metric key -> values of steps 1..N, the trial's MLflow run id) from a trial's progress file; a step
    written twice (a trial resumed from an earlier checkpoint) keeps its last line."""
    by_step: dict[int, dict] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                rec = json.loads(line)
                by_step[int(rec.pop("step"))] = rec
    steps = range(1, max(by_step, default=0) + 1)
    keys = dict.fromkeys(k for r in by_step.values() for k in r if k != "run_id")
    history = {k: [float(by_step.get(s, {}).get(k, math.nan)) for s in steps] for k in keys}
    run_id = next((r["run_id"] for _, r in sorted(by_step.items(), reverse=True) if r.get("run_id")), "")
    return history, run_id


def root_number(trial: FrozenTrial) -> int:
    """The number of the first attempt of a retried trial (its folder), else the trial's own."""
    history = RetryHeartbeatStaleTrialCallback.retry_history(trial)
    return history[0] if history else trial.number


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid; ``_Sweep.claim`` ends the sweep when the grid is covered (``study.stop`` is for optimize)."""

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        pass


class _StudyLock:
    """Serialises study bookkeeping (create, retry, claim) between threads and, for sqlite, processes."""

    def __init__(self, storage_url: str):
        self._thread_lock = threading.Lock()
        path = storage_url.removeprefix("sqlite:///") if storage_url.startswith("sqlite:///") else None
        self._path = Path(path + ".lock") if path else None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._thread_lock:
            if self._path is None:
                yield
                return
            with open(self._path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                yield


class _Sweep:
    """One ``dcmdp tune`` call: the study, the parent MLflow run and the trials this process runs."""

    def __init__(self, cfg: TuneConfig):
        from constraints.penalties import constraint_names

        self.cfg, self.out = cfg, Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.base = load_config(cfg.base, cfg.overrides)
        # what the study, the parent run and its buffer record of the overrides: Optuna's attributes are plain text
        self.public_overrides = redact.public_overrides(cfg.overrides, URI_KEYS)
        self.names = constraint_names(self.base.dual.constraints)
        self.tracking_uri = resolve_tracking_uri(self.base.tracking, self.out)
        # trials read the URI (and any credential in it) from the environment they inherit, so that no trial's
        # run.yaml holds it
        os.environ[TRIAL_URI_VARIABLE] = self.tracking_uri
        self.dists = distributions(cfg.space, grid=cfg.sampler == "grid")
        self.pruner = RulePruner(cfg.select, cfg.prune.collapse_patience)
        url = cfg.storage or f"sqlite:///{(self.out / 'study.db').resolve()}"
        self.lock = _StudyLock(url)
        with self.lock():  # two processes creating one sqlite file's tables at once would collide
            try:
                self.storage = RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, engine_kwargs={
                    "connect_args": {"timeout": 120}} if url.startswith("sqlite") else None)
            except Exception as exc:  # sqlalchemy's errors: a damaged file, a wrong URL, a driver missing
                where = "storage" if cfg.storage else "storage (default <output_dir>/study.db)"
                raise _error(where, f"cannot open the study database {public_uri(url)}: {type(exc).__name__}: "
                                    f"{redact.redact(str(exc).splitlines()[0])}") from None
        self.started = 0
        self.stopping = False
        self.procs: set[subprocess.Popen] = set()
        self.study = self._open_study()
        parent = TrackingConfig(uri=self.tracking_uri, experiment=self.base.tracking.experiment,
                                run_name=f"tune-{cfg.study}", buffer_dir=str(self.out / "tracking_buffer"))
        if (uri_as_written := redact.written_field(self.base.tracking, "uri")) is not None:
            redact.attach_written(parent, {"uri": uri_as_written})  # its buffer names it, for `dcmdp sync`
        self.tracker = Tracker(parent, self.out)
        self.parent_id = self._start_parent()

    def _sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        if self.cfg.sampler == "grid":
            return _GridSampler(self.cfg.space, seed=seed)
        if self.cfg.sampler == "tpe":
            return optuna.samplers.TPESampler(seed=seed)
        return optuna.samplers.GPSampler(seed=seed)

    def _open_study(self) -> optuna.Study:
        spec = json.dumps({"base": self.cfg.base, "overrides": self.public_overrides, "space": self.cfg.space,
                           "sampler": self.cfg.sampler}, sort_keys=True)
        with self.lock():
            try:
                study = optuna.create_study(storage=self.storage, study_name=self.cfg.study, direction="maximize",
                                            sampler=self._sampler(self.cfg.seed), pruner=self.pruner)
                study.set_user_attr("dcmdp.spec", spec)
            except optuna.exceptions.DuplicatedStudyError:
                # another process may be sampling too: a seed of its own keeps tpe/gp from proposing the same
                # points (the grid's order depends on the seed: it stays the study's)
                seed = self.cfg.seed + (0 if self.cfg.sampler == "grid" else os.getpid())
                study = optuna.load_study(storage=self.storage, study_name=self.cfg.study, pruner=self.pruner,
                                          sampler=self._sampler(seed))
                stored = study.user_attrs.get("dcmdp.spec")
                if stored is not None and stored != spec:
                    raise ConfigError(f"tune: study {self.cfg.study!r} in {public_uri(str(self.storage.url))} was made "
                                      f"from another base, overrides, space or sampler ({stored}); set 'study' in the "
                                      f"tune file or use another output_dir")
            optuna.storages.fail_stale_trials(study)
            trials = study.get_trials(deepcopy=False)
            retried = {n for t in trials for n in RetryHeartbeatStaleTrialCallback.retry_history(t)}
            for t in trials:  # failed trials run again, from their checkpoint
                if t.state == TrialState.FAIL and t.number not in retried:
                    RetryHeartbeatStaleTrialCallback(max_retry=None, inherit_intermediate_values=True)(study, t)
        return study

    def _start_parent(self) -> Optional[str]:
        params = {"tune.base": self.cfg.base, "tune.overrides": " ".join(self.public_overrides),
                  "tune.sampler": self.cfg.sampler, "tune.trials": str(self.cfg.trials), "tune.study": self.cfg.study,
                  **{f"tune.space.{k.replace('[', '.').replace(']', '')}": str(v) for k, v in self.cfg.space.items()},
                  **{f"tune.select.{k}": str(v) for k, v in asdict(self.cfg.select).items()},
                  **{f"tune.prune.{k}": str(v) for k, v in asdict(self.cfg.prune).items()}}
        with self.lock():
            known = self.study.user_attrs.get("mlflow_parent")
            run_id = self.tracker.start({} if known else params, run_id=known, tags={"dcmdp.tune": "parent"})
            if run_id.startswith(LOCAL_ID_PREFIX):
                log.warning("MLflow at %s is unreachable: trials are not nested under a parent run",
                            public_uri(self.tracking_uri))
                return None
            self.study.set_user_attr("mlflow_parent", run_id)
        return run_id

    def claim(self) -> Optional[optuna.Trial]:
        """The next trial: a waiting retry first, then a new point while the grid or budget has room."""
        with self.lock():
            if self.stopping:
                return None
            trials = self.study.get_trials(deepcopy=False)
            if not any(t.state == TrialState.WAITING for t in trials):
                if self.cfg.sampler == "grid":
                    done = {json.dumps(t.params, sort_keys=True) for t in trials}
                    if all(json.dumps(p, sort_keys=True) in done for p in grid(self.cfg.space)):
                        return None
                elif len({root_number(t) for t in trials}) >= (self.cfg.trials or 0):
                    return None
            trial = self.study.ask(self.dists)
            self.storage.record_heartbeat(trial._trial_id)  # from now on a silent trial is found stale
            return trial

    def work(self, limit: Optional[int] = None) -> None:
        while (limit is None or limit > 0) and (trial := self.claim()) is not None:
            self.run(trial)
            limit = None if limit is None else limit - 1

    def run(self, trial: optuna.Trial) -> None:
        """Run one trial as a ``dcmdp train`` process, report and prune it, tell Optuna how it ended."""
        frozen = next(t for t in self.study.get_trials(deepcopy=False) if t.number == trial.number)
        d = self.out / "trials" / f"t{root_number(frozen):03d}"
        d.mkdir(parents=True, exist_ok=True)
        settings = {k: trial.params[k] for k in self.dists}
        overrides = {"output_dir": str(d.resolve()), "tracking.uri": f"${{oc.env:{TRIAL_URI_VARIABLE}}}",
                     "tracking.run_name": f"{self.cfg.study}-{d.name}", "tracking.buffer_dir": None,
                     "tracking.parent_run_id": self.parent_id, "tracking.progress_file": str(d / "progress.jsonl"),
                     "progress": False,
                     "checkpoint.resume": "auto"}  # a retried trial continues from its checkpoint, same child run
        try:
            run_cfg = apply_settings(self.base, {**overrides, **settings})
        except ConfigError as exc:
            log.warning("trial %s: %s", d.name, exc)
            return self._tell(trial, TrialState.FAIL, Trial(d.name, settings, status="failed", error=str(exc)))
        (d / "run.yaml").write_text(to_yaml(run_cfg, public=True))
        anchored = [c.anchor is not None for c in run_cfg.dual.constraints]
        trial.set_user_attr("steps_total", run_cfg.steps)
        trial.set_user_attr("process", f"{os.uname().nodename}:{os.getpid()}")
        self.started += 1
        log.info("trial %s (optuna #%d): %s", d.name, trial.number, _fmt_settings(settings))
        with open(d / "train.log", "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "train", str(d / "run.yaml")], stdout=logf,
                                    stderr=subprocess.STDOUT)
        self.procs.add(proc)
        reported, live, beat, pruned, interrupted = set(frozen.intermediate_values), {}, time.monotonic(), "", False
        try:
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=POLL_S)
                history, run_id = read_progress(d / "progress.jsonl")
                for step, acc in enumerate(history.get("eval/accuracy", []), start=1):
                    if math.isfinite(acc) and step not in reported:
                        trial.report(acc, step)
                        reported.add(step)
                state = live_state(history, self.names, self.cfg.select, anchored)
                if state != live:
                    live = state
                    for k, v in state.items():
                        trial.set_user_attr(k, v)
                    # a trial past its last step is finishing: pruning it would only cut its final evaluation
                    if (self.cfg.prune.enabled and proc.poll() is None and state["live/steps"] < run_cfg.steps
                            and trial.should_prune()):
                        pruned = self.pruner.reason({**state, "steps_total": run_cfg.steps})
                        log.info("trial %s pruned at step %d: %s", d.name, state["live/steps"], pruned)
                        proc.send_signal(signal.SIGTERM)  # the trial writes its checkpoint and ends its run KILLED
                        proc.wait()
                if proc.poll() is not None:
                    break
                if time.monotonic() - beat > HEARTBEAT_S:
                    self.storage.record_heartbeat(trial._trial_id)
                    beat = time.monotonic()
        except KeyboardInterrupt:
            self.stop()
            proc.wait()
            interrupted = True
        finally:
            self.procs.discard(proc)
        try:
            self._finish(trial, d, settings, proc.returncode, pruned, anchored)
        finally:
            if interrupted:
                raise KeyboardInterrupt

    def _finish(self, trial: optuna.Trial, d: Path, settings: dict[str, Any], returncode: int, pruned: str,
                anchored: Sequence[bool]) -> None:
        history, run_id = read_progress(d / "progress.jsonl")
        record = assess(Trial(d.name, settings), history, self.names, self.cfg.select, anchored)
        if pruned:
            record.status, record.error, record.run_id = "pruned", pruned, run_id
            self._tag_child(run_id, "PRUNED", trial.number, end="KILLED")
            return self._tell(trial, TrialState.PRUNED, record)
        summary_path = d / "summary.json"
        if returncode != 0 or not summary_path.is_file():
            why = "interrupted" if self.stopping else f"exit code {returncode}: {_last_line(d / 'train.log')}"
            log.warning("trial %s failed (%s); log in %s", d.name, why, d / "train.log")
            record.status, record.error, record.run_id = "failed", why, run_id
            self._tag_child(run_id, "FAIL", trial.number)
            return self._tell(trial, TrialState.FAIL, record)
        summary = json.loads(summary_path.read_text())
        record.accuracy_before, record.accuracy_after = summary["accuracy_before"], summary["accuracy_after"]
        record.run_id, record.seconds = summary["run_id"], summary["seconds"]
        record.warnings = list(summary.get("warnings", []))
        constraints = list((summary.get("constraints") or {}).values())
        record.slack_frac = max((c.get("slack_frac", math.nan) for c in constraints), default=math.nan)
        record.cap_frac = max((c.get("cap_frac", math.nan) for c in constraints), default=math.nan)
        with contextlib.suppress(OSError, ValueError, ConfigError):
            record.eval_prompts = int(load_config(d / "run.yaml", []).task.eval_size)
        if record.accuracy_after < record.accuracy_before:
            record.warnings.append(f"held-out accuracy fell below its start ({record.accuracy_before:.1%} -> "
                                   f"{record.accuracy_after:.1%})")
        select([record], self.cfg.select)
        self._tag_child(record.run_id, "COMPLETE", trial.number)
        self._tell(trial, TrialState.COMPLETE if math.isfinite(record.accuracy_after) else TrialState.FAIL, record)

    def _tell(self, trial: optuna.Trial, state: TrialState, record: Trial) -> None:
        """The record as a user attribute and eligibility as a constraint (tpe and gp model both), then the state."""
        trial.set_user_attr("record", {k: v for k, v in asdict(record).items()
                                       if k not in ("trial", "settings", "selected", "reason", "number")})
        trial.set_constraint("eligible", 0.0 if record.eligible else 1.0)
        self.study.tell(trial, record.accuracy_after if state == TrialState.COMPLETE else None, state=state)

    def _tag_child(self, run_id: str, state: str, number: int, end: str = "") -> None:
        """Tag the trial's MLflow run; with ``end``, also end it with that status if it is still RUNNING (a trial
        stopped after its last step, outside the loop that ends its run on SIGTERM)."""
        if not run_id or run_id.startswith(LOCAL_ID_PREFIX):
            return
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.tracking_uri)
            client.set_tag(run_id, "dcmdp.tune.state", state)
            client.set_tag(run_id, "optuna.trial", str(number))
            if end and client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, end)
        except Exception as exc:  # the trial's outcome is in Optuna; a tag is not worth failing the sweep
            log.warning("cannot tag MLflow run %s (%s)", run_id, exc)

    def stop(self) -> None:
        """No new trial starts; running ones get SIGINT, checkpoint and end (retried on the next call)."""
        self.stopping = True
        for p in list(self.procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)

    def records(self) -> list[Trial]:
        """The latest attempt of every trial in the study, as records."""
        latest: dict[int, FrozenTrial] = {}
        for t in self.study.get_trials(deepcopy=False):
            latest[root_number(t)] = t
        out = []
        for root, t in sorted(latest.items()):
            attrs = dict(t.user_attrs.get("record", {"status": "failed"}))
            if t.state in (TrialState.RUNNING, TrialState.WAITING):  # a retry carries its failed attempt's record
                attrs = {"status": t.state.name.lower()}
            out.append(Trial(f"t{root:03d}", {k: t.params.get(k) for k in self.dists}, number=t.number, **attrs))
        return out


def tune(cfg: TuneConfig) -> tuple[list[Trial], Optional[Trial]]:
    """Run this process's share of the study, select, write and log the outputs; return (trials, selected)."""
    sweep = _Sweep(cfg)
    status = "FAILED"
    try:
        t0 = time.perf_counter()
        prime = (cfg.prime_cold_start and cfg.workers > 1 and sweep.base.cold_start.steps > 0
                 and not sweep.base.model.path)
        if prime:
            sweep.work(limit=1)  # fills the cold-start cache the other trials reuse
        with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
            futures = [pool.submit(sweep.work) for _ in range(cfg.workers)]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                sweep.stop()
                raise
        trials = sweep.records()
        best = select(trials, cfg.select)
        seconds = time.perf_counter() - t0
        for p in write_outputs(cfg, sweep, trials, best, seconds):
            sweep.tracker.log_artifact(p)
        sweep.tracker.log_metrics({"tune/trials": len(trials), "tune/started": sweep.started,
                                   "tune/failed": sum(t.status == "failed" for t in trials),
                                   "tune/pruned": sum(t.status == "pruned" for t in trials),
                                   "tune/selected_accuracy": best.accuracy_after if best else math.nan,
                                   "tune/seconds": seconds}, step=0)
        status = "FINISHED"
        return trials, best
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        sweep.tracker.finish(status)



def write_outputs(cfg: TuneConfig, sweep: _Sweep, trials: list[Trial], best: Optional[Trial],
                  seconds: float) -> list[Path]:
    out, names = sweep.out, sweep.names
    count = {s: sum(t.status == s for t in trials) for s in ("pruned", "failed")}
    text = table(trials, names, cfg.select)
    text += (f"\n\n{len(trials)} trials in study {cfg.study!r} ({sweep.started} run now, {count['pruned']} pruned, "
             f"{count['failed']} failed) in {seconds:.0f} s with {cfg.workers} worker(s)")
    text += f"\nselected: {best.trial} ({_fmt_settings(best.settings)}): {best.reason}" if best else \
        "\nselected: none (no eligible trial)"
    for w in best.warnings if best else ():
        text += f"\nwarning: the selected trial {best.trial}: {w}"
        log.warning("the selected trial %s: %s", best.trial, w)
    print(text)
    (out / "table.txt").write_text(text + "\n")
    csv_path, keys = out / "results.csv", list(cfg.space)
    rows = [_csv_row(t) for t in trials]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    paths = [out / "table.txt", csv_path, out / "tune.png"]
    plot_tune(trials, keys[0], names, paths[-1], log_x=log_spaced(sweep.dists[keys[0]]))
    if best is not None:
        snippet = out / "best.yaml"
        snippet.write_text(best_snippet(sweep.base, best))
        paths.append(snippet)
        print(f"winning settings written to {snippet}")
    return paths



def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-200:] if lines else ""


def run_tune_file(path: str | Path, overrides: Sequence[str] = (), workers: Optional[int] = None
                  ) -> tuple[list[Trial], Optional[Trial]]:
    cfg = load_tune_config(path, overrides)
    if workers is not None:
        cfg.workers = workers
        _check(cfg)
    return tune(cfg)
