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
    # Anchored tolerance (dcmdp.anchor): position xi in [0, 1] of c between D-hat at lambda_max (0) and D-hat without
    # the penalty (1), both measured by probing the run's own updates on the same batch from the same weights;
    # c_k = F_k + g with g = D_max + xi (D_0 - D_max) - F held from the probes and F the floor EMA, so c follows the
    # floor (a precision switch) and is re-anchored when it moves; null: off. Needs floor_slack (c before the first
    # anchoring) and dual.measure_at: updates.
    anchor: Optional[float] = None
    # The first step probed for the anchor (0-based): after the learning-rate warm-up, once AdamW's moments have
    # settled (a fresh AdamW's first steps move every weight by about lr and overstate the drift).
    anchor_start: int = 10
    # Batches probed per anchoring; the gap g is taken from their means.
    anchor_batches: int = 4
    # Re-anchor this many steps after the last anchoring (0: only when the floor moves): the drift of the updates
    # changes as the policy sharpens.
    anchor_every: int = 100
    # Re-anchor when the floor F leaves [F_a / anchor_ratio, F_a x anchor_ratio], F_a the floor at the last anchoring.
    anchor_ratio: float = 1.5
    # Authority (an anchored c under a rule that moves lambda): the dual acts on this constraint only where its penalty
    # can move D-hat across c. Each anchor window compares the penalty's reach (median log D_0 - log D_max of its probed
    # batches) with the batch spread (sd of log D-hat over the anchor's recent steps); while the reach is under
    # authority x the spread, lambda is held at 0 (the dual stands down and the run says so), and it starts from
    # lambda_init at the first window that shows the reach. Before the first window closes lambda is 0. null: the
    # dual acts from lambda_init whatever the reach.
    authority: Optional[float] = None
    # Chance rule (dual.rule: chance): the share alpha of steps allowed outside c; lambda moves by
    # eta (1[D_hat > c] - alpha), so an interior lambda holds D-hat inside c on 1 - alpha of the steps.
    miss_rate: float = 0.2

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
        if not 0 < self.miss_rate < 1:
            raise ValueError(f"config error at '{prefix}.miss_rate': must be in (0, 1), got {self.miss_rate}")
        if self.anchor is not None:
            if not 0 <= self.anchor <= 1:
                raise ValueError(f"config error at '{prefix}.anchor': a position between D-hat at lambda_max (0) and "
                                 f"without the penalty (1), got {self.anchor}; or null")
            if self.floor_slack is None:
                raise ValueError(f"config error at '{prefix}.anchor': anchors c to the floor of an automatic tolerance "
                                 f"(c = F + g); set '{prefix}.floor_slack' too (c before the first anchoring)")
            if self.floor_steps is not None or self.floor_ratchet:
                raise ValueError(f"config error at '{prefix}.anchor': the anchored c follows the floor as it moves; "
                                 f"set floor_steps: null and floor_ratchet: false")
            if not (self.anchor_start >= 0 and self.anchor_batches >= 1 and self.anchor_every >= 0):
                raise ValueError(f"config error at '{prefix}.anchor_start/anchor_batches/anchor_every': need "
                                 f"anchor_start >= 0, anchor_batches >= 1, anchor_every >= 0, got {self.anchor_start}, "
                                 f"{self.anchor_batches}, {self.anchor_every}")
            if 0 < self.anchor_every <= self.anchor_batches:
                raise ValueError(f"config error at '{prefix}.anchor_every': must exceed anchor_batches "
                                 f"({self.anchor_batches}) or be 0, got {self.anchor_every}")
            if self.authority is not None and not 0 < self.authority < float("inf"):
                raise ValueError(f"config error at '{prefix}.authority': the least reach / spread at which the dual "
                                 f"acts, a finite value > 0, got {self.authority}; or null")
            if not self.anchor_ratio > 1:
                raise ValueError(f"config error at '{prefix}.anchor_ratio': must be > 1, got {self.anchor_ratio}")
        elif self.authority is not None:
            raise ValueError(f"config error at '{prefix}.authority': compares the penalty's reach, which the anchor's "
                             f"probes measure; set '{prefix}.anchor' too, or authority: null")
        if self.floor_ratchet:
            if self.floor_slack is None:
                raise ValueError(f"config error at '{prefix}.floor_ratchet': ratchets the floor of an automatic "
                                 f"tolerance; set '{prefix}.floor_slack' too, or floor_ratchet: false")
