"""``dcmdp check CONFIG [key=value ...]``: every problem a run would meet at start, found at once, in seconds.

A run reads its config, then its task files, the tokenizer and the model directory, and picks its device, each
after the one before it succeeded and after seconds of imports: a newcomer met one problem per try. ``find_problems``
looks at all of them and returns each with its config key and the fix:

- config: unknown keys and bad values of each override and of the file, each component's bounds, the cross-component
  rules (``dcmdp.config.validate``);
- tolerances: each constraint's own rules, and a tolerance the measure can never exceed (it never binds);
- files: the task files of ``jsonl`` and ``math`` (every malformed line counted, the first ones named), their split
  (a held-out set that leaves nothing to train on), the cold start's demonstrations, the reward function, the
  math-verify library;
- tokenizer and model: ``model.path`` (a directory with a tokenizer that loads, a config.json of the preset's
  architecture with as many embedding rows as the tokenizer has tokens, weight files), or its absence for a preset
  that needs it;
- engine: a package the rollout engine imports that cannot be imported here (vLLM), with the command that installs it;
- device: ``dcmdp.device.resolve_device`` (``device=cuda`` without CUDA, a local rank beyond the GPUs);
- output: a folder that holds another config's run (``dcmdp check`` only: ``train`` decides that under its folder
  lock; a folder that holds this config's own run, finished or resumable, is no problem: ``folder_line`` says what it
  holds), files ``overwrite=true`` may not remove (``dcmdp.checkpoint.unclaimed_outputs``), every path the run will
  write (the folder, ``checkpoints/``, the tracking buffer, summary.json, dual.png, run.json) probed by writing a
  file as ``train`` does before its cold start (``dcmdp.checkpoint.unwritable_run_paths``; nothing is left behind),
  and a tracking URI or experiment MLflow cannot use.

``dcmdp train`` runs the same checks before it imports the trainer; the exit code is 2 when a problem is bad input
(a config error, or a file or directory named that is missing or malformed), 1 when every one is the machine's (a
library not installed), as the run itself would report them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from dcmdp.config import ConfigError, RunConfig, check_finite, compose_with_problems, load_config, validate
from trainers.errors import not_a_regular_file
from trainers.jsonfile import read_model_config

# Malformed lines of a task file named one by one; the rest are counted.
NAMED_LINES = 3
# Measures whose value never exceeds 1 (a probability difference, a share of tokens or routes): a tolerance of 1 or
# more is never crossed, so lambda never acts.
BOUNDED_BY_ONE = ("abs_prob_diff", "max_abs_prob_diff", "extreme_rate", "routing_mismatch")
_KEY = re.compile(r"config error at '([^']+)'")


@dataclass(frozen=True)
class Problem:
    """One problem: the config key it is about, what is wrong with the fix, and how the run would exit on it."""

    key: str
    message: str
    # 2: bad input (a value to change, a file or directory to fix); 1: the machine's (a library not installed), as
    # ``dcmdp train`` exits on it.
    exit_code: int = 2
    # an input error (a file or directory the user named), which the run reports as an error, not a config error
    file: bool = False

    def line(self) -> str:
        """``dcmdp: <message>`` for a config error, else ``dcmdp: error: <message>``: the line the run prints."""
        return f"dcmdp: {self.message}" if self.exit_code == 2 and not self.file else f"dcmdp: error: {self.message}"


def _problem(exc: BaseException, key: str = "", exit_code: int = 2) -> Problem:
    text = str(exc)
    found = _KEY.search(text)
    return Problem(found.group(1) if found else key, text, exit_code)


def find_problems(path: Optional[str], overrides: Sequence[str], *, run_folder: bool = True,
                  text_first: bool = False) -> list[Problem]:
    """Every problem of the config ``path`` + ``overrides`` and of what it names (see the module docstring), in the
    order a run would meet them; [] when the run can start. ``run_folder``: also whether ``output_dir`` holds
    another run and the tracking settings (``dcmdp check``; ``train`` checks those itself at start).
    ``text_first`` (``train``): problems of the config's own text (a key, a type, a non-finite number) are returned
    alone, before the checks that import torch with the project's registries, so a typo costs no start-up."""
    problems: list[Problem] = []
    cfg = _compose(path, overrides, problems)
    if cfg is None:
        return problems
    try:
        check_finite(cfg)
    except ValueError as exc:
        problems.append(_problem(exc))
    if problems and text_first:
        return problems
    _validate(cfg, problems)
    _tolerances(cfg, problems)
    _task(cfg, problems)
    if text_first and any(p.exit_code == 2 and not p.file for p in problems):
        return _unique(problems)  # a bound out of range, found before torch: the model and engine checks import it
    _model(cfg, problems)
    _engine(cfg, problems)
    _device(cfg, problems)
    if run_folder:
        _run_folder(cfg, problems)
    return _unique(problems)


def _unique(problems: list[Problem]) -> list[Problem]:
    unique: dict[str, Problem] = {}
    for p in problems:
        unique.setdefault(p.message, p)
    return list(unique.values())


def _compose(path: Optional[str], overrides: Sequence[str], problems: list[Problem]) -> Optional[RunConfig]:
    """The config composed without validation; each unknown key of the file and each override that cannot be applied
    is a problem of its own and left out, so that the checks go on with the rest."""
    cfg, found = compose_with_problems(path, overrides)
    problems += [_problem(exc, key) for key, exc in found]
    return cfg


def _validate(cfg: RunConfig, problems: list[Problem]) -> None:
    """Each component's bounds separately (several at once), then the cross-component rules, which ``validate``
    reaches only when every component passes (its first error is then one of those already found)."""
    checks: list[tuple[str, Callable[[], None]]] = [("", lambda: check_finite(cfg))]
    for name in ("model", "rollout", "task", "cold_start", "algo", "optim", "dist", "async_rollout"):
        checks.append((name, getattr(cfg, name).check))
    checks += [("dual.pid", cfg.dual.pid.check), ("dual.context", cfg.dual.context.check)]
    for i, c in enumerate(cfg.dual.constraints):
        checks.append((f"dual.constraints[{i}]", lambda c=c, i=i: c.check(f"dual.constraints[{i}]")))
    found: list[Problem] = []
    for key, check in checks:
        try:
            check()
        except ValueError as exc:  # ConfigError is a ValueError
            found.append(_problem(exc, key))
    try:
        validate(cfg)
    except ValueError as exc:
        found.append(_problem(exc))
    keys = {k for p in problems for k in _named(p.key)}
    for p in found:  # one per key: a NaN learning rate is not finite, and then not > 0 either
        if not keys & _named(p.key):
            keys |= _named(p.key)
            problems.append(p)


def _named(key: str) -> set[str]:
    """The keys a problem's key names: ``a.lambda_min/lambda_max`` names ``a.lambda_min`` and ``a.lambda_max``."""
    head, _, last = key.rpartition(".")
    return {f"{head}.{name}" if head else name for name in last.split("/")}


def _tolerances(cfg: RunConfig, problems: list[Problem]) -> None:
    """A fixed tolerance that the measure can never exceed: the constraint never binds and lambda never acts."""
    if cfg.dual.rule in ("off", "fixed"):
        return
    keys = {p.key for p in problems}
    for i, c in enumerate(cfg.dual.constraints):
        if f"dual.constraints[{i}].tolerance" in keys:  # a value the config's own check refused (inf, < 0)
            continue
        if c.measure in BOUNDED_BY_ONE and c.floor_slack is None and c.quantile is None and c.tolerance >= 1:
            problems.append(Problem(
                f"dual.constraints[{i}].tolerance",
                f"config error at 'dual.constraints[{i}].tolerance': {c.measure} never exceeds 1, so c = "
                f"{c.tolerance:g} never binds and lambda never acts; set c below 1 (dcmdp calibrate measures the "
                f"floor and proposes one), or dual.rule=off to train without the constraint"))


# The reward worker's limits: one refused, the reward's own check would run under it and blame the reward.
REWARD_LIMITS = ("task.reward_memory_mib", "task.reward_load_timeout", "task.reward_timeout")


def _task(cfg: RunConfig, problems: list[Problem]) -> None:
    """Task files, their split, demonstrations and reward (file tasks); a generated task is built (it is cheap)."""
    from trainers import tasks

    t = cfg.task
    if t.name not in tasks.TASKS:
        return  # named by validate
    if t.name not in ("jsonl", "math"):
        if any(p.key.startswith("task.") for p in problems):
            return  # settings already refused are not built on: task.digits=1000000000 would draw for ever
        try:
            tasks.TASKS[t.name](t, cfg.seed)
        except ValueError as exc:
            problems.append(_problem(exc, "task.name"))
        return
    if t.name == "math":
        try:
            tasks._import_math_verify()
        except ImportError as exc:
            problems.append(Problem("task.name", str(exc), 1))
        parse = lambda record, where: tasks.parse_math_record(record)  # noqa: E731
    else:
        parse = tasks.parse_jsonl_record
        if t.reward:
            try:  # in a worker process, within task.reward_load_timeout: an import that exits or hangs is a problem
                # not when validate tried it already, nor with a limit of the worker refused (it would blame the
                # reward for the limit)
                if not any(p.key in ("task.reward", *REWARD_LIMITS) for p in problems):
                    tasks.check_reward(t)
            except ValueError as exc:
                problems.append(_problem(exc, "task.reward"))
        else:
            problems.append(Problem("task.reward", "config error at 'task.reward': task 'jsonl' needs a reward "
                                                   "function: task.reward=module:function or "
                                                   "task.reward=path/to/file.py:function"))
    if not t.path:
        problems.append(Problem("task.path", f"config error at 'task.path': task {t.name!r} needs a JSON-lines file "
                                             f"(one example per line); set task.path"))
        return
    data = _read_examples("task.path", t.path, parse, t.name, problems)
    held = _read_examples("task.eval_path", t.eval_path, parse, t.name, problems) if t.eval_path else None
    if data is None or (t.eval_path and held is None):
        return
    try:
        train, held_out = tasks._split(t, data, held)
    except ValueError as exc:
        key = "task.eval_path" if t.eval_path else "task.eval_size"
        fix = ("; hold out other problems (task.eval_path names another file) or train on another task.path"
               if "also appears" in str(exc) else "")
        problems.append(Problem(key, f"{exc}{fix}", file=True))
        return
    if t.name == "jsonl" and cfg.cold_start.steps > 0 and not cfg.model.path:
        missing = [ex for ex in train + held_out if ex.completion is None]
        if missing:
            problems.append(Problem("cold_start.steps", (
                f"config error at 'cold_start.steps': the cold start trains on demonstrations, and task 'jsonl' "
                f"takes them from each record's \"completion\" string, which {len(missing)} of "
                f"{len(train) + len(held_out)} records lack (first: {missing[0].source}); add a \"completion\" to "
                f"every record of task.path and task.eval_path, or set cold_start.steps=0 (or model.path, to start "
                f"from a trained model)"), file=True))


def _read_examples(key: str, path: str, parse, task: str, problems: list[Problem]) -> Optional[list]:
    """Every example of a task file, or None after adding its problems: missing, not a file, compressed, or lines
    that do not parse (all counted, the first ``NAMED_LINES`` named)."""
    from trainers import tasks

    where = os.path.abspath(path)
    if any(p.key == key for p in problems):  # the config's own check named the file already
        return None
    why = not_a_regular_file(path)
    if why == "does not exist":
        problems.append(Problem(key, f"config error at '{key}': file not found: {where} (relative paths are read "
                                     f"from the working directory, {os.getcwd()})", file=True))
        return None
    if why is not None:
        problems.append(Problem(key, f"config error at '{key}': {where} {why}; name a JSON-lines file", file=True))
        return None
    try:
        f = open(path, "rb")
    except OSError as exc:  # no read permission: the user's file to fix, not the machine's
        problems.append(Problem(key, f"config error at '{key}': cannot read {where}: {exc.strerror or exc}; give "
                                     f"the user running dcmdp read access to it", file=True))
        return None
    examples, bad, n_bad = [], [], 0
    with f:
        head = f.read(4)
        if head[:2] == b"\x1f\x8b" or head in (b"PK\x03\x04", b"BZh9", b"\xfd7zX"):
            problems.append(Problem(key, f"{path}: a compressed file (it starts with the bytes {head!r}); decompress "
                                         f"it: the task reads JSON lines as plain UTF-8 text", file=True))
            return None
        f.seek(0)
        # one line at a time, keeping of each example only what the split and the demonstrations check read: the
        # file's records are the run's to hold (a 200 MB file held whole took check to 3.3 GB)
        for lineno, line in enumerate(f, start=1):
            try:  # as trainers.tasks._load_jsonl reads them: a byte-order mark may open the file
                text = line.decode("utf-8-sig" if lineno == 1 else "utf-8")
                if text.strip():
                    examples.append(_light(parse(tasks.json_line(text), f"{path}:{lineno}")))
                continue
            except UnicodeDecodeError as exc:
                why = f"line {lineno}: not UTF-8 ({exc.reason} at column {exc.start + 1})"
            except ValueError as exc:  # json.JSONDecodeError too
                why = f"line {lineno}: {exc}"
            n_bad += 1
            if len(bad) < NAMED_LINES:
                bad.append(why)
    if n_bad:
        named = "; ".join(bad)
        more = f" (and {n_bad - NAMED_LINES} more)" if n_bad > NAMED_LINES else ""
        problems.append(Problem(key, f"{path}: {n_bad} malformed {task} line(s): {named}{more}; fix or remove "
                                     f"them", file=True))
        return None
    if not examples:
        problems.append(Problem(key, f"{path}: no examples (the file is empty); name a file with one JSON object per "
                                     f"line", file=True))
        return None
    return examples


def _light(example):
    """``example`` as the checks read it: its prompt as a digest (the split compares prompts), whether it has a
    demonstration, where it is; the record and the answer dropped."""
    prompt = hashlib.blake2b(example.prompt.encode(), digest_size=16).hexdigest()
    if hasattr(example, "record"):
        return dataclasses.replace(example, prompt=prompt, answer="", record={},
                                   completion=None if example.completion is None else "")
    return dataclasses.replace(example, prompt=prompt, answer="")


def _model(cfg: RunConfig, problems: list[Problem]) -> None:
    """The model directory: tokenizer, config.json (architecture, embedding rows) and weight files."""
    from trainers.models import PRESETS

    preset = PRESETS.get(cfg.model.preset)
    if preset is None or cfg.model.init == "random":
        return
    if not cfg.model.path:
        if preset.needs_path:
            problems.append(Problem("model.path", f"model.preset={cfg.model.preset!r} loads real weights: set "
                                                  f"model.path to a local directory with the weights and tokenizer, "
                                                  f"or model.init=random for a speed or memory run without them",
                                    file=True))
        return
    from trainers.tokenizer import load_tokenizer

    try:
        tokens = len(load_tokenizer(cfg.model.path))
    except (OSError, ValueError) as exc:
        problems.append(Problem("model.path", str(exc), file=True))
        tokens = None
    if not Path(cfg.model.path).is_dir():
        return  # the tokenizer's problem names the directory
    try:
        arch = read_model_config(cfg.model.path)
    except (OSError, ValueError) as exc:
        problems.append(Problem("model.path", f"no readable config.json in {cfg.model.path!r} ({exc}); model.path "
                                              f"must be a Hugging Face model directory (save_pretrained)", file=True))
        return
    if arch.get("model_type") != preset.model_type:
        problems.append(Problem("model.path", f"model.path {cfg.model.path!r} holds a {arch.get('model_type')!r} "
                                              f"model, preset {preset.name!r} expects {preset.model_type!r}: set "
                                              f"model.preset to the directory's architecture", file=True))
    rows = arch.get("vocab_size")
    if tokens is not None and isinstance(rows, int) and rows < tokens:
        problems.append(Problem("model.path", f"tokenizer has {tokens} tokens but the model in {cfg.model.path!r} has "
                                              f"only {rows} embedding rows: the tokenizer and the weights belong to "
                                              f"different models", file=True))
    weights = [p for p in Path(cfg.model.path).iterdir() if p.suffix in (".safetensors", ".bin")
               or p.name.endswith(".safetensors.index.json")]
    if not weights:
        problems.append(Problem("model.path", f"no weight files (*.safetensors, *.bin) in {cfg.model.path!r}: copy "
                                              f"the model's weights there, or model.init=random for a speed or memory "
                                              f"run without them", file=True))


def _engine(cfg: RunConfig, problems: list[Problem]) -> None:
    """The packages the rollout engine needs (``EngineCapabilities.requires``), looked up without importing them:
    importing vLLM takes longer than the whole check."""
    from trainers.engines import ENGINES

    entry = ENGINES.get(cfg.rollout.engine)
    if entry is None:
        return  # named by validate
    for module, install in entry.capabilities.requires.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install: its parent fails, or a module without a spec
            found = False
        if not found:
            problems.append(Problem("rollout.engine", (
                f"config error at 'rollout.engine': rollout.engine={cfg.rollout.engine} needs {module}, which cannot "
                f"be imported by this Python ({os.path.dirname(os.path.dirname(os.__file__))}); install it with "
                f"{install}, or train with rollout.engine=torch")))


def _device(cfg: RunConfig, problems: list[Problem]) -> None:
    from dcmdp.device import local_rank, resolve_device

    try:
        resolve_device(cfg.device, local_rank())
    except ConfigError as exc:
        problems.append(_problem(exc, "device"))


def _run_folder(cfg: RunConfig, problems: list[Problem]) -> None:
    """A folder that holds another run (or, under overwrite=true, files no run.json proves a run wrote), a path the
    run will write that it cannot (probed as the run probes it), a resume path that names nothing, a tracking setting
    MLflow refuses."""
    from dcmdp.checkpoint import run_in_folder, unclaimed_outputs, unwritable_run_paths
    from dcmdp.tracking import check_sqlite_store, check_tracking_config, resolve_buffer_dir

    out = Path(cfg.output_dir)
    resume = cfg.checkpoint.resume
    if resume and resume != "auto" and not Path(resume).exists():
        problems.append(Problem("checkpoint.resume", f"checkpoint.resume={resume!r}: no checkpoint there; name a "
                                                     f"checkpoint folder (<output_dir>/checkpoints/step_N), or auto",
                                1))
    named = any(p.key == "output_dir" for p in problems)  # a name too long to look at, a file in its way
    if (not named and out.is_dir() and not resume and not cfg.overwrite and (earlier := run_in_folder(out))
            and (conflicts := own_run_conflicts(cfg)) != []):
        why = f" with another config ({'; '.join(conflicts[:3])})" if conflicts else ""
        problems.append(Problem("output_dir", f"output_dir {out} already holds a run{why} ({earlier}): continue it "
                                              f"with checkpoint.resume=auto, start afresh there with overwrite=true, "
                                              f"or choose another output_dir", file=True))
    if (not named and out.is_dir() and not resume and cfg.overwrite and run_in_folder(out)
            and (unclaimed := unclaimed_outputs(out))):
        problems.append(Problem("output_dir", unclaimed, file=True))
    if not named:
        buffer = resolve_buffer_dir(cfg.tracking, out) if cfg.tracking.enabled else None
        buffer_key = "tracking.buffer_dir" if cfg.tracking.buffer_dir else "output_dir"
        problems += [Problem(key, message, file=True) for key, message in unwritable_run_paths(out, buffer, buffer_key)]
    try:
        check_tracking_config(cfg.tracking, out)
        if cfg.tracking.enabled and not named:
            check_sqlite_store(cfg.tracking, out)
    except ConfigError as exc:
        problems.append(_problem(exc, "tracking"))


def memory_plan(path: Optional[str], overrides: Sequence[str], gpus: int = 1, gpu_memory: Optional[float] = None
                ) -> tuple[list[str], Optional[Problem]]:
    """The memory plan's lines for ``gpus`` GPUs of ``gpu_memory`` GiB (the detected GPU's size when None), and the
    problem when it does not fit (``dcmdp.memplan``: the largest term and the key that shrinks it). Without a size
    (no ``--gpu-memory`` and no GPU here) the plan is printed for 80 GiB and refuses nothing."""
    from dcmdp.memplan import detected_gpu_gib, plan_memory

    cfg = load_config(path, overrides, check=False)
    if gpus > 1:  # the checks torchrun's start makes (dcmdp.distributed.init): a plan of a launch that cannot start
        from dcmdp.distributed import DistributedSetupError, check_world

        try:
            check_world(cfg, gpus)
        except DistributedSetupError as exc:
            return [], _problem(exc)
    detected = detected_gpu_gib() if gpu_memory is None else None
    if gpu_memory is not None:
        size, source = gpu_memory, "--gpu-memory"
    elif detected is not None:
        size, source = detected
    else:
        size, source = 80.0, "no GPU here and no --gpu-memory: an 80 GiB GPU assumed"
    plan = plan_memory(cfg, gpus, size, gpu_source=source)
    known = gpu_memory is not None or detected is not None
    problem = None if plan.fits or not known else Problem(plan.largest.key, plan.refusal())
    return plan.lines(), problem


def not_here(path: Optional[str], overrides: Sequence[str], problems: list[Problem]
             ) -> tuple[list[Problem], list[Problem]]:
    """``problems`` split into those that stop a rehearsal and those of the machine the check runs on rather than the
    launch's: a task file or model folder that is not here, a rollout engine package not installed here. A rehearsal
    builds the model from the config's shapes (``model.path``'s config.json when it is here) and stands in for the
    engine's outputs, so it goes on without them; they are still to be checked on the launch's machine."""
    cfg = load_config(path, overrides, check=False)
    absent = {"task.path": cfg.task.path, "task.eval_path": cfg.task.eval_path, "model.path": cfg.model.path}
    from trainers.engines import ENGINES

    entry = ENGINES.get(cfg.rollout.engine)

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # as ``_engine``: a broken install
            return False

    missing = entry is not None and not all(installed(m) for m in entry.capabilities.requires)

    def elsewhere(p: Problem) -> bool:
        if p.key in absent:
            return absent[p.key] is not None and not Path(absent[p.key]).exists()
        return p.key == "rollout.engine" and missing

    return [p for p in problems if not elsewhere(p)], [p for p in problems if elsewhere(p)]


def rehearsal(path: Optional[str], overrides: Sequence[str], gpus: int = 1, gpu_memory: Optional[float] = None
              ) -> list[str]:
    """``dcmdp.rehearse``'s report of one step of the config on ``gpus`` GPUs of ``gpu_memory`` GiB (the detected
    GPU's size when None, else 80 GiB)."""
    from dcmdp.memplan import detected_gpu_gib
    from dcmdp.rehearse import rehearsal_lines

    detected = detected_gpu_gib() if gpu_memory is None else None
    size = gpu_memory if gpu_memory is not None else detected[0] if detected is not None else 80.0
    return rehearsal_lines(load_config(path, overrides, check=False), gpus, size)


def own_run_conflicts(cfg: RunConfig) -> Optional[list[str]]:
    """How ``cfg`` differs from the config of the run in ``cfg.output_dir`` (its ``config.yaml``) where a resume
    would refuse or ignore it (``dcmdp.config.resume_conflicts``): [] when the folder holds this config's own run,
    None when the folder's config cannot be read."""
    from dcmdp.config import flatten, resume_conflicts

    try:
        saved = flatten(load_config(Path(cfg.output_dir) / "config.yaml", check=False))
    except (OSError, ValueError):  # no config.yaml, or one that no longer loads
        return None
    return resume_conflicts(saved, cfg)


def folder_line(path: Optional[str], overrides: Sequence[str]) -> Optional[str]:
    """What the output folder of a config without problems holds, when that is this config's own run: how a run
    continues it; None for an empty or new folder. Read from the folder only (checkpoints, summary.json)."""
    from dcmdp.checkpoint import run_in_folder

    cfg = load_config(path, overrides, check=False)
    out = Path(cfg.output_dir)
    if not out.is_dir() or not (earlier := run_in_folder(out)):
        return None
    try:
        finished = json.loads((out / "summary.json").read_text()).get("steps") == cfg.steps
    except (OSError, ValueError, AttributeError):
        finished = False
    what = f"finished at step {cfg.steps}" if finished else "resumable"
    if cfg.checkpoint.resume:
        how = "checkpoint.resume is set: train continues it" + (", and finds nothing to train" if finished else "")
    elif cfg.overwrite:
        how = "overwrite=true: train removes what its run.json proves the run wrote and starts afresh"
    else:
        how = ("train with checkpoint.resume=auto " + ("says so and trains nothing (steps=N trains further)"
                                                        if finished else "continues it")
               + ", with overwrite=true starts afresh")
    return f"{out} holds this config's own run, {what} ({earlier}): {how}"


def report(problems: Sequence[Problem], what: str, *, listed: bool = False) -> list[str]:
    """The lines that list ``problems`` found in ``what``: under a header line, each with its key; one problem alone
    (``listed=False``, as ``train`` reports) is the one line the run would print."""
    if len(problems) == 1 and not listed:
        return [problems[0].line()]
    return [f"dcmdp: {len(problems)} problem{'s' if len(problems) > 1 else ''} in {what}, each to fix before a run "
            f"can start:", *(f"  {p.key or 'config'}: {p.message}" for p in problems)]


def exit_code(problems: Sequence[Problem]) -> int:
    """2 when any problem is bad input (a config error, a file or directory to fix), 1 when every one is the
    machine's, 0 for none."""
    return max((p.exit_code for p in problems), default=0)
