"""Verifiable tasks at the text level: prompts, reference answers, rewards, demonstrations.

Tokenisation and chat templates are the caller's job; a task sees and returns plain strings. A
completion is the decoded response without EOS / padding. One builder signature::

    TASKS[name](cfg: TaskConfig, seed: int) -> Task

Generated tasks use printable ASCII only, so that a tiny character-level model can learn them.
``addition`` and ``sorting`` have short answers (at most 7 characters with the defaults):

- ``addition``: ``cfg.items`` operands of up to ``cfg.digits`` digits, prompt ``"47+38="``, answer ``"85"``.
- ``sorting``: ``cfg.items`` numbers of up to ``cfg.digits`` digits, prompt ``"S:3,1,2="``, answer
  ``"1,2,3"`` (ascending, duplicates kept).

Reward: 1.0 iff the completion, stripped of surrounding whitespace, equals the canonical answer exactly.

``long_addition`` has long responses, so that a training-inference mismatch per token compounds over a
sequence: schoolbook addition of two non-negative integers written out digit by digit with carries.

- Operands: each length drawn independently and uniformly in [``cfg.min_digits``, ``cfg.digits``], then
  the number uniformly among those of that length (leading digit non-zero; length 1 includes 0).
  ``cfg.items`` must be 2.
- Prompt ``"4738+915="``; answer (``Example.answer``) the sum, ``"5653"``.
- Demonstration: one step ``a+b+c=s;`` per digit position from the least significant, with the operand
  digits ``a``, ``b`` (0 where an operand has no digit there), the carry in ``c`` (0 or 1, always
  written) and the step's decimal sum ``s`` (0..19); one more step ``0+0+1=1;`` if a carry remains;
  then ``|`` and the sum. 4738+915 -> ``8+5+0=13;3+1+1=5;7+9+0=16;4+0+1=5;|5653``.
- Reward: 1.0 iff the text after the last ``|`` of the completion, stripped of surrounding whitespace,
  equals the sum exactly; 0.0 without a ``|``. The scratchpad is not graded (a wrong step with a right
  final answer still scores 1), but the final answer depends on every step the model wrote.
- Lengths with ``min_digits=3, digits=8`` (``configs/stress.yaml``): a correct response takes 29 to 91
  tokens including EOS (one character per token), mean 63.6 over 100k draws; the prompt 8 to 18 tokens.

Held-out split of generated tasks: the evaluation set is ``cfg.eval_size`` distinct prompts drawn with a
fixed generator that depends only on the task config, NOT on the run seed, so runs with different seeds
are scored on the same questions; ``sample`` rejects evaluation prompts, so training never sees them. The
eval set may take at most half of the prompt space (else a ValueError says so). The run seed does not
affect a generated task: training prompts come from the ``rng`` the caller passes to ``sample``.

``math`` reads JSONL problems (see ``load_math_jsonl``) and checks answers with the ``math-verify``
library (``pip install 'dcmdp[math]'``), imported when the task is built.

``jsonl`` is the user's own task: prompts (and optional demonstrations) from a JSON-lines file, scored by a
reward function the config names (``task.reward``), imported by the CLI on every rank; see ``JsonlTask`` and
docs/custom_tasks.md.

Every caller scores completions through ``score_completions``: a reward that raises, exits, runs past
``task.reward_timeout``, holds more than ``task.reward_memory_mib`` or returns anything but a finite number gives 0.0
for that sample, counted (``reward/errors``) and logged; scoring never raises for it (a run whose reward fails on most
samples step after step is stopped by the loop: ``dcmdp.reward_stop``, which names ``last_failure``). A ``jsonl``
reward outside [0, 1] is an error naming the function and the example (``RewardRangeError``): ``eval/accuracy`` is the
mean reward and ``reward/accuracy`` counts rewards > 0.5, so a value outside [0, 1] is a mistake the run cannot report
truthfully; a value within ``REWARD_ROUND_OFF`` of the range is float round-off and is clamped into it.
JSONL files are read as UTF-8 with an optional byte-order mark.

Where the parts live: ``Example`` and the ``Task`` protocol in trainers/task_base.py; the generated tasks in
trainers/generated_tasks.py; ``math``, ``jsonl`` and the reward's worker process in trainers/file_tasks.py; the
registry ``TASKS``, scoring (``score_completions``) and the curriculum here, where every name is importable as before.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, replace
from typing import Callable, Optional

from trainers.config import TaskConfig
from trainers.reward_fn import as_number
from trainers.reward_worker import RewardExited, RewardMemoryExceeded, RewardNotNumber, RewardRaised, RewardTimeout

# the parts, importable from here as before
from trainers.file_tasks import (JsonlTask, MathTask, RecordExample, _FileSplits, _import_math_verify,  # noqa: F401
                                 _load_jsonl, _split, check_reward, json_line, load_math_jsonl, parse_jsonl_record,
                                 parse_math_record, reward_worker, start_reward)
from trainers.generated_tasks import (AdditionTask, ListOpsTask, LongAdditionTask, ProgramTraceTask,  # noqa: F401
                                      SortingTask, _GeneratedTask, list_op, list_states, parse_program,
                                      program_states)
from trainers.task_base import Example, Task  # noqa: F401

log = logging.getLogger(__name__)


def check_task_config(cfg: TaskConfig) -> None:
    """The checks of ``cfg`` that its task can make before it is built (ValueError naming the key)."""
    check = getattr(TASKS.get(cfg.name), "check_config", None)
    if check is not None:
        check(cfg)


# How far outside [0, 1] a reward may fall by float round-off and be read as the bound (clamped): a sum of a few
# fractions is off by a few ulps; a reward on another scale misses [0, 1] by far more.
REWARD_ROUND_OFF = 1e-9


class RewardRangeError(ValueError):
    """A reward returned a number outside the range its task documents ([0, 1] for task ``jsonl``)."""


# a reward that times out this many times in a row in one batch is not called again for the batch's other samples:
# a reward that hangs on every sample then costs this many timeouts per step, and the run stays responsive
MAX_TIMEOUTS_IN_A_ROW = 3


# reward names whose first failure has been logged with its traceback (once per process)
_TRACEBACK_SHOWN: set[str] = set()


@dataclass(frozen=True)
class RewardFailure:
    """The first failing sample of the latest batch a reward failed on (``last_failure``)."""

    # How the reward is named in messages (``task.reward``'s spec, or "of task 'name'").
    reward: str
    # Why it failed ("raised KeyError: ...", "returned nan", ...).
    why: str
    prompt: str
    completion: str
    example: Example
    # The batch's failures and samples.
    errors: int
    samples: int


# the latest batch with a failure, per reward name (what the run's reward-failure stop names)
_LAST_FAILURE: dict[str, RewardFailure] = {}


def _reward_name(task: Task) -> str:
    return getattr(task, "reward_name", None) or f"of task {getattr(task, 'name', type(task).__name__)!r}"


def last_failure(task: Task) -> Optional[RewardFailure]:
    """The first failing sample of the latest batch whose scoring (``score_completions``) had a failure, or None."""
    return _LAST_FAILURE.get(_reward_name(task))


def reward_alone_command(failure: RewardFailure, spec: Optional[str]) -> str:
    """A shell command that calls the reward ``spec`` (``module:function`` or ``file.py:function``; None for a task's
    own reward) on the failing sample, outside the trainer: the example read from its file and line when it has one."""
    import shlex

    if not spec:
        return (f"python -c 'from trainers.tasks import TASKS; ...' (score the completion {failure.completion[:60]!r} "
                f"with the task's reward)")
    target, _, name = spec.rpartition(":")
    q = json.dumps  # a JSON string is a Python string literal in double quotes: the shell quoting stays readable
    source = getattr(failure.example, "source", "")
    path, _, line = source.rpartition(":")
    if path and line.isdigit():
        example = f"json.loads(open({q(path)}, encoding={q('utf-8-sig')}).read().splitlines()[{int(line) - 1}])"
    else:
        example = f"json.loads({q(json.dumps(getattr(failure.example, 'record', {'prompt': failure.prompt})))})"
    load = (f"runpy.run_path({q(target)})[{q(name)}]" if target.endswith(".py") or "/" in target else
            f"importlib.import_module({q(target)}).{name}")
    code = (f"import importlib, json, runpy, sys; sys.path.append({q('.')}); f = {load}; ex = {example}; "
            f"print(f(ex[{q('prompt')}], {q(failure.completion)}, ex))")
    return f"python -c {shlex.quote(code)}"


def score_completions(task: Task, completions: list[str], examples: list[Example]) -> tuple[list[float], int]:
    """``task.reward`` of each completion, and the number of errors: a reward that raises (any Exception), exits
    (``sys.exit``), runs past its timeout (task ``jsonl``: ``task.reward_timeout``) or returns anything but a finite
    real number gives that sample 0.0, and one warning per call names the reward, the count and the first failure
    (the first one in the process with its traceback). After ``MAX_TIMEOUTS_IN_A_ROW`` timeouts in a row the batch's
    remaining samples are not scored (0.0, counted). Never raises for a reward's failure: one bad sample should not
    end a run, and a reward that always fails shows in ``reward/errors``. Raises RewardRangeError when a ``jsonl``
    reward returns a number outside [0, 1] (a mistake in the function, not a bad sample)."""
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
    name = _reward_name(task)
    checks_range = getattr(task, "reward_name", None) is not None
    rewards: list[float] = []
    errors, first, first_exc, timeouts, failed = 0, "", None, 0, None
    for completion, example in zip(completions, examples):
        exc, value = None, None
        if timeouts >= MAX_TIMEOUTS_IN_A_ROW:
            why = f"not called: it timed out on {timeouts} samples in a row"
        else:
            try:
                value, why = as_number(task.reward(completion, example))
            except RewardTimeout as e:
                why = f"timed out after {e.args[0]:g} s ({e.args[1]}; its worker process was killed)"
            except RewardMemoryExceeded as e:
                why = (f"held {e.used_mib:.0f} MiB, above task.reward_memory_mib={e.limit_mib:g}: its worker process "
                       f"was killed and a new one serves the next call")
            except (SystemExit, RewardExited) as e:
                why = (f"ended its worker process ({e.died})" if getattr(e, "died", None) else
                       f"exited (sys.exit({e.code!r})): a reward must return a number, not end the process")
            except RewardNotNumber as e:
                why = str(e)
            except RewardRaised as e:
                why, exc = f"raised {e.type_name}: {e.message}", e
            except Exception as e:
                why, exc = f"raised {type(e).__name__}: {e}", e
            timeouts = timeouts + 1 if why is not None and why.startswith("timed out") else 0
        if why is None and checks_range and -REWARD_ROUND_OFF <= value <= 1.0 + REWARD_ROUND_OFF:
            value = min(max(value, 0.0), 1.0)  # (0.1 + 0.2) / 0.3 is 1 ulp above 1: round-off, not a wrong scale
        if why is None and checks_range and not 0.0 <= value <= 1.0:
            where = getattr(example, "source", "") or "a held-out or generated example"
            raise RewardRangeError(f"reward {name} returned {value!r} for the example at {where} (prompt "
                                   f"{example.prompt[:60]!r}): rewards must lie in [0, 1] (eval/accuracy is the mean "
                                   f"reward, reward/accuracy counts rewards > 0.5); rescale the function's values")
        if why is None:
            rewards.append(value)
            continue
        rewards.append(0.0)
        errors += 1
        if errors == 1:
            first, first_exc = f"{why} on prompt {example.prompt[:60]!r}", exc
            failed = (why, completion, example)
    if failed is not None:
        _LAST_FAILURE[name] = RewardFailure(name, failed[0], failed[2].prompt, failed[1], failed[2], errors,
                                            len(examples))
        show = first_exc is not None and name not in _TRACEBACK_SHOWN
        if show:
            _TRACEBACK_SHOWN.add(name)
        # a reward's exception from its worker carries the worker's traceback as its cause
        log.warning("reward %s failed on %d of %d samples (first: %s); they get reward 0 (counted in reward/errors)",
                    name, errors, len(examples), first, exc_info=first_exc if show else None)
    return rewards, errors


TASKS: dict[str, Callable[[TaskConfig, int], Task]] = {
    "addition": AdditionTask,
    "sorting": SortingTask,
    "long_addition": LongAdditionTask,
    "math": MathTask,
    "jsonl": JsonlTask,
    "program_trace": ProgramTraceTask,
    "list_ops": ListOpsTask,
}


# ------------------------------------------------------------------------------------------------- curriculum


class CurriculumTask:
    """Training prompts of one ``task.curriculum`` phase: the task rebuilt with the phase's ``digits`` /
    ``min_digits``, rejecting the run's held-out prompts (``base``'s evaluation set), so that training never sees
    them whatever the phase. Reward and demonstrations are the task's own (they read ``Example.answer``)."""

    def __init__(self, base: "_GeneratedTask", cfg: TaskConfig):
        self.name = base.name
        self.cfg = cfg
        self._task = type(base)(cfg, 0)
        self._held_out = base._eval_prompts

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        out: list[Example] = []
        while len(out) < n:
            out.extend(ex for ex in self._task.sample(rng, n - len(out)) if ex.prompt not in self._held_out)
        return out


class Curriculum:
    """``task.curriculum``: the training task of each loop step; built once, one task per phase."""

    def __init__(self, base: Task, cfg: TaskConfig):
        if not isinstance(base, _GeneratedTask):
            raise ValueError(f"config error at 'task.curriculum': task {cfg.name!r} has no digits to grow; a "
                             f"curriculum needs a generated task ({', '.join(generated_task_names())})")
        self._cfg = cfg
        self._tasks = {}
        for phase in cfg.curriculum:
            min_digits = cfg.min_digits if phase.min_digits is None else phase.min_digits
            # eval_size 1: the phase's own held-out prompt is a formality, the run's held-out set is base's
            phase_cfg = replace(cfg, digits=phase.digits, min_digits=min_digits, eval_size=1, curriculum=[])
            self._tasks[id(phase)] = CurriculumTask(base, phase_cfg)

    def task_at(self, step: int) -> CurriculumTask:
        """The training task of loop step ``step`` (0-based)."""
        return self._tasks[id(self._cfg.phase_at(step))]


def generated_task_names() -> list[str]:
    """The registered tasks that generate their prompts from ``task.digits`` (those a curriculum can grow)."""
    return [name for name, builder in TASKS.items()
            if isinstance(builder, type) and issubclass(builder, _GeneratedTask)]
