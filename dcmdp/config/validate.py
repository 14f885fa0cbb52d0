"""Checking a composed run config: every float finite, each block's own bounds (its ``check()``), then the checks
that tie blocks together, grouped by the blocks they tie. Every check fails through ``require`` (or ``config_error``
where the message names the element that failed) with a ``ConfigError``, and none rewrites a value.

The checks that need no torch come first, so a bound's error is reported in well under a second; the device, the
registry names (``registry``) and the checks that build on them come after.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dcmdp import redact
from dcmdp.config.registries import check_modes, one_of, registry
from dcmdp.config.schema import RunConfig, _get, nearest
from dcmdp.dual_config import FLOOR_KINDS
from trainers.errors import ConfigError, config_error, require

if TYPE_CHECKING:
    from trainers.engines import EngineCapabilities


# Float fields where +inf means "no bound" (a field NaN is never meaningful): the upper end of lambda's projection
# interval, the TIS caps C, the upper ends of the kept IS bands and the rejection bound. Constraint fields are named
# with ``[*]``.
INF_ALLOWED = frozenset({"dual.constraints[*].lambda_max", "algo.tis.cap", "algo.seq_tis.cap", "algo.icepop.high",
                         "algo.seq_mask.prod.high", "algo.seq_mask.geo.high", "algo.reject.bound"})
# numpy's legacy seeding takes 32-bit seeds
MAX_SEED = 2**32 - 1
# Bytes in one file or folder name on Linux file systems (ext4, xfs, btrfs, tmpfs: NAME_MAX).
NAME_MAX = 255
# Bounds of size-like settings, checked at start (``_check_sizes``): beyond them a setting is either never used by a
# run or asks for memory or time no run has. A reward call may take up to an hour (its worker is killed after it).
MAX_REWARD_TIMEOUT = 3600.0
# Below this a reward call cannot even reach its worker process and back (a pipe round trip and unpickling): every
# call would time out, and every sample score 0.
MIN_REWARD_TIMEOUT = 0.01
# Samples of one rollout batch (prompts_per_step x samples_per_prompt), and samples per prompt.
MAX_BATCH_SAMPLES = 1 << 20
# Held-out prompts, and tokens per rollout batch (samples x max_new_tokens: ids and log-probs are kept per token).
MAX_EVAL_SIZE = 1 << 20
MAX_BATCH_TOKENS = 1 << 27
# Below this temperature float32 sampling saturates: the sampled token's probability rounds to 1 and every other's
# to 0 (a logit gap of 1 becomes exp(-100)), so the IS ratios, the entropy and the discrepancy measure nothing.
MIN_TEMPERATURE = 1e-2
# A staleness above the run's steps is never reached; up to this much is accepted whatever the steps.
STALENESS_SLACK = 64
# prompts drawn per digits setting to find the longest a generated task asks (its lengths vary with the draw)
_FIT_DRAWS = 64


def validate(cfg: RunConfig) -> None:
    """Check every component's bounds and the cross-component rules; raise ConfigError."""
    check_finite(cfg)
    _check_blocks(cfg)
    _check_run(cfg)
    _check_dual_and_constraints(cfg)
    _check_async_and_dual(cfg)
    _check_sizes(cfg)
    # the bounds above need no torch; what follows imports it (the device, the registries): a bound's error is
    # reported in well under a second
    from dcmdp.device import check_device_setting

    check_device_setting(cfg.device)
    _check_names(cfg)
    _check_task_and_model(cfg)
    _check_dual_and_learner(cfg)
    _check_rollout_and_engine(cfg)
    check_modes(cfg)
    _check_shared_weights(cfg)


def check_finite(cfg: Any, prefix: str = "") -> None:
    """Raise ConfigError naming the first float field of ``cfg`` (a dataclass, walked recursively, list elements
    included) that is NaN, or +-inf outside ``INF_ALLOWED``."""
    for f in fields(cfg):
        _check_finite_value(getattr(cfg, f.name), f"{prefix}{f.name}")


def _check_finite_value(value: Any, key: str) -> None:
    if is_dataclass(value):
        check_finite(value, f"{key}.")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_finite_value(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        require(not math.isnan(value), key, "must be a finite number, got nan")
        generic = re.sub(r"\[\d+\]", "[*]", key)
        require(value > 0 and generic in INF_ALLOWED, key, f"must be a finite number, got {value}"
                f"{' (inf is allowed only in ' + ', '.join(sorted(INF_ALLOWED)) + ')' if value > 0 else ''}")


def _check_blocks(cfg: RunConfig) -> None:
    """Each block's own bounds (its ``check()``; a constraint's raises ValueError, here a ConfigError)."""
    cfg.model.check()
    cfg.rollout.check()
    cfg.task.check()
    cfg.cold_start.check()
    cfg.algo.check()
    cfg.optim.check()
    cfg.dual.pid.check()
    cfg.dual.context.check()
    cfg.dist.check()
    cfg.async_rollout.check()
    try:
        for i, c in enumerate(cfg.dual.constraints):
            c.check(f"dual.constraints[{i}]")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _check_run(cfg: RunConfig) -> None:
    """The run's own keys and its records: seed, steps, the output folder, tracking, checkpoints, guards, threads."""
    require(cfg.steps >= 0, "steps", f"must be >= 0, got {cfg.steps}")
    require(cfg.seed >= 0, "seed", f"must be >= 0, got {cfg.seed}")  # numpy seeds only from non-negative integers
    require(cfg.seed <= MAX_SEED, "seed", f"must be <= {MAX_SEED} (2^32 - 1), got {cfg.seed}")
    require(cfg.cold_start.seed is None or 0 <= cfg.cold_start.seed <= MAX_SEED, "cold_start.seed",
            f"must be in [0, {MAX_SEED}], got {cfg.cold_start.seed}")
    require(cfg.output_dir.strip(), "output_dir",
            "empty; name a folder for the run (an empty one would write into the working directory)")
    long = [part for part in Path(cfg.output_dir).parts if len(part.encode()) > NAME_MAX]
    if long:  # the run would fail at its first mkdir with a bare "[Errno 36]"
        raise config_error("output_dir", f"the folder name {long[0][:40]!r}... is {len(long[0].encode())} bytes "
                                         f"long, above the {NAME_MAX} bytes a file system allows for one name; use a "
                                         f"shorter name")
    # a file where the folder would be failed only after the model was built
    blocker = file_in_the_way(cfg.output_dir)
    require(blocker is None, "output_dir", f"{str(blocker)!r} is a file, not a folder; name a folder for the run")
    why = redact.uri_problem(cfg.tracking.uri) if cfg.tracking.uri else None
    require(why is None, "tracking.uri", f"{redact.public_uri(cfg.tracking.uri or '')!r} cannot be used: {why}")
    require(cfg.optim.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {cfg.optim.weight_decay}")
    require(cfg.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {cfg.checkpoint.keep}")
    require(cfg.log_every >= 1, "log_every", f"must be >= 1, got {cfg.log_every}")
    require(cfg.threads == "auto" or (type(cfg.threads) is int and cfg.threads >= 1), "threads",
            f"must be auto or an integer >= 1, got {cfg.threads!r}")
    for key, value in (("eval_every", cfg.eval_every), ("checkpoint.every", cfg.checkpoint.every)):
        require(value >= 0, key, f"must be >= 0, got {value}")
    require(cfg.guard.max_bad_steps >= 1, "guard.max_bad_steps", f"must be >= 1, got {cfg.guard.max_bad_steps}")
    require(0 <= cfg.guard.reward_fail_share <= 1, "guard.reward_fail_share",
            f"must be in [0, 1] (1: never stop), got {cfg.guard.reward_fail_share}")
    require(cfg.guard.reward_fail_steps >= 1, "guard.reward_fail_steps",
            f"must be >= 1, got {cfg.guard.reward_fail_steps}")


def _check_dual_and_constraints(cfg: RunConfig) -> None:
    """The dual's settings against its constraints (and the learning-rate warm-up, the rollouts they read)."""
    d = cfg.dual
    if d.relative:
        for i, c in enumerate(d.constraints):
            require(c.tolerance > 0, f"dual.constraints[{i}].tolerance",
                    f"dual.relative=true divides the violation by c, which must be > 0 (got {c.tolerance})")
    require(d.context.by == "none" or not d.average, "dual.average",
            f"the running mean of the multipliers spans the run, not a context; use dual.average=false with "
            f"dual.context.by={d.context.by}")
    require(d.floor_by in FLOOR_KINDS, "dual.floor_by", f"unknown {d.floor_by!r}; known: {', '.join(FLOOR_KINDS)}")
    require(d.floor_by == "none" or any(c.floor_slack is not None for c in d.constraints), "dual.floor_by",
            f"keeps the floor of an automatic tolerance per {d.floor_by}; set a constraint's floor_slack, or "
            f"dual.floor_by=none")
    ratchet = [i for i, c in enumerate(d.constraints) if c.floor_ratchet]
    late = [i for i in ratchet if (d.constraints[i].floor_steps or 0) < cfg.optim.warmup_steps]
    if late:
        raise config_error(f"dual.constraints[{late[0]}].floor_steps",
                           f"a ratcheted tolerance follows the lowest floor, and the drift during the learning-rate "
                           f"warm-up (optim.warmup_steps={cfg.optim.warmup_steps}) is near 0; set floor_steps >= "
                           f"{cfg.optim.warmup_steps} so the minimum starts after it")
    if d.floor_by != "none" and ratchet:
        raise config_error(f"dual.constraints[{ratchet[0]}].floor_ratchet",
                           f"one lowest floor spans the run, not a {d.floor_by}; use dual.floor_by=none or "
                           f"floor_ratchet: false")
    require(d.context.by != "staleness" or cfg.async_rollout.enabled, "dual.context.by",
            "staleness contexts need asynchronous rollouts (async_rollout.enabled=true); every synchronous batch is "
            "fresh")
    if d.coupling.A or d.coupling.b:
        n = len(d.constraints)
        require(len(d.coupling.A) == len(d.coupling.b) and all(len(r) == n for r in d.coupling.A), "dual.coupling",
                f"A must be {len(d.coupling.b)} x {n} (rows = len(b), columns = number of constraints)")


def _check_async_and_dual(cfg: RunConfig) -> None:
    """``async_rollout.max_staleness: auto`` bounds the D-hat of one of the dual's constraints."""
    a = cfg.async_rollout
    if not a.is_auto:
        return
    n = len(cfg.dual.constraints)
    require(a.auto.constraint < n, "async_rollout.auto.constraint",
            f"{a.auto.constraint} names no constraint (dual.constraints has {n})")
    require(a.auto.tolerance is not None or cfg.dual.constraints[a.auto.constraint].tolerance > 0,
            "async_rollout.auto.tolerance",
            f"the staleness step divides by c_s, and dual.constraints[{a.auto.constraint}].tolerance is not > 0; set "
            f"async_rollout.auto.tolerance")


def _check_sizes(cfg: RunConfig) -> None:
    """Refuse at start a size-like setting no run can use (``MAX_*`` above; task digits against the context:
    ``_check_task_fits``), and the reward timeout's upper end."""
    t, a, algo = cfg.task, cfg.async_rollout, cfg.algo
    require(t.reward_timeout <= MAX_REWARD_TIMEOUT, "task.reward_timeout",
            f"{t.reward_timeout:g} s per reward call is above "
            f"{MAX_REWARD_TIMEOUT:g} s (an hour): a reward that hangs would hold the run that long "
            f"per call; use a finite limit of at most {MAX_REWARD_TIMEOUT:g}")
    require(not (0 < t.reward_timeout < MIN_REWARD_TIMEOUT), "task.reward_timeout",
            f"{t.reward_timeout:g} s is too short for a call to "
            "reach the reward's worker process and come back: every call would time out; use at least "
            f"{MIN_REWARD_TIMEOUT:g}")
    samples = algo.prompts_per_step * algo.samples_per_prompt
    require(samples <= MAX_BATCH_SAMPLES, "algo.prompts_per_step", f"{algo.prompts_per_step} prompts x "
            f"{algo.samples_per_prompt} samples = {samples} samples per step, above {MAX_BATCH_SAMPLES}")
    require(samples * cfg.rollout.max_new_tokens <= MAX_BATCH_TOKENS, "rollout.max_new_tokens", f"{samples} samples x "
            f"{cfg.rollout.max_new_tokens} new tokens = {samples * cfg.rollout.max_new_tokens} tokens "
            f"per rollout batch, above {MAX_BATCH_TOKENS}; lower one of them")
    require(t.eval_size <= MAX_EVAL_SIZE, "task.eval_size", f"{t.eval_size} held-out prompts, above {MAX_EVAL_SIZE}")
    require(t.items <= MAX_EVAL_SIZE, "task.items", f"{t.items} items per prompt cannot fit any context")
    require(cfg.cold_start.batch_size <= MAX_BATCH_SAMPLES, "cold_start.batch_size",
            f"{cfg.cold_start.batch_size} demonstrations per step, above {MAX_BATCH_SAMPLES}")
    require(cfg.rollout.temperature >= MIN_TEMPERATURE, "rollout.temperature", f"{cfg.rollout.temperature:g} is below "
            f"{MIN_TEMPERATURE:g}: float32 sampling is then greedy and every other token's probability "
            f"underflows to 0, so the IS ratios and the discrepancy measure nothing; use >= {MIN_TEMPERATURE:g}")
    if a.enabled:
        key = "async_rollout.auto.max" if a.is_auto else "async_rollout.max_staleness"
        bound = max(cfg.steps, STALENESS_SLACK)
        require(a.cap() <= bound, key, f"a staleness of {a.cap()} is never reached in a run of "
                f"steps={cfg.steps} (and every step keeps a histogram of that size); use at most {bound}")
    require(a.is_auto or a.too_stale == "wait", "async_rollout.too_stale",
            f"{a.too_stale} acts on batches staler than the "
            "bound the controller sets (max_staleness: auto); with the fixed max_staleness="
            f"{a.max_staleness} no batch is ever staler; drop the key or set max_staleness: auto")
    from dcmdp.cpu import usable_cores  # light: no torch

    cores = usable_cores()
    for key, value in (("threads", cfg.threads), ("async_rollout.threads", a.threads)):
        require(not isinstance(value, int) or value <= cores, key,
                f"{value} threads, but this process may run on {cores} "
                "core(s) (os.sched_getaffinity): more threads only wait for each other; use at most "
                f"{cores}, or threads=auto")


def _check_names(cfg: RunConfig) -> None:
    """Every name chosen from a registry exists (the message names the nearest, or lists the registry's names)."""
    precisions = registry("optim.precision")
    require(cfg.optim.precision in precisions, "optim.precision",
            f"got {cfg.optim.precision!r}, expected one of {', '.join(precisions)}")
    for key in ("model.preset", "rollout.engine", "task.name", "algo.loss", "algo.is_mode", "algo.advantage",
                "dual.rule", "dual.penalty"):
        one_of(_get(cfg, key), key)
    require(cfg.dual.measure_at in ("rollout", "updates", "drift"), "dual.measure_at",
            f"unknown {cfg.dual.measure_at!r}{nearest(cfg.dual.measure_at, ['rollout', 'updates', 'drift'])}")
    for i, c in enumerate(cfg.dual.constraints):
        one_of(c.measure, f"dual.constraints[{i}].measure", "dual.constraints[*].measure")


def _check_task_and_model(cfg: RunConfig) -> None:
    """The task's own files and reward, its curriculum, and its prompts with the responses against the model's
    context."""
    from trainers.tasks import check_task_config, generated_task_names

    try:
        check_task_config(cfg.task)  # task jsonl: its files exist and its reward function imports
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    require(not cfg.task.curriculum or cfg.task.name in generated_task_names(), "task.curriculum",
            f"task {cfg.task.name!r} has no digits to grow; a curriculum needs a generated task "
            f"({', '.join(generated_task_names())})")
    _check_task_fits(cfg, _check_response_fits(cfg, registry("model.preset")[cfg.model.preset]))


def _check_dual_and_learner(cfg: RunConfig) -> None:
    """The dual rule's coupled limits at lambda_init, the anchor against the measurement point, and the penalised
    constraints against the learner (a penalty form for each measure; routing replay)."""
    rule = registry("dual.rule")[cfg.dual.rule]
    _check_coupling_feasible(cfg, rule)
    anchored = [i for i, c in enumerate(cfg.dual.constraints) if c.anchor is not None]
    if anchored and cfg.dual.measure_at != "updates":
        raise config_error(f"dual.constraints[{anchored[0]}].anchor",
                           f"the anchor probes D-hat at the updates against mu; set dual.measure_at=updates (got "
                           f"{cfg.dual.measure_at})")
    if not rule.penalizes:
        return
    from constraints.penalties import check_penalty_constraints

    try:
        check_penalty_constraints(cfg.dual.constraints)
    except ValueError as exc:
        raise config_error("dual.constraints", str(exc)) from exc
    mismatch = [i for i, c in enumerate(cfg.dual.constraints) if c.measure == "routing_mismatch"]
    if mismatch and cfg.algo.routing_replay == "r3":
        raise config_error(f"dual.constraints[{mismatch[0]}].measure",
                           "routing_mismatch compares the two engines' expert choices, and algo.routing_replay=r3 "
                           "trains on the rollout engine's choices, so it measures exactly 0 and its constraint can "
                           "never act; drop the constraint or use routing_replay=r2 or none")


def _check_rollout_and_engine(cfg: RunConfig) -> None:
    """What the chosen engine can run: its precisions, routes under R3, a worker thread; routing replay against the
    model."""
    engines = registry("rollout.engine")
    name = cfg.rollout.engine
    engine = engines[name].capabilities
    _check_rollout_quantization(cfg, engine)
    # vLLM returns its own routes on GPUs (compiled forwards and CUDA graphs keep them); on the CPU they come from
    # router hooks, which only eager forwards run
    hooks = engine.routes == "eager" or (engine.routes == "eager_on_cpu" and _runs_on_cpu(cfg.device))
    require(not hooks or cfg.algo.routing_replay != "r3" or getattr(cfg.rollout, name).enforce_eager is not False,
            f"rollout.{name}.enforce_eager",
            f"R3 with the {name} engine on the CPU records routes through router hooks that only run in eager mode; "
            f"set rollout.{name}.enforce_eager=true")
    if cfg.async_rollout.enabled and not engine.async_worker:
        able = " | ".join(n for n, e in engines.items() if e.capabilities.async_worker)
        raise config_error("async_rollout.enabled",
                           f"the rollout worker thread drives an engine in the trainer's process (the {able} engine), "
                           f"not the {name} engine; use rollout.engine={able}, or async_rollout.enabled=false with "
                           f"rollout.engine={name}")
    require(cfg.algo.routing_replay == "none" or registry("model.preset")[cfg.model.preset].is_moe,
            "algo.routing_replay", f"{cfg.algo.routing_replay} replays MoE routes, but model.preset="
                                   f"{cfg.model.preset!r} is a dense model; use routing_replay=none")


def _check_shared_weights(cfg: RunConfig) -> None:
    """``rollout.torch.share_weights``: the engine decodes with the trainer's parameters, so they must be in the
    rollout precision's dtype, unquantised, the same for the whole run, and never updated while it samples."""
    if not cfg.rollout.torch.share_weights:
        return
    key = "rollout.torch.share_weights"
    trainer = "bf16" if cfg.optim.precision.startswith("bf16") else "fp32"
    require(cfg.rollout.engine == "torch", key, f"only the torch engine decodes with the trainer's model; "
                                                f"rollout.engine={cfg.rollout.engine} keeps its own weights")
    require(not cfg.rollout.precision_schedule, key,
            "a precision schedule switches the engine to other weights; drop one of them")
    require(cfg.rollout.precision == trainer, key,
            f"the trainer's parameters are {trainer} (optim.precision={cfg.optim.precision}) and the rollouts are "
            f"asked in {cfg.rollout.precision}; set rollout.precision={trainer}, or share_weights=false for an "
            f"engine copy in {cfg.rollout.precision}")
    require(not cfg.async_rollout.enabled, key, "asynchronous rollouts sample while the trainer updates the same "
                                                "parameters; use async_rollout.enabled=false or share_weights=false")


def _check_rollout_quantization(cfg: RunConfig, engine: EngineCapabilities) -> None:
    """Rollout precisions (and logit noise) the chosen engine and model can run, refused at load, before anything is
    built."""
    import torch

    from trainers.models import model_from_config
    from trainers.quant import fp8_gemm_available, int4_group_error

    r = cfg.rollout
    require(not r.precision_schedule or not engine.no_precision_switch, "rollout.precision_schedule",
            str(engine.no_precision_switch))
    used = {p.precision: f"rollout.precision_schedule[{i}].precision" for i, p in reversed(list(enumerate(
        r.precision_schedule)))}
    used[r.precision] = "rollout.precision"
    for precision, key in used.items():
        if precision in engine.unsupported_precisions:
            raise config_error(key, engine.unsupported_precisions[precision])
        require(precision != "fp8" or not engine.fp8_needs_tensor_cores or fp8_gemm_available(), key,
                str(engine.fp8_needs_tensor_cores))
    require(r.logit_noise <= 0 or not engine.no_logit_noise, "rollout.logit_noise", str(engine.no_logit_noise))
    if "int4" in used:
        # the preset's architecture on the meta device: shapes only, no memory, no weights
        with torch.device("meta"):
            shapes = model_from_config(registry("model.preset")[cfg.model.preset].make_config(128), seed=0)
        problem = int4_group_error(shapes, r.torch.int4_group_size, lm_head=r.torch.quantize_lm_head)
        require(not problem, "rollout.torch.int4_group_size", f"model.preset={cfg.model.preset!r}: {problem}")


def _check_coupling_feasible(cfg: RunConfig, rule: Any) -> None:
    """The coupled limits A lambda <= b must hold at lambda_init (where every run starts), checked before anything is
    built (the dual state is made after the model)."""
    import numpy as np

    c = cfg.dual.coupling
    if not c.A or not rule.projects or len(c.A) != len(c.b):
        return
    lam = rule.initial_lambda(cfg.dual).numpy()
    A, b = np.asarray(c.A, dtype=np.float64), np.asarray(c.b, dtype=np.float64)
    bad = np.flatnonzero(A @ lam > b + 1e-9)
    if bad.size:
        i = int(bad[0])
        raise config_error(f"dual.coupling.b[{i}]", f"the coupled limit row {i} (A[{i}] lambda <= b[{i}] = {b[i]:g}) "
                                                    f"fails at lambda_init {lam.tolist()} (A[{i}] lambda = "
                                                    f"{float(A[i] @ lam):g}): raise b[{i}] or lower the constraints' "
                                                    f"lambda_init")


def _check_response_fits(cfg: RunConfig, preset: Any) -> Optional[int]:
    """rollout.max_new_tokens must leave room for a prompt in the model's context (max_position_embeddings, from
    model.path's config.json or the preset), checked before anything is built. Returns the context (None when
    unknown)."""
    from trainers.jsonfile import read_model_config

    context = None
    if cfg.model.path:
        try:
            context = read_model_config(cfg.model.path).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            return None  # the model loader names a missing or bad model.path
    elif not preset.needs_path:
        context = preset.make_config(128).max_position_embeddings
    if not isinstance(context, int):
        return None
    require(cfg.rollout.max_new_tokens < context, "rollout.max_new_tokens",
            f"{cfg.rollout.max_new_tokens} new tokens leave no room for a prompt in the context of model.preset="
            f"{cfg.model.preset!r} ({context} positions); use at most {context - 1}, less the longest prompt")
    return context


def _check_task_fits(cfg: RunConfig, context: Optional[int]) -> None:
    """Every digits setting of a generated task (task.digits, each task.curriculum phase) must give prompts that fit
    the context with rollout.max_new_tokens, checked at start: a phase's prompts are otherwise drawn only when the
    phase begins, and a number of more digits than the context has positions cannot even be generated cheaply.
    Prompt length is counted in characters (one token each with the character tokenizer of the tiny presets; a
    subword tokenizer takes at most as many for these digit prompts), over ``_FIT_DRAWS`` draws."""
    import random as _random
    from dataclasses import replace

    from trainers.tasks import generated_task_names

    t = cfg.task
    if context is None or t.name not in generated_task_names():
        return
    settings = [("task.digits", t.digits, t.min_digits)]
    settings += [(f"task.curriculum[{i}].digits", p.digits, t.min_digits if p.min_digits is None else p.min_digits)
                 for i, p in enumerate(t.curriculum)]
    make_task = registry("task.name")[t.name]
    room = context - cfg.rollout.max_new_tokens
    require(t.items < room, "task.items", f"{t.items} items do not fit the context of model.preset="
            f"{cfg.model.preset!r} ({context} positions, {cfg.rollout.max_new_tokens} of them for the "
            "response); use fewer items")
    for key, digits, low in settings:
        require(digits < room, key, f"{digits} digits do not fit the context of model.preset="
                f"{cfg.model.preset!r} ({context} positions, {cfg.rollout.max_new_tokens} of them for "
                "the response: rollout.max_new_tokens); use fewer digits")
        task = make_task(replace(t, digits=digits, min_digits=low, eval_size=1, curriculum=[]), cfg.seed)
        longest = max(len(ex.prompt) for ex in task.sample(_random.Random(0), _FIT_DRAWS))
        require(longest + cfg.rollout.max_new_tokens <= context, key,
                f"prompts of {digits} digits run to {longest} characters, "
                f"which with rollout.max_new_tokens={cfg.rollout.max_new_tokens} exceed the context of "
                f"model.preset={cfg.model.preset!r} ({context} positions); use fewer digits or fewer new tokens")



def never_reached(cfg: RunConfig) -> list[str]:
    """Settings that a run of ``cfg.steps`` steps never reaches, each as the warning ``check`` and ``train`` print:
    an anchor whose first window of probed batches closes after the last step (the anchored c never comes into
    force), a learning-rate warm-up longer than the run (the rate never reaches optim.lr). Warnings, not errors: a
    short trial of a long config (``steps=2``) and a run to be resumed further are meant."""
    out = []
    for i, c in enumerate(cfg.dual.constraints):
        end = c.anchor_start + c.anchor_batches
        if c.anchor is not None and end > cfg.steps:
            out.append(f"dual.constraints[{i}].anchor: its first window (anchor_start={c.anchor_start}, "
                       f"anchor_batches={c.anchor_batches}) closes at step {end}, after the run's last (steps="
                       f"{cfg.steps}): the anchored c never comes into force and c stays (1 + floor_slack) x the "
                       f"floor for the whole run; lower anchor_start or anchor_batches, or train at least {end} steps")
    if cfg.optim.warmup_steps > cfg.steps:
        share = cfg.steps / cfg.optim.warmup_steps
        out.append(f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run (steps={cfg.steps}): the "
                   f"learning rate never reaches optim.lr (at the last step it is {share:.3g} of it); lower "
                   f"optim.warmup_steps to at most {cfg.steps}, or train longer")
    return out


def _runs_on_cpu(device: str) -> bool:
    """Whether the ``device`` setting puts the run on the CPU (auto: when no CUDA device is visible)."""
    import torch

    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def file_in_the_way(folder: str) -> Optional[Path]:
    """The first existing path on the way to ``folder`` (itself, then its parents) when it is a file, not a folder;
    None when that path is a folder, or cannot be searched (the writability check at start names it)."""
    for part in (Path(folder), *Path(folder).parents):
        try:
            exists, is_dir = part.exists(), part.is_dir()
        except OSError:
            return None
        if exists:
            return None if is_dir else part
    return None
