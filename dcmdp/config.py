"""The run config: component dataclasses composed with OmegaConf, YAML files and dotlist overrides.

Unknown keys are errors that name the key and its nearest valid spelling; bounds are checked by each
component's ``check()``; checks that span components live in ``validate()`` and raise, never rewrite.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from constraints.config import ConstraintConfig
from dcmdp.async_config import AsyncRolloutConfig
from trainers.config import RENAMED_KEYS as TRAINER_RENAMED_KEYS
from trainers.config import AlgoConfig, ColdStartConfig, ModelConfig, OptimConfig, RolloutConfig, TaskConfig

if TYPE_CHECKING:
    from trainers.engines import EngineCapabilities


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


# Keys that were replaced, with what replaces them: the error for an old key names its replacement.
RENAMED_KEYS = {
    **TRAINER_RENAMED_KEYS,
    "dual.enabled": "dual.rule=off (for dual.enabled=false; dual.enabled=true was the default, dual.rule=projected)",
    "dual.fixed": "dual.rule=fixed (for dual.fixed=true; lambda held at lambda_init)",
}


@dataclass
class PIDConfig:
    # Proportional gain K_P (Stooke et al. 2020).
    kp: float = 0.0
    # Derivative gain K_D, acting on increases of the smoothed cost only.
    kd: float = 0.0
    # EMA factor alpha_p of the proportional term (Stooke et al.'s reference value).
    alpha_p: float = 0.95
    # EMA factor alpha_d of the cost used by the derivative term.
    alpha_d: float = 0.95
    # Delay (in dual steps) of the derivative term.
    delay: int = 10

    def check(self, prefix: str = "dual.pid") -> None:
        for key in ("kp", "kd"):
            if getattr(self, key) < 0:
                raise ValueError(f"config error at '{prefix}.{key}': must be >= 0, got {getattr(self, key)}")
        for key in ("alpha_p", "alpha_d"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"config error at '{prefix}.{key}': must be in [0, 1), got {getattr(self, key)}")
        if self.delay < 1:
            raise ValueError(f"config error at '{prefix}.delay': must be >= 1, got {self.delay}")


@dataclass
class CouplingConfig:
    # Rows of A in the linear limits A @ lambda <= b across constraints (empty: independent boxes).
    A: list[list[float]] = field(default_factory=list)
    # Right-hand side b of A @ lambda <= b.
    b: list[float] = field(default_factory=list)


@dataclass
class DualConfig:
    # Dual update rule: projected | pid | fixed (lambda held at lambda_init: the fixed-coefficient baseline) | off
    # (lambda = 0, no penalty; the measures are still logged). See dcmdp.dual.DUAL_RULES.
    rule: str = "projected"
    # Penalty form in the primal loss: hinge | mean | advantage (see constraints.penalties.PENALTIES).
    penalty: str = "hinge"
    # Constraints, each with its own multiplier.
    constraints: list[ConstraintConfig] = field(default_factory=lambda: [
        ConstraintConfig(measure="abs_prob_diff", tolerance=0.005, lambda_init=0.1, lambda_max=10.0, lr=1.0)])
    # PID gains (rule: pid).
    pid: PIDConfig = field(default_factory=PIDConfig)
    # Linear limits coupling the multipliers (projection solved as a QP with cvxpy).
    coupling: CouplingConfig = field(default_factory=CouplingConfig)
    # Which policy D-hat (the dual step's input) measures against the rollout engine mu:
    # rollout (pi_old, before the updates: the engines' discrepancy at the weights that sampled the batch) |
    # updates (pi_theta of every token at the mini-batch update that trained on it, before that update's
    # optimiser step: the quantity the hinge penalty acts on, engine discrepancy plus update drift; equal to
    # rollout at N = 1).
    measure_at: str = "rollout"
    # Measure the violation in units of the tolerance: the dual step (projected, and the PID terms) uses
    # (D_hat - c) / c instead of D_hat - c, so one eta means "lambda moves by eta per tolerance exceeded" for
    # every measure (abs_prob_diff ~1e-3 and kl_k3 ~1e-4 alike). Needs c > 0.
    relative: bool = False
    # The penalty carries the running mean of the multipliers over the run, lambda_bar_k = mean(lambda_0..lambda_k),
    # instead of the last one (the averaged dual iterate): lambda still moves by the rule; the penalty settles at the
    # level the run's drift asked for and does not let go when D-hat falls inside c late. Logged as dual/lambda_avg/*.
    # Off by default: under very stale rollouts it cost accuracy against lambda itself (stress benchmark, average).
    average: bool = False


@dataclass
class TrackingConfig:
    # MLflow tracking URI; empty uses $MLFLOW_TRACKING_URI, else a local store under output_dir.
    uri: Optional[str] = None
    # MLflow experiment name.
    experiment: str = "dcmdp"
    # MLflow run name (empty: generated from the config).
    run_name: Optional[str] = None
    # Directory for metrics buffered while the tracking server is unreachable.
    buffer_dir: Optional[str] = None
    # MLflow run id of a parent run (``dcmdp tune``): the run is created nested under it.
    parent_run_id: Optional[str] = None
    # log_metrics hands the step's metrics to a sender thread and returns (dcmdp.tracking); off sends in the step.
    async_log: bool = True


@dataclass
class CheckpointConfig:
    # Save a checkpoint every this many steps (0: only at the end and on signals).
    every: int = 0
    # Keep the last N checkpoints.
    keep: int = 2
    # Resume: empty (fresh run) | auto (latest valid checkpoint in output_dir) | a checkpoint path.
    resume: Optional[str] = None


@dataclass
class GuardConfig:
    # Stop the run (after writing a checkpoint) after this many consecutive bad steps: every sample dropped
    # as non-finite, or a mini-batch update skipped for a non-finite loss or gradient norm.
    max_bad_steps: int = 5


@dataclass
class DistConfig:
    # Process-group backend under torchrun: auto (gloo: the trainer runs on the CPU) | gloo | nccl.
    backend: str = "auto"
    # FSDP2 compute dtype of the sharded model (master weights stay float32): fp32 | bf16.
    param_dtype: str = "fp32"
    # FSDP2 dtype of the gradient reduce-scatter: fp32 | bf16.
    reduce_dtype: str = "fp32"

    def check(self, prefix: str = "dist") -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"config error at '{prefix}.backend': got {self.backend!r}, expected auto, gloo or nccl")
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(self, key) not in ("fp32", "bf16"):
                raise ValueError(f"config error at '{prefix}.{key}': got {getattr(self, key)!r}, expected fp32 or bf16")


@dataclass
class RunConfig:
    # Seed of everything (python, numpy, torch, task generators).
    seed: int = 0
    # RL steps (rollout batches).
    steps: int = 60
    # Evaluate on the held-out set every this many steps (0: only before and after).
    eval_every: int = 0
    # Output directory of this run (checkpoints, plots, local MLflow store).
    output_dir: str = "outputs/default"
    # torch intra-op threads (0: torch's default).
    threads: int = 0
    # Show a progress bar; null: only when stdout and stderr are terminals. Without a bar, one line per log_every
    # steps goes to the log (step, reward, accuracy, lambda and D-hat per constraint, step time).
    progress: Optional[bool] = None
    # Steps between two console lines when no progress bar is shown.
    log_every: int = 10
    # Start a fresh run in an output_dir that holds an earlier run's checkpoints or summary.json, deleting them
    # (its MLflow run stays). Without it such a folder is refused unless checkpoint.resume is set.
    overwrite: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dual: DualConfig = field(default_factory=DualConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)


def _valid_keys(node: Any) -> list[str]:
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _nearest(key: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _check_keys(user: Any, schema: Any, prefix: str = "") -> None:
    """Raise ConfigError for the first key of ``user`` that the structured ``schema`` does not have."""
    if not isinstance(user, DictConfig) or not isinstance(schema, DictConfig):
        return
    valid = _valid_keys(schema)
    for key in user.keys():
        path = f"{prefix}{key}"
        if key not in valid:
            if path in RENAMED_KEYS:
                raise ConfigError(f"config key '{path}' was replaced: use {RENAMED_KEYS[path]}")
            raise ConfigError(f"unknown config key '{path}'{_nearest(str(key), valid)}")
        sub_schema = schema._get_node(key)
        sub_user = user._get_node(key)
        if isinstance(sub_schema, ListConfig) and isinstance(sub_user, ListConfig):
            elem = _list_element_schema(schema, key)
            if elem is not None:
                for i, item in enumerate(sub_user):
                    _check_keys(item, elem, f"{path}[{i}].")
        else:
            _check_keys(sub_user, sub_schema, f"{path}.")


def _list_element_schema(schema: DictConfig, key: str) -> Optional[DictConfig]:
    obj_type = OmegaConf.get_type(schema)
    if obj_type is None or not is_dataclass(obj_type):
        return None
    for f in fields(obj_type):
        if f.name == key:
            args = getattr(f.type, "__args__", None)
            if isinstance(f.type, str):
                if "ConstraintConfig" in f.type:
                    return OmegaConf.structured(ConstraintConfig)
                return None
            if args and is_dataclass(args[0]):
                return OmegaConf.structured(args[0])
    return None


def _set_list_element(cfg: DictConfig, key: str, value: str) -> None:
    """Apply one override whose path indexes a list (``dual.constraints[0].lr=50``); raise ConfigError naming
    the key when the element or the field does not exist."""
    parent_path, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_path, default=None) if parent_path else None
    if not isinstance(parent, DictConfig):
        list_path = key.split("[", 1)[0]
        items = OmegaConf.select(cfg, list_path, default=None)
        size = f"it has {len(items)} element(s)" if isinstance(items, ListConfig) else "it is not a list"
        raise ConfigError(f"unknown config key '{key}': no element '{parent_path or key}' ({list_path}: {size})")
    valid = _valid_keys(parent)
    if leaf not in valid:
        raise ConfigError(f"unknown config key '{key}'{_nearest(leaf, valid)}")
    parsed = OmegaConf.from_dotlist([f"value={value}"])["value"]
    OmegaConf.update(cfg, key, parsed, merge=False)


# String fields with a value "off", which YAML 1.1 (OmegaConf's parser, for files and overrides alike) reads as the
# boolean false: ``dual.rule: off`` must stay the rule's name.
_OFF_KEYS = ("dual.rule",)


def yaml_value(key: str, value: Any) -> Any:
    """``value`` as parsed from YAML for the config key ``key``, with a YAML false read back as "off" where that is
    a name the key takes (``_OFF_KEYS``)."""
    return "off" if key in _OFF_KEYS and value is False else value


def _undo_yaml_false(layer: DictConfig) -> None:
    for key in _OFF_KEYS:
        value = OmegaConf.select(layer, key, default=None)
        if yaml_value(key, value) is not value:
            OmegaConf.update(layer, key, yaml_value(key, value), merge=False)


def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Compose defaults <- YAML file <- dotlist overrides into a checked RunConfig."""
    schema = OmegaConf.structured(RunConfig)
    layers = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            layers.append(OmegaConf.load(p))
        except Exception as exc:  # yaml errors carry line numbers
            raise ConfigError(f"cannot parse config file {p}: {exc}") from exc
        if layers[-1] is None or not isinstance(layers[-1], DictConfig):
            raise ConfigError(f"config file {p} must hold a mapping of keys at top level")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value")
    # list elements (dual.constraints[0].tolerance=...) are set on the composed config; the rest merge as a layer
    indexed = [o for o in overrides if "[" in o.split("=", 1)[0]]
    plain = [o for o in overrides if o not in indexed]
    if plain:
        try:
            layers.append(OmegaConf.from_dotlist(plain))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"cannot parse overrides {plain}: {exc}") from exc
    for layer in layers:
        _check_keys(layer, schema)
        _undo_yaml_false(layer)
    try:
        merged = OmegaConf.merge(schema, *layers)
        for override in indexed:
            _set_list_element(merged, *override.split("=", 1))
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except (ConfigKeyError, ConfigAttributeError) as exc:
        raise ConfigError(f"unknown config key: {exc}") from exc
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        # OmegaConf appends full_key / reference_type lines: keep the first, and say "list" in plain words
        msg = str(exc.msg if hasattr(exc, "msg") else exc).splitlines()[0]
        if "is not a ListConfig" in msg:
            msg = "expected a list"
        raise ConfigError(f"bad value for '{key}': {msg}") from exc
    validate(cfg)
    return cfg


# Float fields where +inf means "no bound" (a field NaN is never meaningful): the upper end of lambda's projection
# interval, the TIS caps C, the upper ends of the kept IS bands and the rejection bound. Constraint fields are named
# with ``[*]``.
INF_ALLOWED = frozenset({"dual.constraints[*].lambda_max", "algo.tis.cap", "algo.seq_tis.cap", "algo.icepop.high",
                         "algo.seq_mask.prod.high", "algo.seq_mask.geo.high", "algo.reject.bound"})


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
        if math.isnan(value):
            raise ConfigError(f"config error at '{key}': must be a finite number, got nan")
        generic = re.sub(r"\[\d+\]", "[*]", key)
        if value < 0 or generic not in INF_ALLOWED:
            raise ConfigError(f"config error at '{key}': must be a finite number, got {value}"
                              f"{' (inf is allowed only in ' + ', '.join(sorted(INF_ALLOWED)) + ')' if value > 0 else ''}")


def validate(cfg: RunConfig) -> None:
    """Check every component's bounds and the cross-component rules; raise ConfigError."""
    check_finite(cfg)
    try:
        cfg.model.check()
        cfg.rollout.check()
        cfg.task.check()
        cfg.cold_start.check()
        cfg.algo.check()
        cfg.optim.check()
        cfg.dual.pid.check()
        cfg.dist.check()
        cfg.async_rollout.check()
        for i, c in enumerate(cfg.dual.constraints):
            c.check(f"dual.constraints[{i}]")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.steps < 0:
        raise ConfigError(f"config error at 'steps': must be >= 0, got {cfg.steps}")
    if cfg.seed < 0:  # numpy seeds only from non-negative integers
        raise ConfigError(f"config error at 'seed': must be >= 0, got {cfg.seed}")
    if cfg.optim.weight_decay < 0:
        raise ConfigError(f"config error at 'optim.weight_decay': must be >= 0, got {cfg.optim.weight_decay}")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"config error at 'checkpoint.keep': must be >= 1, got {cfg.checkpoint.keep}")
    if cfg.log_every < 1:
        raise ConfigError(f"config error at 'log_every': must be >= 1, got {cfg.log_every}")
    for key, value in (("eval_every", cfg.eval_every), ("threads", cfg.threads),
                       ("checkpoint.every", cfg.checkpoint.every)):
        if value < 0:
            raise ConfigError(f"config error at '{key}': must be >= 0, got {value}")
    if cfg.guard.max_bad_steps < 1:
        raise ConfigError(f"config error at 'guard.max_bad_steps': must be >= 1, got {cfg.guard.max_bad_steps}")
    if cfg.dual.relative:
        for i, c in enumerate(cfg.dual.constraints):
            if not c.tolerance > 0:
                raise ConfigError(f"config error at 'dual.constraints[{i}].tolerance': dual.relative=true divides the "
                                  f"violation by c, which must be > 0 (got {c.tolerance})")
    _validate_staleness_control(cfg)
    if cfg.dual.coupling.A or cfg.dual.coupling.b:
        n = len(cfg.dual.constraints)
        if len(cfg.dual.coupling.A) != len(cfg.dual.coupling.b) or any(len(r) != n for r in cfg.dual.coupling.A):
            raise ConfigError(f"config error at 'dual.coupling': A must be {len(cfg.dual.coupling.b)} x {n} "
                              f"(rows = len(b), columns = number of constraints)")
    _validate_registries(cfg)


def _validate_staleness_control(cfg: RunConfig) -> None:
    """``async_rollout.max_staleness: auto`` bounds the D-hat of one of the dual's constraints."""
    a = cfg.async_rollout
    if not a.is_auto:
        return
    n = len(cfg.dual.constraints)
    if not a.auto.constraint < n:
        raise ConfigError(f"config error at 'async_rollout.auto.constraint': {a.auto.constraint} names no constraint "
                          f"(dual.constraints has {n})")
    if a.auto.tolerance is None and not cfg.dual.constraints[a.auto.constraint].tolerance > 0:
        raise ConfigError(f"config error at 'async_rollout.auto.tolerance': the staleness step divides by c_s, and "
                          f"dual.constraints[{a.auto.constraint}].tolerance is not > 0; set async_rollout.auto.tolerance")


def _validate_registries(cfg: RunConfig) -> None:
    """Names chosen from a registry must exist; messages list the registry's names."""
    from constraints.measures import MEASURES
    from constraints.penalties import PENALTIES, check_penalty_constraints
    from trainers.advantages import ADVANTAGES
    from trainers.engines import ENGINES
    from trainers.losses import IS_MODES, POLICY_LOSSES
    from trainers.models import PRESETS
    from trainers.tasks import TASKS, check_task_config

    from dcmdp.dual import DUAL_RULES

    def one_of(value: str, registry: Any, key: str) -> None:
        if value not in registry:
            raise ConfigError(f"config error at '{key}': unknown {value!r}{_nearest(value, list(registry))}")

    one_of(cfg.model.preset, PRESETS, "model.preset")
    one_of(cfg.rollout.engine, ENGINES, "rollout.engine")
    one_of(cfg.task.name, TASKS, "task.name")
    try:
        check_task_config(cfg.task)  # task jsonl: its files exist and its reward function imports
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    one_of(cfg.algo.loss, POLICY_LOSSES, "algo.loss")
    one_of(cfg.algo.is_mode, IS_MODES, "algo.is_mode")
    one_of(cfg.algo.advantage, ADVANTAGES, "algo.advantage")
    one_of(cfg.dual.rule, DUAL_RULES, "dual.rule")
    one_of(cfg.dual.penalty, PENALTIES, "dual.penalty")
    one_of(cfg.dual.measure_at, ("rollout", "updates"), "dual.measure_at")
    for i, c in enumerate(cfg.dual.constraints):
        one_of(c.measure, MEASURES, f"dual.constraints[{i}].measure")
    penalizes = DUAL_RULES[cfg.dual.rule].penalizes
    if penalizes:
        try:
            check_penalty_constraints(cfg.dual.constraints)
        except ValueError as exc:
            raise ConfigError(f"config error at 'dual.constraints': {exc}") from exc
    engine = ENGINES[cfg.rollout.engine].capabilities
    _validate_rollout_quantization(cfg, PRESETS, engine)
    name = cfg.rollout.engine
    if engine.routes == "eager" and cfg.algo.routing_replay == "r3" and not getattr(cfg.rollout, name).enforce_eager:
        raise ConfigError(f"config error at 'rollout.{name}.enforce_eager': R3 with the {name} engine records routes "
                          f"through router hooks that only run in eager mode; set rollout.{name}.enforce_eager=true")
    if cfg.async_rollout.enabled and not engine.async_worker:
        able = " | ".join(n for n, e in ENGINES.items() if e.capabilities.async_worker)
        raise ConfigError(f"config error at 'async_rollout.enabled': the rollout worker thread drives an engine in "
                          f"the trainer's process (the {able} engine), not the {cfg.rollout.engine} engine; use "
                          f"rollout.engine={able}, or async_rollout.enabled=false with "
                          f"rollout.engine={cfg.rollout.engine}")
    mismatch = [i for i, c in enumerate(cfg.dual.constraints) if c.measure == "routing_mismatch"]
    if penalizes and mismatch and cfg.algo.routing_replay == "r3":
        raise ConfigError(f"config error at 'dual.constraints[{mismatch[0]}].measure': routing_mismatch compares the "
                          f"two engines' expert choices, and algo.routing_replay=r3 trains on the rollout engine's "
                          f"choices, so it measures exactly 0 and its constraint can never act; drop the constraint "
                          f"or use routing_replay=r2 or none")
    if cfg.algo.routing_replay != "none" and not PRESETS[cfg.model.preset].is_moe:
        raise ConfigError(f"config error at 'algo.routing_replay': {cfg.algo.routing_replay} replays MoE routes, "
                          f"but model.preset={cfg.model.preset!r} is a dense model; use routing_replay=none")


def _validate_rollout_quantization(cfg: RunConfig, presets: dict, engine: EngineCapabilities) -> None:
    """Rollout precisions (and logit noise) the chosen engine and model can run, refused at load, before anything is
    built."""
    import torch

    from trainers.models import model_from_config
    from trainers.quant import fp8_gemm_available, int4_group_error

    r = cfg.rollout
    if r.precision in engine.unsupported_precisions:
        raise ConfigError(f"config error at 'rollout.precision': {engine.unsupported_precisions[r.precision]}")
    if r.precision == "fp8" and engine.fp8_needs_tensor_cores and not fp8_gemm_available():
        raise ConfigError(f"config error at 'rollout.precision': {engine.fp8_needs_tensor_cores}")
    if r.logit_noise > 0 and engine.no_logit_noise:
        raise ConfigError(f"config error at 'rollout.logit_noise': {engine.no_logit_noise}")
    if r.precision == "int4":
        # the preset's architecture on the meta device: shapes only, no memory, no weights
        with torch.device("meta"):
            shapes = model_from_config(presets[cfg.model.preset].make_config(128), seed=0)
        problem = int4_group_error(shapes, r.torch.int4_group_size, lm_head=r.torch.quantize_lm_head)
        if problem:
            raise ConfigError(f"config error at 'rollout.torch.int4_group_size': model.preset={cfg.model.preset!r}: "
                              f"{problem}")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Flattened resolved config (dotted keys) for MLflow params."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list) and node and isinstance(node[0], dict):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")
        else:
            out[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), "")
    return out


# Keys a resumed run must share with its checkpoint: the model's shape and weights, and the dual state's layout
# and meaning (number, order and measures of the constraints, the dual rule). Others (lr, steps, tolerances, ...)
# may change on resume. ``*`` stands for a constraint's index.
RESUME_KEYS = ("model.preset", "model.path", "model.dtype", "task.name", "dual.rule", "dual.constraints.*.measure",
               "dual.constraints.*.tau")


def _rule_of_old_keys(saved: dict[str, str]) -> dict[str, str]:
    """A flattened config saved before ``dual.rule`` named off and fixed: its ``dual.enabled=False`` is rule off and
    its ``dual.fixed=True`` rule fixed (see ``RENAMED_KEYS``)."""
    if saved.get("dual.enabled") == "False":
        return {**saved, "dual.rule": "off"}
    if saved.get("dual.fixed") == "True":
        return {**saved, "dual.rule": "fixed"}
    return saved


def resume_conflicts(saved: dict[str, str], cfg: RunConfig) -> list[str]:
    """One line per ``RESUME_KEYS`` key where ``cfg`` differs from the flattened config ``saved`` with a checkpoint
    (``flatten``), the number of constraints first; empty when the run can continue from it."""
    saved = _rule_of_old_keys(saved)
    now = flatten(cfg)

    def count(flat: dict[str, str]) -> int:
        return len({k.split(".")[2] for k in flat if k.startswith("dual.constraints.")})

    out = []
    if count(saved) != count(now):
        out.append(f"dual.constraints: {count(saved)} constraint(s) in the checkpoint, {count(now)} now")
    for key in sorted(set(saved) | set(now)):
        generic = re.sub(r"^dual\.constraints\.\d+\.", "dual.constraints.*.", key)
        if generic in RESUME_KEYS and key in saved and key in now and saved[key] != now[key]:
            out.append(f"{key}: {saved[key]!r} in the checkpoint, {now[key]!r} now")
    return out

