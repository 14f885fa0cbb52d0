"""The tasks read from JSONL files: ``math`` (problems with boxed answers, checked by ``math-verify``) and ``jsonl``
(the user's own prompts, scored by the reward function ``task.reward`` names, in a worker process the trainer can always
stop: ``reward_worker``, ``start_reward``, ``check_reward``), with the reading of their files, line by line."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from trainers.config import TaskConfig
from trainers.errors import InputError, InputFileNotFoundError, not_a_regular_file
from trainers.reward_worker import RewardExited, RewardMemoryExceeded, RewardRaised, RewardTimeout, RewardWorker
from trainers.task_base import Example

# the log lines of the tasks keep the name they have always had
log = logging.getLogger("trainers.tasks")


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
