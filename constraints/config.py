"""Config of one discrepancy constraint: a measure, its tolerance c and its multiplier settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ConstraintConfig:
    # Discrepancy measure (see constraints.measures.MEASURES), e.g. abs_prob_diff, kl_k3, routing_mismatch.
    measure: str = "abs_prob_diff"
    # Tolerance c: the tolerance region is D <= c.
    tolerance: float = 0.005
    # Initial multiplier lambda_0.
    lambda_init: float = 0.1
    # Lower end of the projection interval of lambda.
    lambda_min: float = 0.0
    # Upper end of the projection interval of lambda.
    lambda_max: float = 10.0
    # Dual step size eta (projected rule) / integral gain K_I (pid rule).
    lr: float = 1.0
    # Threshold tau of extreme_rate (share of tokens with max(rho, 1/rho) > tau).
    tau: float = 2.0
    # Tail constraint: D is the q-quantile of the per-token measure over the batch's valid tokens instead of its
    # mean (D <= c: at most a share 1 - q of the tokens outside the tolerance region, the tokens the hinge penalty
    # acts on); null: the mean. Needs a measure with a per-token form.
    quantile: Optional[float] = None
    # Automatic tolerance: slack s of c_k = F_k (1 + s), F_k an EMA of this measure between pi_old and mu before
    # the updates (identical weights: the numerical floor), re-measured every step; null keeps `tolerance` fixed
    # (which then also serves as c until the first measurement).
    floor_slack: Optional[float] = None
    # EMA factor of the floor F_k behind the automatic tolerance (F_k = a F_{k-1} + (1 - a) D_floor_k).
    floor_ema: float = 0.9
    # Measure the floor on the first floor_steps batches only, then hold it (null: re-measured every batch). A
    # floor that keeps following the measurement rises with it when the policy drifts to where the deployment
    # deviates most, and so does c; a held floor keeps c where the run started.
    floor_steps: Optional[int] = None
    # The tolerance follows the floor down and never back up: c_k = (1 + s) x the lowest F so far (F the EMA above,
    # then never held). A measure that falls as the policy sharpens (the drift of the updates) leaves a held c slack;
    # a ratcheted c stays (1 + s) above the lowest level the run has reached, so a later rise of D-hat meets the
    # constraint. The minimum starts once F spans its window, 1 / (1 - floor_ema) batches; with floor_steps K, F
    # restarts at batch K + 1 and the minimum starts K batches later still (c = (1 + s) F before): an EMA that still
    # carries a learning-rate warm-up's near-zero drift would hold c there for the whole run.
    floor_ratchet: bool = False

    def check(self, prefix: str = "constraint") -> None:
        if not self.tolerance >= 0:
            raise ValueError(f"config error at '{prefix}.tolerance': must be >= 0, got {self.tolerance}")
        if not 0 <= self.lambda_min <= self.lambda_max:
            raise ValueError(f"config error at '{prefix}.lambda_min/lambda_max': need 0 <= lambda_min <= "
                             f"lambda_max, got [{self.lambda_min}, {self.lambda_max}]")
        if not self.lambda_min <= self.lambda_init <= self.lambda_max:
            raise ValueError(f"config error at '{prefix}.lambda_init': {self.lambda_init} is outside "
                             f"[{self.lambda_min}, {self.lambda_max}]")
        if not self.lr >= 0:
            raise ValueError(f"config error at '{prefix}.lr': must be >= 0, got {self.lr}")
        if not self.tau > 1:
            raise ValueError(f"config error at '{prefix}.tau': must be > 1, got {self.tau}")
        if self.quantile is not None and not 0 < self.quantile < 1:
            raise ValueError(f"config error at '{prefix}.quantile': must be in (0, 1) or null, got {self.quantile}")
        if self.floor_slack is not None and not 0 <= self.floor_slack < float("inf"):
            raise ValueError(f"config error at '{prefix}.floor_slack': must be a finite value >= 0 or null, "
                             f"got {self.floor_slack}")
        if not 0 <= self.floor_ema < 1:
            raise ValueError(f"config error at '{prefix}.floor_ema': must be in [0, 1), got {self.floor_ema}")
        if self.floor_steps is not None:
            if self.floor_slack is None:
                raise ValueError(f"config error at '{prefix}.floor_steps': holds the floor of an automatic tolerance; "
                                 f"set '{prefix}.floor_slack' too, or floor_steps: null")
            if not self.floor_steps >= 1:
                raise ValueError(f"config error at '{prefix}.floor_steps': must be >= 1 or null, got {self.floor_steps}")
        if self.floor_ratchet:
            if self.floor_slack is None:
                raise ValueError(f"config error at '{prefix}.floor_ratchet': ratchets the floor of an automatic "
                                 f"tolerance; set '{prefix}.floor_slack' too, or floor_ratchet: false")
