"""Stop a run whose reward keeps failing: it trains on nothing.

A reward that fails on a sample (raises, exits, times out, passes its memory limit, returns NaN or no number) gives
that sample 0 and the run goes on (``trainers.tasks.score_completions``): one bad sample must not end a run. A reward
that fails on most samples step after step is another matter: every advantage is 0, the policy does not move, and a
run that ends with exit 0 and a held-out accuracy reads as finished. So after ``guard.reward_fail_steps`` consecutive
steps with more than ``guard.reward_fail_share`` of the samples failing, the run writes a checkpoint of its last step,
ends its MLflow run FAILED, and stops with a ``ConfigError`` (``dcmdp.loop.stop_on_failing_reward``) (exit 2: the reward is the user's to fix) that names the
reward, the share, the first failure of the last step and a command that runs the reward alone on that sample.
"""

from __future__ import annotations

from typing import Optional, Sequence

from dcmdp.config import GuardConfig
from trainers.tasks import RewardFailure, reward_alone_command


def failing_steps(errors_by_step: Sequence[float], samples: int, guard: GuardConfig) -> bool:
    """True when each of the last ``guard.reward_fail_steps`` steps (``errors_by_step``: the failed samples of each
    step so far, of ``samples`` per step) failed on more than ``guard.reward_fail_share`` of its samples."""
    recent = errors_by_step[-guard.reward_fail_steps:]
    return len(recent) == guard.reward_fail_steps and all(e > guard.reward_fail_share * samples for e in recent)


def run_end_window(steps_run: int, guard: GuardConfig) -> Optional[int]:
    """The steps the rule reads at the end of a run of ``steps_run`` steps shorter than ``guard.reward_fail_steps``
    (all of them: a reward that failed on each trained nothing, though the window never filled); None otherwise."""
    return steps_run if 0 < steps_run < guard.reward_fail_steps else None


def stop_message(failure: Optional[RewardFailure], spec: Optional[str], samples: int, guard: GuardConfig,
                 step: int, window: Optional[int] = None) -> str:
    """What the stop says: the reward, the share, the first failure of the last step, and how to run it alone;
    ``window``: the run ended after that many steps, fewer than guard.reward_fail_steps (``run_end_window``)."""
    steps = (f"every one of the run's {window} step(s), which ended before the {guard.reward_fail_steps} consecutive "
             f"steps the rule waits for" if window else
             f"each of {guard.reward_fail_steps} consecutive steps up to step {step}")
    share = f"more than {guard.reward_fail_share:.0%} of the {samples} samples of {steps} " \
            f"(guard.reward_fail_share={guard.reward_fail_share:g}, guard.reward_fail_steps={guard.reward_fail_steps})"
    if failure is None:
        return f"the reward failed on {share}, so the run trained on nothing"
    return (f"reward {failure.reward} failed on {share}, so the run trained on nothing; at step {step} it failed on "
            f"{failure.errors} of {failure.samples}, first: {failure.why} on prompt {failure.prompt[:60]!r}. Run it "
            f"alone on that sample: {reward_alone_command(failure, spec)}")
