"""scripts/make_math_data.py: local GSM8K / DAPO-Math files -> the recipes' data/math_train.jsonl, math_eval.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dcmdp.check import find_problems
from trainers.tasks import load_math_jsonl

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "make_math_data.py"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _gsm8k(path: Path, start: int, n: int) -> None:
    path.write_text("".join(json.dumps({"question": f"Tom has {i} apples and buys 2. How many?",
                                        "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}) + "\n"
                            for i in range(start, start + n)))


def test_gsm8k_train_and_test_files_become_the_recipe_files(tmp_path):
    _gsm8k(tmp_path / "train.jsonl", 0, 30)
    _gsm8k(tmp_path / "test.jsonl", 25, 10)  # problems 25-29 are in both: held out, so dropped from training
    done = _run("--train", "train.jsonl", "--eval", "test.jsonl", "--out", "data", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    train, held = (load_math_jsonl(tmp_path / "data" / f"math_{s}.jsonl") for s in ("train", "eval"))
    assert [ex.answer for ex in train] == [str(i + 2) for i in range(25)]
    assert [ex.answer for ex in held] == [str(i + 2) for i in range(25, 35)]
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held}
    assert "25 problems (5 dropped as held out)" in done.stdout and "10 problems; 0 unreadable" in done.stdout
    first = json.loads((tmp_path / "data" / "math_train.jsonl").read_text().splitlines()[0])
    assert first == {"problem": "Tom has 0 apples and buys 2. How many?", "answer": "2"}


def test_dapo_rows_are_deduplicated_and_a_held_out_set_is_drawn(tmp_path):
    rows = []
    for i in range(12):
        record = {"prompt": [{"role": "user", "content": f"Compute {i}*3. Answer: $Answer"}],
                  "reward_model": {"ground_truth": str(3 * i), "style": "rule"}}
        rows += [record] * 3  # DAPO-Math repeats its problems
    rows.insert(5, {"prompt": "no answer here"})
    (tmp_path / "dapo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    done = _run("--train", "dapo.jsonl", "--eval-size", "4", "--max-bad", "0.1", "--out", "data", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    train, held = (load_math_jsonl(tmp_path / "data" / f"math_{s}.jsonl") for s in ("train", "eval"))
    assert len(train) == 8 and len(held) == 4 and len({ex.prompt for ex in train + held}) == 12
    assert f"skipped {Path('dapo.jsonl')}:6: unknown layout with keys ['prompt']" in done.stderr
    assert "dapo.jsonl:38: not JSON" in done.stderr and "2 unreadable rows skipped" in done.stdout
    again = _run("--train", "dapo.jsonl", "--eval-size", "4", "--max-bad", "0.1", "--out", "again", cwd=tmp_path)
    assert again.returncode == 0
    assert (tmp_path / "again" / "math_eval.jsonl").read_text() == (tmp_path / "data" / "math_eval.jsonl").read_text()

    # the 8B recipe then finds its task files in order: no task problem is left for `dcmdp check`
    problems = find_problems(str(ROOT / "configs" / "qwen3-8b.yaml"), [
        f"task.path={tmp_path / 'data' / 'math_train.jsonl'}",
        f"task.eval_path={tmp_path / 'data' / 'math_eval.jsonl'}",
        f"output_dir={tmp_path / 'out'}", "model.init=random", "rollout.engine=torch", "device=cpu"])
    assert not [p for p in problems if p.key.startswith("task.")], problems


@pytest.mark.parametrize("args, needle", [
    (("--train", "nowhere.jsonl"), "nowhere.jsonl: no such file"),
    (("--train", "junk.jsonl"), "3 of 3 rows are unreadable"),
    (("--train", "train.jsonl", "--eval-size", "30"), "--eval-size 30 must be between 1 and the 29"),
])
def test_bad_inputs_write_nothing(args, needle, tmp_path):
    _gsm8k(tmp_path / "train.jsonl", 0, 30)
    (tmp_path / "junk.jsonl").write_text('{"a": 1}\n{"b": 2}\n[3]\n')
    done = _run(*args, "--out", "data", cwd=tmp_path)
    assert done.returncode != 0 and needle in done.stderr
    assert not (tmp_path / "data").exists()
