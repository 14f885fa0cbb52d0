"""The training loop: rollout -> pi_old -> measure -> N mini-batch updates -> dual step -> sync -> log.

One flat function, ``train``, reads top to bottom; each phase is a small helper below it. The dual
step uses D-hat measured on this batch before the updates (pi_old vs mu; with ``dual.measure_at: updates``,
pi_theta as each mini-batch update saw it vs mu); the updated lambdas apply from
the next rollout batch, to every mini-batch alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from constraints.config import ConstraintConfig
from constraints.measures import discrepancy_metrics
from constraints.penalties import constraint_names
from dcmdp.async_rollout import RolloutWorker, staleness_plan
from dcmdp.checkpoint import (RunFolderError, RunFolderInputError, RunFolderLock, RunPathInputError, SignalCheckpointer,
                              capture_rng, checkpoint_run_uid, clear_run_folder, load_checkpoint,
                              load_resume_checkpoint, new_run_uid, read_run_file, restore_rng, run_in_folder,
                              save_checkpoint, unclaimed_outputs, unwritable_run_paths, write_config_yaml,
                              write_run_file)
from dcmdp.config import ConfigError, RunConfig, flatten, load_config, resume_conflicts, to_yaml
from dcmdp.errors import InputFileNotFoundError
from dcmdp import distributed
from dcmdp.cpu import apply_threads
from dcmdp.dual import DualState, dual_step, enter_context, enter_floor, init_state, needs_floor, penalty_spec
from dcmdp.dual import (anchor_due, batch_spread, batch_tolerances, bound_in_force, penalty_reach, record_anchor,
                        staleness_step, with_staleness)
from dcmdp.probe import constraint_values, probe_updates
from dcmdp.mismatch import mismatch_metrics
from dcmdp.plots import plot_dual
from dcmdp.redact import public_uri, written_field
from dcmdp.reward_stop import failing_steps, run_end_window, stop_message
from dcmdp.tracking import (NoTracker, Tracker, check_sqlite_store, check_tracking_config, provenance_tags,
                            resolve_buffer_dir)
from dcmdp.policy import (Policy, build_policy, decode_responses, encode_prompts, held_out_accuracy, held_out_examples,
                          screen_task_prompts, seed_everything, step_seed)
from trainers import guards, learner
from trainers.advantages import ADVANTAGES
from trainers.batch import Rollout
from trainers.config import PRECISION_BITS, AlgoConfig
from trainers.models import compute_dtype
from trainers.optim import build_optimizer, precision_param_dtype
from trainers.tasks import Example, last_failure, score_completions

log = logging.getLogger("dcmdp")


@dataclass(slots=True)
class RunState:
    """What changes as the run goes: restored from a checkpoint on resume, saved in every checkpoint."""

    dual: DualState
    # One metrics dict per step so far.
    history: list[dict[str, float]] = field(default_factory=list)
    start_step: int = 0
    # Consecutive bad steps so far (every sample dropped or an update skipped; see guard.max_bad_steps).
    bad_steps: int = 0
    # Held-out accuracy before the first RL step (kept in checkpoints, so a resumed run reports the same one).
    accuracy_before: Optional[float] = None
    # The held-out examples that fit the context by length in characters (``dcmdp.policy.held_out_examples``), once
    # screened.
    eval_examples: Optional[list[Example]] = None
    # Consecutive steps in which almost every group had zero reward variance (see ``_watch_signal``).
    no_signal_steps: int = 0
    # (step, perf_counter) of the previous console line: its s/step is the mean since then.
    line_mark: tuple[int, float] = (0, 0.0)

    # The last step whose update, dual step and logging all finished, and the last step checkpointed: an error
    # later than ``done_step`` checkpoints it first (``_checkpoint_before_failing``).
    done_step: int = 0
    checkpointed_step: int = 0
    # True from a step's first parameter update until its end: the weights are then between two steps.
    mid_update: bool = False
    # This run's identity (``<output_dir>/run.json``), carried by its checkpoints.
    run_uid: str = ""


@dataclass
class ConstraintSummary:
    """One constraint over a run, from the dual/ metrics of every step that measured it."""

    # Mean D-hat as the dual step saw it (dual/measured/<name>: at the updates under dual.measure_at=updates).
    measured_mean: float
    # The tolerance c in force at the first and the last measured step.
    tolerance_start: float
    tolerance_end: float
    # Share of the measured steps with D-hat <= c.
    inside_frac: float
    # Share of the measured steps with D-hat < c and lambda at its floor (lambda_min): the dual did nothing there. This,
    # cap_frac and acting_frac count, for a constraint with ``authority``, the steps the dual was in force (not
    # standing down); NaN when it stood down on all of them.
    slack_frac: float
    lambda_mean: float
    lambda_final: float
    # Share of the measured steps with lambda at its cap (lambda_max): the constraint was not held, a constant was.
    cap_frac: float = 0.0
    # Over the first FEASIBILITY_STEPS measured steps: the least value at the measurement point that no update of the
    # step changes (dual/floor_at_point/<name>) and the largest tolerance; the constraint is infeasible from the start
    # when that floor exceeds c on every one of them (NaN: not measured).
    start_floor: float = math.nan
    start_tolerance: float = math.nan
    # Share of the measured steps with lambda above ACTING_LAMBDA: the dual acting (a slack dual sits at 0).
    acting_frac: float = math.nan
    # Whether c was anchored by the run's own probes (constraints[i].anchor): then "lower c" means a lower anchor.
    anchored: bool = False
    # The penalty's reach: median over the probed batches of log D_0 - log D_max (without the penalty and at
    # lambda_max, dcmdp.dual.penalty_reach), and how many batches were probed; None: no probe ran (a fixed tolerance).
    reach: Optional[float] = None
    reach_probes: int = 0
    # The batch spread: sd of log D-hat over the steps after the learning-rate warm-up (dcmdp.dual.batch_spread), and
    # over how many steps; None: fewer than 2.
    spread: Optional[float] = None
    spread_steps: int = 0
    # The least and the largest c in force over the summarised steps (c moving more than C_MOVE_FACTOR is warned of).
    tolerance_min: float = math.nan
    tolerance_max: float = math.nan
    # What reach against spread says about the share inside c (``control_sentence``), and for a constraint with
    # ``authority`` what the dual did with it (``stand_down_sentence``).
    control: str = ""
    # For a constraint with ``authority``: the anchor windows closed and those that gave the dual authority, and the
    # share of the summarised steps whose updates carried no penalty because the dual stood down.
    windows: int = 0
    windows_acting: int = 0
    stood_down_frac: float = 0.0


@dataclass(slots=True)
class Setup:
    """What a run builds once (``setup``), and its mutable ``state``."""

    cfg: RunConfig
    # Tokenizer, task, model (pi_theta) and rollout engine (mu), from ``dcmdp.policy.build_policy``.
    policy: Policy
    # How the training engine scores a rollout (temperature, LM-head precision, MoE, this rank's rows).
    scoring: learner.ScoringSpec
    # Optimiser, LR schedule, fp16 loss scaler and gradient clip of the mini-batch updates.
    optim: learner.OptimStep
    tracker: Tracker
    # The constraints' names (``constraints.penalties.constraint_names``).
    names: list[str]
    state: RunState
    # Rank and world size under torchrun (world 1: a single process).
    dist: distributed.Dist = field(default_factory=distributed.Dist)
    # Rollout worker thread (async_rollout.enabled), started by ``_train``; None samples in the loop.
    worker: Optional[RolloutWorker] = None
    # The exclusive lock on output_dir (rank 0), released when the run ends.
    lock: Optional[RunFolderLock] = None


@dataclass
class Summary:
    accuracy_before: float
    accuracy_after: float
    final_lambda: dict[str, float]
    # Mean of every discrepancy/ measure, pi_old vs mu before the updates (not the constrained D-hat; see constraints).
    mean_discrepancy: dict[str, float]
    steps: int
    run_id: str
    tracking_uri: str
    output_dir: str
    seconds: float
    # Step the run was resumed from (0: a fresh run); this process ran steps - resumed_at steps in ``seconds``.
    resumed_at: int = 0
    constraints: dict[str, ConstraintSummary] = field(default_factory=dict)
    # What the run's end found wrong (a constraint slack throughout, accuracy at chance level); also logged.
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        disc = ", ".join(f"{k}={v:.4g}" for k, v in self.mean_discrepancy.items()) or "-"
        ran = (f"{self.steps} steps in {self.seconds:.0f} s" if not self.resumed_at else
               f"{self.steps} steps ({self.steps - self.resumed_at} in {self.seconds:.0f} s after resuming at step "
               f"{self.resumed_at})")
        out = [f"held-out accuracy: {self.accuracy_before:.1%} -> {self.accuracy_after:.1%} "
               f"({100 * (self.accuracy_after - self.accuracy_before):+.1f} points) after {ran}"]
        for name, c in self.constraints.items():
            acting = (f"acting on {c.acting_frac:.0%} of steps, at its cap on {c.cap_frac:.0%}"
                      if math.isfinite(c.acting_frac) and math.isfinite(c.cap_frac) else
                      "never in force (the dual stood down)")
            out.append(f"constraint {name}: mean D-hat {c.measured_mean:.4g} (as constrained), c {c.tolerance_start:.4g}"
                       f" -> {c.tolerance_end:.4g}, inside on {c.inside_frac:.0%} of steps, lambda mean "
                       f"{c.lambda_mean:.4g}, final {c.lambda_final:.4g}, {acting}")
            if c.control:
                out.append(f"constraint {name}: {c.control}")
        if not self.constraints:
            lam = ", ".join(f"{k}={v:.4g}" for k, v in self.final_lambda.items()) or "-"
            out.append(f"final lambda: {lam}")
        out += [f"mean discrepancy before the updates (pi_old vs mu): {disc}",
                *(f"warning: {w}" for w in self.warnings),
                f"MLflow run {self.run_id} at {self.tracking_uri}" if self.run_id else
                "MLflow: off (tracking.enabled=false)", f"outputs: {self.output_dir}"]
        return out


# A constraint is reported as slack when D-hat < c with lambda at its floor on at least this share of its steps.
SLACK_FRAC = 0.95
# ... as pinned when lambda sits at lambda_max on more than this share, and as not held when D-hat > c on more: a dual
# that holds its constraint has D-hat inside c on >= 70% of the steps with lambda below its cap on >= 80%.
CAP_FRAC = 0.2
OUTSIDE_FRAC = 0.3
# ... as mostly idle when lambda is above ACTING_LAMBDA on less than this share (and not slack throughout).
ACTING_FRAC = 0.5
ACTING_LAMBDA = 0.01
# Steps at the start of a run whose floor at the measurement point decides feasibility (``feasibility_warnings``).
FEASIBILITY_STEPS = 3
# Rules whose lambda responds to D-hat: only they can be slack, pinned or infeasible in the sense above.
_MOVING_RULES = ("projected", "pid", "signed", "chance")
# A dual that stood down (``authority``) on more than this share of the steps is not judged slack, idle, pinned or
# not holding: it did not act there by design, and its control line says why.
STOOD_DOWN_FRAC = 0.5
# A c whose largest value over a run is more than this factor times its least is warned of: the share inside c then
# follows c's placement as much as D-hat.
C_MOVE_FACTOR = 1.5


def control_sentence(reach: Optional[float], spread: Optional[float], inside_frac: float, probes: int = 0,
                     steps: int = 0, lambda_max: float = math.nan) -> str:
    """What the share of steps inside c says, from the penalty's reach (log D_0 - log D_max) against the batch spread
    (sd of log D-hat), both on the log scale: lambda in [0, lambda_max] shifts log D-hat by at most the reach, while
    the batches scatter log D-hat by the spread around any c. Where the reach is under the spread the share inside is
    set by where c sits in D-hat's distribution, not by lambda (a placebo with lambda fixed at 0 or at lambda_max lands
    near it); where it is not, the penalty can move D-hat across c, and the share can measure control (checked
    against those placebos). A reach that was not measured (no probe: a fixed tolerance) is said, never guessed."""
    inside = f"inside c on {inside_frac:.0%} of the steps"
    spread_s = ("the batch spread was not measured (fewer than 2 steps)" if spread is None else
                f"the batch spread {spread:.3g} (sd of log D-hat over {steps} steps after warm-up)")
    if reach is None:
        return (f"the penalty's reach was not measured (no probe ran: c is not anchored), {spread_s}: whether lambda "
                f"could move D-hat across c is unknown, so {inside} is not evidence of control; a placebo arm (lambda "
                f"fixed at 0 and at lambda_max) or an anchored c (its probes) would measure it")
    reach_s = (f"the penalty's reach {reach:.3g} (median log D_0 - log D_max over {probes} probed batch"
               f"{'es' if probes != 1 else ''})")
    if spread is None:
        return f"{reach_s}, {spread_s}: {inside}, not compared"
    if reach < spread:
        cap = f"{lambda_max:g}" if math.isfinite(lambda_max) else "lambda_max"
        return (f"{reach_s} is under {spread_s}: the penalty cannot move D-hat much here, so {inside} is set by where "
                f"c sits, not by lambda; what would give it authority: a longer horizon (a penalty that acts across "
                f"steps, not within one), a measure the penalty acts on (dual.measure_at=drift), or a larger "
                f"lambda_max (now {cap})")
    return (f"{reach_s} is at least {spread_s}: lambda can move D-hat across c, so {inside} can reflect control "
            f"(measured as the margin over the placebos, lambda fixed at 0 and at lambda_max)")


def stand_down_sentence(windows: int, acting: int, stood_down_frac: float, authority: float) -> str:
    """What a dual with ``authority`` did: acted where an anchor window showed the penalty's reach at least authority
    x the batch spread, stood down (lambda held at 0, no penalty) where it did not."""
    rule = f"reach at least {authority:g} x the spread (dual.constraints[i].authority)"
    if windows == 0:
        return (f"the dual stood down throughout (lambda held at 0, no penalty): no anchor window closed, so its "
                f"authority ({rule}) was never measured")
    if acting == 0:
        return (f"the dual stood down throughout (lambda held at 0, no penalty): none of its {windows} anchor "
                f"window{'s' if windows != 1 else ''} showed the {rule}; this run trained as its lambda = 0 placebo "
                f"does, and its share inside c is c's placement alone")
    return (f"the dual acted on {acting} of {windows} anchor windows ({rule}) and stood down on the rest: "
            f"{stood_down_frac:.0%} of the steps carried no penalty")


def constraint_summaries(history: Sequence[dict[str, float]], names: Sequence[str],
                         constraints: Sequence[ConstraintConfig], warmup: int = 0) -> dict[str, ConstraintSummary]:
    """Per constraint, from the steps whose dual/measured/<name> is finite (a skipped step measured nothing); for an
    anchored tolerance (``anchor``), from the step after its first window closed (before it there is no tolerance in
    force and lambda holds), or every step when it never closed. The penalty's reach comes from every probed step
    (dual/anchor_zero/<name>, dual/anchor_max/<name>), the batch spread from the measured steps after the first
    ``warmup`` (history[i] is step i + 1)."""
    out = {}
    for name, c in zip(names, constraints):
        probed = [h for h in history if f"dual/anchor_zero/{name}" in h and f"dual/anchor_max/{name}" in h]
        reach = penalty_reach([h[f"dual/anchor_zero/{name}"] for h in probed],
                              [h[f"dual/anchor_max/{name}"] for h in probed])
        n_probes = sum(h[f"dual/anchor_zero/{name}"] > 0 and h[f"dual/anchor_max/{name}"] > 0 for h in probed)
        late = [h[f"dual/measured/{name}"] for h in history[warmup:]
                if np.isfinite(h.get(f"dual/measured/{name}", math.nan)) and h[f"dual/measured/{name}"] > 0]
        spread = batch_spread(late)
        rows = [h for h in history if np.isfinite(h.get(f"dual/measured/{name}", float("nan")))]
        anchored = [k for k, h in enumerate(rows) if f"dual/anchor_gap/{name}" in h][:1]
        if getattr(c, "anchor", None) is not None and anchored and anchored[0] + 1 < len(rows):
            rows = rows[anchored[0] + 1:]
        if not rows:
            continue
        d = np.array([h[f"dual/measured/{name}"] for h in rows])
        tol = np.array([h[f"dual/tolerance/{name}"] for h in rows])
        lam = np.array([h[f"dual/lambda/{name}"] for h in rows])
        floor = (lam <= c.lambda_min + 1e-12) & (d < tol)
        # a dual with authority is judged slack, pinned or acting on the steps it was in force (not standing down)
        live = np.array([h.get(f"dual/stood_down/{name}", 0.0) < 0.5 for h in rows])
        start = [h for h in rows[:FEASIBILITY_STEPS] if np.isfinite(h.get(f"dual/floor_at_point/{name}", math.nan))]
        start_floor = min(h[f"dual/floor_at_point/{name}"] for h in start) if start else math.nan
        start_tol = max(h[f"dual/tolerance/{name}"] for h in start) if start else math.nan
        inside = float((d <= tol).mean())
        control = control_sentence(reach, spread, inside, int(n_probes), len(late), c.lambda_max)
        flags = [h[f"dual/stood_down/{name}"] for h in rows if f"dual/stood_down/{name}" in h]
        decisions = [h[f"dual/authority/{name}"] for h in history if f"dual/authority/{name}" in h]
        stood = float(np.mean(flags)) if flags else 0.0
        if flags:
            control += "; " + stand_down_sentence(len(decisions), int(sum(x > 0 for x in decisions)), stood,
                                                  float(getattr(c, "authority", math.nan) or math.nan))
        def share(x: np.ndarray) -> float:
            return float(x[live].mean()) if live.any() else math.nan

        out[name] = ConstraintSummary(float(d.mean()), float(tol[0]), float(tol[-1]), inside,
                                      share(floor), float(lam.mean()), float(lam[-1]),
                                      share(lam >= c.lambda_max - 1e-12), float(start_floor), float(start_tol),
                                      share(lam > ACTING_LAMBDA), c.anchor is not None, reach,
                                      int(n_probes) if reach is not None else 0, spread, len(late),
                                      float(tol.min()), float(tol.max()), control, len(decisions),
                                      int(sum(x > 0 for x in decisions)), stood)
    return out


def feasibility_warnings(history: Sequence[dict[str, float]], names: Sequence[str],
                         constraints: Sequence[ConstraintConfig], rule: str, measure_at: str) -> list[str]:
    """Constraints whose tolerance lies below the floor at the measurement point on each of the first
    ``FEASIBILITY_STEPS`` steps (``history``): no update can bring D-hat inside c, and lambda would wind up to its cap.

    The floor at the measurement point (``dual/floor_at_point/<name>``) is the part of this step's D-hat that the
    step's updates do not change: pi_old vs mu for ``measure_at`` rollout and updates (the first mini-batch update
    starts from pi_theta = pi_old; getting below it means chasing the engine's rounding), 0 for drift.
    """
    if rule not in _MOVING_RULES:
        return []
    out = []
    for name, c in zip(names, constraints):
        rows = [h for h in history[:FEASIBILITY_STEPS] if np.isfinite(h.get(f"dual/floor_at_point/{name}", math.nan))]
        if len(rows) < FEASIBILITY_STEPS or not all(h[f"dual/floor_at_point/{name}"] > h[f"dual/tolerance/{name}"]
                                                    for h in rows):
            continue
        floors = ", ".join(f"{h[f'dual/floor_at_point/{name}']:.4g}" for h in rows)
        tols = ", ".join(f"{h[f'dual/tolerance/{name}']:.4g}" for h in rows)
        out.append(f"constraint {name} is infeasible at its measurement point (dual.measure_at={measure_at}): on each of "
                   f"the first {len(rows)} steps the part of D-hat no update of the step changes (pi_old vs mu: "
                   f"{floors}) is above c ({tols}), so lambda can only wind up to its cap ({c.lambda_max:g}). Raise c "
                   f"above that floor (dcmdp calibrate proposes one), raise floor_slack, or constrain the part the "
                   f"update controls: dual.measure_at=drift")
    return out


def end_of_run_warnings(constraints: dict[str, ConstraintSummary], rule: str, accuracy_after: float,
                        chance: float, eval_prompts: int) -> list[str]:
    """Under a rule that moves lambda: a constraint slack on (nearly) every step (the dual never acted), lambda acting
    on less than ``ACTING_FRAC`` of them (it mostly rested), lambda at its
    cap on more than ``CAP_FRAC`` of the steps (a constant with extra steps), D-hat outside c on more than
    ``OUTSIDE_FRAC`` of them (the constraint was not held), infeasible from the first steps
    (``feasibility_warnings``), none of these for a dual that stood down on more than ``STOOD_DOWN_FRAC`` of the
    steps (``authority``); under any rule, a c that moved more than ``C_MOVE_FACTOR`` over the run; and held-out
    accuracy at chance level (at most one eval prompt above ``chance``)."""
    out = []
    for name, c in constraints.items():
        if c.tolerance_max > C_MOVE_FACTOR * c.tolerance_min > 0:  # NaN compares False
            out.append(f"constraint {name}: c moved {c.tolerance_max / c.tolerance_min:.2g}x during the run (from "
                       f"{c.tolerance_min:.4g} to {c.tolerance_max:.4g}; {c.tolerance_start:.4g} at the start, "
                       f"{c.tolerance_end:.4g} at the end), more than {C_MOVE_FACTOR:g}x: c followed the run's own "
                       f"floor, so the share inside c ({c.inside_frac:.0%}) follows where c was placed as much as "
                       f"D-hat; a fixed tolerance (a bound you set) does not move")
        if rule not in _MOVING_RULES or c.stood_down_frac > STOOD_DOWN_FRAC:
            continue  # a dual that stood down over most of the run says so in its control line, not as a fault
        if c.start_floor > c.start_tolerance:  # NaN compares False
            out.append(f"constraint {name} was infeasible from the start: the floor at its measurement point "
                       f"({c.start_floor:.4g}, the least over the first {FEASIBILITY_STEPS} steps) was above c "
                       f"({c.start_tolerance:.4g}); see the warning at step {FEASIBILITY_STEPS}")
        if c.cap_frac > CAP_FRAC + 1e-9:
            out.append(f"constraint {name}: lambda sat at its cap lambda_max on {c.cap_frac:.0%} of the steps (mean "
                       f"{c.lambda_mean:.4g}): the penalty acted as a constant, not a controller. c "
                       f"({c.tolerance_start:.4g} -> {c.tolerance_end:.4g}) is below what the penalty can reach (mean "
                       f"D-hat {c.measured_mean:.4g}); raise c or floor_slack (dcmdp calibrate proposes one), or "
                       f"constrain the part the update controls (dual.measure_at=drift)")
        if 1.0 - c.inside_frac > OUTSIDE_FRAC + 1e-9:  # shares of a whole number of steps
            out.append(f"constraint {name}: D-hat was outside c on {1.0 - c.inside_frac:.0%} of the steps (mean D-hat "
                       f"{c.measured_mean:.4g}, c {c.tolerance_start:.4g} -> {c.tolerance_end:.4g}): the constraint "
                       f"was not held")
        if c.slack_frac < SLACK_FRAC and c.acting_frac < ACTING_FRAC:
            # the anchor sets c where a batch exceeds it with probability miss_rate: a rule holding D-hat's mean rests
            lower = ("lower the anchor (constraints[i].anchor), or hold P(D-hat > c) instead of its mean: "
                     "dual.rule=chance, as configs/default.yaml does" if c.anchored and rule != "chance" else
                     "lower the anchor (constraints[i].anchor)" if c.anchored else
                     "lower it, or let the run anchor it (constraints[i].anchor, as configs/default.yaml does)")
            out.append(f"constraint {name}: lambda was above {ACTING_LAMBDA:g} on only {c.acting_frac:.0%} of the steps "
                       f"(mean {c.lambda_mean:.4g}): the dual mostly rested; c ({c.tolerance_start:.4g} -> "
                       f"{c.tolerance_end:.4g}) lies above most of D-hat (mean {c.measured_mean:.4g}); {lower}")
        if c.slack_frac >= SLACK_FRAC:
            out.append(f"constraint {name} was slack on {c.slack_frac:.0%} of the steps (D-hat < c with lambda at its "
                       f"floor): the dual never acted. c ({c.tolerance_start:.4g} -> {c.tolerance_end:.4g}) lies above "
                       f"the measured D-hat (mean {c.measured_mean:.4g}); lower the tolerance (dcmdp calibrate "
                       f"proposes one) or let it track the floor (floor_slack), as configs/default.yaml does")
    if eval_prompts and accuracy_after <= chance + 1.0 / eval_prompts:
        out.append(f"held-out accuracy ended at chance level ({accuracy_after:.1%}, chance {chance:.1%} on "
                   f"{eval_prompts} prompts): the policy answers nothing right; check the cold start and the task")
    return out


def finished_run(cfg: RunConfig) -> Optional[str]:
    """With ``checkpoint.resume=auto``: what to say instead of training when output_dir holds this config's run,
    finished at ``cfg.steps`` (its summary.json); None when there is something to train (or resume refuses)."""
    out = Path(cfg.output_dir)
    if cfg.checkpoint.resume != "auto" or not (out / "summary.json").is_file():
        return None
    try:
        done = json.loads((out / "summary.json").read_text())
        saved = flatten(load_config(out / "config.yaml"))
    except (OSError, ValueError):  # unreadable: resuming reports what is wrong
        return None
    if done.get("steps") != cfg.steps or resume_conflicts(saved, cfg):
        return None
    # a folder whose later checkpoints were removed (or a copy taken mid-run) resumes from its latest one
    steps = [int(p.name[5:]) for p in (out / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    if steps and max(steps) < cfg.steps:
        return None
    summary = Summary(**{k: v for k, v in done.items() if k in Summary.__dataclass_fields__})
    summary.constraints = {k: ConstraintSummary(**v) for k, v in (done.get("constraints") or {}).items()}
    return "\n".join([f"{out} holds this run, finished at step {cfg.steps} (summary.json): nothing to train. Train "
                      f"further with steps=N, afresh with overwrite=true, or elsewhere with output_dir=...",
                      *summary.lines()])


def train(cfg: RunConfig) -> Summary:
    t_start = time.perf_counter()
    s = setup(cfg)
    try:
        return _train(s, t_start)
    except BaseException as exc:
        _checkpoint_before_failing(s, exc)
        # never leave the MLflow run RUNNING; the guard and the signal stop have ended it already (a no-op then)
        s.tracker.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        if s.lock is not None:
            s.lock.release()


def _checkpoint_before_failing(s: Setup, exc: BaseException) -> None:
    """Save the last completed step before an error ends the run, so that no finished step is lost to it. Not when
    the error came in the middle of a step's updates (the weights are then part-way between two steps), nor under
    torchrun (a sharded save needs every rank, and the failing one may be alone)."""
    if s.state.done_step <= s.state.checkpointed_step or s.dist.sharded:
        return
    if s.state.mid_update:
        log.error("%s during the update of step %d: no checkpoint of that step is consistent; the last one is of "
                  "step %d", type(exc).__name__, s.state.done_step + 1, s.state.checkpointed_step)
        return
    try:
        path = checkpoint(s, s.state.done_step)
    except Exception as save_exc:  # the original error is the one to report
        log.error("could not checkpoint step %d before stopping: %s", s.state.done_step, save_exc)
        return
    log.error("%s after step %d: checkpoint of step %d written to %s before stopping (resume with "
              "checkpoint.resume=auto)", type(exc).__name__, s.state.done_step, s.state.done_step, path)


def _train(s: Setup, t_start: float) -> Summary:
    cfg = s.cfg
    if s.state.accuracy_before is None:
        s.state.accuracy_before = evaluate(s, seed=cfg.seed)
        s.tracker.log_metrics({"eval/accuracy": s.state.accuracy_before}, step=s.state.start_step)
    acc_before = s.state.accuracy_before
    if s.dist.main:
        log.info("held-out accuracy before RL: %.1f%% (%s)", 100 * acc_before,
                 "measured before the run was resumed" if s.state.eval_examples is None else
                 f"{len(s.state.eval_examples)} eval prompts, one response each sampled by the rollout engine at "
                 f"{cfg.rollout.precision_at(s.state.start_step)}, temperature {cfg.rollout.temperature:g}; the "
                 f"figure the run's end compares with")
    s.state.line_mark = (s.state.start_step, time.perf_counter())
    s.worker = _rollout_worker(s)
    steps = range(s.state.start_step, cfg.steps)
    bar = tqdm(steps, desc="dcmdp train", disable=not show_bar(cfg), dynamic_ncols=True, initial=s.state.start_step,
               total=cfg.steps)
    with SignalCheckpointer() as stop, s.worker or contextlib.nullcontext():
        for step in bar:
            _train_step(s, step, bar)
            distributed.agree_stop(stop, s.dist)
            if s.state.bad_steps >= cfg.guard.max_bad_steps:
                _stop_bad_run(s, step + 1)
            stop_on_failing_reward(s, step + 1)
            if stop.requested or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0):
                with stop.hold():
                    checkpoint(s, step + 1)
            if stop.requested:
                log.warning("%s received: checkpoint written at step %d, stopping", stop.signal_name, step + 1)
                s.tracker.finish("KILLED")
                raise SystemExit(128 + int(stop.signum))
    if (cfg.steps > s.state.start_step and cfg.checkpoint.at_end
            and not (cfg.checkpoint.every and cfg.steps % cfg.checkpoint.every == 0)):
        checkpoint(s, cfg.steps)
    acc_after = evaluate(s, seed=cfg.seed)
    s.tracker.log_metrics({"eval/accuracy": acc_after}, step=cfg.steps)
    return finish(s, acc_before, acc_after, time.perf_counter() - t_start)


def train_step(s: Setup, step: int) -> None:
    """One rollout batch of ``s``'s run, outside ``train``'s loop and without a progress bar (``dcmdp calibrate`` runs
    a run's first steps in memory through it)."""
    _train_step(s, step, tqdm(disable=True))


def _train_step(s: Setup, step: int, bar) -> None:
    """One rollout batch: rollout -> pi_old -> measure -> updates -> dual step -> sync -> log.

    With one mini-batch (``learner.fuses_old_pass``) the pi_old forward keeps its graph and is the update's
    forward: time/old_logp then holds the forward and time/update the backward and the optimiser step."""
    cfg = s.cfg
    t0 = time.perf_counter()
    if cfg.dual.floor_by == "precision":
        s.state.dual = enter_floor(s.state.dual, cfg.rollout.precision_at(step))
    examples, rollout, fresh_B, async_metrics = _next_rollout(s, step)
    t1 = time.perf_counter()
    rewards_B, reward_metrics = reward_phase(s.policy, examples, rollout)
    reward_metrics["time/reward"] = time.perf_counter() - t1
    rollout, advantages_B, keep_B, guard_metrics = screen_phase(cfg.algo, rollout, rewards_B, fresh_B)
    # rewards and screens ran on the host; the learner and the measures run where the model lives
    rollout, advantages_B, keep_B = learner.place(s.policy.model, rollout, advantages_B, keep_B)
    old = learner.old_pass(s.policy.model, rollout, advantages_B, keep_B, cfg.algo, s.scoring)
    # train_logp_BT: pi_old vs mu before the updates; None (a bypass with N > 1) measures each token's update instead
    batch, keep_B, train_logp_BT, old_metrics = old.batch, old.keep_B, old.train_logp_BT, old.metrics
    kept = bool(keep_B.any())
    t2 = time.perf_counter()
    # nothing left to measure: a NaN D-hat makes the dual step keep lambda and report the skip
    measured_C, disc_metrics = (measure_phase(cfg.dual.constraints, batch, train_logp_BT)
                                if kept and train_logp_BT is not None else
                                (torch.full((len(s.names),), float("nan"), dtype=torch.float64), {}))
    t3 = time.perf_counter()
    context_metrics = _enter_context(s, step, async_metrics)
    due = anchor_due(s.state.dual, cfg.dual, step) if kept else []
    probes = anchor_probes(s, batch, step) if any(due) else None
    s.state.mid_update = kept
    # a probe put the weights back in place, which invalidates the fused forward's graph: the update recomputes it
    result = learner.update(
        s.policy.model, s.optim, batch, scoring=s.scoring, penalty=penalty_spec(s.state.dual, cfg.dual), cfg=cfg.algo,
        generator=torch.Generator().manual_seed(step_seed(cfg.seed, step, 2)),
        forward=old.forward if probes is None else None) if kept else None
    del old  # the fused forward's graph
    t4 = time.perf_counter()
    if result is not None and train_logp_BT is None:
        measured_C, disc_metrics = measure_phase(cfg.dual.constraints, batch, result.trained_logp_BT)
    # an automatic tolerance's floor: pi_old vs mu on identical weights. A batch that older weights sampled
    # (asynchronous rollouts) also holds the policy's drift since then, so it leaves the floor as it is (NaN)
    floor_C = measured_C if _sampled_by_current_weights(s, rollout, step) else torch.full_like(measured_C, float("nan"))
    # the part of D-hat that no update of this step changes (feasibility_warnings): the pre-update value, 0 for drift
    point_floor_C = torch.zeros_like(measured_C) if cfg.dual.measure_at == "drift" else measured_C
    if result is not None and cfg.dual.measure_at == "updates":
        measured_C = constraint_values(cfg.dual.constraints, batch, result.trained_logp_BT)
    elif cfg.dual.measure_at == "drift":  # pi_theta at each token's update vs pi_old: the update's own part
        measured_C = (constraint_values(cfg.dual.constraints, batch, result.trained_logp_BT, batch.old_logp_BT)
                      if result is not None else torch.full_like(measured_C, float("nan")))
        floor_C = measured_C  # an automatic tolerance on the drift follows the run's own drift (dcmdp.dual)
    tolerance_C = batch_tolerances(s.state.dual, floor_C, cfg.dual) if cfg.async_rollout.is_auto else None
    s.state.dual, dual_metrics = dual_step(s.state.dual, measured_C, cfg.dual, floor_C=floor_C)
    if probes is not None:  # the anchored tolerance's window; its c applies from the next batch, like lambda
        floor_now_C = torch.where(torch.isfinite(s.state.dual.floor_C), s.state.dual.floor_C, point_floor_C)
        s.state.dual, anchor_metrics = record_anchor(s.state.dual, cfg.dual, step, due, *probes, floor_now_C)
        dual_metrics.update(anchor_metrics)
    if cfg.async_rollout.is_auto:  # the staleness bound, the dual's second action
        s.state.dual, staleness_metrics = staleness_step(s.state.dual, measured_C, tolerance_C, cfg.async_rollout.auto)
        dual_metrics.update(staleness_metrics)
    t5 = time.perf_counter()
    if s.worker is None:
        s.policy.engine.load_weights(s.policy.model.state_dict(), version=step + 1)
    else:
        s.worker.publish(s.policy.model.state_dict(), version=step + 1, bound=_bound(s))
    t6 = time.perf_counter()
    dual_metrics.update({f"dual/floor_at_point/{n}": float(v) for n, v in zip(s.names, point_floor_C.tolist())})
    metrics = {**reward_metrics, **disc_metrics, **dual_metrics, **context_metrics,
               **(result.metrics() if result is not None else {})}
    metrics.update(guard_metrics)
    metrics.update(old_metrics)
    metrics.update(mismatch_metrics(cfg.dual, cfg.algo, batch, result, step, s.state.dual.floor_C))
    metrics.update(_guard_step(s, step, metrics, kept, stale_drop=async_metrics.get("async/dropped_batches", 0) > 0))
    metrics.update(_timings(rollout, t0, t1, t2, t3, t4, t5, t6))
    metrics.update(async_metrics)
    metrics["rollout/precision_bits"] = PRECISION_BITS[cfg.rollout.precision_at(step)]
    if s.dist.device.type == "cuda":
        metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(s.dist.device) / 2**30
    if cfg.task.curriculum:
        metrics["task/digits"] = float(cfg.task.phase_at(step).digits)
    if s.worker is not None:
        metrics["time/trainer_idle_frac"] = (t1 - t0) / max(t6 - t0, 1e-9)
    if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
        metrics["eval/accuracy"] = evaluate(s, seed=cfg.seed)
    metrics = {k: float(v) for k, v in metrics.items()}
    s.state.history.append(metrics)
    s.state.done_step, s.state.mid_update = step + 1, False
    if step + 1 == FEASIBILITY_STEPS and s.dist.main:
        for w in feasibility_warnings(s.state.history, s.names, cfg.dual.constraints, cfg.dual.rule, cfg.dual.measure_at):
            log.warning("%s", w)
    if step == s.state.start_step and step > 0:
        # the engine got the trainer's weights at resume: a spike here would mean it did not
        log.info("first step after resume (step %d): %s", step + 1, ", ".join(
            f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("discrepancy/")))
    s.tracker.log_metrics(metrics, step=step + 1)
    if cfg.tracking.progress_file and s.dist.main:  # dcmdp tune follows, and may prune, a trial through it
        with open(cfg.tracking.progress_file, "a") as f:
            f.write(json.dumps({"step": step + 1, "run_id": s.tracker.run_id, **metrics}) + "\n")
    bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.2f}",
                    **{f"lam_{n}": f"{float(v):.3g}" for n, v in zip(s.names, s.state.dual.lambda_C)})
    if bar.disable and s.dist.main and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
        log.info("%s", step_line(s, step + 1, metrics))
        s.state.line_mark = (step + 1, time.perf_counter())
    _watch_signal(s, step + 1, metrics)


def _enter_context(s: Setup, step: int, async_metrics: dict[str, float]) -> dict[str, float]:
    """Per-context multipliers (``dual.context``): switch the dual state to this batch's context before the penalty
    and the dual step; metric dual/context (the staleness bucket's index, the precision's bits or the digits)."""
    cfg = s.cfg
    if cfg.dual.context.by == "none":
        return {}
    phase = cfg.task.phase_at(step)
    key, value = cfg.dual.context.key(async_metrics.get("async/staleness_mean", 0.0), cfg.rollout.precision_at(step),
                                      cfg.task.digits if phase is None else phase.digits)
    s.state.dual = enter_context(s.state.dual, key, cfg.dual)
    return {"dual/context": value}


def show_bar(cfg: RunConfig) -> bool:
    """``progress``, or when unset, whether stdout and stderr are terminals (a bar redirected to a file is a line
    per refresh)."""
    return cfg.progress if cfg.progress is not None else sys.stdout.isatty() and sys.stderr.isatty()


def step_line(s: Setup, step: int, metrics: dict[str, float]) -> str:
    """The console line of a step when no progress bar is shown: this step's reward, training accuracy (the sampled
    rollouts'), lambda and D-hat; the wall time per step since the previous line (evaluations included) and the ETA."""
    nan = float("nan")
    lam = " ".join(f"{n}={float(v):.3g}" for n, v in zip(s.names, s.state.dual.lambda_C)) or "-"
    measured = " ".join(f"{n}={metrics.get(f'dual/measured/{n}', nan):.3g}" for n in s.names) or "-"
    since, t_since = s.state.line_mark
    per_step = (time.perf_counter() - t_since) / max(step - since, 1)
    eta = int(round(per_step * (s.cfg.steps - step)))
    return (f"step {step}/{s.cfg.steps}: reward {metrics.get('reward/mean', nan):.3f}, rollout accuracy "
            f"{metrics.get('reward/accuracy', nan):.1%}, lambda {lam}, D-hat {measured}, {per_step:.2f} s/step "
            f"(mean of steps {since + 1}-{step}), ETA {eta // 60}m{eta % 60:02d}s")


# RL has no signal when at least this share of the groups has one reward for every sample ...
NO_SIGNAL_FRAC = 0.95
# ... for this many steps in a row: warned once per such stretch.
NO_SIGNAL_STEPS = 20


def _watch_signal(s: Setup, step: int, metrics: dict[str, float]) -> None:
    """Warn when almost every group's rewards are all equal (``advantage/zero_groups_frac``) for many steps in a
    row: group advantages are then 0 and RL cannot learn, though nothing fails."""
    zero = metrics.get("advantage/zero_groups_frac")
    s.state.no_signal_steps = s.state.no_signal_steps + 1 if zero is not None and zero >= NO_SIGNAL_FRAC else 0
    if s.state.no_signal_steps == NO_SIGNAL_STEPS and s.dist.main:
        log.warning("RL has no signal: for %d steps in a row (up to step %d) at least %.0f%% of the groups gave the "
                    "same reward to every sample (advantage/zero_groups_frac), so their advantages are 0 and the "
                    "policy does not move (reward/accuracy %.1f%%); the task is too hard or too easy for the model: "
                    "check the cold start (cold_start.steps, cold_start.target_accuracy), the task, or raise "
                    "algo.samples_per_prompt", NO_SIGNAL_STEPS, step, 100 * NO_SIGNAL_FRAC,
                    100 * metrics.get("reward/accuracy", float("nan")))


def screen_phase(algo: AlgoConfig, rollout: Rollout, rewards_B: torch.Tensor, fresh_B: Optional[torch.Tensor] = None
                 ) -> tuple[Rollout, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Drop the samples with a non-finite rollout log-prob, reward or advantage (``trainers.guards``), and
    those outside ``fresh_B`` (too stale, ``dcmdp.async_rollout.screen_stale``).

    Advantages come from the kept samples of each group only; returns the masked rollout, advantages_B
    (0 at dropped samples), keep_B and the guard/ and advantage metrics.
    """
    rewards_B = rewards_B.to(rollout.rollout_logp_BT.device)  # rewards come from the host, a rollout may not
    keep_B, metrics = guards.screen_rows(rollout.rollout_logp_BT, rollout.response_mask_BT, rewards_B)
    if fresh_B is not None:
        keep_B = keep_B & fresh_B.to(keep_B.device)
    advantages_B, adv_metrics = guards.screened_advantages(ADVANTAGES[algo.advantage], rewards_B, keep_B,
                                                           algo.samples_per_prompt, algo)
    keep_B, adv_guard = guards.screen_advantages(advantages_B, keep_B)
    advantages_B = torch.where(keep_B, advantages_B, torch.zeros((), dtype=advantages_B.dtype))
    return guards.mask_rows(rollout, keep_B), advantages_B, keep_B, {**metrics, **adv_guard, **adv_metrics}


def _guard_step(s: Setup, step: int, metrics: dict[str, float], kept: bool, stale_drop: bool = False
                ) -> dict[str, float]:
    """Count the step as bad (every sample dropped, or an update skipped), warn, and report guard/ metrics. A batch
    dropped whole as too stale (``stale_drop``, async_rollout.too_stale=drop) is not bad (its samples were fine) and
    leaves the count of bad steps in a row as it was."""
    skipped = metrics.get("guard/skipped_updates", 0.0)
    bad = (not kept and not stale_drop) or skipped > 0
    s.state.bad_steps = s.state.bad_steps + 1 if bad else s.state.bad_steps if stale_drop else 0
    dropped = {k: v for k, v in metrics.items() if k.startswith("guard/bad_") and v > 0}
    if dropped or bad:
        what = ", ".join(f"{int(v)} for a non-finite {k.removeprefix('guard/bad_').removesuffix('_samples')}"
                         for k, v in dropped.items())
        log.warning("step %d: non-finite values (samples dropped: %s; updates skipped: %d)%s; %d consecutive bad "
                    "step(s)", step + 1, what or "none", int(skipped), "; every sample dropped" if not kept else "",
                    s.state.bad_steps)
    return {"guard/dropped_samples": float(sum(dropped.values())), "guard/skipped_updates": float(skipped),
            "guard/skipped_step": float(not kept),
            "guard/bad_step": float(bad), "guard/consecutive_bad_steps": float(s.state.bad_steps)}


def stop_on_failing_reward(s: Setup, step: int) -> None:
    """After step ``step``: when the reward failed too often for too long (``failing_steps``), checkpoint the step,
    end the MLflow run FAILED and raise ConfigError; nothing otherwise. Rank 0 decides for every rank."""
    cfg = s.cfg
    samples = cfg.algo.prompts_per_step * cfg.algo.samples_per_prompt
    errors = [h.get("reward/errors", 0.0) for h in s.state.history[-cfg.guard.reward_fail_steps:]]
    window = run_end_window(len(s.state.history), cfg.guard) if step == cfg.steps else None
    guard = dataclasses.replace(cfg.guard, reward_fail_steps=window) if window else cfg.guard
    if not s.dist.from_main(failing_steps(errors, samples, guard)):
        return
    message = stop_message(last_failure(s.policy.task), cfg.task.reward, samples, cfg.guard, step, window)
    path = checkpoint(s, step)
    s.tracker.finish("FAILED")
    raise ConfigError(f"training stopped: {message}; checkpoint of step {step} written to {path} (resume with "
                      f"checkpoint.resume=auto once the reward is fixed), MLflow run ended FAILED")


def _stop_bad_run(s: Setup, step: int) -> None:
    """Checkpoint, mark the run failed and raise: too many consecutive bad steps."""
    path = checkpoint(s, step)
    last = s.state.history[-1]
    what = ", ".join(f"{k}={v:g}" for k, v in last.items()
                     if k.startswith("guard/") and k != "guard/consecutive_bad_steps" and v)
    s.tracker.finish("FAILED")
    s.policy.engine.close()
    raise guards.TooManyBadStepsError(
        f"{s.state.bad_steps} consecutive bad steps up to step {step} "
        f"(guard.max_bad_steps={s.cfg.guard.max_bad_steps}): "
        f"non-finite values in the rollout log-probs, rewards, advantages, pi_old log-probs, loss or gradient norm; "
        f"last step: {what}; checkpoint of step {step} written to {path}")


def setup(cfg: RunConfig, *, owns_folder: bool = True) -> Setup:
    """Seeds, tokenizer, task, (cold-started) model, rollout engine, optimiser, dual state, tracker.

    ``owns_folder=False`` (``dcmdp calibrate``, which trains nothing): no lock on output_dir, no resume, and the run
    folder's checkpoints and config.yaml are left as they are; only a new MLflow run is added to its store."""
    d = distributed.init(cfg)
    if not show_bar(cfg):  # transformers' own bars (saving a model) too: a redirected log gets no bar lines
        import transformers

        transformers.utils.logging.disable_progress_bar()
    seed_everything(cfg.seed)
    why_threads = apply_threads(cfg.threads)
    if d.main:
        log.info("%s", why_threads)
    out = Path(cfg.output_dir)
    try:  # a folder the user cannot write (or reach) is named as such before the tracking store beside it is tried
        os.stat(out)
        blocked = not os.access(out, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids)
    except FileNotFoundError:
        blocked = False
    except PermissionError:
        blocked = True
    if blocked:
        raise OSError(errno.EACCES, f"output_dir={cfg.output_dir!r} is not a writable directory: Permission denied "
                                    f"({out})")
    # an unusable URI would keep nothing but buffered metrics: refuse it before anything is written
    if cfg.tracking.enabled:
        check_tracking_config(cfg.tracking, out)
        check_sqlite_store(cfg.tracking, out)
    lock, error = None, None
    try:
        out.mkdir(parents=True, exist_ok=True)
        if d.main and owns_folder:
            lock = RunFolderLock(out).acquire()
    except OSError as exc:
        error = OSError(exc.errno, f"output_dir={cfg.output_dir!r} is not a writable directory: "
                                   f"{exc.strerror or exc} ({exc.filename or out})")
    except RunFolderError as exc:
        error = exc
    error = d.from_main(error)  # every rank stops alike, none waits in a collective for rank 0
    if error is not None:
        raise error
    try:
        return _build(cfg, d, out, lock, owns_folder)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


@dataclass
class _Start:
    """Where a run starts: the checkpoint it continues (None: a fresh run) and whose run that is."""

    resume: Optional[Path] = None
    state: Optional[dict] = None
    # The run identity this process logs under (``<output_dir>/run.json`` and every checkpoint).
    uid: str = ""
    # The checkpoint is another run's, named explicitly: a new MLflow run, linked to that one.
    foreign: bool = False
    # The MLflow run of an earlier run this folder held before ``overwrite=true`` cleared it.
    replaced_run_id: Optional[str] = None


def _unreadable_run_file(out: Path) -> Optional[str]:
    """Why ``<out>/run.json`` exists but names no run (damaged: not JSON, too deep or large, not a mapping), else
    None (absent, or readable)."""
    from trainers.jsonfile import read_small_json

    path = out / "run.json"
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = read_small_json(path)
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__
    return None if isinstance(data, dict) and data.get("uid") else "it holds no run uid"


def _clear_earlier_run(out: Path, d: distributed.Dist) -> None:
    """``overwrite=true``: remove what the folder's earlier run wrote (its run.json names it; anything else stays,
    ``clear_run_folder``), or refuse on every rank, nothing removed, when no run.json proves a run wrote the files a
    run would write over (``unclaimed_outputs``)."""
    refusal = d.from_main(unclaimed_outputs(out) if d.main else None)
    if refusal:
        raise RunFolderInputError(refusal)
    if d.main:
        clear_run_folder(out)


def _resume_state(cfg: RunConfig, out: Path, d: distributed.Dist) -> _Start:
    """The checkpoint to continue from and its payload, checked against ``cfg`` before any file or MLflow run is
    touched; for a fresh run, refuse (or with ``overwrite``, clear) a folder that holds an earlier run."""
    found = load_resume_checkpoint(out / "checkpoints", cfg.checkpoint.resume) if d.main else None
    resume = d.from_main(found[0] if found is not None else None)
    owner = read_run_file(out)
    if resume is None:
        if cfg.checkpoint.resume and cfg.checkpoint.resume != "auto":
            raise InputFileNotFoundError(f"checkpoint.resume={cfg.checkpoint.resume!r}: no checkpoint there")
        # every rank raises alike (rank 0 alone raising would leave the others waiting in a collective)
        earlier = d.from_main(run_in_folder(out) if d.main and not cfg.checkpoint.resume else None)
        if earlier and not cfg.overwrite:
            raise RunFolderInputError(f"output_dir {out} already holds a run ({earlier}): continue it with "
                                      f"checkpoint.resume=auto, start afresh there with overwrite=true (removes its "
                                      f"checkpoints, summary.json and dual.png, which its run.json proves it wrote; "
                                      f"anything else, and its MLflow run, stays), or choose another output_dir")
        if earlier:
            _clear_earlier_run(out, d)
        # the folder's earlier run, if its MLflow run is still RUNNING, was killed (the folder's lock is ours now)
        return _Start(uid=new_run_uid(), replaced_run_id=owner.get("run_id"))
    state = found[1] if found is not None else load_checkpoint(resume)
    saved = state.get("config")
    if saved is None:
        log.warning("checkpoint %s records no config (written by an older dcmdp): its compatibility with this "
                    "config is not checked", resume)
    elif conflicts := resume_conflicts(saved, cfg):
        raise ConfigError(f"cannot resume from {resume}: the config differs from the checkpoint's in "
                          f"{'; '.join(conflicts)}. Resume with the checkpoint's values, or start a new run in "
                          f"another output_dir; nothing was changed")
    if cfg.steps < int(state["step"]):
        raise ConfigError(f"config error at 'steps': steps={cfg.steps} is below the step of the checkpoint it resumes "
                          f"({int(state['step'])}, {resume}); a run cannot go back: set steps >= "
                          f"{int(state['step'])}; nothing was changed")
    if "model" in state and d.sharded:
        raise RunFolderInputError(f"checkpoint {resume} was written by a single-process run; resume it with world "
                                  f"size 1 (without torchrun), or start the {d.world}-rank run afresh")
    uid = checkpoint_run_uid(state)
    if uid is None or uid == owner.get("uid"):
        return _Start(resume, state, uid=uid or owner.get("uid") or new_run_uid())
    whose = (f"run {uid} (MLflow run {state.get('run_id')}"
             f"{', written in ' + state['run']['output_dir'] if state['run'].get('output_dir') else ''})")
    inside = Path(resume).resolve().parent == (out / "checkpoints").resolve()
    if (cfg.checkpoint.resume == "auto" or inside) and (damaged := _unreadable_run_file(out)):
        raise RunFolderInputError(
            f"{out / 'run.json'}, which names the run that owns output_dir, cannot be read ({damaged}), so checkpoint "
            f"{resume} of run {uid} cannot be told to be this folder's own: if it is, restore run.json as "
            f"{json.dumps({'uid': uid, 'run_id': state.get('run_id')})} and resume again; nothing was changed")
    if cfg.checkpoint.resume == "auto" or inside:
        raise RunFolderInputError(f"checkpoint {resume} belongs to another {whose}, not to the run of output_dir "
                                  f"{out}{' (run ' + owner['uid'] + ')' if owner.get('uid') else ''}: "
                                  + ("checkpoint.resume=auto continues a folder's own run only; "
                                     if cfg.checkpoint.resume == "auto" else "")
                                  + "to start a new run from it, move it out of checkpoints/ and name it: "
                                  "checkpoint.resume=<its path> (a new MLflow run, linked to that one); nothing was "
                                  "changed")
    earlier = d.from_main(run_in_folder(out) if d.main else None)
    if earlier and not cfg.overwrite:
        raise RunFolderInputError(f"output_dir {out} already holds a run ({earlier}), and checkpoint {resume} "
                                  f"belongs to another {whose}: start from it in another output_dir, or clear this "
                                  f"one with overwrite=true; nothing was changed")
    if earlier:
        _clear_earlier_run(out, d)
    log.warning("checkpoint %s belongs to another %s: starting a new MLflow run from its step %d, linked to that run "
                "(tag dcmdp.resumed_from_run)", resume, whose, int(state["step"]))
    return _Start(resume, state, uid=new_run_uid(), foreign=True, replaced_run_id=owner.get("run_id"))


def _probe_run_paths(cfg: RunConfig, out: Path, d: distributed.Dist) -> None:
    """Every path the run will write, written once before the cold start (``unwritable_run_paths``): a checkpoints/
    the run cannot write would otherwise be found at the last step, with every step's weights lost."""
    buffer_key = "tracking.buffer_dir" if cfg.tracking.buffer_dir else "output_dir"
    found = d.from_main(unwritable_run_paths(out, resolve_buffer_dir(cfg.tracking, out) if cfg.tracking.enabled
                                             else None, buffer_key) if d.main else None)
    if found:
        raise RunPathInputError("; ".join(message for _, message in found))


def _build(cfg: RunConfig, d: distributed.Dist, out: Path, lock: Optional[RunFolderLock], owns_folder: bool = True
           ) -> Setup:
    start = _resume_state(cfg, out, d) if owns_folder else _Start()
    if owns_folder:
        _probe_run_paths(cfg, out, d)
    resume, state = start.resume, start.state
    # the parameters in the optimiser's dtype, cast after the cold start (cached at the model's own dtype) and after
    # the engine took its copy; under torchrun sharded, built shard by shard
    policy = build_policy(cfg, out, d=d, progress=show_bar(cfg), param_dtype=precision_param_dtype(cfg.optim.precision))
    screen_task_prompts(policy, cfg.rollout.max_new_tokens)
    model = policy.model
    optimizer = build_optimizer(model.parameters(), cfg.optim, seed=cfg.seed)
    # float16 compute needs dynamic loss scaling: small gradients underflow in float16 without it
    scaler = (torch.amp.GradScaler(next(model.parameters()).device.type) if compute_dtype(model) == torch.float16
              else None)
    scheduler = None
    if cfg.optim.warmup_steps > 0:
        warm = cfg.optim.warmup_steps * cfg.algo.minibatches
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warm))
    dual, history, start_step, run_id, bad_steps = init_state(cfg.dual), [], 0, None, 0
    accuracy_before = None
    if resume is not None:
        distributed.restore_model_optimizer(resume, state, model, optimizer, d)
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        dual, history = DualState.from_state_dict(state["dual"]), list(state["history"])
        start_step, run_id = int(state["step"]), None if start.foreign else state["run_id"]
        bad_steps = int(state.get("guard", {}).get("consecutive_bad_steps", 0))
        distributed.restore_rank_rng(state, d)
        # the engine must sample from the trainer's weights, not the cold start's, from the first new rollout
        policy.engine.load_weights(model.state_dict(), version=int(state["engine_version"]))
        accuracy_before = state.get("accuracy_before")
        log.info("resumed from %s at step %d (MLflow run %s)", resume, start_step, run_id)
    caps = {n: c.lambda_max for n, c in zip(constraint_names(cfg.dual.constraints), cfg.dual.constraints)}
    tracker = Tracker(cfg.tracking, out, dual_caps=caps) if d.main and cfg.tracking.enabled else NoTracker()
    parent = ({"run_id": state.get("run_id"), "uid": checkpoint_run_uid(state), "checkpoint": str(resume)}
              if start.foreign else None)
    tracker.start(flatten(cfg), run_id=run_id,
                  tags={"model.preset": cfg.model.preset, "dcmdp.version": _version(), "dcmdp.device": str(d.device),
                        **({"dcmdp.random_init": f"RANDOM weights ({cfg.model.num_layers or 'all'} layers), character "
                                                 f"tokenizer stand-in: a speed and memory run"}
                           if cfg.model.init == "random" else {}),
                        "dcmdp.output_dir": written_field(cfg, "output_dir") or str(out.resolve()), "dcmdp.run_uid": start.uid, **provenance_tags(),
                        **({"dcmdp.resumed_from_run": str(parent["run_id"]), "dcmdp.resumed_from": str(resume)}
                           if parent else {})})
    try:
        if d.main and owns_folder:
            write_run_file(out, start.uid, tracker.run_id, parent, tracking_uri=public_uri(tracker.tracking_uri))
            if start.replaced_run_id and start.replaced_run_id != tracker.run_id:
                tracker.end_stale_run(start.replaced_run_id)
        if resume is not None and d.main and not start.foreign:
            # the steps between the checkpoint and the crash were logged once already: they are not logged again
            tracker.skip_logged(after_step=start_step)
        if d.main and owns_folder:  # written once the run started cleanly: a run that failed to start leaves the old
            tracker.log_artifact(write_config_yaml(out, to_yaml(cfg, public=True), [f.name for f in fields(RunConfig)]))
    except BaseException:  # a full disk: the MLflow run is not left RUNNING, and the tracker counts what it lost
        tracker.finish("FAILED")
        raise
    scoring = learner.ScoringSpec(temperature=cfg.rollout.temperature, fp32_lm_head=cfg.model.fp32_lm_head,
                                  lm_head_kernel=cfg.model.lm_head_kernel, moe=policy.moe, shard=d.shard,
                                  micro_batch_tokens=cfg.algo.micro_batch_tokens)
    optim = learner.OptimStep(optimizer, scheduler, scaler, cfg.optim.grad_clip)
    run_state = RunState(dual, history, start_step, bad_steps, accuracy_before, done_step=start_step,
                         checkpointed_step=start_step, run_uid=start.uid)
    return Setup(cfg, policy, scoring, optim, tracker, constraint_names(cfg.dual.constraints), run_state, dist=d,
                 lock=lock)


def checkpoint(s: Setup, step: int) -> Path:
    """Everything a bitwise-identical continuation needs; written atomically, last ``keep`` kept."""
    s.tracker.flush()  # the metrics of the steps this checkpoint covers are stored or on disk before it exists
    if s.worker is not None:
        # the engine then holds version ``step``, and the rollout schedule restarts there, as on resume
        s.worker.drain(s.policy.model.state_dict(), step, bound=_bound(s))
    payload = {"step": step, "model": s.policy.model.state_dict(), "optimizer": s.optim.optimizer.state_dict(),
               "scheduler": s.optim.scheduler.state_dict() if s.optim.scheduler is not None else None,
               "dual": s.state.dual.state_dict(), "engine_version": s.policy.engine.version, "run_id": s.tracker.run_id,
               "history": s.state.history, "rng": capture_rng(), "guard": {"consecutive_bad_steps": s.state.bad_steps},
               "config": flatten(s.cfg), "accuracy_before": s.state.accuracy_before,
               "run": {"uid": s.state.run_uid, "output_dir": written_field(s.cfg, "output_dir")
                                                               or str(Path(s.cfg.output_dir).resolve())},
               "scaler": s.optim.scaler.state_dict() if s.optim.scaler is not None else None}
    ckpt_dir = Path(s.cfg.output_dir) / "checkpoints"
    if s.dist.sharded:
        payload = {k: v for k, v in payload.items() if k not in ("model", "optimizer")}
        path = distributed.save_sharded_checkpoint(ckpt_dir, step, payload, s.policy.model, s.optim.optimizer,
                                                   keep=s.cfg.checkpoint.keep, d=s.dist)
    else:
        path = save_checkpoint(ckpt_dir, step, payload, keep=s.cfg.checkpoint.keep)
    s.state.checkpointed_step = step
    return path


def rollout_phase(policy: Policy, cfg: RunConfig, step: int) -> tuple[list[Example], Rollout]:
    """Sample B prompts, G responses each; row p*G + g is sample g of prompt p."""
    rng = random.Random(step_seed(cfg.seed, step, 0))
    source = policy.curriculum.task_at(step) if policy.curriculum is not None else policy.task
    prompts = source.sample(rng, cfg.algo.prompts_per_step)
    examples = [ex for ex in prompts for _ in range(cfg.algo.samples_per_prompt)]
    ids = encode_prompts(policy.tokenizer, policy.model, examples, cfg.rollout.max_new_tokens)
    if cfg.rollout.precision_schedule:
        policy.engine.set_precision(cfg.rollout.precision_at(step))
    rollout = policy.engine.generate(ids, seed=step_seed(cfg.seed, step, 1))
    return examples, rollout


def _sampled_by_current_weights(s: Setup, rollout: Rollout, step: int) -> bool:
    """True when every sample of the batch of ``step`` comes from the trainer's current weights (version
    ``step``): always in a synchronous run; under asynchronous rollouts at the start and after each drain."""
    return s.worker is None or rollout.version_B is None or bool((rollout.version_B == step).all())


def _next_rollout(s: Setup, step: int) -> tuple[list[Example], Rollout, Optional[torch.Tensor], dict[str, float]]:
    """The batch of ``step``: sampled here, or taken from the rollout worker with its staleness screen."""
    if s.worker is None:
        return (*rollout_phase(s.policy, s.cfg, step), None, {})
    a = s.cfg.async_rollout
    bound = _bound(s) if a.is_auto else a.cap()
    # dual.floor_by: a precision without a floor yet gets a batch of the trainer's current weights, which measures it
    fresh = s.cfg.dual.floor_by != "none" and needs_floor(s.state.dual, s.cfg.dual)
    batch, fresh_B, metrics = s.worker.take(step, bound, a.too_stale, s.policy.model.state_dict(), fresh=fresh)
    plan = s.worker.staleness_of
    if a.forced != "off":
        metrics["async/staleness_forced"] = float(plan(step))
    return batch.examples, batch.rollout, fresh_B, metrics


def _bound(s: Setup) -> Optional[int]:
    """The staleness bound the controller sets now (max_staleness: auto), None otherwise."""
    return bound_in_force(s.state.dual, s.cfg.async_rollout.auto) if s.cfg.async_rollout.is_auto else None


def _rollout_worker(s: Setup) -> Optional[RolloutWorker]:
    cfg = s.cfg.async_rollout
    if not cfg.enabled:
        return None
    if cfg.is_auto:
        s.state.dual = with_staleness(s.state.dual, cfg.auto)
    return RolloutWorker(s.policy.engine, lambda step: rollout_phase(s.policy, s.cfg, step), start=s.state.start_step,
                         stop=s.cfg.steps, cap=cfg.cap(), threads=cfg.threads, state_dict=s.policy.model.state_dict(),
                         staleness_of=staleness_plan(cfg, s.cfg.seed), bound=_bound(s))


def reward_phase(policy: Policy, examples: list[Example], rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
    completions = decode_responses(policy.tokenizer, rollout)
    rewards, errors = score_completions(policy.task, completions, examples)
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    lengths = rollout.response_mask_BT.sum(dim=1).float()
    return rewards_B, {"reward/accuracy": float((rewards_B > 0.5).float().mean()), "reward/errors": float(errors),
                       "response/length_mean": float(lengths.mean())}


def anchor_probes(s: Setup, batch: learner.ScoredBatch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """D-hat at the updates of this batch without the penalty and at lambda_max (``dcmdp.probe.probe_updates``, from
    the run's weights, moments and this step's mini-batches, all put back): the anchored tolerance's probes."""
    cfg = s.cfg
    lam_max_C = torch.tensor([c.lambda_max for c in cfg.dual.constraints], dtype=torch.float64)
    at_zero_C, at_max_C = probe_updates(s.policy.model, s.optim, batch, scoring=s.scoring, algo=cfg.algo,
                                        dual_state=s.state.dual, dual_cfg=cfg.dual,
                                        lambdas=[torch.zeros_like(lam_max_C), lam_max_C],
                                        seed=step_seed(cfg.seed, step, 2))
    return at_zero_C, at_max_C


def measure_phase(constraints: Sequence[ConstraintConfig], batch: learner.ScoredBatch,
                  train_logp_BT: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, float]]:
    """D-hat of every constraint (the training engine's ``train_logp_BT`` vs mu: pi_old before the updates) and
    all discrepancy measures, with the per-token p50/p90/p99 of every constraint's measure.

    With ``dual.measure_at: updates`` the loop replaces D-hat after the updates (``constraint_values`` of
    the log-probs the updates saw); the discrepancy/ metrics stay pi_old vs mu. With ``algo.old_logp: rollout``
    and N > 1 there is no pi_old: ``train_logp_BT`` is then pi_theta at each token's update. Default: pi_old."""
    r = batch.rollout
    train_logp_BT = batch.old_logp_BT if train_logp_BT is None else train_logp_BT
    return constraint_values(constraints, batch, train_logp_BT), discrepancy_metrics(
        train_logp_BT, r.rollout_logp_BT.float(), r.response_mask_BT.bool(), **batch.routes(),
        quantiles_of=[c.measure for c in constraints])


@torch.no_grad()
def evaluate(s: Setup, seed: int) -> float:
    """Held-out accuracy: share of eval prompts whose sampled response (rollout temperature) is correct."""
    if s.worker is not None:
        # between two worker batches, on the trainer's current weights
        return s.worker.evaluate(lambda: _evaluate(s, seed), s.policy.model.state_dict())
    return _evaluate(s, seed)


def _evaluate(s: Setup, seed: int) -> float:
    if s.state.eval_examples is None:
        s.state.eval_examples = held_out_examples(s.policy)
    return held_out_accuracy(s.policy, s.state.eval_examples, s.cfg.rollout.max_new_tokens, seed)


def finish(s: Setup, acc_before: float, acc_after: float, seconds: float) -> Summary:
    cfg, out = s.cfg, Path(s.cfg.output_dir)
    if s.state.history and s.names and s.dist.main:
        # history[i] is step i + 1, as in MLflow
        plot_dual([{**h, "step": i + 1} for i, h in enumerate(s.state.history)], s.names, out / "dual.png",
                  lambda_init={n: c.lambda_init for n, c in zip(s.names, cfg.dual.constraints)},
                  lambda_max={n: c.lambda_max for n, c in zip(s.names, cfg.dual.constraints)})
        s.tracker.log_artifact(out / "dual.png")
    # steps with every sample dropped measured nothing and have no discrepancy/ keys
    disc_keys = dict.fromkeys(k for h in s.state.history for k in h if k.startswith("discrepancy/"))
    mean_disc = {k.split("/", 1)[1]: float(np.mean([h[k] for h in s.state.history if k in h])) for k in disc_keys}
    constraints = constraint_summaries(s.state.history, s.names, cfg.dual.constraints, cfg.optim.warmup_steps)
    warnings = end_of_run_warnings(constraints, cfg.dual.rule, acc_after, getattr(s.policy.task, "chance_accuracy", 0.0),
                                   len(s.state.eval_examples or ()))
    summary = Summary(acc_before, acc_after, {n: float(v) for n, v in zip(s.names, s.state.dual.lambda_C)}, mean_disc,
                      cfg.steps, s.tracker.run_id, public_uri(s.tracker.tracking_uri),
                      written_field(cfg, "output_dir") or str(out), seconds,
                      s.state.start_step, constraints, warnings)
    if s.dist.main:
        for w in warnings:
            log.warning("%s", w)
        (out / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=2))
    s.tracker.log_artifact(out / "summary.json")
    s.tracker.finish()
    s.policy.engine.close()
    distributed.shutdown(s.dist)
    return summary


def _timings(rollout: Rollout, t0, t1, t2, t3, t4, t5, t6) -> dict[str, float]:
    tokens = float(rollout.response_mask_BT.sum())
    return {"time/rollout": t1 - t0, "time/old_logp": t2 - t1, "time/measure": t3 - t2, "time/update": t4 - t3,
            "time/dual": t5 - t4, "time/sync": t6 - t5, "time/step": t6 - t0,
            "throughput/response_tokens_per_s": tokens / max(t6 - t0, 1e-9),
            "throughput/tokens": tokens + float(rollout.prompt_mask_BP.sum())}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dcmdp")
    except PackageNotFoundError:
        return "dev"
