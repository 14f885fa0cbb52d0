"""How many CPU threads a run uses: ``threads: auto`` counts the cores free now, not the cores present.

On a machine shared with other jobs, torch's intra-op pool splits every operation across its threads and each
parallel region waits for its slowest thread: a thread the scheduler parked behind another job stalls the whole
step (on 2 cores with one other busy job a tiny-model RL step ran ~28x slower with 2 threads than with 1; on a quiet
machine both ran alike). ``auto`` therefore takes

    threads = max(1, cores - round(load_1min)),

cores = the CPUs this process may run on (``os.sched_getaffinity``), load_1min = the 1-minute load average (the
runnable jobs of the whole machine, taken before this run starts working). A busy machine also gets OpenMP's passive
wait policy (``OMP_WAIT_POLICY=PASSIVE``: threads idle between parallel regions sleep instead of spinning on the
cores other jobs need); the OpenMP runtime reads it once, when torch loads it, so the command sets it before torch is
imported, and only where the user has not set it.

A fixed count keeps runs comparable: CPU sums split across threads round differently, so a CPU cold start (its
cache key holds the thread count) and the run depend on the count, not only on the seed.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Union

# The 1-minute load average above which the machine counts as busy (another job holds at least half a core).
BUSY_LOAD = 0.5


def free_cores(cores: int, load: float) -> int:
    """max(1, cores - round(load)): the cores not taken by the runnable jobs the load average counts."""
    return max(1, cores - int(round(max(load, 0.0))))


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or ``taskset``'s share, not the machine's
    count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine() -> tuple[int, Optional[float]]:
    """(cores this process may use, 1-minute load average or None where the platform has none)."""
    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return cores, load


def choose_threads(setting: Union[int, str], cores: int, load: Optional[float], ranks: int = 1) -> tuple[int, str]:
    """(threads, why) for the config's ``threads``: an int as given, ``auto`` from the free cores, shared by the
    ``ranks`` processes of this machine (torchrun's LOCAL_WORLD_SIZE)."""
    if setting != "auto":
        return int(setting), f"threads={setting} (fixed in the config)"
    share = f", shared by {ranks} processes" if ranks > 1 else ""
    if load is None:
        n = max(1, cores // ranks)
        return n, f"threads=auto: {n} ({cores} cores available{share}; no load average on this platform)"
    free = free_cores(cores, load)
    n = max(1, free // ranks)
    return n, (f"threads=auto: {n} = {cores} cores available - {load:.2f} 1-minute load average (rounded), at least "
               f"1{share}" + ("" if free == cores else
                              "; other jobs hold the rest: a fixed count (threads=N) makes runs comparable"))


def passive_wait_policy(load: Optional[float], env: Optional[dict] = None) -> Optional[str]:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``env`` (default os.environ) when the machine is busy, torch is not loaded
    yet and the user has not chosen a policy; returns what was done (for the log), None when nothing applies."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env:
        return None
    if load is None or load < BUSY_LOAD:
        return None
    if "torch" in sys.modules:  # the OpenMP runtime has read its environment already
        return (f"1-minute load average {load:.2f}: OMP_WAIT_POLICY=PASSIVE would help but torch is already loaded; "
                f"set it in the environment")
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return (f"1-minute load average {load:.2f} (another job is running): OMP_WAIT_POLICY=PASSIVE, idle OpenMP threads "
            f"sleep instead of spinning")


def apply_threads(setting: Union[int, str]) -> str:
    """Set torch's intra-op threads from the config's ``threads``; returns the line that says what and why."""
    import torch

    n, why = choose_threads(setting, *machine(), ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(n)
    return why
