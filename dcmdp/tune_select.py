"""The selection rule of ``dcmdp tune`` and the pruner that applies it while a trial runs: a trial's record
(``Trial``), what its per-step history says of it (``assess``, ``authority``, ``live_state``), which trial is
selected and why every other is not (``select``), and ``RulePruner``. The rule is stated in dcmdp/tune.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import optuna
from optuna.trial import FrozenTrial

from dcmdp.tune_file import SelectRule


@dataclass
class Trial:
    """One trial's outcome; ``lambda_history`` holds λ per step (steps 1..N) of every constraint."""

    trial: str
    settings: dict[str, Any]
    status: str = "ok"  # ok | pruned | failed | running
    error: str = ""
    accuracy_before: float = math.nan
    accuracy_after: float = math.nan
    mean_discrepancy: dict[str, float] = field(default_factory=dict)
    inside_frac: float = math.nan
    final_lambda: dict[str, float] = field(default_factory=dict)
    nonfinite_loss: bool = False
    peak_window_mean: float = math.nan
    final_window_mean: float = math.nan
    collapsed: bool = False
    eligible: bool = False
    selected: bool = False
    run_id: str = ""
    seconds: float = math.nan
    steps: int = 0
    number: int = -1
    reason: str = ""
    lambda_history: dict[str, list[float]] = field(default_factory=dict)
    # Per constraint with ``authority``: 1 on the steps its dual stood down (lambda held at 0 by its own measurement of
    # the reach against the spread, not by the config), 0 where it was in force.
    stood_down_history: dict[str, list[float]] = field(default_factory=dict)
    # The run's end-of-run warnings (summary.json: a constraint slack throughout, accuracy at chance level), and
    # held-out accuracy that ended below its start.
    warnings: list[str] = field(default_factory=list)
    # Largest share of steps over the constraints with the dual slack (lambda at its floor, D-hat < c), and with
    # lambda at its cap (summary.json; NaN: unknown).
    slack_frac: float = math.nan
    cap_frac: float = math.nan
    # Mean tolerance c over the steps, summed over the constraints (the tightness the rule prefers).
    mean_tolerance: float = math.nan
    # Held-out prompts behind accuracy_after (0: unknown; the standard error is then 0).
    eval_prompts: int = 0
    # Per constraint: the penalty's reach (median log D_0 - log D_max over the probed batches, dcmdp.dual.penalty_reach)
    # and the batch spread (sd of log D-hat after warm-up, dcmdp.dual.batch_spread); NaN: not measured.
    reach: dict[str, float] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)
    # Constraint -> why its inside share is not judged (an anchored c whose reach is under the spread, or not measured).
    unjudged: dict[str, str] = field(default_factory=dict)
    # Share of the post-warm-up steps with every judged constraint inside c (NaN: none judged).
    judged_inside_frac: float = math.nan



def assess(trial: Trial, history: dict[str, list[float]], names: Sequence[str], rule: SelectRule,
           anchored: Optional[Sequence[bool]] = None) -> Trial:
    """Fill the per-step derived fields of ``trial`` from ``history`` (metric key -> values of steps 1..N).

    inside_frac = share of steps t > warmup_steps with measured_c(t) <= tolerance_c(t) for every constraint c;
    a non-finite D-hat counts as outside, a run without constraints is inside on every step, and a run with
    no step after warm-up gets NaN (and is not eligible). judged_inside_frac is the same share over the judged
    constraints (``authority``; ``anchored``: whether each constraint's c is anchored, by default whether it was
    probed).
    """
    inside = _inside(history, names, rule)
    trial.steps = max((len(v) for v in history.values()), default=0)
    trial.inside_frac = sum(inside) / len(inside) if inside else math.nan
    anchored = _anchored(history, names, anchored)
    trial.reach, trial.spread, trial.unjudged = {}, {}, {}
    for c, a in zip(names, anchored):
        trial.reach[c], trial.spread[c], note = authority(history, c, rule, a, live=False)
        if note:
            trial.unjudged[c] = note
    judged = [c for c in names if c not in trial.unjudged]
    inside_judged = _inside(history, judged, rule) if judged else []
    trial.judged_inside_frac = sum(inside_judged) / len(inside_judged) if inside_judged else math.nan
    trial.mean_discrepancy = {c: _finite_mean(history.get(f"dual/measured/{c}", [])) for c in names}
    trial.mean_tolerance = sum(_finite_mean(history.get(f"dual/tolerance/{c}", [])) for c in names) if names else 0.0
    trial.lambda_history = {c: list(history.get(f"dual/lambda/{c}", [])) for c in names}
    trial.stood_down_history = {c: list(history[f"dual/stood_down/{c}"]) for c in names
                                if f"dual/stood_down/{c}" in history}
    trial.final_lambda = {c: v[-1] for c, v in trial.lambda_history.items() if v}
    trial.nonfinite_loss = any(not math.isfinite(v) for k, vs in history.items() if k.startswith("loss/") for v in vs)
    means = _window_means(history.get(rule.collapse_metric, []), rule.collapse_window)
    trial.peak_window_mean = max(means) if means else math.nan
    trial.final_window_mean = means[-1] if means else math.nan
    trial.collapsed = trial.nonfinite_loss or (bool(means) and trial.final_window_mean < rule.collapse_drop_frac
                                               * trial.peak_window_mean)
    return trial


def authority(history: dict[str, list[float]], name: str, rule: SelectRule, anchored: bool,
              live: bool = True) -> tuple[float, float, str]:
    """(reach, spread, why not judged) of one constraint from ``history``: the reach from its probed batches
    (``dual/anchor_zero/<name>``, ``dual/anchor_max/<name>``; ``dcmdp.dual.penalty_reach``), the spread from
    ``dual/measured/<name>`` after warm-up (``dcmdp.dual.batch_spread``), NaN where not measured.

    The inside share of an anchored c is judged only where the reach is at least the spread: lambda in [0, lambda_max]
    shifts log D-hat by at most the reach while the batches scatter it by the spread, so below it the share is set by
    where the anchor placed c, and a placebo (lambda fixed at 0 or at lambda_max) meets it as well
    (``dcmdp.loop.control_sentence``). ``live`` (a running trial): the reach counts only once the first anchor window
    has closed (``dual/anchor_gap/<name>``). A fixed c, never probed, is a bound the user set: always judged."""
    from dcmdp.dual import batch_spread, penalty_reach

    measured = history.get(f"dual/measured/{name}", [])
    spread = batch_spread(measured[rule.warmup_steps:])
    reach = penalty_reach(history.get(f"dual/anchor_zero/{name}", []), history.get(f"dual/anchor_max/{name}", []))
    if live and not any(math.isfinite(v) for v in history.get(f"dual/anchor_gap/{name}", [])):
        reach = None
    reach_f, spread_f = (math.nan if x is None else x for x in (reach, spread))
    if not anchored or (reach is not None and spread is not None and reach >= spread):
        return reach_f, spread_f, ""
    if reach is None or spread is None:
        return reach_f, spread_f, f"inside c not judged: {'reach' if reach is None else 'spread'} not measured"
    return reach_f, spread_f, f"inside c not judged: reach {reach:.3g} under spread {spread:.3g}"


def _anchored(history: dict[str, list[float]], names: Sequence[str],
              anchored: Optional[Sequence[bool]]) -> list[bool]:
    return list(anchored) if anchored is not None else [f"dual/anchor_zero/{c}" in history for c in names]


def _inside(history: dict[str, list[float]], names: Sequence[str], rule: SelectRule) -> list[bool]:
    n = max((len(v) for v in history.values()), default=0)
    return [all(math.isfinite(d := _at(history, f"dual/measured/{c}", t))
                and d <= _at(history, f"dual/tolerance/{c}", t) for c in names) for t in range(rule.warmup_steps, n)]


def _window_means(watched: Sequence[float], window: int) -> list[float]:
    return [sum(watched[i:i + window]) / window for i in range(len(watched) - window + 1)] \
        or ([_finite_mean(watched)] if watched else [])


def live_state(history: dict[str, list[float]], names: Sequence[str], rule: SelectRule,
               anchored: Optional[Sequence[bool]] = None) -> dict[str, Any]:
    """What the pruner needs of a running trial: steps so far, post-warm-up steps outside the tolerance of a judged
    constraint (``authority`` on the history so far: an anchored c only once its first window closed and its reach
    is at least the running spread), a non-finite loss, and for how many trailing steps the collapse condition has
    held."""
    means = _window_means(history.get(rule.collapse_metric, []), rule.collapse_window)
    collapsed_for = 0
    for j in range(len(means) - 1, -1, -1):
        if not means[j] < rule.collapse_drop_frac * max(means[:j + 1]):
            break
        collapsed_for += 1
    judged = [c for c, a in zip(names, _anchored(history, names, anchored)) if not authority(history, c, rule, a)[2]]
    return {"live/steps": max((len(v) for v in history.values()), default=0),
            "live/outside": sum(not ok for ok in _inside(history, judged, rule)) if judged else 0,
            "live/nonfinite": any(not math.isfinite(v) for k, vs in history.items() if k.startswith("loss/")
                                  for v in vs),
            "live/collapsed_for": collapsed_for}


class RulePruner(optuna.pruners.BasePruner):
    """Prunes a trial that the selection rule can no longer pick, from the ``live/`` user attributes the
    tune process sets as the trial runs (``live_state``) and its ``steps_total``.

    Outside for good: more than (1 - min_inside_frac) x (steps_total - warmup_steps) post-warm-up steps with
    D-hat > c, so the inside share can no longer reach min_inside_frac; counted only for judged constraints, so a
    trial whose reach is under its running spread is never pruned for its inside share. Collapsed: a non-finite loss, or the
    collapse condition (last window mean < collapse_drop_frac x peak window mean) on ``patience`` steps in a
    row (a collapse that lasts is not expected to recover within the run).
    """

    def __init__(self, rule: SelectRule, patience: Optional[int] = None):
        self.rule, self.patience = rule, patience or rule.collapse_window

    def reason(self, attrs: dict[str, Any]) -> str:
        if not attrs.get("live/steps"):
            return ""
        allowed = (1 - self.rule.min_inside_frac) * max(attrs.get("steps_total", 0) - self.rule.warmup_steps, 0)
        if attrs.get("live/nonfinite"):
            return "non-finite loss"
        if attrs["live/outside"] > allowed + 1e-9:
            return (f"outside tolerance on {attrs['live/outside']} steps after warm-up, more than the "
                    f"{allowed:.3g} that {self.rule.min_inside_frac:.0%} inside allows")
        if attrs["live/collapsed_for"] >= self.patience:
            return f"collapsed ({self.rule.collapse_metric} window mean below {self.rule.collapse_drop_frac:g} x " \
                   f"its peak for {attrs['live/collapsed_for']} steps)"
        return ""

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return bool(self.reason(trial.user_attrs))


def accuracy_se(t: Trial) -> float:
    """Binomial standard error sqrt(p (1 - p) / n) of a trial's held-out accuracy (0 with n unknown)."""
    p = t.accuracy_after
    return math.sqrt(max(p * (1.0 - p), 0.0) / t.eval_prompts) if t.eval_prompts > 0 and math.isfinite(p) else 0.0


def select(trials: list[Trial], rule: SelectRule) -> Optional[Trial]:
    """Mark eligible trials, the selected one, why it was chosen and why every other was not; return it or None.

    Among the eligible trials (``_eligible``), the best accuracy p* and its standard error se (``accuracy_se``); the
    selected trial is the one with the smallest mean tolerance among those with accuracy >= p* - tolerance_se x se
    (ties: higher accuracy, larger inside share, smaller mean discrepancy, the earlier trial)."""
    for t in trials:
        t.selected = False
        t.eligible = _eligible(t, rule)
    eligible = [(i, t) for i, t in enumerate(trials) if t.eligible]
    if not eligible:
        for t in trials:
            t.reason = _why_not(t, None, rule)
        return None
    mean_d = lambda t: sum(t.mean_discrepancy.values()) if t.mean_discrepancy else 0.0  # noqa: E731
    top = max((t for _, t in eligible), key=lambda t: t.accuracy_after)
    floor = top.accuracy_after - rule.tolerance_se * accuracy_se(top)
    near = [(i, t) for i, t in eligible if t.accuracy_after >= floor]
    tight = lambda t: t.mean_tolerance if math.isfinite(t.mean_tolerance) else math.inf  # noqa: E731
    best = min(near, key=lambda it: (tight(it[1]), -it[1].accuracy_after, -_nan_low(it[1].inside_frac),
                                     mean_d(it[1]), it[0]))[1]
    for t in trials:
        t.reason = _why_not(t, best, rule, floor) if t is not best else _why_chosen(best, top, floor, len(near),
                                                                                   len(eligible), rule)
    best.selected = True
    return best


def _eligible(t: Trial, rule: SelectRule) -> bool:
    share = _judged_share(t)
    return (t.status == "ok" and not t.collapsed and math.isfinite(t.accuracy_after)
            and (share is None or share >= rule.min_inside_frac)
            and not t.slack_frac > rule.max_slack_frac and not t.cap_frac > rule.max_cap_frac  # NaN: unknown, passes
            and _fixed_lambda(t, rule) is None)


def _judged_share(t: Trial) -> Optional[float]:
    """The inside share the constraint clause judges: every constraint's (``inside_frac``) when each is judged, that
    of the judged ones when some are not, None (not required) when none is."""
    if not t.unjudged:
        return t.inside_frac
    return None if len(t.unjudged) >= len(t.reach) else t.judged_inside_frac


def _fixed_lambda(t: Trial, rule: SelectRule) -> Optional[tuple[str, float]]:
    """(constraint, value) of a lambda that held one value on every step after warm-up (at least 2) on which its dual
    was in force: a placebo (``dual.rule=fixed``, lambda at 0 or at lambda_max) or any constant, which no clause on
    D-hat tells from a dual; None when every lambda moved. The steps a dual with ``authority`` stood down are left
    out: its lambda 0 there is its own decision, taken at each anchor window from the reach it measured (a dual that
    stood down throughout is judged by the accuracy clause alone, as an unjudged c is), which no placebo logs."""
    for c, lam in t.lambda_history.items():
        down = t.stood_down_history.get(c, [])
        late = [v for k, v in enumerate(lam) if k >= rule.warmup_steps and math.isfinite(v)
                and not (k < len(down) and down[k] > 0.5)]
        if len(late) >= 2 and max(late) - min(late) <= 1e-12:
            return c, late[0]
    return None


def clause(t: Trial) -> str:
    """Which clause decides on the constraint: the inside share (judged), or the accuracy clause alone (not)."""
    if t.unjudged:
        many = len(t.reach) > 1
        return "; ".join(f"{note} ({c})" if many else note for c, note in t.unjudged.items())
    pairs = [(c, t.reach[c], t.spread.get(c, math.nan)) for c in t.reach if math.isfinite(t.reach[c])]
    if not pairs:
        return "inside c judged (a fixed c)" if t.reach else ""
    return "inside c judged: " + ", ".join(f"reach {r:.3g} >= spread {sp:.3g}" for _, r, sp in pairs)


def _why_chosen(best: Trial, top: Trial, floor: float, n_near: int, n_eligible: int, rule: SelectRule) -> str:
    decided = _decided(best, rule)
    if n_near == 1:
        return (f"selected: the best held-out accuracy ({best.accuracy_after:.1%}) of {n_eligible} eligible trial(s); "
                f"no other within {rule.tolerance_se:g} standard error(s) (>= {floor:.1%}){decided}")
    same = " (the best accuracy too)" if best is top else f" (best: {top.trial}, {top.accuracy_after:.1%})"
    return (f"selected: the tightest c (mean {best.mean_tolerance:.4g}) of the {n_near} eligible trials within "
            f"{rule.tolerance_se:g} standard error(s) of the best accuracy, >= {floor:.1%}; its accuracy "
            f"{best.accuracy_after:.1%}{same}{decided}")


def _decided(t: Trial, rule: SelectRule) -> str:
    """The clause that made ``t`` eligible on its constraint, as a tail of its reason ("" where nothing is known)."""
    what = clause(t)
    if not what:
        return ""
    if _judged_share(t) is None:
        return f"; eligible on the accuracy clause alone ({what})"
    return f"; {what}, inside on {_fmt(_judged_share(t), '.0%')} >= {rule.min_inside_frac:.0%}"


def _why_not(t: Trial, best: Optional[Trial], rule: SelectRule, floor: float = math.nan) -> str:
    if t.status != "ok":
        return f"{t.status}: {t.error}" if t.error else t.status
    if t.nonfinite_loss:
        return "collapsed: non-finite loss"
    if t.collapsed:
        return (f"collapsed: last {rule.collapse_window}-step mean {t.final_window_mean:.3g} < "
                f"{rule.collapse_drop_frac:g} x peak {t.peak_window_mean:.3g}")
    if not math.isfinite(t.accuracy_after):
        return "no held-out accuracy"
    if (share := _judged_share(t)) is not None and not share >= rule.min_inside_frac:
        return f"inside tolerance on {_fmt(share, '.0%')} of steps < {rule.min_inside_frac:.0%}"
    if t.slack_frac > rule.max_slack_frac:
        return (f"dual off: slack (lambda at its floor, D-hat < c) on {t.slack_frac:.0%} of steps > "
                f"{rule.max_slack_frac:.0%}")
    if t.cap_frac > rule.max_cap_frac:
        return f"lambda at its cap on {t.cap_frac:.0%} of steps > {rule.max_cap_frac:.0%}: a constant, not a controller"
    if (fixed := _fixed_lambda(t, rule)) is not None:
        return (f"lambda fixed at {fixed[1]:.4g} ({fixed[0]}) on every step after warm-up: a constant, not a "
                f"controller")
    assert best is not None
    if t.accuracy_after < floor:
        return (f"eligible, accuracy {t.accuracy_after:.1%} more than {rule.tolerance_se:g} standard error(s) under "
                f"the best (< {floor:.1%})")
    if t.mean_tolerance > best.mean_tolerance:
        return (f"eligible, within {rule.tolerance_se:g} standard error(s) of the best accuracy but a looser c than "
                f"{best.trial} (mean {_fmt(t.mean_tolerance)} > {_fmt(best.mean_tolerance)})")
    return f"eligible, same c as {best.trial}, lost the tie (accuracy, inside share, mean D, then order)"


def _at(history: dict[str, list[float]], key: str, t: int) -> float:
    values = history.get(key, [])
    return float(values[t]) if t < len(values) else math.nan


def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x




def _fmt(x: Any, spec: str = ".4g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
