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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol

from trainers.config import TaskConfig
from trainers.errors import InputError, InputFileNotFoundError, not_a_regular_file
from trainers.reward_fn import as_number
from trainers.reward_worker import (RewardExited, RewardMemoryExceeded, RewardNotNumber, RewardRaised, RewardTimeout,
                                    RewardWorker)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    # What the model is given (raw problem text; no chat template).
    prompt: str
    # Reference answer, as a canonical string.
    answer: str


class Task(Protocol):
    name: str
    cfg: TaskConfig

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        """``n`` training examples drawn with ``rng`` (never from the evaluation set)."""
        ...

    def eval_set(self) -> list[Example]:
        """The held-out examples: deterministic, disjoint from training."""
        ...

    def reward(self, completion: str, example: Example) -> float:
        """1.0 if ``completion`` answers ``example`` correctly, else 0.0 (task ``jsonl``: what the user's function
        returns). Callers score through ``score_completions``, which turns a failure into 0.0 and counts it."""
        ...

    def demonstration(self, example: Example) -> str:
        """Target completion for the supervised cold start (gets reward 1.0)."""
        ...


# ---------------------------------------------------------------------------------------- generated tasks


class _GeneratedTask:
    """Shared split / sampling / reward logic; subclasses define ``_draw`` and ``space_size``."""

    name = ""
    # Whether the task reads ``cfg.min_digits``; the others draw numbers uniformly in [0, 10^digits).
    uses_min_digits = False

    def __init__(self, cfg: TaskConfig, seed: int):
        cfg.check()
        if cfg.min_digits != 1 and not self.uses_min_digits:
            raise ValueError(f"config error at 'task.min_digits': task {self.name!r} draws numbers uniformly in "
                             f"[0, 10^digits) and has no use for it; leave it at 1 (got {cfg.min_digits})")
        self.cfg = cfg
        space = self.space_size()
        if cfg.eval_size > space // 2:
            raise ValueError(f"task.eval_size={cfg.eval_size} is too large for task {self.name!r} with "
                             f"digits={cfg.digits}, items={cfg.items}: the prompt space holds {space} prompts and "
                             f"the evaluation set may take at most half ({space // 2})")
        # Depends on the task config only (see the module docstring); str seeds hash deterministically.
        eval_rng = random.Random(f"dcmdp-eval/{self.name}/{self._split_tag()}")
        examples: dict[str, Example] = {}
        while len(examples) < cfg.eval_size:
            ex = self._draw(eval_rng)
            examples.setdefault(ex.prompt, ex)
        self._eval = list(examples.values())
        self._eval_prompts = frozenset(examples)

    def space_size(self) -> int:
        return (10 ** self.cfg.digits) ** self.cfg.items

    def _split_tag(self) -> str:
        """The config fields that shape the prompt distribution, as part of the held-out set's seed."""
        return f"{self.cfg.digits}/{self.cfg.items}"

    def _draw(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            ex = self._draw(rng)
            if ex.prompt not in self._eval_prompts:  # at most half the space is held out: ~2 draws at worst
                out.append(ex)
        return out

    def eval_set(self) -> list[Example]:
        return list(self._eval)

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if completion.strip() == example.answer else 0.0

    def demonstration(self, example: Example) -> str:
        return example.answer

    def _numbers(self, rng: random.Random) -> list[int]:
        return [rng.randrange(10 ** self.cfg.digits) for _ in range(self.cfg.items)]


class AdditionTask(_GeneratedTask):
    """``"47+38="`` -> ``"85"``: ``cfg.items`` operands uniform in [0, 10^digits)."""

    name = "addition"

    def _draw(self, rng: random.Random) -> Example:
        xs = self._numbers(rng)
        return Example("+".join(map(str, xs)) + "=", str(sum(xs)))


class SortingTask(_GeneratedTask):
    """``"S:3,1,2="`` -> ``"1,2,3"``: ``cfg.items`` numbers uniform in [0, 10^digits), sorted ascending."""

    name = "sorting"

    def _draw(self, rng: random.Random) -> Example:
        xs = self._numbers(rng)
        return Example("S:" + ",".join(map(str, xs)) + "=", ",".join(map(str, sorted(xs))))


class LongAdditionTask(_GeneratedTask):
    """``"4738+915="`` -> ``"8+5+0=13;3+1+1=5;7+9+0=16;4+0+1=5;|5653"``: schoolbook addition with carries.

    Format, operand distribution and reward: see the module docstring.
    """

    name = "long_addition"
    uses_min_digits = True

    def __init__(self, cfg: TaskConfig, seed: int):
        if cfg.items != 2:
            raise ValueError(f"config error at 'task.items': task 'long_addition' adds two operands, got {cfg.items}")
        super().__init__(cfg, seed)

    @staticmethod
    def _count(length: int) -> int:
        """Non-negative integers written with exactly ``length`` digits (no leading zero; ``0`` has length 1)."""
        return 10 if length == 1 else 9 * 10 ** (length - 1)

    def space_size(self) -> int:
        numbers = sum(self._count(n) for n in range(self.cfg.min_digits, self.cfg.digits + 1))
        return numbers ** 2

    def _split_tag(self) -> str:
        return f"{self.cfg.min_digits}-{self.cfg.digits}"

    def _operand(self, rng: random.Random) -> int:
        length = rng.randint(self.cfg.min_digits, self.cfg.digits)
        return rng.randrange(10) if length == 1 else rng.randrange(10 ** (length - 1), 10 ** length)

    def _draw(self, rng: random.Random) -> Example:
        a, b = self._operand(rng), self._operand(rng)
        return Example(f"{a}+{b}=", str(a + b))

    def reward(self, completion: str, example: Example) -> float:
        _, bar, answer = completion.rpartition("|")
        return 1.0 if bar and answer.strip() == example.answer else 0.0

    def demonstration(self, example: Example) -> str:
        a, b = example.prompt.rstrip("=").split("+")
        steps, carry = [], 0
        for i in range(max(len(a), len(b))):
            da = int(a[-1 - i]) if i < len(a) else 0
            db = int(b[-1 - i]) if i < len(b) else 0
            s = da + db + carry
            steps.append(f"{da}+{db}+{carry}={s};")
            carry = s // 10
        if carry:
            steps.append("0+0+1=1;")
        return "".join(steps) + "|" + example.answer


# --------------------------------------------------------------------------------------------- math (JSONL)


def _boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _chat_prompt(messages: list) -> str:
    """The content of the last user message of a chat-format prompt (the raw problem text)."""
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    raise ValueError("chat prompt has no user message with string content")


def _scalar_answer(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"'{key}' must be a string or a number, got {type(value).__name__}")
    return str(value)


def parse_math_record(record: Any) -> Example:
    """One JSON object -> Example, for the layouts in common use (checked in this order):

    - DAPO-Math / verl: ``{"prompt": [chat messages] | str, "reward_model": {"ground_truth": ...}}``; a
      chat prompt contributes the content of its last user message.
    - GSM8K: ``{"question": str, "answer": str}``; the final answer follows the last ``####``.
    - MATH-style: ``{"problem": str, "answer": str}`` or ``{"problem": str, "solution": str}`` with the answer
      in the solution's last ``\\boxed{}``.

    Raises ValueError (without location; the loader adds file:line) on anything else.
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "reward_model" in record:
        rm = record["reward_model"]
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise ValueError("'reward_model' must be an object with a 'ground_truth'")
        prompt = record.get("prompt")
        if isinstance(prompt, list):
            prompt = _chat_prompt(prompt)
        elif not isinstance(prompt, str):
            raise ValueError("'prompt' must be a string or a list of chat messages")
        answer = _scalar_answer(rm["ground_truth"], "reward_model.ground_truth")
    elif "question" in record:
        prompt, solution = record.get("question"), record.get("answer")
        if not isinstance(prompt, str) or not isinstance(solution, str):
            raise ValueError("GSM8K layout needs string 'question' and 'answer'")
        if "####" not in solution:
            raise ValueError("GSM8K 'answer' has no '####' before the final answer")
        answer = solution.rsplit("####", 1)[1]
    elif "problem" in record:
        prompt = record.get("problem")
        if not isinstance(prompt, str):
            raise ValueError("'problem' must be a string")
        if "answer" in record:
            answer = _scalar_answer(record["answer"], "answer")
        elif isinstance(record.get("solution"), str):
            boxed = _boxed_content(record["solution"])
            if boxed is None:
                raise ValueError("'solution' has no \\boxed{} answer")
            answer = boxed
        else:
            raise ValueError("'problem' layout needs an 'answer' or a 'solution' string")
    else:
        raise ValueError(f"unknown layout with keys {sorted(record)}: expected 'prompt'+'reward_model', "
                         f"'question'+'answer' or 'problem'+'answer'/'solution'")
    prompt, answer = prompt.strip(), answer.strip()
    if not prompt or not answer:
        raise ValueError("empty prompt or answer")
    return Example(prompt, answer)


def load_math_jsonl(path: str | os.PathLike, *, on_error: str = "raise") -> list[Example]:
    """Read one example per non-blank line (layouts: ``parse_math_record``).

    ``on_error="raise"`` (default, what the ``math`` task uses) raises InputError (a ValueError) naming
    ``path:line`` on the first malformed line; ``"skip"`` logs a warning per malformed line and drops it. A file
    without any example raises InputError in both modes; a missing file InputFileNotFoundError (a
    FileNotFoundError).
    """
    return _load_jsonl(path, lambda record, where: parse_math_record(record), "math", on_error=on_error)


def json_line(text: str) -> Any:
    """``json.loads`` of one line, with a ValueError (not a RecursionError) for JSON nested deeper than Python's
    decoder recurses (about 1,000 levels)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep to read (over about 1,000 levels of [ or {); a record is a flat object "
                         "with a 'prompt'") from None


def _load_jsonl(path: str | os.PathLike, parse: Callable[[Any, str], Example], task: str, *,
                on_error: str = "raise") -> list[Example]:
    """``parse(json.loads(line), "path:line")`` of every non-blank line (UTF-8, a leading byte-order mark
    allowed); the errors of ``load_math_jsonl``, naming ``task``."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputFileNotFoundError(f"{task} task file not found: {path!r}")
    examples = []
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(0)
        if head[:2] == b"\x1f\x8b" or head[:4] in (b"PK\x03\x04", b"BZh9", b"\xfd7zX"):
            raise InputError(f"{path}: a compressed file (it starts with the bytes {head!r}); decompress it: the task "
                             f"reads JSON lines as plain UTF-8 text")
        for lineno, raw in enumerate(f, start=1):
            try:
                # a byte-order mark may open the file; each line is decoded alone, so a bad byte names its line
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                if not line.strip():
                    continue
                examples.append(parse(json_line(line), f"{path}:{lineno}"))
            except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                if isinstance(exc, UnicodeDecodeError):
                    exc = ValueError(f"not UTF-8 ({exc.reason}: byte {raw[exc.start:exc.start + 1]!r} at column "
                                     f"{exc.start + 1}); save the file as UTF-8")
                msg = f"{path}:{lineno}: malformed {task} example: {exc}"
                if on_error == "raise":
                    raise InputError(msg) from exc
                log.warning("%s (skipped)", msg)
    if not examples:
        raise InputError(f"{path}: no examples (the file is empty or every line was malformed)")
    return examples


def _split(cfg: TaskConfig, data: list[Example], eval_data: Optional[list[Example]]
           ) -> tuple[list[Example], list[Example]]:
    """(train, eval): ``eval_data`` if given, else the last ``cfg.eval_size`` examples of ``data``; training drops
    every prompt that is also held out."""
    if eval_data is not None:
        held_out = eval_data
    elif len(data) <= cfg.eval_size:
        raise InputError(f"{cfg.path}: {len(data)} examples leave none for training after holding out "
                         f"task.eval_size={cfg.eval_size}: lower task.eval_size or set task.eval_path")
    else:
        held_out, data = data[-cfg.eval_size:], data[:-cfg.eval_size]
    prompts = {ex.prompt for ex in held_out}
    train = [ex for ex in data if ex.prompt not in prompts]
    if not train:
        raise InputError(f"{cfg.path}: every training problem also appears in the evaluation set")
    return train, list(held_out)


def _import_math_verify():
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError("task 'math' checks answers with the math-verify library, which is not installed: "
                          "pip install 'math-verify>=0.7' (or the package's 'math' extra)") from exc
    return math_verify


class _FileSplits:
    """The train / held-out lists of a task read from a file (``self._train``, ``self._eval``, ``self.cfg.path``)."""

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        return [rng.choice(self._train) for _ in range(n)]

    def train_set(self) -> list[Example]:
        """Every training example (``sample`` draws from these)."""
        return list(self._train)

    def keep_train(self, examples: list[Example]) -> None:
        """Train on ``examples`` only (a non-empty subset of ``train_set``, e.g. the prompts that fit the context)."""
        if not examples:
            raise ValueError(f"{self.cfg.path}: no training example left")
        self._train = list(examples)

    def keep_eval(self, examples: list[Example]) -> None:
        """Hold out ``examples`` only (a subset of ``eval_set``)."""
        self._eval = list(examples)

    def eval_set(self) -> list[Example]:
        return list(self._eval)


class MathTask(_FileSplits):
    """Math word problems from JSONL, answers checked for mathematical equivalence with math-verify.

    Split: ``cfg.eval_path`` holds the evaluation set if given (training then drops any prompt that also
    appears there); otherwise the last ``cfg.eval_size`` examples of ``cfg.path`` are held out and the rest
    is for training (ValueError if nothing would be left to train on). ``sample`` draws with replacement.

    Reward: math-verify's ``verify(parse(gold), parse(completion))``: the gold answer is parsed as LaTeX
    between ``$`` delimiters, the completion by math-verify's default extraction (last ``\\boxed{}``,
    LaTeX, or a plain expression), so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` all match gold ``1/2``.
    Parse or verification errors count as wrong. math-verify's timeouts use SIGALRM, which only works in
    the main thread; elsewhere they are disabled.

    Demonstration: ``\\boxed{answer}`` (the datasets' solutions are not kept, only the final answers).
    """

    name = "math"

    def __init__(self, cfg: TaskConfig, seed: int):
        cfg.check()
        if not cfg.path:
            raise ValueError("config error at 'task.path': task 'math' needs a JSONL file of problems")
        self.cfg = cfg
        self._mv = _import_math_verify()
        self._train, self._eval = _split(cfg, load_math_jsonl(cfg.path),
                                         load_math_jsonl(cfg.eval_path) if cfg.eval_path else None)
        self._gold: dict[str, list] = {}

    def _timeout(self) -> Optional[int]:
        return 5 if threading.current_thread() is threading.main_thread() else None

    def reward(self, completion: str, example: Example) -> float:
        mv, timeout = self._mv, self._timeout()
        gold = self._gold.get(example.answer)
        if gold is None:
            gold = mv.parse(f"${example.answer}$", parsing_timeout=timeout)
            self._gold[example.answer] = gold
        pred = mv.parse(completion.strip(), parsing_timeout=timeout)
        if not gold or not pred:
            return 0.0
        return 1.0 if mv.verify(gold, pred, timeout_seconds=timeout) else 0.0

    def demonstration(self, example: Example) -> str:
        return f"\\boxed{{{example.answer}}}"


# ------------------------------------------------------------------------------------- your own task (JSONL)


@dataclass(frozen=True)
class RecordExample(Example):
    """An example of task ``jsonl``: ``answer`` is the record's ``"answer"`` as a string ("" without one)."""

    # The line's whole JSON object, given to the reward function.
    record: dict = field(default_factory=dict, compare=False, repr=False)
    # Target completion for the cold start: the record's "completion", None without one.
    completion: Optional[str] = None
    # "file:line" of the record, for messages.
    source: str = ""


def parse_jsonl_record(record: Any, where: str = "") -> RecordExample:
    """One JSON object of task ``jsonl``: a non-blank string ``"prompt"`` (given to the model as it is), an
    optional string ``"completion"`` (the cold start's demonstration), any other keys for the reward function.
    Raises ValueError (without location; the loader adds file:line) on anything else."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("needs a non-empty string 'prompt'" if "prompt" in record else
                         f"no 'prompt' (keys: {sorted(record)})")
    completion = record.get("completion")
    if completion is not None and not isinstance(completion, str):
        raise ValueError(f"'completion' must be a string, got {type(completion).__name__}")
    answer = record.get("answer")
    answer = str(answer) if isinstance(answer, (str, int, float)) and not isinstance(answer, bool) else ""
    return RecordExample(prompt, answer, record=record, completion=completion, source=where)


def _file_digest(paths: list[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()[:16]


class JsonlTask(_FileSplits):
    """Your own task: prompts from a JSON-lines file, scored by your reward function (docs/custom_tasks.md).

    Data: one JSON object per line (``parse_jsonl_record``): ``"prompt"`` (a string), an optional
    ``"completion"`` (the cold start's demonstration), and whatever the reward needs (``"answer"``, test cases,
    ...). A malformed line is a ValueError naming file and line. Split: as task ``math`` (``cfg.eval_path``, else
    the last ``cfg.eval_size`` lines of ``cfg.path``); ``sample`` draws training records with replacement.

    Reward: ``cfg.reward`` names ``function(prompt: str, completion: str, example: dict) -> float``: the record's
    prompt, the decoded response (no EOS or padding), and a deep copy of the record (a reward that changes it
    changes nothing). The value must lie in [0, 1] (numpy scalars and bools are numbers);
    ``reward/accuracy`` counts rewards > 0.5 and the held-out score (``eval/accuracy``) is the mean reward.
    Each call may take at most ``cfg.reward_timeout`` seconds. Failures: see ``score_completions``.

    Cold start: trains on every record's ``"completion"``; a record without one stops it with a ValueError
    (``check_demonstrations``). The cache key of the cold start covers the files' bytes (``data_digest``).
    """

    name = "jsonl"

    def __init__(self, cfg: TaskConfig, seed: int):
        cfg.check()
        self._check_files(cfg)
        self.cfg = cfg
        self.reward_name = cfg.reward
        self._train, self._eval = _split(cfg, _load_jsonl(cfg.path, parse_jsonl_record, "jsonl"),
                                         _load_jsonl(cfg.eval_path, parse_jsonl_record, "jsonl") if cfg.eval_path
                                         else None)
        self.data_digest = _file_digest([p for p in (cfg.path, cfg.eval_path) if p])
        # imported now, in the worker that will call it (never in this process: its import runs arbitrary code)
        self._worker = reward_worker(cfg)
        start_reward(self._worker)

    @staticmethod
    def check_config(cfg: TaskConfig) -> None:
        """What the config alone shows: both files exist and the reward function imports in its worker process
        (``check_reward``; ValueError naming the key)."""
        JsonlTask._check_files(cfg)
        check_reward(cfg)

    @staticmethod
    def _check_files(cfg: TaskConfig) -> None:
        if not cfg.path:
            raise ValueError("config error at 'task.path': task 'jsonl' needs a JSON-lines file of prompts "
                             "(one {\"prompt\": ...} object per line)")
        for key, path in (("task.path", cfg.path), ("task.eval_path", cfg.eval_path)):
            why = not_a_regular_file(path) if path else None
            if why == "does not exist":
                raise ValueError(f"config error at '{key}': file not found: {os.path.abspath(path)}")
            if why is not None:
                raise ValueError(f"config error at '{key}': {os.path.abspath(path)} {why}; name a JSON-lines file")
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"config error at '{key}': cannot read {os.path.abspath(path)}: permission denied; "
                                 f"give the user running dcmdp read access to it")
        if not cfg.reward:
            raise ValueError("config error at 'task.reward': task 'jsonl' needs a reward function: "
                             "task.reward=module:function or task.reward=path/to/file.py:function")

    def reward(self, completion: str, example: Example) -> Any:
        """The reward, called in the task's worker process (``trainers.reward_worker``: a hard deadline, a copy of
        the record); its failures raise as the worker reports them (see ``score_completions``)."""
        record = example.record if isinstance(example, RecordExample) else {"prompt": example.prompt}
        return self._worker.call(example.prompt, completion, record)

    def close(self) -> None:
        """End the reward's worker process (a later call starts a new one)."""
        self._worker.close()

    def check_demonstrations(self) -> None:
        """InputError (a ValueError) unless every record has a ``"completion"`` (the cold start trains on them)."""
        missing = [ex for ex in self._train + self._eval if ex.completion is None]
        if missing:
            raise InputError(f"config error at 'cold_start.steps': the cold start trains on demonstrations, and task "
                             f"'jsonl' takes them from each record's \"completion\" string, which "
                             f"{len(missing)} of {len(self._train) + len(self._eval)} records lack (first: "
                             f"{missing[0].source}); add a \"completion\" to every record of task.path and "
                             f"task.eval_path, or set cold_start.steps=0 (or model.path, to start from a trained "
                             f"model)")

    def demonstration(self, example: Example) -> str:
        completion = getattr(example, "completion", None)
        if completion is None:
            raise ValueError(f"{getattr(example, 'source', '') or example.prompt[:40]!r}: no \"completion\" to "
                             f"demonstrate")
        return completion


def check_task_config(cfg: TaskConfig) -> None:
    """The checks of ``cfg`` that its task can make before it is built (ValueError naming the key)."""
    check = getattr(TASKS.get(cfg.name), "check_config", None)
    if check is not None:
        check(cfg)


def reward_worker(cfg: TaskConfig) -> RewardWorker:
    """The worker process of ``cfg.reward`` with the task's limits (not started)."""
    return RewardWorker(cfg.reward, cfg.reward_timeout, load_timeout=cfg.reward_load_timeout,
                        memory_limit_mib=cfg.reward_memory_mib or None)


def start_reward(worker: RewardWorker) -> None:
    """Start ``worker`` and import its reward: ValueError naming ``task.reward`` when the import fails, names no usable
    function, ends the process (``os._exit``, ``sys.exit``, a signal), runs past ``task.reward_load_timeout`` or holds
    more than ``task.reward_memory_mib``."""
    spec = f"config error at 'task.reward': {worker.spec!r}"
    try:
        worker.start()
    except RewardTimeout as e:
        raise ValueError(f"{spec}: importing it did not finish within {e.args[0]:g} s ({e.args[1]}; the worker was "
                         f"killed); make the import quick (load what the reward needs on its first call), or raise "
                         f"{e.args[1]}") from None
    except RewardRaised as e:  # load_reward's own errors already name the key and the fix
        raise ValueError(e.message if e.type_name == "RewardSpecError" else
                         f"{spec}: importing it failed: {e.type_name}: {e.message}") from None
    except RewardExited as e:
        raise ValueError(f"{spec}: importing it ended the worker process ({e.died or f'sys.exit({e.code!r})'}); a "
                         f"reward module must define its function when imported, not end the process (os._exit, "
                         f"sys.exit, a signal)") from None
    except RewardMemoryExceeded as e:
        raise ValueError(f"{spec}: importing it took {e.used_mib:.0f} MiB, above task.reward_memory_mib="
                         f"{e.limit_mib:g}; load less at import, or raise task.reward_memory_mib") from None


def check_reward(cfg: TaskConfig) -> None:
    """Import ``cfg.reward`` in a worker process as a run does (``start_reward``, within its limits), then end it:
    a reward whose import hangs, exits or fails is refused before anything is built, and runs nothing here."""
    worker = reward_worker(cfg)
    try:
        start_reward(worker)
    finally:
        worker.close()


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
}


# ---------------------------------------------------------------------------------------------- program trace


class ProgramTraceTask(_GeneratedTask):
    """``"7:+3*2-5+8="`` -> ``"7+3=0;0*2=0;0-5=5;5+8=3;|3"``: the trace of a one-register program.

    A program is a start value x_0 in 0..9 and L instructions ``op d`` (op one of ``+ - *``, d in 0..9), L uniform
    in [``cfg.min_digits``, ``cfg.digits``] (for this task the two keys count instructions, so a curriculum grows
    the programs), every part uniform. Instruction k sets x_k = (x_{k-1} op d_k) mod 10 (Python's mod: 0..9).
    The demonstration writes one step ``x_{k-1} op d_k = x_k;`` per instruction, then ``|`` and x_L, so a correct
    response takes 6 L + 3 tokens with EOS (one character per token), 27 to 51 with min_digits=4, digits=8; the
    prompt takes 2 L + 3. ``Example.answer`` is x_L.

    Reward: 1.0 iff the completion, stripped of surrounding whitespace, is the whole trace exactly: the answer
    alone is a digit a guess finds one time in ten, the trace is verified step by step. Held-out split and
    sampling as every generated task (module docstring).
    """

    name = "program_trace"
    uses_min_digits = True
    OPS = "+-*"

    def space_size(self) -> int:
        per_instruction = len(self.OPS) * 10
        return 10 * sum(per_instruction ** n for n in range(self.cfg.min_digits, self.cfg.digits + 1))

    def _split_tag(self) -> str:
        return f"{self.cfg.min_digits}-{self.cfg.digits}"

    def _draw(self, rng: random.Random) -> Example:
        x = rng.randrange(10)
        program = [(rng.choice(self.OPS), rng.randrange(10)) for _ in range(rng.randint(self.cfg.min_digits,
                                                                                         self.cfg.digits))]
        prompt = f"{x}:" + "".join(f"{op}{d}" for op, d in program) + "="
        return Example(prompt, str(program_states(x, program)[-1]))

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if completion.strip() == self.demonstration(example) else 0.0

    def demonstration(self, example: Example) -> str:
        x, program = parse_program(example.prompt)
        states = program_states(x, program)
        steps = "".join(f"{a}{op}{d}={b};" for a, (op, d), b in zip(states, program, states[1:]))
        return f"{steps}|{states[-1]}"


def parse_program(prompt: str) -> tuple[int, list[tuple[str, int]]]:
    """(x_0, [(op, d), ...]) of a ``program_trace`` prompt ``"7:+3*2="``."""
    start, _, body = prompt.rstrip("=").partition(":")
    return int(start), [(body[i], int(body[i + 1])) for i in range(0, len(body), 2)]


def program_states(x: int, program: list[tuple[str, int]]) -> list[int]:
    """[x_0, x_1, ..., x_L]: x_k = (x_{k-1} op d_k) mod 10."""
    states = [x]
    for op, d in program:
        x = {"+": x + d, "-": x - d, "*": x * d}[op] % 10
        states.append(x)
    return states


TASKS["program_trace"] = ProgramTraceTask


# ---------------------------------------------------------------------------------------------- list operations


class ListOpsTask(_GeneratedTask):
    """``"4721:RLI="`` -> ``"R1274;L2741;I3852;|3852"``: a list of digits rewritten by a sequence of operations.

    A prompt is a list of ``cfg.items`` digits (each uniform in 0..9, written without separators), ``:``, then L
    operations, L uniform in [``cfg.min_digits``, ``cfg.digits``] (for this task the two keys count operations, so a
    curriculum grows the programs), each uniform among ``OPS``:

    - ``R`` reverse the list; ``L`` rotate it left by one (the first digit moves to the end);
    - ``S`` swap the first and the last digit; ``I`` add 1 to every digit, mod 10.

    The demonstration writes one step ``<op><list after it>;`` per operation, then ``|`` and the final list, so the
    state is a whole list rewritten at every step, where ``program_trace`` carries one digit and ``long_addition`` a
    digit and a carry. A correct response takes (items + 2) L + items + 2 tokens with EOS (one character per token):
    18 to 42 with items = 4, L in 2..6. ``Example.answer`` is the final list.

    Reward: 1.0 iff the completion, stripped of surrounding whitespace, is the whole trace exactly (as
    ``program_trace``: a right final list after a wrong step scores 0). Held-out split and sampling as every
    generated task (module docstring).
    """

    name = "list_ops"
    uses_min_digits = True
    OPS = "RLSI"

    def __init__(self, cfg: TaskConfig, seed: int):
        if cfg.items < 2:
            raise ValueError(f"config error at 'task.items': task 'list_ops' rewrites a list of task.items digits; "
                             f"need >= 2 (e.g. 4), got {cfg.items}")
        super().__init__(cfg, seed)

    def space_size(self) -> int:
        return 10 ** self.cfg.items * sum(len(self.OPS) ** n for n in range(self.cfg.min_digits, self.cfg.digits + 1))

    def _split_tag(self) -> str:
        return f"{self.cfg.items}x{self.cfg.min_digits}-{self.cfg.digits}"

    def _draw(self, rng: random.Random) -> Example:
        digits = "".join(str(rng.randrange(10)) for _ in range(self.cfg.items))
        ops = "".join(rng.choice(self.OPS) for _ in range(rng.randint(self.cfg.min_digits, self.cfg.digits)))
        return Example(f"{digits}:{ops}=", list_states(digits, ops)[-1])

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if completion.strip() == self.demonstration(example) else 0.0

    def demonstration(self, example: Example) -> str:
        digits, _, ops = example.prompt.rstrip("=").partition(":")
        states = list_states(digits, ops)
        return "".join(f"{op}{s};" for op, s in zip(ops, states[1:])) + f"|{states[-1]}"


def list_op(op: str, digits: str) -> str:
    """One ``list_ops`` operation on a digit string: R reverse, L rotate left by one, S swap first and last, I add 1
    to every digit mod 10."""
    if op == "R":
        return digits[::-1]
    if op == "L":
        return digits[1:] + digits[:1]
    if op == "S":
        return digits if len(digits) < 2 else digits[-1] + digits[1:-1] + digits[0]
    if op == "I":
        return "".join(str((int(d) + 1) % 10) for d in digits)
    raise ValueError(f"unknown list_ops operation {op!r}; known: {', '.join(ListOpsTask.OPS)}")


def list_states(digits: str, ops: str) -> list[str]:
    """[s_0, s_1, ..., s_L]: s_0 = ``digits``, s_k = op_k(s_{k-1})."""
    states = [digits]
    for op in ops:
        states.append(list_op(op, states[-1]))
    return states


TASKS["list_ops"] = ListOpsTask


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
