"""Task program_trace: generator determinism and held-out split, the trace by hand, rewards on the reference and
on perturbed traces, the program lengths, the tokenizer's coverage of the alphabet, and a curriculum over it."""

from __future__ import annotations

import random

import pytest

from trainers.config import CurriculumPhase, TaskConfig
from trainers.tasks import TASKS, Curriculum, Example, parse_program, program_states, score_completions
from trainers.tokenizer import CHARACTERS, build_char_tokenizer


def _task(min_digits: int = 4, digits: int = 8, eval_size: int = 200):
    return TASKS["program_trace"](TaskConfig(name="program_trace", min_digits=min_digits, digits=digits,
                                             eval_size=eval_size), 0)


def test_generator_is_deterministic_and_disjoint_from_the_held_out_set():
    task = _task()
    a = task.sample(random.Random(7), 500)
    assert a == _task().sample(random.Random(7), 500)
    assert a != task.sample(random.Random(8), 500)
    ev = task.eval_set()
    # the held-out set depends on the task config only, not on the run seed
    assert ev == TASKS["program_trace"](task.cfg, 123).eval_set()
    assert len({e.prompt for e in ev}) == 200
    assert not {e.prompt for e in task.sample(random.Random(1), 5000)} & {e.prompt for e in ev}


@pytest.mark.parametrize("prompt,trace", [
    # 7+3 = 10 -> 0; 0*2 = 0; 0-5 = -5 -> 5 (mod 10 in 0..9); 5+8 = 13 -> 3
    ("7:+3*2-5+8=", "7+3=0;0*2=0;0-5=5;5+8=3;|3"),
    # 9*9 = 81 -> 1; 1-9 = -8 -> 2
    ("9:*9-9=", "9*9=1;1-9=2;|2"),
    ("0:+0=", "0+0=0;|0"),
])
def test_traces_by_hand(prompt, trace):
    task = _task(1, 3, eval_size=1)
    x, program = parse_program(prompt)
    example = Example(prompt, str(program_states(x, program)[-1]))
    assert task.demonstration(example) == trace
    assert example.answer == trace.rpartition("|")[2]


def test_reward_is_one_on_the_reference_trace_and_zero_on_perturbed_ones():
    task = _task()
    rng = random.Random(0)
    for ex in task.sample(rng, 200):
        trace = task.demonstration(ex)
        assert task.reward(trace, ex) == 1.0 and task.reward(f"  {trace}\n", ex) == 1.0
        # one character of one step changed (a digit into another digit, or an op into another op)
        i = rng.choice([j for j, c in enumerate(trace) if c.isdigit() or c in "+-*"])
        pool = "0123456789" if trace[i].isdigit() else "+-*"
        wrong = trace[:i] + rng.choice([c for c in pool if c != trace[i]]) + trace[i + 1:]
        assert task.reward(wrong, ex) == 0.0
        # the right answer after a wrong scratchpad, a step left out, the answer alone, no answer
        steps, _, answer = trace.rpartition("|")
        assert task.reward(steps.split(";", 1)[1] + "|" + answer, ex) == 0.0
        assert task.reward(answer, ex) == 0.0 and task.reward("|" + answer, ex) == 0.0
        assert task.reward(steps + "|", ex) == 0.0
    rewards, errors = score_completions(task, ["", "garbage", "|"], task.sample(rng, 3))
    assert rewards == [0.0, 0.0, 0.0] and errors == 0


def test_program_lengths_and_response_lengths():
    task = _task(4, 8)
    examples = task.sample(random.Random(3), 3000)
    lengths = [len(parse_program(ex.prompt)[1]) for ex in examples]
    assert set(lengths) == set(range(4, 9))
    for ex, n in zip(examples, lengths):
        assert len(ex.prompt) == 2 * n + 3 and len(task.demonstration(ex)) == 6 * n + 2
    ops = {op for ex in examples for op, _ in parse_program(ex.prompt)[1]}
    assert ops == {"+", "-", "*"}


def test_tokenizer_covers_the_alphabet():
    task = _task()
    tok = build_char_tokenizer()
    text = "".join(ex.prompt + task.demonstration(ex) for ex in task.sample(random.Random(0), 500))
    assert set(text) <= set(CHARACTERS)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids and tok.decode(ids) == text


def test_split_and_config_checks():
    # 1 instruction: 10 starts x 30 instructions = 300 prompts; the held-out set may take half
    assert _task(1, 1, eval_size=150).space_size() == 300
    with pytest.raises(ValueError, match="task.eval_size=151"):
        _task(1, 1, eval_size=151)
    with pytest.raises(ValueError, match="task.min_digits"):
        TaskConfig(name="program_trace", min_digits=5, digits=4).check()


def test_a_curriculum_grows_the_programs():
    cfg = TaskConfig(name="program_trace", min_digits=4, digits=8, eval_size=50,
                     curriculum=[CurriculumPhase(until_step=10, digits=2, min_digits=1), CurriculumPhase(digits=8)])
    curriculum = Curriculum(TASKS[cfg.name](cfg, 0), cfg)
    short = {len(parse_program(ex.prompt)[1]) for ex in curriculum.task_at(0).sample(random.Random(0), 300)}
    long = {len(parse_program(ex.prompt)[1]) for ex in curriculum.task_at(10).sample(random.Random(0), 300)}
    assert short == {1, 2} and long == set(range(4, 9))
