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
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from trainers.config import TaskConfig

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
        """1.0 if ``completion`` answers ``example`` correctly, else 0.0."""
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

    ``on_error="raise"`` (default, what the ``math`` task uses) raises ValueError naming ``path:line`` on
    the first malformed line; ``"skip"`` logs a warning per malformed line and drops it. A file without any
    example raises ValueError in both modes; a missing file raises FileNotFoundError.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"math task file not found: {path!r}")
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                examples.append(parse_math_record(json.loads(line)))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                msg = f"{path}:{lineno}: malformed math example: {exc}"
                if on_error == "raise":
                    raise ValueError(msg) from exc
                log.warning("%s (skipped)", msg)
    if not examples:
        raise ValueError(f"{path}: no examples (the file is empty or every line was malformed)")
    return examples


def _import_math_verify():
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError("task 'math' checks answers with the math-verify library, which is not installed: "
                          "pip install 'math-verify>=0.7' (or the package's 'math' extra)") from exc
    return math_verify


class MathTask:
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
        data = load_math_jsonl(cfg.path)
        if cfg.eval_path:
            self._eval = load_math_jsonl(cfg.eval_path)
            held = {ex.prompt for ex in self._eval}
            self._train = [ex for ex in data if ex.prompt not in held]
        else:
            if len(data) <= cfg.eval_size:
                raise ValueError(f"{cfg.path}: {len(data)} examples leave none for training after holding out "
                                 f"task.eval_size={cfg.eval_size}: lower task.eval_size or set task.eval_path")
            self._eval = data[-cfg.eval_size:]
            held = {ex.prompt for ex in self._eval}
            self._train = [ex for ex in data[:-cfg.eval_size] if ex.prompt not in held]
        if not self._train:
            raise ValueError(f"{cfg.path}: every training problem also appears in the evaluation set")
        self._gold: dict[str, list] = {}

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        return [rng.choice(self._train) for _ in range(n)]

    def eval_set(self) -> list[Example]:
        return list(self._eval)

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


TASKS: dict[str, Callable[[TaskConfig, int], Task]] = {
    "addition": AdditionTask,
    "sorting": SortingTask,
    "long_addition": LongAdditionTask,
    "math": MathTask,
}
