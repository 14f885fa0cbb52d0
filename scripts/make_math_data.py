"""Make the math recipes' data files from local copies of public math sets.

    python scripts/make_math_data.py --train gsm8k/train.jsonl --eval gsm8k/test.jsonl --out data
    python scripts/make_math_data.py --train dapo-math-17k.parquet --eval-size 500 --out data

Reads every layout ``trainers.tasks.parse_math_record`` knows (GSM8K ``question``/``answer`` with ``####``,
DAPO-Math / verl ``prompt`` + ``reward_model.ground_truth``, MATH-style ``problem`` + ``answer`` or a
``\\boxed{}`` solution), from JSON lines or Parquet (one row per problem, the same columns; Parquet needs pyarrow),
and writes ``<out>/math_train.jsonl`` and ``<out>/math_eval.jsonl`` with one ``{"problem", "answer"}`` object per
line, the files ``configs/qwen3-8b.yaml`` and ``configs/qwen3-30b-a3b.yaml`` name. Problems are de-duplicated by
their text (DAPO-Math repeats each problem many times); without ``--eval`` the held-out set is ``--eval-size``
problems drawn with ``--seed``; a training problem that is also held out is dropped. A row that no layout reads is
counted and the first ones are named; the script stops (exit 1) when more than ``--max-bad`` of the rows are bad.
Nothing is downloaded: fetch the sets yourself and point the script at the files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from trainers.tasks import Example, parse_math_record  # noqa: E402

# Bad rows named one by one before the rest are only counted.
NAMED = 5


def rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) of every row of a JSON-lines or Parquet file; a line that is not JSON is yielded as the
    exception that reading it raised."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert it to JSON "
                             f"lines first") from None
        for i, record in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:row {i}", record
        return
    with open(path, encoding="utf-8-sig") as f:
        for i, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield f"{path}:{i}", json.loads(line)
                except ValueError as exc:
                    yield f"{path}:{i}", exc


def read(paths: list[Path], bad: list[str]) -> tuple[list[Example], int]:
    """(the distinct problems of ``paths`` in file order, the first answer of a repeated problem kept; rows read)."""
    seen: dict[str, Example] = {}
    count = 0
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"{path}: no such file")
        for where, record in rows(path):
            count += 1
            try:
                if isinstance(record, Exception):
                    raise ValueError(f"not JSON: {record}")
                example = parse_math_record(record)
            except ValueError as exc:
                bad.append(f"{where}: {exc}")
                continue
            seen.setdefault(example.prompt, example)
    return list(seen.values()), count


def write(path: Path, examples: list[Example]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"problem": ex.prompt, "answer": ex.answer}, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", nargs="+", type=Path, required=True, help="training files (.jsonl or .parquet)")
    p.add_argument("--eval", nargs="+", type=Path, default=None, help="held-out files (default: drawn from --train)")
    p.add_argument("--eval-size", type=int, default=500, help="held-out problems drawn without --eval (default 500)")
    p.add_argument("--seed", type=int, default=0, help="seed of that draw (default 0)")
    p.add_argument("--out", type=Path, default=Path("data"), help="folder of math_train.jsonl and math_eval.jsonl")
    p.add_argument("--max-bad", type=float, default=0.01, help="largest share of unreadable rows accepted (0.01)")
    ns = p.parse_args(argv)

    bad: list[str] = []
    train, total = read(ns.train, bad)
    held, held_rows = read(ns.eval, bad) if ns.eval else ([], 0)
    total += held_rows
    for line in bad[:NAMED]:
        print(f"skipped {line}", file=sys.stderr)
    if len(bad) > NAMED:
        print(f"skipped {len(bad) - NAMED} more unreadable rows", file=sys.stderr)
    if bad and len(bad) > ns.max_bad * total:
        print(f"{len(bad)} of {total} rows are unreadable (more than --max-bad {ns.max_bad:g}): not a math set this "
              f"script reads; nothing written", file=sys.stderr)
        return 1
    if not ns.eval:
        if not 0 < ns.eval_size < len(train):
            print(f"--eval-size {ns.eval_size} must be between 1 and the {len(train) - 1} problems it leaves one of "
                  f"for training; lower it or give --eval; nothing written", file=sys.stderr)
            return 1
        held = random.Random(ns.seed).sample(train, ns.eval_size)
    held_prompts = {ex.prompt for ex in held}
    overlap = sum(ex.prompt in held_prompts for ex in train)
    train = [ex for ex in train if ex.prompt not in held_prompts]
    if not train or not held:
        print(f"no {'training' if not train else 'held-out'} problem left; nothing written", file=sys.stderr)
        return 1
    write(ns.out / "math_train.jsonl", train)
    write(ns.out / "math_eval.jsonl", held)
    print(f"{ns.out / 'math_train.jsonl'}: {len(train)} problems ({overlap} dropped as held out); "
          f"{ns.out / 'math_eval.jsonl'}: {len(held)} problems; {len(bad)} unreadable rows skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
