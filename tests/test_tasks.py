"""Verifiable tasks: determinism, held-out disjointness, rewards, demonstrations, math JSONL and math-verify."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest

from trainers.config import TaskConfig
from trainers.tasks import TASKS, Example, load_math_jsonl, parse_math_record

DATA = Path(__file__).parent / "data" / "math_sample.jsonl"
PRINTABLE = set(string.printable) - set("\t\r\x0b\x0c")


@pytest.mark.parametrize("name", ["addition", "sorting", "long_addition", "list_ops"])
def test_generated_tasks_are_deterministic_and_disjoint(name):
    cfg = TaskConfig(name=name, eval_size=200)
    task = TASKS[name](cfg, 0)
    a = task.sample(random.Random(7), 500)
    b = TASKS[name](cfg, 0).sample(random.Random(7), 500)
    assert a == b
    assert a != task.sample(random.Random(8), 500)
    # the held-out set depends on the task config only: same questions whatever the run seed
    ev = task.eval_set()
    assert ev == TASKS[name](cfg, 123).eval_set()
    assert len(ev) == 200 and len({e.prompt for e in ev}) == 200
    train_prompts = {e.prompt for e in task.sample(random.Random(1), 5000)}
    assert not train_prompts & {e.prompt for e in ev}


def test_eval_set_disjoint_even_when_it_covers_half_the_space():
    # digits=1, items=2: 100 prompts, eval takes 50; 2000 training draws cover the other 50 and nothing else
    task = TASKS["addition"](TaskConfig(digits=1, items=2, eval_size=50), 0)
    held = {e.prompt for e in task.eval_set()}
    seen = {e.prompt for e in task.sample(random.Random(0), 2000)}
    assert len(held) == 50 and len(seen) == 50 and not held & seen
    with pytest.raises(ValueError, match="task.eval_size=51"):
        TASKS["addition"](TaskConfig(digits=1, items=2, eval_size=51), 0)


def test_addition_format_and_rewards():
    task = TASKS["addition"](TaskConfig(digits=2, items=2, eval_size=16), 0)
    ex = Example("47+38=", "85")
    assert task.reward("85", ex) == 1.0
    assert task.reward(" 85\n", ex) == 1.0  # surrounding whitespace is stripped
    assert task.reward("84", ex) == 0.0
    assert task.reward("85 ", ex) == 1.0 and task.reward("8 5", ex) == 0.0
    assert task.reward("085", ex) == 0.0 and task.reward("85.0", ex) == 0.0
    assert task.reward("", ex) == 0.0 and task.reward("x#~", ex) == 0.0
    for e in task.sample(random.Random(3), 300) + task.eval_set():
        left, right = e.prompt[:-1].split("+")
        assert e.prompt.endswith("=") and int(left) + int(right) == int(e.answer)
        assert 0 <= int(left) < 100 and 0 <= int(right) < 100
        assert len(e.answer) <= 3 and set(e.prompt + e.answer) <= PRINTABLE
        assert task.reward(task.demonstration(e), e) == 1.0


def test_addition_three_operands():
    task = TASKS["addition"](TaskConfig(digits=1, items=3, eval_size=10), 0)
    for e in task.sample(random.Random(0), 50):
        assert e.prompt.count("+") == 2 and sum(map(int, e.prompt[:-1].split("+"))) == int(e.answer)


def test_sorting_format_and_rewards():
    task = TASKS["sorting"](TaskConfig(name="sorting", digits=1, items=4, eval_size=32), 0)
    ex = Example("S:3,1,2,1=", "1,1,2,3")
    assert task.reward("1,1,2,3", ex) == 1.0
    assert task.reward("1,2,3", ex) == 0.0 and task.reward("3,2,1,1", ex) == 0.0
    assert task.reward("1, 1, 2, 3", ex) == 0.0 and task.reward("1,1,2,3,", ex) == 0.0
    for e in task.sample(random.Random(5), 300) + task.eval_set():
        assert e.prompt.startswith("S:") and e.prompt.endswith("=")
        xs = [int(x) for x in e.prompt[2:-1].split(",")]
        assert len(xs) == 4 and e.answer == ",".join(map(str, sorted(xs)))
        assert len(e.answer) <= 8 and set(e.prompt + e.answer) <= PRINTABLE
        assert task.reward(task.demonstration(e), e) == 1.0


def test_task_exposes_name_and_config():
    cfg = TaskConfig(name="sorting", digits=1, items=3, eval_size=8)
    task = TASKS["sorting"](cfg, 0)
    assert task.name == "sorting" and task.cfg is cfg


# --------------------------------------------------------------------------------------------- long addition


def _long(min_digits: int = 3, digits: int = 8, eval_size: int = 256):
    return TASKS["long_addition"](TaskConfig(name="long_addition", min_digits=min_digits, digits=digits,
                                             eval_size=eval_size), 0)


@pytest.mark.parametrize("prompt, demonstration", [
    # 8+5=13 (carry 1), 3+1+1=5, 7+9=16 (carry 1), 4+(none)+1=5: 5653
    ("4738+915=", "8+5+0=13;3+1+1=5;7+9+0=16;4+0+1=5;|5653"),
    # every position carries, so one extra step writes the last carry: 1000
    ("999+1=", "9+1+0=10;9+0+1=10;9+0+1=10;0+0+1=1;|1000"),
    # 0+5=5, 2+0=2, 1+3=4, no carry anywhere: 425
    ("120+305=", "0+5+0=5;2+0+0=2;1+3+0=4;|425"),
    # the first operand is the shorter one: 5+3=8, (none)+2=2, (none)+1=1: 128
    ("5+123=", "5+3+0=8;0+2+0=2;0+1+0=1;|128"),
    # one position, 0+0=0
    ("0+0=", "0+0+0=0;|0"),
    # 6+7=13, 9+8+1=18, 0+(none)+1=1, 5+0=5: 5183
    ("5096+87=", "6+7+0=13;9+8+1=18;0+0+1=1;5+0+0=5;|5183"),
])
def test_long_addition_demonstrations_by_hand(prompt, demonstration):
    a, b = map(int, prompt[:-1].split("+"))
    ex = Example(prompt, str(a + b))
    task = _long(1, 4, eval_size=16)
    assert task.demonstration(ex) == demonstration
    assert task.reward(demonstration, ex) == 1.0


def test_long_addition_rewards_grade_the_final_answer_only():
    task = _long()
    ex = Example("4738+915=", "5653")
    assert task.reward("8+5+0=13;3+1+1=5;7+9+0=16;4+0+1=5;|5654", ex) == 0.0  # wrong final answer
    assert task.reward("8+5+0=12;3+1+1=9;|5653", ex) == 1.0  # wrong scratchpad, right answer
    assert task.reward("|5653", ex) == 1.0 and task.reward("|  5653\n", ex) == 1.0
    assert task.reward("5653", ex) == 0.0  # no "|": no final answer
    assert task.reward("|1|5653", ex) == 1.0 and task.reward("|5653|1", ex) == 0.0  # the last "|" counts
    assert task.reward("|5653;", ex) == 0.0 and task.reward("|05653", ex) == 0.0 and task.reward("", ex) == 0.0


def test_long_addition_operands_and_lengths():
    task = _long()
    lengths, seen = [], set()
    for e in task.sample(random.Random(0), 20000) + task.eval_set():
        a, b = e.prompt[:-1].split("+")
        assert 3 <= len(a) <= 8 and 3 <= len(b) <= 8 and a[0] != "0" and b[0] != "0"
        assert e.answer == str(int(a) + int(b)) and len(e.prompt) <= 18
        demo = task.demonstration(e)
        assert set(e.prompt + demo) <= PRINTABLE and task.reward(demo, e) == 1.0
        lengths.append(len(demo) + 1)  # one token per character, plus EOS
        seen.add((len(a), len(b)))
    # 3+3 digits without carries: 3 steps of 8 characters, "|", 3 digits, EOS = 29; 8+8 digits all carrying:
    # 8 steps of 9, the extra step of 8, "|", 9 digits, EOS = 91 (the module docstring's range)
    assert min(lengths) >= 29 and max(lengths) <= 91
    assert min(lengths) <= 32 and max(lengths) >= 85  # both ends are reached in 20k draws
    assert 60 < sum(lengths) / len(lengths) < 67
    assert seen == {(i, j) for i in range(3, 9) for j in range(3, 9)}


def test_long_addition_split_and_config_checks():
    # lengths 1..1: 10 numbers, 100 prompts; the eval set may take half of them
    small = _long(1, 1, eval_size=50)
    held = {e.prompt for e in small.eval_set()}
    assert len(held) == 50 and not held & {e.prompt for e in small.sample(random.Random(0), 2000)}
    with pytest.raises(ValueError, match="task.eval_size=51"):
        _long(1, 1, eval_size=51)
    # the held-out set depends on the digit range
    assert _long(3, 8, eval_size=32).eval_set() != _long(2, 8, eval_size=32).eval_set()
    with pytest.raises(ValueError, match="task.min_digits"):
        _long(5, 4)
    with pytest.raises(ValueError, match="task.items"):
        TASKS["long_addition"](TaskConfig(name="long_addition", items=3), 0)
    with pytest.raises(ValueError, match="task.min_digits"):
        TASKS["addition"](TaskConfig(min_digits=2), 0)


# ------------------------------------------------------------------------------------------------------ math


def test_math_jsonl_parses_all_layouts():
    exs = load_math_jsonl(DATA)
    assert [e.answer for e in exs] == ["7", "180", "\\frac{1}{2}", "28", "3", "2", "1/2"]
    assert exs[0].prompt.startswith("Tom has 3 boxes")  # GSM8K question
    assert exs[2].prompt == "What is the value of $\\frac{3}{6}$ as a reduced fraction?"  # chat: user content
    assert exs[3].prompt == "Compute $2^{5} - 4$."  # the system message is not part of the problem text
    assert exs[4].prompt.startswith("Find the positive root")  # DAPO with a plain string prompt
    assert exs[5].answer == "2"  # last \boxed{} of a MATH-style solution


def test_boxed_answer_with_nested_braces():
    ex = parse_math_record({"problem": "p", "solution": "first \\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}}."})
    assert ex.answer == "\\frac{1}{\\sqrt{2}}"


@pytest.mark.parametrize("line, message", [
    ("{not json", "malformed"),
    ('["a list"]', "JSON object"),
    ('{"question": "q", "answer": "no marker"}', "####"),
    ('{"prompt": "p", "reward_model": {"style": "rule"}}', "ground_truth"),
    ('{"prompt": [{"role": "system", "content": "x"}], "reward_model": {"ground_truth": "1"}}', "user message"),
    ('{"problem": "p", "solution": "no box"}', "boxed"),
    ('{"text": "unknown"}', "unknown layout"),
    ('{"question": "  ", "answer": "#### 3"}', "empty"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(ValueError) as err:
        load_math_jsonl(path)
    assert f"{path}:3:" in str(err.value) and message in str(err.value)
    # skip mode drops the line and keeps the rest
    assert len(load_math_jsonl(path, on_error="skip")) == 2


def test_empty_or_missing_file_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="no examples"):
        load_math_jsonl(empty)
    with pytest.raises(FileNotFoundError):
        load_math_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="task.path"):
        TASKS["math"](TaskConfig(name="math"), 0)


def test_math_task_split_and_rewards():
    pytest.importorskip("math_verify")
    task = TASKS["math"](TaskConfig(name="math", path=str(DATA), eval_size=2), 0)
    ev = task.eval_set()
    assert [e.answer for e in ev] == ["2", "1/2"]  # the last eval_size lines
    train = task.sample(random.Random(0), 200)
    assert {e.answer for e in train} == {"7", "180", "\\frac{1}{2}", "28", "3"}
    assert train == task.sample(random.Random(0), 200)
    half = Example("What is $0.25 + 0.25$?", "1/2")
    for good in ["0.5", "1/2", "\\frac{1}{2}", "The answer is \\boxed{\\frac12}.", " 0.50 "]:
        assert task.reward(good, half) == 1.0, good
    for bad in ["0.25", "2", "", "}}{\\boxed{", "!!??"]:
        assert task.reward(bad, half) == 0.0, bad
    frac = Example("q", "\\frac{1}{2}")
    assert task.reward("0.5", frac) == 1.0 and task.reward("1/3", frac) == 0.0
    for e in load_math_jsonl(DATA):
        assert task.reward(task.demonstration(e), e) == 1.0, e


def test_math_task_eval_path_removes_overlap(tmp_path):
    pytest.importorskip("math_verify")
    ev_path = tmp_path / "eval.jsonl"
    ev_path.write_text(DATA.read_text().splitlines()[0] + "\n")
    task = TASKS["math"](TaskConfig(name="math", path=str(DATA), eval_path=str(ev_path), eval_size=1), 0)
    assert [e.answer for e in task.eval_set()] == ["7"]
    assert "7" not in {e.answer for e in task.sample(random.Random(0), 300)}
    with pytest.raises(ValueError, match="eval_size=7"):
        TASKS["math"](TaskConfig(name="math", path=str(DATA), eval_size=7), 0)


# -------------------------------------------------------------------------------------------------- list_ops


def _list_ops(min_ops: int = 2, max_ops: int = 5, items: int = 4, eval_size: int = 64):
    return TASKS["list_ops"](TaskConfig(name="list_ops", items=items, min_digits=min_ops, digits=max_ops,
                                        eval_size=eval_size), 0)


@pytest.mark.parametrize("prompt, demonstration", [
    # R: 4721 -> 1274; L: 1274 -> 2741; I: 2741 -> 3852
    ("4721:RLI=", "R1274;L2741;I3852;|3852"),
    # S swaps the ends: 9015 -> 5019; I wraps 9 to 0: 5019 -> 6120; R: 0216
    ("9015:SIR=", "S5019;I6120;R0216;|0216"),
    # two rotations of 1230: 2301, 3012; swapping the ends of 3012: 2013
    ("1230:LLS=", "L2301;L3012;S2013;|2013"),
])
def test_list_ops_demonstrations_by_hand(prompt, demonstration):
    task = _list_ops(1, 4, eval_size=16)
    ex = Example(prompt, demonstration.rpartition("|")[2])
    assert task.demonstration(ex) == demonstration
    assert task.reward(demonstration, ex) == 1.0 and task.reward(f"  {demonstration}\n", ex) == 1.0


def test_list_ops_reward_grades_the_whole_trace():
    task = _list_ops()
    ex = Example("4721:RLI=", "3852")
    assert task.reward("R1274;L2741;I3852;|3852", ex) == 1.0
    assert task.reward("R1274;L2741;I3852;|3853", ex) == 0.0  # wrong final list
    assert task.reward("R1274;L2714;I3852;|3852", ex) == 0.0  # a wrong step, right final list
    assert task.reward("|3852", ex) == 0.0 and task.reward("3852", ex) == 0.0 and task.reward("", ex) == 0.0


def test_list_ops_prompts_lengths_and_split():
    task = _list_ops(2, 6)
    lengths, ops_seen, n_ops = [], set(), set()
    for ex in task.sample(random.Random(0), 5000) + task.eval_set():
        digits, ops = ex.prompt[:-1].split(":")
        assert len(digits) == 4 and digits.isdigit() and 2 <= len(ops) <= 6 and set(ops) <= set("RLSI")
        demo = task.demonstration(ex)
        assert set(ex.prompt + demo) <= PRINTABLE and task.reward(demo, ex) == 1.0 and demo.endswith("|" + ex.answer)
        lengths.append(len(demo) + 1)  # one token per character, plus EOS
        ops_seen |= set(ops)
        n_ops.add(len(ops))
    # (items + 2) L + items + 2 with items 4: 18 at L = 2, 42 at L = 6 (the class docstring's range)
    assert min(lengths) == 18 and max(lengths) == 42
    assert ops_seen == set("RLSI") and n_ops == set(range(2, 7))
    held = {e.prompt for e in task.eval_set()}
    assert held == {e.prompt for e in _list_ops(2, 6).eval_set()} and len(held) == 64
    assert not held & {e.prompt for e in task.sample(random.Random(1), 5000)}
    # the held-out set depends on the list length and the operation range
    assert held != {e.prompt for e in _list_ops(2, 6, items=5).eval_set()}
    assert held != {e.prompt for e in _list_ops(3, 6).eval_set()}


def test_list_ops_config_checks():
    with pytest.raises(ValueError, match="task.items"):
        _list_ops(items=1)
    # items 2, one operation: 100 lists x 4 operations = 400 prompts, at most 200 held out
    assert len(_list_ops(1, 1, items=2, eval_size=200).eval_set()) == 200
    with pytest.raises(ValueError, match="task.eval_size=201"):
        _list_ops(1, 1, items=2, eval_size=201)
