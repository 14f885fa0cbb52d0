"""Where a run computes: the ``device`` setting resolved once at start, next to ``distributed.Dist``.

``device: auto`` is ``cuda:LOCAL_RANK`` when CUDA is available (under ``torchrun`` each process takes the GPU of its
local rank; alone, GPU 0) and the CPU otherwise; ``cpu`` and ``cuda`` (or ``cuda:N``) force one. The resolved device
rides on ``Dist.device`` and every part of the loop takes it from there: the model and the optimiser state live
on it, the torch rollout engine decodes on the device of the model it copies, the learner scores and updates the
batch on it, and the discrepancy measures reduce there. What stays on the host: rewards and user code, the rollout
batch between the engine and the learner (rewards and the screens read it), and the dual's state (float64,
checkpointed with the run).
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from dcmdp.errors import require

DEVICE_SETTINGS = ("auto", "cpu", "cuda")
_CUDA_INDEX = re.compile(r"^cuda:(\d+)$")


def check_device_setting(setting: str) -> None:
    """Raise ConfigError for a ``device`` value that is not auto, cpu, cuda or cuda:N (no hardware is looked at)."""
    require(setting in DEVICE_SETTINGS or _CUDA_INDEX.match(str(setting)), "device",
            f"got {setting!r}, expected auto, cpu, cuda or cuda:N")


def local_rank() -> int:
    """``LOCAL_RANK`` as ``torchrun`` sets it; 0 outside it."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(setting: str, local_rank: int = 0, *, cuda_count: Optional[int] = None
                   ) -> tuple[torch.device, str]:
    """(device, why) for the ``device`` setting; ConfigError when CUDA is asked for and cannot be had.

    ``cuda_count``: the number of visible CUDA devices (default: ``torch.cuda.device_count()`` when CUDA is
    available, else 0), a parameter so the choice can be tested without a GPU.
    """
    check_device_setting(setting)
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if setting == "cpu":
        return torch.device("cpu"), "device=cpu (set in the config)"
    if setting == "auto" and cuda_count == 0:
        why = ("torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible")
        return torch.device("cpu"), f"device=auto: the CPU ({why})"
    match = _CUDA_INDEX.match(setting)
    index = int(match.group(1)) if match else local_rank
    why = ("this torch build has no CUDA (a CPU build)" if torch.version.cuda is None else
           "torch sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)")
    require(cuda_count > 0, "device", f"device={setting} but {why}; use device=auto or device=cpu to train on the "
                                      f"CPU, or install a CUDA build of torch on a GPU machine")
    require(index < cuda_count, "device",
            f"device={setting} needs CUDA device {index} (local rank {local_rank}), but {cuda_count} are visible; "
            f"launch at most {cuda_count} processes per node (torchrun --nproc_per_node {cuda_count}) or set "
            f"CUDA_VISIBLE_DEVICES")
    source = "set in the config" if setting != "auto" else "device=auto: CUDA is available"
    return torch.device("cuda", index), f"cuda:{index} ({source}; {cuda_count} visible, local rank {local_rank})"


def default_backend(device: torch.device) -> str:
    """The process-group backend for ``dist.backend: auto``: nccl for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_backend(backend: str, device: torch.device) -> None:
    """Raise ConfigError for a backend that cannot reduce tensors living on ``device``."""
    require(backend != "nccl" or device.type == "cuda", "dist.backend",
            f"nccl reduces CUDA tensors and this run trains on {device}; use dist.backend=auto (gloo on the CPU) or a "
            f"GPU (device=cuda)")


def activate(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (kernels and NCCL communicators then default to it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
