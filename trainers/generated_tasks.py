"""The generated tasks: ``addition``, ``sorting``, ``long_addition``, ``program_trace`` and ``list_ops``, their prompts
drawn from ``task.digits`` and ``task.items`` with a held-out set fixed by the task config alone. Their formats,
operand distributions and rewards are described in trainers/tasks.py, which registers them."""

from __future__ import annotations

import random

from trainers.config import TaskConfig
from trainers.task_base import Example


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
