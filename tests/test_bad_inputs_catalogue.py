"""docs/bad_inputs.md walked row by row: every row of every table names tests that exist, and every command-line
case with bad input runs as a user would give it, exiting with its documented code (2 for a bad config, option or
file) and no traceback.

``CLI`` holds the command-line cases; a row names each of its cases as ``test_cli[<id>]`` (the Round 4 table's
``test_catalogue[<id>]`` cases run through ``dcmdp check`` in ``test_bad_inputs_round4.py``). A row that documents
exit code 2 names such a case, or is in ``NOT_A_COMMAND`` with the reason its case needs more than a command line
(a checkpoint, a trained run); its named tests cover it. ``test_cli`` runs each case in this process (fast);
``test_cli_in_a_new_process`` runs each as a new process, reading stdout and stderr for a traceback (slow, but for
``FAST``)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from dcmdp import cli

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bad_inputs.md"

EXPERIMENT = """about: x
base: configs/default.yaml
levels: {a: {about: a}}
methods: {m: {about: m}}
profiles: {quick: {about: q, cells: [{levels: [a], methods: [m], N: [1], seeds: [0]}]}}
"""


def _file(name: str, text: str | bytes) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return write


def _folder(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).mkdir()


TUNE = f"base: {ROOT / 'configs' / 'tiny-dense.yaml'}\noverrides: [steps=1, threads=1]\noutput_dir: o\n"


def _symlink_loop(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).symlink_to(name)


def _fifo(name: str) -> Callable[[Path], None]:
    return lambda d: os.mkfifo(d / name)


def _jsonl_task(*lines: str) -> Callable[[Path], None]:
    """sums.jsonl holding ``lines`` and my_reward.py, whose ``score`` a jsonl task can call."""
    def write(d: Path) -> None:
        (d / "sums.jsonl").write_text("".join(f"{line}\n" for line in lines))
        (d / "my_reward.py").write_text("def score(prompt, completion, example):\n    return 1.0\n")
    return write


SUMS = tuple(f'{{"prompt": "{i}+1", "answer": "{i + 1}"}}' for i in range(10))
JSONL = ("dcmdp", "train", "task.name=jsonl", "task.path=sums.jsonl", "task.reward=my_reward.py:score",
         "task.eval_size=2", "output_dir=out")


def _deep_buffer_line(d: Path) -> None:
    """A leftover tracking buffer segment whose one record is nested 1,000 levels deep."""
    (d / "buffer").mkdir()
    header = json.dumps({"t": "header", "uri": "http://127.0.0.1:9", "created": 0}).encode() + b"\n"
    (d / "buffer" / "00000000000000000001-abcdef01.jsonl").write_bytes(
        header + b'{"t": "metric", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}\n")


@dataclass(frozen=True)
class Case:
    """``argv`` (``dcmdp ...`` or ``benchmarks/run.py ...``) run in a folder that ``setup`` fills; the error holds
    ``needle``; the command exits with ``code``."""

    argv: tuple[str, ...]
    needle: str
    code: int = 2
    setup: Callable[[Path], None] = lambda d: None


def _experiment(needle: str, setup: Callable[[Path], None], read: bool = False) -> Case:
    """``benchmarks/run.py bad.yaml --profile quick`` (training nothing); the error line is ``error: bad.yaml`` and
    ``needle`` (``error: cannot read bad.yaml`` and ``needle`` when the file's bounds refuse it: ``read``)."""
    return Case(("benchmarks/run.py", "bad.yaml", "--profile", "quick", "--no-train", "--bench-dir", "b", "--results",
                 "r"), f"error: {'cannot read ' if read else ''}bad.yaml{needle}", setup=setup)


CLI: dict[str, Case] = {
    "unknown-key": Case(("dcmdp", "check", "algo.minibatchs=4"),
                        "unknown config key 'algo.minibatchs'; did you mean 'minibatches'?"),
    "wrong-type": Case(("dcmdp", "check", "algo.std_normalize=maybe"),
                       "bad value for 'algo.std_normalize': Value 'maybe' is not a valid bool"),
    "negative-tolerance": Case(("dcmdp", "check", "dual.constraints[0].tolerance=-1"),
                               "config error at 'dual.constraints[0].tolerance': must be >= 0"),
    "lambda-min-above-max": Case(("dcmdp", "check", "dual.constraints[0].lambda_min=2",
                                  "dual.constraints[0].lambda_max=1"), "need 0 <= lambda_min <= lambda_max"),
    "minibatches-do-not-divide": Case(("dcmdp", "check", "algo.minibatches=3"),
                                      "3 mini-batches do not divide the rollout batch of 16 x 8 = 128 samples"),
    "top-p-out-of-range": Case(("dcmdp", "check", "rollout.top_p=1.5"),
                               "config error at 'rollout.top_p': must be in (0, 1], got 1.5"),
    "misspelled-task": Case(("dcmdp", "check", "task.name=additon"), "unknown 'additon'; did you mean 'addition'?"),
    "r2-on-dense": Case(("dcmdp", "check", "model.preset=tiny-dense", "algo.routing_replay=r2"),
                        "r2 replays MoE routes, but model.preset='tiny-dense' is a dense model"),
    "config-file-missing": Case(("dcmdp", "check", "nosuch.yaml"), "config file not found: nosuch.yaml"),
    "config-file-malformed": Case(("dcmdp", "check", "run.yaml"), "cannot parse config file run.yaml",
                                  setup=_file("run.yaml", "steps: [3\n")),
    "math-without-path": Case(("dcmdp", "check", "task.name=math"), "config error at 'task.path': task 'math' needs"),
    "non-finite-lr": Case(("dcmdp", "check", "optim.lr=inf"),
                          "config error at 'optim.lr': must be a finite number, got inf"),
    "routing-mismatch-under-r3": Case(("dcmdp", "check", "algo.routing_replay=r3",
                                       "dual.constraints=[{measure: routing_mismatch, tolerance: 0.1}]"),
                                      "routing_mismatch compares the two engines' expert choices"),
    "tracking-uri-scheme": Case(("dcmdp", "check", "tracking.uri=foo://x"),
                                "MLflow cannot use the tracking URI 'foo://x' (scheme 'foo')"),
    "sync-missing-folder": Case(("dcmdp", "sync", "nosuch"), "tracking buffer folder nosuch does not exist"),
    "sync-of-a-file": Case(("dcmdp", "sync", "afile"), "tracking buffer folder afile is a file, not a folder",
                           setup=_file("afile", "")),
    "reward-module-missing": Case(("dcmdp", "check", "task.name=jsonl", "task.path=x.jsonl", "task.reward=nomod:score"),
                                  "'nomod:score': no module 'nomod' in the working directory"),
    "jsonl-without-path": Case(("dcmdp", "check", "task.name=jsonl"),
                               "config error at 'task.path': task 'jsonl' needs a JSON-lines file"),
    "several-at-once": Case(("dcmdp", "check", "algo.minibatchs=4", "optim.lr=inf"),
                            "2 problems in the config"),
    "reward-timeout-zero": Case(("dcmdp", "check", "task.reward_timeout=0"),
                                "config error at 'task.reward_timeout': must be a finite number of seconds > 0"),
    "file-store-uri": Case(("dcmdp", "check", "tracking.uri=file:///tmp/mlruns"),
                           "'file:///tmp/mlruns' is a file store"),
    "empty-experiment-name": Case(("dcmdp", "check", "tracking.experiment="), "'tracking.experiment'"),
    "empty-config-file": Case(("dcmdp", "check", "run.yaml"), "config file run.yaml holds no setting",
                              setup=_file("run.yaml", "# nothing\n")),
    "seed-too-large": Case(("dcmdp", "check", "seed=4294967296"), "config error at 'seed': must be <= 4294967295"),
    "empty-output-dir": Case(("dcmdp", "check", "output_dir="), "'output_dir'"),
    "max-new-tokens-beyond-context": Case(("dcmdp", "check", "rollout.max_new_tokens=100000"),
                                          "config error at 'rollout.max_new_tokens': 100000 new tokens leave no room"),
    "infeasible-coupling": Case(("dcmdp", "check", "dual.coupling.A=[[1.0]]", "dual.coupling.b=[-1.0]"),
                                "config error at 'dual.coupling.b[0]'"),
    "calibrate-zero-batches": Case(("dcmdp", "calibrate", "--batches", "0"), "argument --batches: must be >= 1"),
    "output-dir-a-file": Case(("dcmdp", "check", "output_dir=afile"), "'afile' is a file, not a folder",
                              setup=_file("afile", "")),
    "eval-checkpoint-missing": Case(("dcmdp", "eval", "--checkpoint", "nosuch"), "--checkpoint nosuch does not exist"),
    "calibrate-measure-typo": Case(("dcmdp", "calibrate", "--measures", "kl_k33"),
                                   "config error at '--measures': unknown 'kl_k33'; did you mean 'kl_k3'?"),
    "calibrate-out-a-folder": Case(("dcmdp", "calibrate", "--out", "adir"),
                                   "config error at '--out': adir is a folder", setup=_folder("adir")),
    "report-empty-out": Case(("dcmdp", "report", "--out", ""), "argument --out: empty; give a value"),
    "eval-empty-checkpoint": Case(("dcmdp", "eval", "--checkpoint", ""), "argument --checkpoint: empty"),
    "calibrate-empty-out": Case(("dcmdp", "calibrate", "--out", ""), "argument --out: empty"),
    "sync-empty-uri": Case(("dcmdp", "sync", "--tracking-uri", "", "buffer"), "argument --tracking-uri: empty"),
    "password-with-slash": Case(("dcmdp", "check", "tracking.uri=http://alice:QWxh/ZGRp+bg==@host"),
                                "its userinfo holds an unencoded '/', '?' or '#'"),
    "reward-timeout-huge": Case(("dcmdp", "check", "task.reward_timeout=1e308"),
                                "1e+308 s per reward call is above 3600 s"),
    "samples-per-step-huge": Case(("dcmdp", "check", "algo.samples_per_prompt=100000000"),
                                  "1600000000 samples per step, above 1048576"),
    "digits-beyond-context": Case(("dcmdp", "check", "task.digits=1000000000"),
                                  "config error at 'task.digits': 1000000000 digits do not fit the context"),
    "curriculum-unknown-key": Case(("dcmdp", "check", "task.curriculum=[{at: 1, digits: 8}]"),
                                   "task.curriculum: unknown config key: Key 'at' not in 'CurriculumPhase'"),
    "model-config-json-nested-100000-levels": Case(
        ("dcmdp", "check", "model.path=m"), "no readable config.json in 'm' (config.json is nested more than 32 levels deep)",
        setup=_file("m/config.json", '{"a": ' * 100_000 + "1" + "}" * 100_000)),
    "tokenizer-config-json-nested-100000-levels": Case(
        ("dcmdp", "check", "model.path=m"), "no loadable tokenizer in 'm': tokenizer_config.json is nested more than 32 "
        "levels deep", setup=_file("m/tokenizer_config.json", '{"a": ' * 100_000 + "1" + "}" * 100_000)),
    "ess-lr-scale-2": Case(("dcmdp", "check", "algo.ess_lr_scale=2"),
                           "config error at 'algo.ess_lr_scale': expected true or false, got 2"),
    "temperature-underflows": Case(("dcmdp", "check", "rollout.temperature=1e-30"),
                                   "config error at 'rollout.temperature': 1e-30 is below 0.01"),
    "experiment-malformed": _experiment(": not a readable YAML file: ", _file("bad.yaml", "about: [x\n")),
    "experiment-missing-base": _experiment(
        ".base: no config file 'configs/missing.yaml'",
        _file("bad.yaml", EXPERIMENT.replace("configs/default.yaml", "configs/missing.yaml"))),
    "experiment-nested-1000-levels": _experiment(
        ": nested more than 32 levels deep (line 33)",
        _file("bad.yaml", "".join(f"{'  ' * i}k{i}:\n" for i in range(1000)) + "  " * 1000 + "v: 1\n"), read=True),
    "experiment-nested-flow": _experiment(": nested more than 32 levels deep (line 2)",
                                          _file("bad.yaml", "about: x\nbase: " + "[" * 5000 + "]" * 5000 + "\n"),
                                          read=True),
    "experiment-over-1-mib": _experiment(" is larger than 1 MiB; an experiment file is a few KiB",
                                         _file("bad.yaml", "about: x\n" + "# padding\n" * 200_000)),
    "experiment-alias-bomb": _experiment(
        ": more than 100,000 values once its aliases (*name) are expanded",
        _file("bad.yaml", "about: x\nl0: &l0 [x, x, x, x, x, x, x, x, x, x]\n"
              + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 10))), read=True),
    "experiment-wrong-key": _experiment(": unknown key(s) ['profilez']",
                                        _file("bad.yaml", EXPERIMENT + "profilez: {}\n")),
    "experiment-wrong-shape": _experiment(
        ": a value of the wrong shape (TypeError: 'int' object is not iterable)",
        _file("bad.yaml", EXPERIMENT.replace("levels: [a]", "levels: 3"))),
    "experiment-a-folder": _experiment(": is not a file", _folder("bad.yaml")),
    "tune-file-nested-1000-levels": Case(
        ("dcmdp", "tune", "tune.yaml"), "cannot read tune file tune.yaml: nested more than 32 levels deep (line 33)",
        setup=_file("tune.yaml", "".join(f"{'  ' * i}k{i}:\n" for i in range(1000)) + "  " * 1000 + "v: 1\n")),
    "tune-file-over-1-mib": Case(("dcmdp", "tune", "tune.yaml"), "tune file tune.yaml is larger than 1 MiB",
                                 setup=_file("tune.yaml", "base: x\n" + "# padding\n" * 200_000)),
    "sync-buffer-line-nested-1000-levels": Case(
        ("dcmdp", "sync", "buffer"), "a segment with unreadable lines, kept for inspection", code=1,
        setup=_deep_buffer_line),
    "model-path-missing": Case(("dcmdp", "train", "model.path=no_model", "output_dir=out"),
                               "dcmdp: error: tokenizer directory not found: 'no_model' (model.path must be a local "
                               "directory"),
    "resume-missing": Case(("dcmdp", "train", "checkpoint.resume=no_ckpt", "output_dir=out"),
                           "dcmdp: error: resume checkpoint no_ckpt does not exist"),
    "report-out-a-file": Case(("dcmdp", "report", "dcmdp", "--out", "a_file"),
                              "dcmdp: error: --out a_file is a file: the report is a folder",
                              setup=_file("a_file", "")),
    "jsonl-malformed-line": Case(JSONL, "dcmdp: error: sums.jsonl: 1 malformed jsonl line(s): line 2: no 'prompt' "
                                        "(keys: ['question'])",
                                 setup=_jsonl_task(SUMS[0], '{"question": "x"}', *SUMS[2:])),
    "jsonl-cold-start-without-completion": Case(
        JSONL, "dcmdp: error: config error at 'cold_start.steps': the cold start trains on demonstrations",
        setup=_jsonl_task(*SUMS)),
    "threads-above-cores": Case(("dcmdp", "check", "threads=1000"),
                                "config error at 'threads': 1000 threads, but this process may run on"),
    "tracking-uri-query-token": Case(("dcmdp", "check", "tracking.uri=http://127.0.0.1:5000/?token=t0k3n-abc"),
                                     "config error at 'tracking.uri': 'http://127.0.0.1:5000/' cannot be used: an "
                                     "MLflow server's URI takes no query or fragment"),
    "memory-plan-overhead-largest": Case(("dcmdp", "check", "--gpu-memory", "1"),
                                         "the largest term is overhead (3.0 GiB: CUDA context, NCCL buffers, allocator "
                                         "slack (assumed)): no key shrinks this fixed cost"),
    "calibrate-updates-without-constraints": Case(
        ("dcmdp", "calibrate", "dual.measure_at=updates", "dual.constraints=[]"),
        "config error at 'dual.constraints': calibrate under dual.measure_at=updates proposes c"),
    "experiment-cell-name-not-a-template": _experiment(".cell_name: expected the template of one folder name",
                                                       _file("bad.yaml", EXPERIMENT + "cell_name: 5\n")),
    "experiment-late-from-2": _experiment(".late_from: expected the share of the steps after which evaluations count "
                                          "as late, a number in [0, 1] (e.g. 0.6), got 2",
                                          _file("bad.yaml", EXPERIMENT + "late_from: 2\n")),
    "experiment-workers-0": Case(("benchmarks/run.py", "bad.yaml", "--workers", "0"),
                                 "argument --workers: must be an integer >= 1, got 0",
                                 setup=_file("bad.yaml", EXPERIMENT)),
    "experiment-workers-negative": Case(("benchmarks/run.py", "bad.yaml", "--workers", "-3"),
                                        "argument --workers: must be an integer >= 1, got -3",
                                        setup=_file("bad.yaml", EXPERIMENT)),
    "config-symlink-loop": Case(("dcmdp", "check", "run.yaml"),
                                "config file run.yaml is a symbolic link loop (too many levels of symbolic links)",
                                setup=_symlink_loop("run.yaml")),
    "config-a-folder": Case(("dcmdp", "check", "run.yaml"), "config file run.yaml is a directory, not a file",
                            setup=_folder("run.yaml")),
    "config-a-fifo": Case(("dcmdp", "check", "run.yaml"), "config file run.yaml is not a regular file (a FIFO, "
                          "a named pipe)", setup=_fifo("run.yaml")),
    "config-dev-zero": Case(("dcmdp", "check", "/dev/zero"), "config file /dev/zero is not a regular file (a "
                            "character device)"),
    "config-file-named-with-equals": Case(("dcmdp", "check", "my=cfg.yaml"), "unknown config key 'stepz'",
                                          setup=_file("my=cfg.yaml", "stepz: 2\n")),
    "output-dir-name-over-255-bytes": Case(("dcmdp", "check", "output_dir=" + "a" * 300),
                                           "config error at 'output_dir': the folder name 'aaaa"),
    "task-file-symlink-loop": Case(("dcmdp", "check", "task.name=math", "task.path=loop.jsonl"),
                                   "loop.jsonl is a symbolic link loop (too many levels of symbolic links); name a "
                                   "JSON-lines file", setup=_symlink_loop("loop.jsonl")),
    "reward-memory-limit-refused-alone": Case(
        ("dcmdp", "check", *JSONL[2:6], "cold_start.steps=0", "task.reward_memory_mib=-1"),
        "dcmdp: 1 problem in the config, each to fix before a run can start:\n  task.reward_memory_mib: config "
        "error at 'task.reward_memory_mib': must be 0 (no limit) or in [64, 1048576] MiB", setup=_jsonl_task(*SUMS)),
    "reward-load-timeout-refused-alone": Case(
        ("dcmdp", "check", *JSONL[2:6], "cold_start.steps=0", "task.reward_load_timeout=0"),
        "dcmdp: 1 problem in the config, each to fix before a run can start:\n  task.reward_load_timeout: config "
        "error at 'task.reward_load_timeout': must be a number of seconds in (0, 3600]", setup=_jsonl_task(*SUMS)),
    "tune-grid-value-out-of-range": Case(
        ("dcmdp", "tune", "tune.yaml"), "dcmdp: tune config error at 'space.rollout.top_p': the value 1.5 cannot be "
        "run: config error at 'rollout.top_p': must be in (0, 1], got 1.5",
        setup=_file("tune.yaml", TUNE + "space: {rollout.top_p: [0.9, 1.5]}\n")),
    "tune-grid-value-of-the-wrong-type": Case(
        ("dcmdp", "tune", "tune.yaml"), "dcmdp: tune config error at 'space.algo.minibatches': the value 'two' cannot "
        "be run: cannot set 'algo.minibatches' to 'two': Value 'two' of type 'str' could not be converted to Integer",
        setup=_file("tune.yaml", TUNE + "space: {algo.minibatches: [two]}\n")),
    "tune-key-of-the-wrong-type": Case(
        ("dcmdp", "tune", "tune.yaml"), "tune config error at 'workers' in tune.yaml: Value 'abc' of type 'str' could "
        "not be converted to Integer", setup=_file("tune.yaml", TUNE + "workers: abc\nspace: {seed: [1]}\n")),
    "tune-grid-of-4-million-trials": Case(
        ("dcmdp", "tune", "tune.yaml"), "tune config error at 'space': the grid has 4,100,625 combinations (45 x 45 x "
        "45 x 45), above 10,000, each a training run",
        setup=_file("tune.yaml", TUNE + "space: {" + ", ".join(f"{k}: {list(range(1, 46))}" for k in
                                                          ("steps", "eval_every", "log_every", "seed")) + "}\n")),
    "store-a-folder": Case(("dcmdp", "check", "output_dir=out"), "mlflow.db is a directory, not a file; a sqlite "
                           "store is a file", setup=_folder("mlflow.db")),
    "store-a-folder-train": Case(("dcmdp", "train", "model.preset=tiny-dense", "cold_start.steps=0", "threads=1",
                                  "steps=2", "output_dir=out"),
                                 "dcmdp: config error at 'output_dir': the MLflow store ", setup=_folder("mlflow.db")),
    "anchor-never-reached": Case(("dcmdp", "check", "steps=5", "dual.measure_at=updates",
                                  "dual.constraints=[{measure: kl_k3, anchor: 0.5, floor_slack: 1.0}]"),
                                 "dcmdp: warning: dual.constraints[0].anchor: its first window (anchor_start=10, "
                                 "anchor_batches=4) closes at step 14, after the run's last (steps=5)", code=0),
    "warmup-longer-than-the-run": Case(("dcmdp", "check", "optim.warmup_steps=1000000000000"),
                                       "dcmdp: warning: optim.warmup_steps=1000000000000 is longer than the run "
                                       "(steps=60): the learning rate never reaches optim.lr", code=0),
    "checkpoints-a-file": Case(("dcmdp", "check", "output_dir=out"), "output_dir: cannot write checkpoints to "
                               "out/checkpoints: out/checkpoints is a file, not a folder",
                               setup=_file("out/checkpoints", "")),
    "overwrite-without-run-json": Case(
        ("dcmdp", "check", "output_dir=x6", "overwrite=true"), "overwrite=true: output_dir x6 holds summary.json but "
        "no readable run.json naming a dcmdp run that wrote them",
        setup=lambda d: (_file("x6/summary.json", "{}\n")(d), _file("x6/checkpoints/notes.txt", "mine\n")(d))),
}

# rows that document exit code 2 for a case a command line alone cannot make: the tests they name cover them
NOT_A_COMMAND = {
    "resume onto an incompatible config": "needs a checkpoint of an earlier run",
    "resuming with `steps` below the checkpoint's step": "needs a checkpoint of an earlier run",
    "`dcmdp eval` of a MoE checkpoint with a dense preset": "needs a checkpoint of a trained model",
    "`dcmdp tune` with a damaged study database": "needs a tune file and its database",
    "a tune file's `output_dir` that is a file": "needs a tune file",
    "`model.preset=${oc.env:P}`, P changed between run and resume": "needs a checkpoint of an earlier run",
    "`optim.lr` changed on resume": "needs a checkpoint of an earlier run",
    "a reward that returns NaN on every sample": "stops a training run after its steps",
    "a fresh run (no `checkpoint.resume`) in an `output_dir` that holds an earlier run": "needs an earlier run",
    "a checkpoint of another run (or step) copied into `checkpoints/`": "needs a checkpoint of an earlier run",
    "a checkpoint's `manifest.json` (or the folder's `run.json`) nested": "needs a checkpoint of an earlier run",
    "a resume with a changed anchor": "needs a checkpoint of an earlier run",
    "a task file without read permission": "needs a user without root's right to read every file",
    "a damaged `run.json`": "needs a checkpoint of an earlier run",
    "a reward returning NaN on every call in a run shorter": "stops a training run after its steps",
    "the folder that holds the local MLflow store": "needs a user without root's right to write every folder",
}
# the cases run as a new process in the default test run (the rest with -m slow)
FAST = ("experiment-nested-1000-levels", "sync-buffer-line-nested-1000-levels")


def _tables() -> list[tuple[str, str, list[str]]]:
    """(section title, the row's line, its cells) of every row of every table in docs/bad_inputs.md."""
    rows, section = [], ""
    lines = DOC.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            section = line.lstrip("# ")
        is_header = i + 1 < len(lines) and lines[i + 1].startswith("|---")
        if line.startswith("| ") and not is_header:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            rows.append((section, line, cells))
    return rows


def _named_tests(rows: list[tuple[str, str, list[str]]]) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """Per row, (its case, its line, [(test file, function, parameter id)]) from its last cell; ``::name`` is in the
    file named before it, "same test" repeats the row above; a whole file named alone is (file, "", "")."""
    out, previous = [], []
    for _, line, cells in rows:
        named, file = [], ""
        for span in re.findall(r"`([^`]*)`", cells[-1]):
            m = re.fullmatch(r"(test_\w+\.py)?(?:::(test_\w+)(?:\[([\w-]+)\])?)?", span)
            if not m or not (m[1] or m[2]):
                continue
            file = m[1] or file
            named.append((file, m[2] or "", m[3] or ""))
        if "same test" in cells[-1] or (not named and cells[-1].startswith("same")):
            named = named + previous
        out.append((cells[1] if cells[0].isdigit() else cells[0], line, named))
        previous = named
    return out


def test_every_row_names_tests_that_exist():
    """Each row of each table names at least one test (or says it was checked by hand), and each named test file,
    function and ``test_cli`` case exists."""
    rows = _tables()
    assert len(rows) > 140 and {s for s, _, _ in rows} >= {"Bad inputs: what happens",
                                                           "Cases found and fixed: before and after"}
    wrong = []
    for case, row, named in _named_tests(rows):
        if not named and not row.rstrip(" |").split("|")[-1].strip().startswith("by hand"):
            wrong.append(f"row names no test: {case[:80]}")
        for file, function, param in named:
            path = ROOT / "tests" / file
            if not path.is_file() or (function and f"def {function}(" not in path.read_text()):
                wrong.append(f"{file}::{function} (row: {case[:60]}) does not exist")
            elif function == "test_cli" and param not in CLI:
                wrong.append(f"test_cli[{param}] (row: {case[:60]}) is not a case of CLI")
    assert not wrong, "\n".join(wrong)


def test_every_cli_case_has_a_row_and_every_exit_2_row_a_case():
    """Each ``CLI`` case is named by a row; a row documenting exit code 2 names a command-line case (``test_cli`` or
    the Round 4 ``test_catalogue``), or says in ``NOT_A_COMMAND`` why it cannot be one."""
    rows = _tables()
    named = {param for _, _, tests in _named_tests(rows) for _, function, param in tests if function == "test_cli"}
    assert named == set(CLI), (sorted(set(CLI) - named), sorted(named - set(CLI)))
    for case, row, tests in _named_tests(rows):
        if not re.search(r"exit(?: code)? 2\b", row) or any(case.startswith(k) for k in NOT_A_COMMAND):
            continue
        assert any(f in ("test_cli", "test_catalogue") for _, f, _ in tests), \
            f"the row '{case[:80]}' documents exit code 2 but names no command-line case"
    unused = [k for k in NOT_A_COMMAND if not any(case.startswith(k) for case, _, _ in _named_tests(rows))]
    assert not unused, unused


@functools.cache
def _bench_run():
    """benchmarks/run.py as a module (benchmarks/ is not a package; its dataclasses need it in sys.modules)."""
    spec = importlib.util.spec_from_file_location("bench_run_catalogue", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", sorted(CLI))
def test_cli(case, tmp_path, monkeypatch, capsys, caplog):
    """Each case in this process: its exit code, its line, no traceback on the console or in the log, no line of
    OmegaConf's own (``full_key``, ``reference_type``)."""
    c = CLI[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    c.setup(tmp_path)
    try:
        if c.argv[0] == "dcmdp":
            rc = cli.main(list(c.argv[1:]))
        else:
            _bench_run().main(list(c.argv[1:]))
            rc = 0
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == c.code, out + err
    assert c.needle in err, err
    assert "Traceback" not in out + err + caplog.text
    assert "full_key:" not in err and "reference_type=" not in err, err  # OmegaConf's own lines, never the user's


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CLI)])
def test_cli_in_a_new_process(case, tmp_path):
    """Each case as a user runs it: a new process, its exit code, its line and no traceback in stdout or stderr."""
    c = CLI[case]
    c.setup(tmp_path)
    head = ["-m", "dcmdp.cli"] if c.argv[0] == "dcmdp" else [str(ROOT / c.argv[0])]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run([sys.executable, *head, *c.argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == c.code, done.stderr[-2000:]
    assert c.needle in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
