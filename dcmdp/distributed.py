"""Scale-out: FSDP2 under ``torchrun``, sharded checkpoints, rank-0 or tensor-parallel vLLM rollouts.

Launched by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the run becomes data parallel:

- every rank builds the model on the meta device and ``shard_model`` wraps it with
  ``torch.distributed.fsdp.fully_shard``: each decoder layer, the LM head (its own unit so it can keep float32
  parameters when ``model.fp32_lm_head``), then the root (embedding, final norm), with the ``dist`` block's
  ``MixedPrecisionPolicy``; each rank then materialises its shards only and fills them one full tensor at a time
  (``build_sharded_model``), from the cold-start cache or ``model.path`` or the seed's replayed random init, so no
  rank holds the whole model (a cold start not cached yet is trained by rank 0 first, on a whole model);
- rank 0 alone holds the MLflow run (the other ranks log nothing, ``dcmdp.tracking.NoTracker``) and the torch rollout
  engine: ``RankZeroEngine`` broadcasts every Rollout it samples. A vLLM engine is instead hosted by every
  rank (``SpmdEngine``): vLLM's ``external_launcher`` executor makes rank r tensor-parallel part r of one
  colocated engine (``rollout.vllm.tensor_parallel_size`` = world size), and all ranks generate from the same
  prompts and seed. Either way each rank computes the rewards and the group advantages over the same FULL
  batch (so group statistics never depend on the world size);
- each rank scores and back-propagates its own block of rows (``trainers.learner.DataShard``); per-token
  log-probs are all-gathered, so the measures, the dual step and every metric see the full batch, and
  losses are normalised by the global token count (the gradient reduction sums, divide factor 1);
- after the updates each sharded tensor is gathered and the full weights go into rank 0's torch engine, or
  into every rank's vLLM worker, which keeps its tensor-parallel shard;
- checkpoints are written with ``torch.distributed.checkpoint`` (``save_sharded_checkpoint``).

A world size of 1 (plain ``dcmdp train``, or ``torchrun --nproc_per_node 1``) is the single-process run,
untouched: no process group, no sharding, the plain checkpoint format.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dcmdp.device import activate, check_backend, default_backend, local_rank, resolve_device
from dcmdp.checkpoint import (CheckpointError, capture_rng, prepare_checkpoint_dir, publish_checkpoint,
                              restore_rng)
from trainers.engines import build_engine, capabilities
from trainers.learner import DataShard

log = logging.getLogger(__name__)

SHARDED_DIR = "sharded"
"""Sub-directory of a checkpoint holding the ``torch.distributed.checkpoint`` files (model and optimiser)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class DistributedSetupError(ValueError):
    """A run that cannot be made data parallel as configured; the message names the key to change."""


@dataclass
class Dist:
    """Where this process stands in the run: rank ``rank`` of ``world`` (world 1: not distributed)."""

    rank: int = 0
    world: int = 1
    backend: Optional[str] = None
    shard: DataShard = field(default_factory=DataShard)
    # Where this process trains (``dcmdp.device.resolve_device``): model, optimiser state, engine, batches.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # In a process group with an FSDP2-sharded model: world > 1, or one torchrun process with dist.shard_one_process.
    sharded: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled broadcast); ``obj`` itself when not distributed."""
        if self.world == 1:
            return obj
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_to_main(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out: Optional[list[Any]] = [None] * self.world if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block before the others (e.g. to fill an on-disk cache they then read)."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded weights on rank 0 (an empty dict on the other ranks); a collective when distributed."""
        if not self.sharded:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as ``torchrun`` sets them; (0, 1) outside it."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def check_world(cfg, world: int, sharded: bool = False) -> None:
    """Raise DistributedSetupError for a config that cannot run on ``world`` data-parallel ranks (``sharded``: one
    torchrun process sharded anyway, ``dist.shard_one_process``)."""
    if world == 1 and not sharded:
        return
    algo = cfg.algo
    batch = algo.prompts_per_step * algo.samples_per_prompt
    name = cfg.rollout.engine
    if capabilities(name).tensor_parallel and getattr(cfg.rollout, name).tensor_parallel_size != world:
        raise DistributedSetupError(
            f"config error at 'rollout.{name}.tensor_parallel_size': under torchrun every rank hosts its "
            f"tensor-parallel part of one colocated {name} engine, so the tensor-parallel size must be the world "
            f"size; set rollout.{name}.tensor_parallel_size={world} "
            f"(got {getattr(cfg.rollout, name).tensor_parallel_size})")
    if getattr(getattr(cfg, "async_rollout", None), "enabled", False):
        raise DistributedSetupError(
            f"config error at 'async_rollout.enabled': asynchronous rollouts run in a single process; under "
            f"torchrun ({world} ranks) use async_rollout.enabled=false")
    if (batch // algo.minibatches) % world:
        raise DistributedSetupError(
            f"config error at 'algo.minibatches': mini-batches of {batch // algo.minibatches} samples "
            f"({algo.prompts_per_step} x {algo.samples_per_prompt} / {algo.minibatches}) do not split evenly over "
            f"{world} ranks")
    if cfg.model.dtype != "float32":
        raise DistributedSetupError(
            f"config error at 'model.dtype': under FSDP2 the sharded master weights stay float32 and "
            f"dist.param_dtype sets the compute dtype; use model.dtype=float32 dist.param_dtype=bf16 instead of "
            f"model.dtype={cfg.model.dtype}")
    if cfg.rollout.torch.share_weights:
        raise DistributedSetupError(
            "config error at 'rollout.torch.share_weights': under torchrun the trainer's model is sharded over the "
            "ranks and rank 0's engine needs whole weights; use rollout.torch.share_weights=false")
    if cfg.dist.backend == "nccl" and cfg.device == "cpu":
        raise DistributedSetupError(
            "config error at 'dist.backend': nccl reduces CUDA tensors and device=cpu trains on the CPU; use "
            "dist.backend=auto (gloo on the CPU, nccl on GPUs) or device=auto on a GPU machine")


def init(cfg) -> Dist:
    """This process's place in the run: its device (``cfg.device``, logged with the reason) and, when ``torchrun``
    launched WORLD_SIZE > 1 processes, the process group (``dist.backend``; auto: nccl on CUDA, gloo on the CPU)."""
    rank, world = world_from_env()
    forced = world == 1 and cfg.dist.shard_one_process and "LOCAL_RANK" in os.environ
    check_world(cfg, world, sharded=forced)
    device, why = resolve_device(cfg.device, local_rank())
    if rank == 0:
        log.info("training on %s", why)
    activate(device)
    if world == 1 and not forced:
        return Dist(device=device)
    backend = default_backend(device) if cfg.dist.backend == "auto" else cfg.dist.backend
    check_backend(backend, device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), backend=backend,
                shard=DataShard(rank=dist.get_rank(), world=dist.get_world_size()), device=device, sharded=True)


def shutdown(d: Dist) -> None:
    """Leave the process group together: a barrier first, so no rank tears down its gloo pairs while a peer is
    still in the run's last collectives or writing its results, then ``destroy_process_group``."""
    if d.sharded and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_worker(code: int) -> None:
    """End a ``torchrun`` worker process with ``code`` without the interpreter's teardown.

    The run has finished by then (checkpoint written, MLflow run ended, process group destroyed), but objects
    that still hold the process group (FSDP2's device mesh) would be freed during interpreter finalisation,
    and a gloo worker thread that then needs the GIL is stopped by the interpreter, which aborts the process
    ("terminate called without an active exception", SIGABRT) and fails the whole torchrun job. So the
    cleanup runs while the interpreter is whole: the exit handlers (vLLM's shared-memory segments, MLflow),
    a garbage collection of what the run left (model, engine, process-group references), then the log
    handlers and the standard streams are flushed and the process exits."""
    atexit._run_exitfuncs()
    gc.collect()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def shard_model(model: torch.nn.Module, cfg, d: Dist) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, the LM head (float32 parameters when ``model.fp32_lm_head``),
    then the root; gradients are summed across ranks (divide factor 1: the losses already divide by the
    global token count). Returns ``model`` itself (FSDP2 shards in place)."""
    if not d.sharded:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from trainers.packing import register_fsdp_justified
    from trainers.scoring import register_fsdp_scoring

    mesh = init_device_mesh(d.device.type, (d.world,))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.dist.param_dtype], reduce_dtype=DTYPES[cfg.dist.reduce_dtype])
    head_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    head = model.get_output_embeddings()
    # a tied head shares the embedding's parameter, which the root unit holds: it cannot be its own unit
    if head.weight is not model.get_input_embeddings().weight:
        fully_shard(head, mesh=mesh, mp_policy=head_policy if cfg.model.fp32_lm_head else policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM: gloo has no pre-multiplied sum (and nccl's sum is the same reduction)
            module.set_force_sum_reduction_for_comms(True)
    register_fsdp_scoring(model)
    register_fsdp_justified(model)
    return model


def load_shards(model: torch.nn.Module, tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy each (name, full tensor) of ``tensors`` into ``model``'s tensor of that name: into this rank's shard of an
    FSDP2-sharded parameter (the rows ``fully_shard``'s dim-0 placement gives this rank), whole into anything else.
    Holds no more than the source hands over (one full tensor at a time for ``trainers.weights``' sources). Every
    parameter must be written: a missing one is a KeyError naming it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


    own = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    missing = set(own)
    for name, full in tensors:
        target = own.get(name, buffers.get(name))
        if target is None:
            raise KeyError(f"load_shards: the model has no tensor {name!r}")
        with torch.no_grad():
            if isinstance(target, DTensor):
                shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
                rows = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
                target.to_local().copy_(rows)
            else:
                target.copy_(full)
        missing.discard(name)
        del full
    if missing:
        raise KeyError(f"load_shards: no weights for {len(missing)} parameters, e.g. {sorted(missing)[:3]}")


def build_sharded_model(model: torch.nn.Module, tensors: Iterable[tuple[str, Tensor]], cfg, d: Dist,
                        dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """The training model of a sharded run, built shard by shard: ``model`` (on the meta device,
    ``trainers.models.build_meta_model``) cast to ``dtype`` (the optimiser's parameter dtype; None: as built),
    wrapped by ``shard_model``, materialised with ``to_empty`` on this rank's device (its shards only), then filled
    from ``tensors`` (``load_shards``) and its rotary buffers computed (``trainers.weights.init_buffers``).

    A rank then holds its 1/world of the weights plus what the source holds at a time (one full tensor), never the
    whole model. Returns ``model`` (sharded in place)."""
    from trainers.models import cast_model
    from trainers.weights import init_buffers

    if dtype is not None:
        cast_model(model, dtype)
    shard_model(model, cfg, d)
    model.to_empty(device=d.device)
    load_shards(model, tensors)
    init_buffers(model)
    return model


class GatheredStateDict(Mapping):
    """The full weights of an FSDP2-sharded state dict, gathered one tensor at a time as a reader asks for it and cast
    to ``dtype`` (None: as trained): a weight sync then holds one full tensor beside the shards, not the whole float32
    model (Qwen3-30B-A3B: 122 GB). Reading a tensor is a collective: every rank must read the same names in the same
    order, which an engine loading every tensor once, in the state dict's order, does on every rank."""

    def __init__(self, state_dict: dict[str, Tensor], dtype: Optional[torch.dtype] = None):
        self._sharded, self._dtype = state_dict, dtype

    def __getitem__(self, name: str) -> Tensor:
        tensor = self._sharded[name]
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if self._dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self._dtype)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._sharded)

    def __len__(self) -> int:
        return len(self._sharded)


def sync_dtype(rollout_cfg) -> Optional[torch.dtype]:
    """The dtype weights travel in to the rollout engine: its own for a plain cast (fp32, bf16, fp16); None (as
    trained) for a quantised precision, which re-quantises from the full-precision values."""
    from trainers.quant import PRECISION_DTYPES, QUANTIZED_PRECISIONS

    if rollout_cfg.precision_schedule or rollout_cfg.precision in QUANTIZED_PRECISIONS:
        return None
    return PRECISION_DTYPES[rollout_cfg.precision]


class RankZeroEngine:
    """The rollout engine as every rank sees it: rank 0 drives the real engine (``inner``) and broadcasts each
    Rollout, so every rank computes rewards and advantages over the same full batch; ``load_weights`` takes
    the FSDP2-sharded state dict, gathers each tensor (a collective, every rank calls it), casts it to the engine's
    dtype and hands it to rank 0's engine through host memory: the device holds one full tensor at a time."""

    def __init__(self, inner, d: Dist, dtype: Optional[torch.dtype] = None):
        self.inner, self.d, self.dtype = inner, d, dtype
        self.version = inner.version if inner is not None else 0

    def generate(self, prompts: list[list[int]], seed: int):
        return self.d.from_main(self.inner.generate(prompts, seed) if self.d.main else None)

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        full = {}
        gathered = GatheredStateDict(state_dict, self.dtype)
        for name in gathered:
            tensor = gathered[name]
            if self.d.main:  # the other ranks drop each gathered tensor at once
                full[name] = tensor.to("cpu")
        if self.d.main:
            self.inner.load_weights(full, version=version)
        self.version = int(version)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


class SpmdEngine:
    """A vLLM engine hosted by every rank (``distributed_executor_backend="external_launcher"``): rank r holds
    tensor-parallel part r of one engine, and all ranks call ``generate`` with the same prompts and seed, as
    vLLM's external launcher requires (its scheduling is deterministic, the logits are all-gathered and each
    rank samples with the same per-request seeds, so every rank returns the same Rollout; ``generate`` checks
    that). ``load_weights`` streams the FSDP2-sharded state dict into every rank's vLLM worker one gathered tensor
    at a time, in the engine's dtype (``GatheredStateDict``); each worker keeps its own shard of it."""

    def __init__(self, inner, d: Dist, dtype: Optional[torch.dtype] = None):
        self.inner, self.d, self.dtype = inner, d, dtype
        self.version = inner.version

    def generate(self, prompts: list[list[int]], seed: int):
        rollout = self.inner.generate(prompts, seed)
        mine = _rollout_digest(rollout, self.d.device)
        digests = [torch.empty_like(mine) for _ in range(self.d.world)]
        dist.all_gather(digests, mine)
        if not all(torch.equal(d, digests[0]) for d in digests):
            raise RuntimeError(f"vLLM under torchrun: the ranks' engines returned different rollouts for the same "
                               f"prompts and seed (ranks {[r for r, d in enumerate(digests) if not torch.equal(d, mine)]} "
                               f"differ from rank {self.d.rank}): their weight shards disagree (a failed "
                               f"weight sync) or a kernel is not deterministic; the data-parallel batch must be one")
        return rollout

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.inner.load_weights(GatheredStateDict(state_dict, self.dtype), version=version)
        self.version = int(version)

    def close(self) -> None:
        self.inner.close()


# Elements of a Rollout field checksummed at a time by ``_rollout_digest``: its int64 temporaries are two of this
# size (16 MiB), whatever the field's length (the 30B recipe's routes are ~1.7e9 elements).
DIGEST_CHUNK = 1 << 20


def _rollout_digest(rollout, device: torch.device) -> Tensor:
    """(fields, 2) int64 checksums of everything a Rollout holds (tokens, masks, log-probs, routes), computed on
    ``device`` to compare ranks cheaply: per field its element count and sum_i bits_i * w_i, with bits_i the value's
    bit pattern (floats viewed as integers) and w_i a fixed pseudo-random weight in [1, 65521), so a changed, moved
    or reordered element changes it. Wrapping int64 arithmetic is the same on every rank, and associative: the sum
    is taken ``DIGEST_CHUNK`` elements at a time (``field_checksum``), so the digest does not depend on the chunk."""
    sums = []
    for name, value in sorted(vars(rollout).items()):
        if isinstance(value, Tensor):
            sums.append(field_checksum(value.detach(), device, DIGEST_CHUNK))
    return torch.stack(sums)


def field_checksum(value: Tensor, device: torch.device, chunk: int) -> Tensor:
    """(2,) int64: ``value``'s element count and sum_i bits_i * w_i (``_rollout_digest``), ``chunk`` elements at a
    time: each chunk is moved to ``device`` and widened to int64 on its own (two int64 temporaries of ``chunk``
    elements), never the whole field (the routes are int8: a whole-field int64 copy is 8x them, each temporary of
    the weights' arithmetic another 8x)."""
    flat = value.reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, flat.numel(), chunk):
        x = flat[start:start + chunk].to(device)
        if x.is_floating_point():
            x = x.float().view(torch.int32)
        w = torch.arange(start, start + x.numel(), device=device, dtype=torch.int64)
        w.mul_(2654435761).add_(97).remainder_(65521).add_(1).mul_(x)
        total += w.sum()
    return torch.stack([torch.tensor(flat.numel(), device=device), total])


def rollout_engine(cfg, model: torch.nn.Module, model_dir: str, *, eos_id: int, pad_id: int, d: Dist):
    """The run's rollout engine: built as configured in a single process; under torchrun an engine whose
    ``weight_sync`` is every_rank hosted by every rank (``SpmdEngine``), any other engine driven by rank 0
    (``RankZeroEngine``)."""
    if not d.sharded:
        return build_engine(cfg.rollout, model, model_dir, eos_id=eos_id, pad_id=pad_id)
    if capabilities(cfg.rollout.engine).weight_sync == "every_rank":
        d.barrier()  # rank 0 may have just written model_dir
        return SpmdEngine(build_engine(cfg.rollout, model, model_dir, eos_id=eos_id, pad_id=pad_id, every_rank=True),
                          d, sync_dtype(cfg.rollout))
    return RankZeroEngine(build_engine(cfg.rollout, model, model_dir, eos_id=eos_id, pad_id=pad_id)
                          if d.main else None, d, sync_dtype(cfg.rollout))


def agree_stop(stop, d: Dist) -> None:
    """Make every rank see a stop signal that any rank received (SignalCheckpointer), so that all ranks write
    the checkpoint and leave at the same step; the signal number is the largest one received."""
    if d.world == 1:
        return
    flag = torch.tensor([(stop.signum or 0) if stop.requested else 0], dtype=torch.long, device=d.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag) and not stop.requested:
        stop.requested, stop.signum = True, int(flag)


# ------------------------------------------------------------------------------------------------ checkpoints


def save_sharded_checkpoint(ckpt_dir: str | Path, step: int, payload: dict[str, Any], model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, *, keep: int, d: Dist) -> Path:
    """A checkpoint of a data-parallel run: model and optimiser shards with ``torch.distributed.checkpoint``
    under ``<step dir>/sharded/``, and rank 0's ``payload`` (dual state, history, scheduler, ...) plus every
    rank's RNG state in ``state.pt``; the same atomic, checksummed layout as ``checkpoint.save_checkpoint``
    (every DCP file is listed in the manifest). A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rngs = d.gather_to_main(capture_rng())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    tmp, error = None, None
    if d.main:
        try:
            tmp = prepare_checkpoint_dir(ckpt_dir, step)
        except CheckpointError as exc:
            error = str(exc)
    tmp, error = d.from_main((tmp, error))
    if error:
        raise CheckpointError(error)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=Path(tmp) / SHARDED_DIR)
    path = None
    if d.main:
        try:
            path = publish_checkpoint(Path(tmp), ckpt_dir, step, {**payload, "rng_ranks": rngs, "world_size": d.world},
                                      keep=keep)
        except CheckpointError as exc:
            error = str(exc)
    path, error = d.from_main((path, error))
    if error:
        raise CheckpointError(error)
    return Path(path)


def restore_model_optimizer(path: str | Path, state: dict[str, Any], model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, d: Dist) -> None:
    """Load model and optimiser from checkpoint ``path`` (its ``state.pt`` already loaded as ``state``).

    A sharded checkpoint is read with ``torch.distributed.checkpoint``, which reshards: it loads at any world
    size, 1 included. A single-process checkpoint (full state dicts in ``state.pt``) loads at world size 1
    only: its optimiser state is keyed by parameter index, not by name.
    """
    if "model" in state:
        if d.sharded:
            raise CheckpointError(
                f"checkpoint {path} was written by a single-process run; resume it with world size 1 (without "
                f"torchrun), or start the {d.world}-rank run afresh")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = int(state.get("world_size", 0))
    if saved != d.world:
        log.warning("checkpoint %s was written by %d ranks, this run has %d: resharding the model and optimiser",
                    path, saved, d.world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    holder = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(holder, checkpoint_id=Path(path) / SHARDED_DIR)
    set_state_dict(model, optimizer, model_state_dict=holder["model"], optim_state_dict=holder["optimizer"])


def restore_rank_rng(state: dict[str, Any], d: Dist) -> None:
    """This rank's RNG state from the checkpoint (rank 0's when the checkpoint has no state for this rank)."""
    rngs = state.get("rng_ranks")
    if rngs and d.rank < len(rngs):
        restore_rng(rngs[d.rank])
    else:
        restore_rng(state["rng"])
