"""Asynchronous rollouts: a worker thread samples the next rollout batches while the trainer trains.

Schedule. The batch of step k is sampled with the weights of version

    v(k) = max(k0, k - max_staleness)

(version v = the trainer's weights after v steps; k0 = the step the worker started at: the run's start,
the resumed step, or the last checkpoint). Its staleness k - v(k) is therefore at most
``max_staleness``, and never more: the worker waits until the trainer has published version v(k)
before it samples batch k (so nothing is ever produced too stale to use), and the trainer waits for
batch k. With ``max_staleness`` = s >= 1 the worker runs up to s batches ahead and sampling overlaps
the updates; ``max_staleness`` = 0 is the synchronous loop run through the worker (batch k waits for
version k) and reproduces the synchronous run bitwise. Samples carry the version that produced them
(``Rollout.version_B``, set by the engine); ``screen_stale`` checks it, drops samples staler than the
bound (counted in ``async/dropped``: a safety net for an engine that misreports its version, the
schedule never produces one) and reports ``async/staleness_mean`` and ``async/staleness_max``.

The lag is fixed rather than "the newest weights available" (AReaL's choice): with the newest
weights, which version a batch gets depends on thread timing and no run could be repeated or resumed
bitwise. With the fixed lag a run is a function of its config and seed alone, and the randomness of
step k (prompts, sampling seed) is derived from (seed, k) whichever thread samples it.

Weight sync. After its updates the trainer ``publish``es a snapshot (a clone of its state dict) of the
new version; the worker loads the snapshot it needs between two batches, never during a generation,
holding the engine lock while it loads and samples. Held-out evaluation in the middle of a run takes
the same lock, loads the trainer's current weights, evaluates and puts the worker's weights back.

Checkpoints. ``drain`` (called by every checkpoint) stops the worker after the batch in flight, loads
the trainer's weights into the engine (so the engine's version is the checkpointed step, as in a
synchronous run), keeps the sampled batches that a worker started at that step would sample identically
(version v(k) unchanged) and drops the others; the next ``get`` restarts the worker from the
checkpointed step. A run resumed from a checkpoint therefore repeats the uninterrupted run exactly,
since both restart the schedule there. Stopping on SIGINT/SIGTERM goes through the same checkpoint.

The decoupled objective. The rollout log-probs of a stale sample are log mu of the engine at version
v(k); ``learner.score_old`` recomputes log pi_old with the trainer's current weights (version k). That
is AReaL's decoupled PPO (arXiv 2505.24298, DESIGN.md §8) with pi_prox = pi_old:
E[(pi_prox / pi_behav) * min(u A, clip(u, 1 +- eps) A)], u = pi_theta / pi_prox. The IS weight
(``algo.is_mode``) acts on rho = pi_old / mu, the clip on u = pi_theta / pi_old. Per token

    pi_old / mu = (pi_k / pi_v) * (pi_v / mu_v)

(pi_v: the trainer's probabilities at version v): rho, and with it every discrepancy measure, the
constraint D-hat the dual controller sees and the penalty, measures staleness times training-inference
discrepancy, not the discrepancy alone. Tolerances calibrated on a synchronous run are then tighter
than they look; the multiplier rises and the penalty pulls pi_theta back toward the behaviour policy
(a trust region around mu). Separating the two factors would need the trainer's log-probs at version
v: one more forward per batch with weights the trainer no longer holds.

Threads. The torch engine runs in this process; torch releases the GIL inside its ops, so sampling
and the updates overlap as far as the cores allow. ``async_rollout.threads`` sets the worker's torch
intra-op threads (torch's setting is per thread); 0 keeps the trainer's count. On a machine with few
cores, split them (e.g. ``threads=1`` for both on 2 cores) instead of oversubscribing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from dcmdp.config import AsyncRolloutConfig  # noqa: F401 (defined with the run config, which imports no torch)
from trainers.batch import Rollout
from trainers.engines import RolloutEngine




def behaviour_version(step: int, start: int, max_staleness: int) -> int:
    """v(k) = max(k0, k - max_staleness): the weights version that samples the batch of ``step``."""
    return max(start, step - max_staleness)


def screen_stale(version_B: Optional[Tensor], step: int, max_staleness: int) -> tuple[Tensor, dict[str, float]]:
    """Keep mask of the samples at most ``max_staleness`` versions older than the trainer at ``step``.

    staleness_b = step - version_b. Returns (keep_B bool, metrics): async/staleness_mean and
    async/staleness_max over every sample of the batch, async/dropped = samples staler than the bound.
    A sample newer than the trainer cannot exist and raises.
    """
    if version_B is None:
        raise ValueError("asynchronous rollouts need the engine to tag every sample with its version (version_B)")
    staleness_B = step - version_B.long()
    if bool((staleness_B < 0).any()):
        raise ValueError(f"step {step}: samples of version {int(version_B.max())} are newer than the trainer")
    keep_B = staleness_B <= max_staleness
    return keep_B, {"async/staleness_mean": float(staleness_B.float().mean()),
                    "async/staleness_max": float(staleness_B.max()),
                    "async/dropped": float((~keep_B).sum())}


@dataclass
class RolloutBatch:
    """One sampled batch, as the worker hands it to the trainer."""

    step: int
    examples: list
    rollout: Rollout
    # Weights version that sampled it.
    version: int
    # Seconds the worker spent sampling it, and waiting beforehand for its weights version.
    generate_s: float
    weights_wait_s: float

    def timings(self) -> dict[str, float]:
        return {"time/rollout_generate": self.generate_s, "time/rollout_weights_wait": self.weights_wait_s}


def snapshot(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A detached copy of a state dict that later optimiser steps cannot change."""
    return {k: v.detach().clone() for k, v in state_dict.items()}


class RolloutWorker:
    """Drives the rollout engine from a worker thread on the fixed-lag schedule of the module docstring.

    ``make_batch(step) -> (examples, rollout)`` samples the batch of ``step`` with the engine (prompts and
    seed derived from (seed, step)); ``stop`` is the first step not to sample. The engine must hold the
    weights of version ``start`` (the trainer's, given as ``state_dict``) when the worker is built.
    """

    # Seconds between checks that the worker thread is still alive while the trainer waits.
    _POLL_S = 1.0

    def __init__(self, engine: RolloutEngine, make_batch: Callable[[int], tuple[list, Rollout]], *, start: int,
                 stop: int, max_staleness: int, threads: int, state_dict: dict[str, Tensor]):
        if engine.version != start:
            raise ValueError(f"the rollout engine holds version {engine.version}, the worker starts at {start}")
        self.engine = engine
        self.make_batch = make_batch
        self.stop = stop
        self.max_staleness = max_staleness
        self.threads = threads
        self._cond = threading.Condition()
        # Held while the engine loads weights or samples (worker batches, evaluation).
        self._engine_lock = threading.Lock()
        self._start = start
        self._next = start
        # Version of the trainer's weights: the last one published.
        self._trainer_version = start
        self._published: dict[int, dict[str, Tensor]] = {}
        self._ready: dict[int, RolloutBatch] = {}
        # (version, snapshot) of the weights in the engine, to put them back after an evaluation.
        self._loaded = (start, snapshot(state_dict))
        self._error: Optional[BaseException] = None
        self._error_step: Optional[int] = None
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------ trainer side

    def get(self, step: int) -> RolloutBatch:
        """The batch of ``step``; starts the worker if it is not running, waits until the batch is ready."""
        if self._thread is None:
            self._launch(step)
        with self._cond:
            while step not in self._ready:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout worker stopped before sampling the batch of step {step}")
                self._cond.wait(self._POLL_S)
            return self._ready.pop(step)

    def publish(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Make the trainer's weights of ``version`` available to the worker (a snapshot is taken)."""
        self._trainer_version = version
        last_needed = behaviour_version(self.stop - 1, self._start, self.max_staleness)
        if version > last_needed:
            return  # no batch left to sample is sampled with it
        snap = snapshot(state_dict)
        with self._cond:
            self._published[version] = snap
            self._cond.notify_all()

    def evaluate(self, fn: Callable[[], Any], state_dict: dict[str, Tensor]) -> Any:
        """Run ``fn`` (which samples with the engine) on the trainer's current weights, between two batches."""
        version = self._trainer_version
        with self._engine_lock:
            own_version, own_weights = self._loaded
            if own_version != version:
                self.engine.load_weights(state_dict, version=version)
            try:
                return fn()
            finally:
                if own_version != version:
                    self.engine.load_weights(own_weights, version=own_version)

    def drain(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Stop the worker after its batch in flight and restart the schedule at ``version`` (a checkpoint).

        The engine gets the trainer's weights of ``version``; sampled batches that the restarted schedule
        would sample with other weights are dropped. The next ``get`` starts the worker again.
        """
        self._halt()
        self._raise_if_failed()
        self._ready = {k: b for k, b in self._ready.items()
                       if b.version == behaviour_version(k, version, self.max_staleness)}
        self._published.clear()
        snap = snapshot(state_dict)
        if self.engine.version != version:
            self.engine.load_weights(snap, version=version)
        self._loaded = (version, snap)
        self._start = version
        self._next = version
        self._trainer_version = version
        while self._next in self._ready:
            self._next += 1

    def close(self) -> None:
        """Stop the worker thread (after the batch in flight); idempotent."""
        self._halt()

    def __enter__(self) -> "RolloutWorker":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- worker side

    def _launch(self, step: int) -> None:
        if step != self._next and step not in self._ready:
            raise ValueError(f"the rollout worker's next batch is step {self._next}, the trainer asked for {step}")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dcmdp-rollout-worker", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            exc.add_note(f"(raised in the rollout worker thread, sampling the batch of step {self._error_step})")
            raise exc

    def _run(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        step = self._next
        try:
            while step < self.stop:
                t0 = time.perf_counter()
                need = behaviour_version(step, self._start, self.max_staleness)
                with self._cond:
                    while not self._stopping and need != self._loaded[0] and need not in self._published:
                        self._cond.wait()
                    if self._stopping:
                        return
                    weights = self._published.pop(need, None)
                    for old in [v for v in self._published if v < need]:
                        del self._published[old]
                t1 = time.perf_counter()
                with self._engine_lock:
                    if weights is not None:
                        self.engine.load_weights(weights, version=need)
                        self._loaded = (need, weights)
                    examples, rollout = self.make_batch(step)
                batch = RolloutBatch(step, examples, rollout, need, time.perf_counter() - t1, t1 - t0)
                with self._cond:
                    self._ready[step] = batch
                    step += 1
                    self._next = step
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the trainer thread, which re-raises it
            with self._cond:
                self._error, self._error_step = exc, step
                self._cond.notify_all()
