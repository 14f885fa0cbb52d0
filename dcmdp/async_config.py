"""Config of the asynchronous rollout worker (``dcmdp.async_rollout``): the staleness bound and its modes.

Kept apart from ``dcmdp.config`` (which re-exports ``AsyncRolloutConfig``) and free of torch: reading a config
imports no torch. No ``from __future__ import annotations`` here: the config's key check reads the element type
of ``schedule`` from the field's real type.
"""

import math
from dataclasses import dataclass, field
from typing import Optional, Union

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
        if self.min < 0:
            raise ValueError(f"config error at '{prefix}.min': must be >= 0, got {self.min}")
        if self.max < self.min:
            raise ValueError(f"config error at '{prefix}': the range needs min <= max, got min={self.min} "
                             f"max={self.max}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"config error at '{prefix}.lr': must be > 0, got {self.lr}")
        if not (self.nu_max > 0 and math.isfinite(self.nu_max)):
            raise ValueError(f"config error at '{prefix}.nu_max': must be > 0, got {self.nu_max}")
        if self.nu_init is not None and not 0 <= self.nu_init <= self.nu_max:
            raise ValueError(f"config error at '{prefix}.nu_init': must be in [0, nu_max={self.nu_max}], "
                             f"got {self.nu_init}")
        if self.constraint < 0:
            raise ValueError(f"config error at '{prefix}.constraint': must be >= 0, got {self.constraint}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"config error at '{prefix}.tolerance': must be > 0, got {self.tolerance}")


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
        if isinstance(ms, str) and ms != "auto":
            raise ValueError(f"config error at '{prefix}.max_staleness': expected an integer >= 0 or auto, got {ms!r}")
        if not self.is_auto and ms < 0:
            raise ValueError(f"config error at '{prefix}.max_staleness': must be >= 0, got {ms}")
        if self.threads < 0:
            raise ValueError(f"config error at '{prefix}.threads': must be >= 0, got {self.threads}")
        if (self.is_auto or ms > 0 or self.forced != "off") and not self.enabled:
            what = f"max_staleness={ms}" if self.forced == "off" else f"forced={self.forced}"
            raise ValueError(f"config error at '{prefix}.{what.split('=')[0]}': {what} needs the rollout worker; set "
                             f"{prefix}.enabled=true")
        if self.too_stale not in TOO_STALE:
            raise ValueError(f"config error at '{prefix}.too_stale': expected one of {', '.join(TOO_STALE)}, got "
                             f"{self.too_stale!r}")
        if self.forced not in FORCED:
            raise ValueError(f"config error at '{prefix}.forced': expected one of {', '.join(FORCED)}, got "
                             f"{self.forced!r}")
        self.auto.check(f"{prefix}.auto")
        if self.forced != "off" and self.is_auto:
            raise ValueError(f"config error at '{prefix}.forced': forced={self.forced} sets the staleness of every "
                             f"batch; it needs an integer max_staleness (its cap), not auto")
        if self.schedule and self.forced != "schedule":
            raise ValueError(f"config error at '{prefix}.schedule': phases are given but {prefix}.forced="
                             f"{self.forced}; set {prefix}.forced=schedule")
        if self.forced == "schedule":
            self._check_schedule(prefix)
        if self.forced == "power_law" and not (self.power_law.exponent > 0 and math.isfinite(self.power_law.exponent)):
            raise ValueError(f"config error at '{prefix}.power_law.exponent': must be > 0, got "
                             f"{self.power_law.exponent}")
        if self.forced == "geometric" and not 0 < self.geometric.p <= 1:
            raise ValueError(f"config error at '{prefix}.geometric.p': must be in (0, 1], got {self.geometric.p}")

    def _check_schedule(self, prefix: str) -> None:
        if not self.schedule:
            raise ValueError(f"config error at '{prefix}.schedule': forced=schedule needs at least one phase")
        last_until = -1
        for i, phase in enumerate(self.schedule):
            key = f"{prefix}.schedule[{i}]"
            last = i == len(self.schedule) - 1
            if last and phase.until_step is not None:
                raise ValueError(f"config error at '{key}.until_step': the last phase covers every later step; "
                                 f"leave its until_step out")
            if not last and phase.until_step is None:
                raise ValueError(f"config error at '{key}.until_step': only the last phase may leave it out")
            if phase.until_step is not None:
                if phase.until_step <= last_until:
                    raise ValueError(f"config error at '{key}.until_step': must be > the previous phase's "
                                     f"({last_until}), got {phase.until_step}")
                last_until = phase.until_step
            if not 0 <= phase.staleness <= int(self.max_staleness):
                raise ValueError(f"config error at '{key}.staleness': must be in [0, max_staleness="
                                 f"{self.max_staleness}], got {phase.staleness}")
