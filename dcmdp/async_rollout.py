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

The bound as the dual's second action (``max_staleness: auto``, docs/design.md §"The staleness bound"). The controller
(``dcmdp.dual.staleness_step``) sets the bound b_v with every weights version v it publishes, from the dual's
D-hat of the batch just trained; the worker samples batch k with the first version whose bound reaches it,

    v(k) = min{v >= k0 : v + b_v >= k},

so the bound is enforced where the weights are published (a constant bound s gives v(k) = max(k0, k - s), the
fixed lag above, batch for batch). The bound can fall after a batch was sampled: the trainer holds batch k to the
bound b_k in force at step k, and a batch staler than that (k - v(k) > b_k) gets ``async_rollout.too_stale``:
``wait`` (the trainer blocks while the engine samples batch k again, same prompts and seed, with the trainer's
current weights: staleness 0) or ``drop`` (every sample is screened out; the step makes no update, lambda and nu
stay, counted in ``async/dropped_batches``; not a bad step for the guard). Both are functions of the run's
config and seed, so an auto run repeats and resumes bitwise like a fixed one.

Forced staleness (``async_rollout.forced``, a testbed knob for varying staleness): batch k is sampled with the
weights of version max(k0, k - s_k), s_k from a schedule of phases or drawn per batch from a seeded heavy-tailed
law on 0..max_staleness (``staleness_pmf``; the draw of step k depends on (seed, k) only). Versions are then not
monotone in k: the worker keeps the snapshot of every version a later batch still needs.

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
is AReaL's decoupled PPO (arXiv 2505.24298; docs/design.md §"Sources") with pi_prox = pi_old:
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

import numpy as np
import torch
from torch import Tensor

from dcmdp.async_config import AsyncRolloutConfig  # noqa: F401 (re-exported; the config module imports no torch)
from trainers.batch import Rollout
from trainers.engines import RolloutEngine

# Stream of np.random.SeedSequence([seed, step, stream]) behind the forced staleness draw of a step (the loop's
# streams 0-2 are prompts, sampling and mini-batch order).
_DRAW_STREAM = 4


def behaviour_version(step: int, start: int, max_staleness: int) -> int:
    """v(k) = max(k0, k - max_staleness): the weights version that samples the batch of ``step``."""
    return max(start, step - max_staleness)


def bounded_version(step: int, bounds: dict[int, int]) -> Optional[int]:
    """v(k) = min{v : v + b_v >= k} over the published versions v and their bounds b_v (``bounds``, from the
    worker's start k0 on); None while no published bound reaches ``step``."""
    for v in sorted(bounds):
        if v + bounds[v] >= step:
            return v
    return None


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


def staleness_histogram(version_B: Tensor, step: int, cap: int) -> dict[str, float]:
    """async/staleness_count/<s>: samples of the batch at staleness s = step - version, for s = 0..cap (zeros
    included, so every chart has a point at every step)."""
    counts = torch.bincount((step - version_B.long()).clamp(0, cap), minlength=cap + 1)
    return {f"async/staleness_count/{s}": float(n) for s, n in enumerate(counts.tolist())}


def staleness_pmf(cfg: AsyncRolloutConfig) -> list[float]:
    """P(s), s = 0..S (S = max_staleness), of the forced staleness draw, in closed form:

    power_law: P(s) = (s + 1)^-a / sum_{j=0}^{S} (j + 1)^-a           (a = power_law.exponent; a discrete Zipf law)
    geometric: P(s) = p (1 - p)^s / (1 - (1 - p)^(S + 1))             (p = geometric.p; truncated at S)
    """
    cap = int(cfg.max_staleness)
    s = np.arange(cap + 1, dtype=np.float64)
    if cfg.forced == "power_law":
        w = (s + 1.0) ** -float(cfg.power_law.exponent)
    elif cfg.forced == "geometric":
        p = float(cfg.geometric.p)
        w = p * (1.0 - p) ** s
    else:
        raise ValueError(f"async_rollout.forced={cfg.forced!r} draws no staleness")
    return (w / w.sum()).tolist()


def draw_staleness(pmf: list[float], seed: int, step: int) -> int:
    """The staleness of the batch of ``step``: inverse CDF of ``pmf`` at one uniform from (seed, step) alone, so
    any thread, run or resume draws the same value."""
    u = np.random.default_rng(np.random.SeedSequence([seed, step, _DRAW_STREAM])).random()
    cdf = np.cumsum(np.asarray(pmf, dtype=np.float64))
    return int(min(np.searchsorted(cdf, u, side="right"), len(pmf) - 1))


def scheduled_staleness(cfg: AsyncRolloutConfig, step: int) -> int:
    """The staleness the phase covering ``step`` (0-based) forces: the first phase with step < until_step."""
    for phase in cfg.schedule:
        if phase.until_step is None or step < phase.until_step:
            return int(phase.staleness)
    raise ValueError(f"async_rollout.schedule covers no phase for step {step}")


def staleness_plan(cfg: AsyncRolloutConfig, seed: int) -> Optional[Callable[[int], int]]:
    """step -> the staleness s_k of the fixed lag (v(k) = max(k0, k - s_k)): the constant max_staleness, the
    forced schedule or draw; None under max_staleness: auto (the published bounds decide, ``bounded_version``)."""
    if cfg.is_auto:
        return None
    if cfg.forced == "schedule":
        return lambda step: scheduled_staleness(cfg, step)
    if cfg.forced in ("power_law", "geometric"):
        pmf = staleness_pmf(cfg)
        return lambda step: draw_staleness(pmf, seed, step)
    fixed = int(cfg.max_staleness)
    return lambda step: fixed


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
        """time/rollout_generate, time/rollout_weights_wait, time/rollout_idle_frac (the share of the worker's time
        on this batch spent waiting for weights) and throughput/rollout_tokens_per_s (response tokens per second of
        generation)."""
        busy = self.generate_s + self.weights_wait_s
        tokens = float(self.rollout.response_mask_BT.sum())
        return {"time/rollout_generate": self.generate_s, "time/rollout_weights_wait": self.weights_wait_s,
                "time/rollout_idle_frac": self.weights_wait_s / busy if busy > 0 else 0.0,
                "throughput/rollout_tokens_per_s": tokens / max(self.generate_s, 1e-9)}


def snapshot(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A detached copy of a state dict that later optimiser steps cannot change."""
    return {k: v.detach().clone() for k, v in state_dict.items()}


class RolloutWorker:
    """Drives the rollout engine from a worker thread on the schedule of the module docstring.

    ``make_batch(step) -> (examples, rollout)`` samples the batch of ``step`` with the engine (prompts and
    seed derived from (seed, step)); ``stop`` is the first step not to sample. The engine must hold the
    weights of version ``start`` (the trainer's, given as ``state_dict``) when the worker is built. The schedule is
    either ``staleness_of`` (step -> s_k, v(k) = max(k0, k - s_k), s_k <= ``cap``: a fixed or forced lag) or, with
    ``bound`` (the bound of version ``start``), the bounds published with the versions (``bounded_version``).
    """

    # Seconds between checks that the worker thread is still alive while the trainer waits.
    _POLL_S = 1.0

    def __init__(self, engine: RolloutEngine, make_batch: Callable[[int], tuple[list, Rollout]], *, start: int,
                 stop: int, cap: int, threads: int, state_dict: dict[str, Tensor],
                 staleness_of: Optional[Callable[[int], int]] = None, bound: Optional[int] = None):
        if engine.version != start:
            raise ValueError(f"the rollout engine holds version {engine.version}, the worker starts at {start}")
        if (staleness_of is None) == (bound is None):
            raise ValueError("the rollout worker needs exactly one of staleness_of (a lag per step) and bound "
                             "(published bounds)")
        self.engine = engine
        self.make_batch = make_batch
        self.stop = stop
        self.cap = cap
        self.threads = threads
        self.staleness_of = staleness_of
        self._cond = threading.Condition()
        # Held while the engine loads weights or samples (worker batches, evaluation, resampling).
        self._engine_lock = threading.Lock()
        self._start = start
        self._next = start
        # Version of the trainer's weights: the last one published.
        self._trainer_version = start
        # Snapshots of the versions some batch left still needs (the start's too: a forced lag may go back to it).
        self._published: dict[int, dict[str, Tensor]] = {start: snapshot(state_dict)}
        # Bound b_v published with each version v >= start (bound schedule only).
        self._bounds: dict[int, int] = {} if bound is None else {start: int(bound)}
        self._ready: dict[int, RolloutBatch] = {}
        # (version, snapshot) of the weights in the engine, to put them back after an evaluation.
        self._loaded = (start, self._published[start])
        self._error: Optional[BaseException] = None
        self._error_step: Optional[int] = None
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # -------------------------------------------------------------------------------------------- schedule

    def version_for(self, step: int) -> Optional[int]:
        """v(k) of the batch of ``step``; None while the published bounds do not reach it yet."""
        if self.staleness_of is not None:
            return max(self._start, step - int(self.staleness_of(step)))
        return bounded_version(step, self._bounds)

    def _needed(self, version: int, from_step: int) -> bool:
        """Whether a batch of a step >= ``from_step`` (and < stop) is sampled with ``version``."""
        if self.staleness_of is None:
            # versions only grow with k here, and a version published with bound b samples up to version + b
            return self._bounds.get(version, -1) + version >= from_step and from_step < self.stop
        last = min(version + self.cap, self.stop - 1)
        return any(self.version_for(k) == version for k in range(max(version, from_step), last + 1))

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

    def take(self, step: int, bound: int, too_stale: str, state_dict: dict[str, Tensor], fresh: bool = False
             ) -> tuple[RolloutBatch, Tensor, dict[str, float]]:
        """The batch of ``step`` held to the bound in force ``bound``, with its keep mask and async/ metrics.

        A batch staler than ``bound`` is sampled again with the trainer's current weights ``state_dict``
        (``too_stale`` = wait) or has every sample screened out (drop). ``fresh``: any stale batch is sampled again
        (a floor to measure, ``dual.floor_by``). Metrics: async/bound, async/too_stale, async/resampled,
        async/resampled_fresh (sampled again for ``fresh``), async/dropped_batches, the staleness screen
        (``screen_stale``) and histogram (``staleness_histogram``), and the batch's timings."""
        batch = self.get(step)
        too_old = step - batch.version > bound
        for_fresh = fresh and batch.version != self._trainer_version
        resampled = (too_old and too_stale == "wait") or for_fresh
        if resampled:
            batch = self.resample(step, state_dict)
        fresh_B, metrics = screen_stale(batch.rollout.version_B, step, bound)
        return batch, fresh_B, {**metrics, **staleness_histogram(batch.rollout.version_B, step, self.cap),
                                **batch.timings(), "async/bound": float(bound), "async/too_stale": float(too_old),
                                "async/resampled": float(resampled), "async/resampled_fresh": float(for_fresh),
                                "async/dropped_batches": float(too_old and not resampled)}

    def resample(self, step: int, state_dict: dict[str, Tensor]) -> RolloutBatch:
        """The batch of ``step`` sampled (same prompts and seed) with the trainer's current weights, between two
        worker batches."""
        t0 = time.perf_counter()
        with self._engine_lock:
            t1 = time.perf_counter()
            examples, rollout = self._with_trainer_weights(lambda: self.make_batch(step), state_dict)
        return RolloutBatch(step, examples, rollout, self._trainer_version, time.perf_counter() - t1, t1 - t0)

    def publish(self, state_dict: dict[str, Tensor], version: int, bound: Optional[int] = None) -> None:
        """Make the trainer's weights of ``version`` (and, on the bound schedule, the bound ``bound`` they sample
        under) available to the worker; a snapshot is taken only if some batch left is sampled with them."""
        self._trainer_version = version
        with self._cond:
            if self.staleness_of is None:
                if bound is None:
                    raise ValueError(f"publishing version {version}: the bound schedule needs its bound")
                self._bounds[version] = int(bound)
                # only a version that reaches past every earlier one samples a batch
                needed = version + bound > max((v + b for v, b in self._bounds.items() if v < version), default=-1) \
                    and self._needed(version, self._next)
            else:
                needed = self._needed(version, self._next)
            if needed:
                self._published[version] = snapshot(state_dict)
            self._cond.notify_all()

    def evaluate(self, fn: Callable[[], Any], state_dict: dict[str, Tensor]) -> Any:
        """Run ``fn`` (which samples with the engine) on the trainer's current weights, between two batches."""
        with self._engine_lock:
            return self._with_trainer_weights(fn, state_dict)

    def _with_trainer_weights(self, fn: Callable[[], Any], state_dict: dict[str, Tensor]) -> Any:
        version = self._trainer_version
        own_version, own_weights = self._loaded
        if own_version != version:
            self.engine.load_weights(state_dict, version=version)
        try:
            return fn()
        finally:
            if own_version != version:
                self.engine.load_weights(own_weights, version=own_version)

    def drain(self, state_dict: dict[str, Tensor], version: int, bound: Optional[int] = None) -> None:
        """Stop the worker after its batch in flight and restart the schedule at ``version`` (a checkpoint).

        The engine gets the trainer's weights of ``version``; sampled batches that the restarted schedule
        would sample with other weights are dropped. The next ``get`` starts the worker again. On the bound
        schedule ``bound`` is the bound of ``version``.
        """
        self._halt()
        self._raise_if_failed()
        self._start = version
        if self.staleness_of is None:
            if bound is None:
                raise ValueError(f"draining at version {version}: the bound schedule needs its bound")
            self._bounds = {version: int(bound)}
        self._ready = {k: b for k, b in self._ready.items() if b.version == self.version_for(k)}
        snap = snapshot(state_dict)
        self._published = {version: snap}
        if self.engine.version != version:
            self.engine.load_weights(snap, version=version)
        self._loaded = (version, snap)
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

    def _available(self, need: Optional[int]) -> bool:
        return need is not None and (need == self._loaded[0] or need in self._published)

    def _run(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        step = self._next
        try:
            while step < self.stop:
                t0 = time.perf_counter()
                with self._cond:
                    while not self._stopping and not self._available(need := self.version_for(step)):
                        self._cond.wait()
                    if self._stopping:
                        return
                    weights = None if need == self._loaded[0] else self._published[need]
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
                    for old in [v for v in self._published if not self._needed(v, step)]:
                        del self._published[old]
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the trainer thread, which re-raises it
            with self._cond:
                self._error, self._error_step = exc, step
                self._cond.notify_all()
