"""The run config's schema: the dataclasses of the run's own blocks (tracking, checkpoints, guards, the distributed
set-up) and ``RunConfig``, which composes them with the blocks of the learner (``trainers.config``), the dual
controller (``dcmdp.dual_config``, ``constraints.config``) and the asynchronous rollout (``dcmdp.async_config``).

Defaults live only here and in those modules; each field's comment is its documentation.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from dcmdp.async_config import AsyncRolloutConfig
from dcmdp.dual_config import DualConfig
from trainers.config import RENAMED_KEYS as TRAINER_RENAMED_KEYS
from trainers.config import AlgoConfig, ColdStartConfig, ModelConfig, OptimConfig, RolloutConfig, TaskConfig
from trainers.errors import require


# Keys that were replaced, with what replaces them: the error for an old key names its replacement.
RENAMED_KEYS = {
    **TRAINER_RENAMED_KEYS,
    "dual.enabled": "dual.rule=off (for dual.enabled=false; dual.enabled=true was the default, dual.rule=projected)",
    "dual.fixed": "dual.rule=fixed (for dual.fixed=true; lambda held at lambda_init)",
}


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
    # Append each step's metrics as one JSON line to this file (``dcmdp tune`` follows, and may prune, a trial
    # through it); null: none.
    progress_file: Optional[str] = None
    # Log to MLflow; false: no MLflow run at all (the console, summary.json, dual.png and checkpoints still hold
    # everything), for throwaway speed runs or a machine without mlflow installed.
    enabled: bool = True


@dataclass
class CheckpointConfig:
    # Save a checkpoint every this many steps (0: only at the end and on signals).
    every: int = 0
    # Keep the last N checkpoints.
    keep: int = 2
    # Resume: empty (fresh run) | auto (latest valid checkpoint in output_dir) | a checkpoint path.
    resume: Optional[str] = None
    # Write a checkpoint after the last step; false only for throwaway speed runs (a real-size checkpoint is tens of
    # GB and minutes of disk time): such a run cannot be resumed or evaluated from its folder.
    at_end: bool = True


@dataclass
class GuardConfig:
    # Stop the run (after writing a checkpoint) after this many consecutive bad steps: every sample dropped
    # as non-finite, or a mini-batch update skipped for a non-finite loss or gradient norm.
    max_bad_steps: int = 5
    # Stop the run (exit 2, after writing a checkpoint; MLflow run FAILED) when the reward fails (raises, exits, times
    # out, passes its memory limit or returns no finite number) on more than this share of a step's samples for
    # reward_fail_steps consecutive steps: a run whose every reward is 0 trains on nothing.
    reward_fail_share: float = 0.5
    # Consecutive steps of reward failures above reward_fail_share that stop the run.
    reward_fail_steps: int = 3


@dataclass
class DistConfig:
    # Process-group backend under torchrun: auto (nccl when the run trains on CUDA, gloo on the CPU) | gloo | nccl.
    backend: str = "auto"
    # FSDP2 compute dtype of the sharded model (master weights stay float32): fp32 | bf16.
    param_dtype: str = "fp32"
    # FSDP2 dtype of the gradient reduce-scatter: fp32 | bf16.
    reduce_dtype: str = "fp32"
    # Under torchrun with ONE process, join a process group and shard with FSDP2 anyway: the distributed path (the
    # backend, FSDP2, sharded checkpoints) on a one-GPU machine. Without it world size 1 is the plain single-process
    # run.
    shard_one_process: bool = False

    def check(self, prefix: str = "dist") -> None:
        require(self.backend in ("auto", "gloo", "nccl"), f"{prefix}.backend",
                f"got {self.backend!r}, expected auto, gloo or nccl")
        for key in ("param_dtype", "reduce_dtype"):
            require(getattr(self, key) in ("fp32", "bf16"), f"{prefix}.{key}",
                    f"got {getattr(self, key)!r}, expected fp32 or bf16")


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
    # torch intra-op threads: an int from 1 to the cores this process may run on, or auto (the cores free when the
    # run starts; see dcmdp.cpu).
    threads: Union[int, str] = "auto"
    # Where the model, optimiser, engine and batches live: auto (cuda:LOCAL_RANK when CUDA is available, else the
    # CPU; logged with the reason at start) | cpu | cuda | cuda:N. See dcmdp.device.
    device: str = "auto"
    # Show a progress bar; null: only when stdout and stderr are terminals. Without a bar, one line per log_every
    # steps goes to the log (step, reward, accuracy, lambda and D-hat per constraint, step time).
    progress: Optional[bool] = None
    # Steps between two console lines when no progress bar is shown.
    log_every: int = 10
    # Start a fresh run in an output_dir that holds an earlier run's checkpoints or summary.json, removing only what
    # the run its run.json names wrote (anything else stays, named; no run.json: refused, nothing removed; its MLflow
    # run stays). Without it such a folder is refused unless checkpoint.resume is set.
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


def nearest(key: str, valid: Sequence[str]) -> str:
    """The tail of an unknown key's or name's message: its nearest valid spelling, else every valid one."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _get(obj: Any, key: str) -> Any:
    """The value of the dotted ``key`` of a config (or any nested object)."""
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj

