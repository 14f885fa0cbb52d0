"""Config of the asynchronous rollout worker (``dcmdp.async_rollout``): the staleness bound and its modes.

Kept apart from ``dcmdp.config`` (which re-exports ``AsyncRolloutConfig``) and free of torch: reading a config
imports no torch. No ``from __future__ import annotations`` here: the config's key check reads the element type
of ``schedule`` from the field's real type.
"""

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from trainers.errors import config_error, require

# What a batch staler than the bound in force gets (the bound of ``max_staleness: auto`` fell since it was sampled).
TOO_STALE = ("wait", "drop")
# Staleness forced per batch (a testbed knob): off (the schedule of the bound) | schedule | power_law | geometric.
FORCED = ("off", "schedule", "power_law", "geometric")


@dataclass
class StalenessAutoConfig:
    """The staleness controller of ``max_staleness: auto`` (``dcmdp.dual.staleness_step``)."""

    # Smallest bound the controller sets (at nu = nu_max).
    min: int = 0
    # Largest bound the controller sets (at nu = 0).
    max: int = 4
    # Step size eta_s of the ascent on nu, in units of the tolerance: nu <- nu + eta_s (D_hat - c_s) / c_s.
    lr: float = 0.2
    # Upper end nu_max of nu's projection interval [0, nu_max].
    nu_max: float = 1.0
    # Initial nu (null: nu_max, so the run starts at the bound min and earns asynchrony while D-hat stays inside c_s).
    nu_init: Optional[float] = None
    # Index into dual.constraints of the constraint whose D-hat the staleness constraint bounds.
    constraint: int = 0
    # Tolerance c_s of D_hat_stale <= c_s (null: that constraint's tolerance in force, the penalty's c).
    tolerance: Optional[float] = None

    def check(self, prefix: str) -> None:
        require(self.min >= 0, f"{prefix}.min", f"must be >= 0, got {self.min}")
        require(self.max >= self.min, prefix, f"the range needs min <= max, got min={self.min} max={self.max}")
        require(self.lr > 0 and math.isfinite(self.lr), f"{prefix}.lr", f"must be > 0, got {self.lr}")
        require(self.nu_max > 0 and math.isfinite(self.nu_max), f"{prefix}.nu_max", f"must be > 0, got {self.nu_max}")
        require(self.nu_init is None or 0 <= self.nu_init <= self.nu_max, f"{prefix}.nu_init",
                f"must be in [0, nu_max={self.nu_max}], got {self.nu_init}")
        require(self.constraint >= 0, f"{prefix}.constraint", f"must be >= 0, got {self.constraint}")
        require(self.tolerance is None or self.tolerance > 0, f"{prefix}.tolerance",
                f"must be > 0, got {self.tolerance}")


@dataclass
class StalenessPhase:
    """One phase of a forced staleness schedule."""

    # The phase covers the batches of steps < until_step (0-based; null: every later step, the last phase only).
    until_step: Optional[int] = None
    # Staleness forced on the batches of this phase (<= async_rollout.max_staleness).
    staleness: int = 0


@dataclass
class PowerLawConfig:
    """Forced staleness drawn per batch with P(s) proportional to (s + 1)^-exponent, s = 0..max_staleness."""

    # Exponent alpha of the power law (larger: lighter tail).
    exponent: float = 1.5


@dataclass
class GeometricConfig:
    """Forced staleness drawn per batch with P(s) proportional to p (1 - p)^s, s = 0..max_staleness."""

    # Success probability p of the geometric law (smaller: heavier tail).
    p: float = 0.3


@dataclass
class AsyncRolloutConfig:
    """The rollout worker thread of ``dcmdp.async_rollout``."""

    # Sample rollouts in a worker thread while the trainer trains (false: in the loop, between the updates).
    enabled: bool = False
    # Staleness bound: an int s (batch k sampled with the weights of step max(k0, k - s); 0 reproduces the
    # synchronous run) | auto (the controller sets it in [auto.min, auto.max] each step from the dual's D-hat).
    max_staleness: Union[int, str] = 0
    # The staleness controller (max_staleness: auto).
    auto: StalenessAutoConfig = field(default_factory=StalenessAutoConfig)
    # A batch staler than the bound in force (auto only): wait (the trainer resamples it with its current weights)
    # | drop (the step trains on nothing; counted in async/dropped_batches).
    too_stale: str = "wait"
    # Forced staleness per batch, capped at max_staleness (a testbed knob): off | schedule | power_law | geometric.
    forced: str = "off"
    # Phases of forced: schedule, e.g. [{until_step: 50, staleness: 0}, {until_step: 150, staleness: 8}, {staleness: 2}]
    schedule: list[StalenessPhase] = field(default_factory=list)
    # The law of forced: power_law.
    power_law: PowerLawConfig = field(default_factory=PowerLawConfig)
    # The law of forced: geometric.
    geometric: GeometricConfig = field(default_factory=GeometricConfig)
    # torch intra-op threads of the rollout worker (0: the trainer's count).
    threads: int = 0

    @property
    def is_auto(self) -> bool:
        return self.max_staleness == "auto"

    def cap(self) -> int:
        """The largest staleness a batch can have: max_staleness, or auto.max."""
        return self.auto.max if self.is_auto else int(self.max_staleness)

    def check(self, prefix: str = "async_rollout") -> None:
        ms = self.max_staleness
        require(not isinstance(ms, str) or ms == "auto", f"{prefix}.max_staleness",
                f"expected an integer >= 0 or auto, got {ms!r}")
        require(self.is_auto or ms >= 0, f"{prefix}.max_staleness", f"must be >= 0, got {ms}")
        require(self.threads >= 0, f"{prefix}.threads", f"must be >= 0, got {self.threads}")
        if (self.is_auto or ms > 0 or self.forced != "off") and not self.enabled:
            what = f"max_staleness={ms}" if self.forced == "off" else f"forced={self.forced}"
            raise config_error(f"{prefix}.{what.split('=')[0]}",
                               f"{what} needs the rollout worker; set {prefix}.enabled=true")
        require(self.too_stale in TOO_STALE, f"{prefix}.too_stale", f"expected one of {', '.join(TOO_STALE)}, got "
                f"{self.too_stale!r}")
        require(self.forced in FORCED, f"{prefix}.forced", f"expected one of {', '.join(FORCED)}, got {self.forced!r}")
        self.auto.check(f"{prefix}.auto")
        require(self.forced == "off" or not self.is_auto, f"{prefix}.forced",
                f"forced={self.forced} sets the staleness of every "
                "batch; it needs an integer max_staleness (its cap), not auto")
        require(not self.schedule or self.forced == "schedule", f"{prefix}.schedule",
                f"phases are given but {prefix}.forced={self.forced}; set {prefix}.forced=schedule")
        if self.forced == "schedule":
            self._check_schedule(prefix)
        exponent = self.power_law.exponent
        require(self.forced != "power_law" or (exponent > 0 and math.isfinite(exponent)),
                f"{prefix}.power_law.exponent", f"must be > 0, got {exponent}")
        require(self.forced != "geometric" or 0 < self.geometric.p <= 1, f"{prefix}.geometric.p",
                f"must be in (0, 1], got {self.geometric.p}")

    def _check_schedule(self, prefix: str) -> None:
        require(self.schedule, f"{prefix}.schedule", "forced=schedule needs at least one phase")
        last_until = -1
        for i, phase in enumerate(self.schedule):
            key = f"{prefix}.schedule[{i}]"
            last = i == len(self.schedule) - 1
            require(not last or phase.until_step is None, f"{key}.until_step",
                    "the last phase covers every later step; leave its until_step out")
            require(last or phase.until_step is not None, f"{key}.until_step", "only the last phase may leave it out")
            if phase.until_step is not None:
                require(phase.until_step > last_until, f"{key}.until_step", "must be > the previous phase's "
                        f"({last_until}), got {phase.until_step}")
                last_until = phase.until_step
            require(0 <= phase.staleness <= int(self.max_staleness), f"{key}.staleness", "must be in [0, max_staleness="
                    f"{self.max_staleness}], got {phase.staleness}")
