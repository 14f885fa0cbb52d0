"""Mismatch stress testbed: a dose-response of every method to the training-inference discrepancy.

Where the stability matrix (``benchmarks/stability.py``: 3-token answers, a 2-layer MoE, int8 rollouts)
found every method level, this benchmark builds the regime in which the mismatch matters (DESIGN.md §9):
long responses (``task: long_addition``, 24-96 tokens written digit by digit with carries, so the
sequence ratio prod_t rho_t compounds), a larger MoE with sharper routing (``small-moe``: 4 layers,
16 experts, top-2, where near-tied routers flip under another precision), and a ladder of rollout
deployments (the x axis, ``LEVELS``): fp32 (no mismatch, the control), bf16, fp8 (W8A8 e4m3), int8 and
int4 weight-only, and, past what quantisation reaches, seeded Gaussian noise on the rollout logits
(``rollout.logit_noise``, a documented stress knob reported as the kl_k3 it produces). None of those separated
the methods; the harshest level is int4 rollouts from weights up to 4 policy versions old (``int4_async4``),
where the uncorrected method falls behind (``benchmarks/results/stress_full.md``).

Every run is ``configs/stress.yaml`` + the level's overrides + the method's + ``algo.minibatches=N seed=S``,
from one shared cold start (``cold_start.seed: 0`` in the base config): the seeds differ in RL sampling only.
Every method carries the same ``abs_prob_diff`` constraint, so the same measurement is logged for all; only the
methods with the dual on let lambda act.

Methods (``METHODS``): ``grpo_no_is`` (MiniRL's loss and clip mask without the IS weight), ``tis`` (PPO clip
with token TIS, C = 5), ``icepop`` (PPO clip, rho kept only inside [0.5, 5]), ``seq_mis`` (PPO clip with a
geometric-mean sequence mask), ``minirl`` (Zheng et al. Eq. 7), ``minirl_r3`` (+ R3 routing replay),
``fixed_penalty`` (MiniRL + R3 + the hinge penalty with a constant lambda) and ``dcmdp_r3`` (MiniRL + R3 + the
hinge penalty with lambda from the dual; ONE config for every level, see ``DCMDP``).

Collapse (fixed before the runs): any non-finite update; or the final held-out accuracy of the deployed
policy (the rollout engine's, at the level's precision) below half of the run's peak held-out accuracy
(step 0 included); or the mean reward accuracy over the last W = max(5, steps / 20) steps below half of the
best W-step running mean after the LR warm-up.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stress.py --profile quick --workers 2

runs the missing cells (finished cells are skipped, a killed run resumes from its checkpoint), prints a table
last and writes ``benchmarks/results/stress_<profile>`` (.md, .json, .csv, plots). ``--profile smoke`` is a
seconds-long plumbing check (CI). A hand-written ``stress_<profile>_reading.md``, when present, is appended.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import stability  # noqa: E402  (the run machinery: worker processes, cell folders, collapse rule)
from benchmarks._reading import reading_lines  # noqa: E402

BASE_CONFIG = ROOT / "configs" / "stress.yaml"

# Rollout deployments, mildest first. The discrepancy each produces at the shared cold start is measured by
# the benchmark (mean of the fp32-trainer-vs-rollout measures over the first steps of its runs).
LEVELS: dict[str, list[str]] = {
    "fp32": ["rollout.precision=fp32"],
    "bf16": ["rollout.precision=bf16"],
    "fp8": ["rollout.precision=fp8"],
    "int8": ["rollout.precision=int8"],
    "int4": ["rollout.precision=int4"],
    # int4 with groups of 64 inputs (a whole expert down-projection row of small-moe) and the LM head quantised
    # too: a coarser weight-dependent error, which a policy can learn to be robust to (unlike logit noise)
    "int4_g64_head": ["rollout.precision=int4", "rollout.torch.int4_group_size=64",
                      "rollout.torch.quantize_lm_head=true"],
    "noise0.5": ["rollout.precision=fp32", "rollout.logit_noise=0.5"],
    "noise1": ["rollout.precision=fp32", "rollout.logit_noise=1.0"],
    "noise2": ["rollout.precision=fp32", "rollout.logit_noise=2.0"],
    # int4 rollouts from weights up to 4 policy versions old (asynchronous rollouts on one worker thread; the
    # checkpoint every 25 steps drains the worker, so the schedule restarts there): the first setting where the
    # uncorrected method falls behind (``--profile probe_async``). Staleness is a mismatch the policy's step
    # controls (DESIGN.md §9), unlike logit noise; the automatic tolerance's floor comes from the fresh batches.
    "int4_async4": ["rollout.precision=int4", "async_rollout.enabled=true", "async_rollout.max_staleness=4",
                    "async_rollout.threads=1"],
    # ... and up to 8 versions old: twice the drift per stale batch, where the constant that trains best at
    # int4_async4 (lambda = 0.1) may no longer be the right one (``--profile async8``)
    "int4_async8": ["rollout.precision=int4", "async_rollout.enabled=true", "async_rollout.max_staleness=8",
                    "async_rollout.threads=1"],
}

# The constraint every method carries (only logged where the dual is off). The tolerance is automatic: c tracks
# the floor of abs_prob_diff (pi_old vs mu before the updates, identical weights) with 100% slack, so one
# config serves every level; the fixed tolerance below only applies until the first measurement.
CONSTRAINT = ("dual.constraints=[{measure: abs_prob_diff, tolerance: 0.005, lambda_init: 0.1, lr: 0.5, "
              "floor_slack: 1.0, floor_ema: 0.9}]")
# DCMDP, one config for every level: relative dual step (eta 0.5 per tolerance exceeded), D-hat measured on the
# log-probs the updates trained on (pi_theta vs mu: the engines' floor plus the drift of the mini-batch updates).
DCMDP = ["dual.relative=true", "dual.measure_at=updates"]
# The fixed-coefficient penalty: the same hinge and tolerance with lambda held at FIXED_LAMBDA.
FIXED_LAMBDA = 1.0

_PPO = ["algo.loss=ppo_clip", "dual.rule=off"]
_MINIRL = ["algo.loss=minirl", "algo.is_mode=tis"]
METHODS: dict[str, list[str]] = {
    "grpo_no_is": ["algo.loss=minirl", "algo.is_mode=none", "dual.rule=off"],
    "tis": _PPO + ["algo.is_mode=tis"],
    "icepop": _PPO + ["algo.is_mode=icepop"],
    "seq_mis": _PPO + ["algo.is_mode=none", "algo.seq_mask.mode=geo"],
    "minirl": _MINIRL + ["dual.rule=off"],
    "minirl_r3": _MINIRL + ["algo.routing_replay=r3", "dual.rule=off"],
    "fixed_penalty": _MINIRL + ["algo.routing_replay=r3", "dual.rule=fixed",
                                "dual.constraints[0].lambda_init=%g" % FIXED_LAMBDA],
    "dcmdp_r3": _MINIRL + ["algo.routing_replay=r3", *DCMDP],
}
# the methods the quick profile runs
KEY_METHODS = ("grpo_no_is", "tis", "minirl_r3", "dcmdp_r3")
# the methods of the benchmark proper (the full profile); the variants below only serve the probes
MAIN_METHODS = tuple(METHODS)
# variants: MiniRL + R3 without the dual-clip (a token with A < 0 and a ratio above clip_ratio_c = 3 keeps its
# gradient), and token TIS in bypass mode (log mu stands in for log pi_old: no pi_old forward)
METHODS.update({
    "minirl_r3_no_dual_clip": METHODS["minirl_r3"] + ["algo.clip_ratio_c=null"],
    "tis_bypass": METHODS["tis"] + ["algo.old_logp=rollout"],
    # DCMDP + R3 with the floor behind its automatic tolerance measured on the first 5 batches, then held
    "dcmdp_r3_held_floor": METHODS["dcmdp_r3"] + ["dual.constraints[0].floor_steps=5"],
    # the fixed penalty at a tenth of FIXED_LAMBDA (near DCMDP + R3's mean lambda at int4_async4)
    "fixed_penalty_0.1": METHODS["fixed_penalty"] + ["dual.constraints[0].lambda_init=0.1"],
    # ... and at 0.2 (above DCMDP + R3's mean lambda at int4_async8, 0.17)
    "fixed_penalty_0.2": METHODS["fixed_penalty"] + ["dual.constraints[0].lambda_init=0.2"],
    # DCMDP + R3 with lambda capped at 0.3 (its bursts reach ~1, where a constant lambda collapses every run)
    "dcmdp_r3_cap0.3": METHODS["dcmdp_r3"] + ["dual.constraints[0].lambda_max=0.3"],
    # DCMDP + R3 with a tighter automatic tolerance (c = 1.5 x the floor, where the stale batches' drift exceeds it
    # on about half the steps and the synchronous ones stay inside), lambda capped at 0.3 or at 0.1 (the constant
    # that trained best)
    "dcmdp_r3_slack0.5_cap0.3": METHODS["dcmdp_r3"] + ["dual.constraints[0].floor_slack=0.5",
                                                       "dual.constraints[0].lambda_max=0.3"],
    "dcmdp_r3_slack0.5_cap0.1": METHODS["dcmdp_r3"] + ["dual.constraints[0].floor_slack=0.5",
                                                       "dual.constraints[0].lambda_max=0.1"],
    # ... and a slow dual: a tenth of the step (eta 0.05 per tolerance exceeded), so lambda drifts from
    # lambda_0 = 0.1 over tens of steps instead of jumping with each batch
    "dcmdp_r3_slow": METHODS["dcmdp_r3"] + ["dual.constraints[0].floor_slack=0.5", "dual.constraints[0].lr=0.05",
                                            "dual.constraints[0].lambda_max=0.3"],
    # the benchmark's DCMDP + R3 with lambda kept in [0.1, 0.3]: the constant that trained best as a floor, raised
    # by the dual when D-hat exceeds c
    "dcmdp_r3_floor0.1": METHODS["dcmdp_r3"] + ["dual.constraints[0].lambda_min=0.1",
                                                "dual.constraints[0].lambda_max=0.3"],
    # the DCMDP paper's dual step: eta = 1 on the absolute violation D-hat - c with a fixed c = 0.005 and
    # lambda_0 = 0.1, so lambda drifts by ~1e-3 per step (nearly constant over a run)
    "dcmdp_r3_paper_step": METHODS["dcmdp_r3"] + ["dual.relative=false", "dual.constraints[0].floor_slack=null",
                                                  "dual.constraints[0].lr=1.0"],
    # the PID Lagrangian on the tighter tolerance: a slow integral (K_I = 0.05 per tolerance exceeded, from
    # lambda_0 = 0.1) plus a proportional term (K_P = 0.1 on the violation smoothed over ~2 steps) that answers a
    # stale batch's drift at once and lets go when it passes, lambda capped at 0.3
    "dcmdp_r3_pid": METHODS["dcmdp_r3"] + ["dual.rule=pid", "dual.pid.kp=0.1", "dual.pid.alpha_p=0.5",
                                           "dual.constraints[0].floor_slack=0.5", "dual.constraints[0].lr=0.05",
                                           "dual.constraints[0].lambda_max=0.3"],
})
# a tail constraint: D-hat is the 90th percentile of |pi_theta - mu| over the tokens instead of its mean; otherwise as
# dcmdp_r3_slack0.5_cap0.3, so its floor, and c, are the 90th percentile's too. (Measured: |pi - mu| is so
# heavy-tailed here that its p90, ~6e-4, lies in the bulk, ten times under the mean; and the p90 floor, taken on the
# fresh batches only, lags 5-20x behind as the policy sharpens, so lambda sat at 0.)
METHODS["dcmdp_r3_p90"] = METHODS["dcmdp_r3_slack0.5_cap0.3"] + ["dual.constraints[0].quantile=0.9"]
# the tail constraint at the tail: at most 5% of the tokens with |pi_theta - mu| above a fixed c = 0.005 (the
# automatic tolerance of the mean measure sits at 4-9e-3, with 4-5% of the tokens outside it), lambda capped at 0.3
METHODS["dcmdp_r3_p95"] = METHODS["dcmdp_r3"] + ["dual.constraints[0].quantile=0.95",
                                                 "dual.constraints[0].floor_slack=null",
                                                 "dual.constraints[0].lambda_max=0.3"]
# the mean penalty form: lambda pulls every token's pi_theta towards mu (d_t), not only those outside c (relu(d_t - c));
# otherwise as dcmdp_r3_slack0.5_cap0.3
METHODS["dcmdp_r3_mean_form"] = METHODS["dcmdp_r3_slack0.5_cap0.3"] + ["dual.penalty=mean"]
# two levers the design names, on dcmdp_r3_slack0.5_cap0.3: D-hat measured at the rollout (pi_old vs mu, before the
# updates: under asynchronous rollouts a stale batch's D-hat holds the drift since the weights that sampled it, a
# fresh one only the engines' floor) instead of at the updates; and the paper's other lambda_0 (0.05)
METHODS["dcmdp_r3_at_rollout"] = METHODS["dcmdp_r3_slack0.5_cap0.3"] + ["dual.measure_at=rollout"]
METHODS["dcmdp_r3_lambda0.05"] = METHODS["dcmdp_r3_slack0.5_cap0.3"] + ["dual.constraints[0].lambda_init=0.05"]
# the averaged multiplier: the dual's iterate moves as in dcmdp_r3_slack0.5_cap0.3, the penalty carries its running
# mean over the run (the dual releases the penalty late, when D-hat falls inside c, while the constant that keeps
# lambda on every step trains better; the mean keeps what the drift asked for on average, level by level)
METHODS["dcmdp_r3_avg"] = METHODS["dcmdp_r3_slack0.5_cap0.3"] + ["dual.average=true"]
# seq-MIS with its geometric band widened ten-fold, [0.99, 1.01]: the published [0.999, 1.001] masks 75-97% of the int4
# sequences of this task and collapses every int4_async8 run
METHODS["seq_mis_band0.01"] = METHODS["seq_mis"] + ["algo.seq_mask.geo.low=0.99", "algo.seq_mask.geo.high=1.01"]


@dataclass(frozen=True)
class Profile:
    # (levels, methods, minibatches, seeds) blocks: cells = the union of their products
    blocks: tuple[tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...], tuple[int, ...]], ...]
    # dotlist overrides on top of configs/stress.yaml, before the level's and the method's
    overrides: tuple[str, ...]
    about: str

    def cells(self) -> list[tuple[str, str, int, int]]:
        out: list[tuple[str, str, int, int]] = []
        for levels, methods, ns, seeds in self.blocks:
            for n in sorted(ns, reverse=True):
                for seed in seeds:
                    for level in levels:
                        for method in methods:
                            if (level, method, n, seed) not in out:
                                out.append((level, method, n, seed))
        return out

    @property
    def levels(self) -> list[str]:
        return [lv for lv in LEVELS if any(lv in b[0] for b in self.blocks)]

    @property
    def methods(self) -> list[str]:
        return [m for m in METHODS if any(m in b[1] for b in self.blocks)]

    @property
    def minibatches(self) -> list[int]:
        return sorted({n for b in self.blocks for n in b[2]})


# the harshest levels by effect, not by kl_k3: synchronous settings never separated the methods (noise up to
# sigma = 2 and int4 with groups of 64 included, see the probes' readings); staleness on int4 rollouts does
HARSHEST = ("int4_async4",)
HARSH_TWO = ("int4", "int4_async4")

# what every lever profile measures a DCMDP variant against: the learner without the dual, the constant that trains
# best and the best-scoring DCMDP config so far (their run folders are the levers profile's, copied in)
LEVER_BASELINES = ("minirl_r3", "fixed_penalty_0.1", "dcmdp_r3_slack0.5_cap0.3")


def _lever(method: str, what: str) -> Profile:
    """A profile for one DCMDP lever: ``method`` beside LEVER_BASELINES at the harshest level, N = 4, 5 seeds."""
    return Profile(blocks=((HARSHEST, (*LEVER_BASELINES, method), (4,), tuple(range(5))),), overrides=(),
                   about=f"DCMDP + R3 with {what} against the projected rule on the same tighter tolerance (slack 0.5, "
                         "lambda capped at 0.3), the fixed penalty at lambda = 0.1 and MiniRL + R3 at the harshest "
                         "level, N = 4, 5 seeds (the other methods' run folders are the levers profile's, copied in)")


# the methods of the full profile at the harshest level: the regime's two ends (no correction, token TIS), the
# learner DCMDP builds on (MiniRL + R3), and the penalty with a constant lambda against the controller
FULL_METHODS = ("grpo_no_is", "tis", "minirl_r3", "fixed_penalty", "dcmdp_r3")
# every method of the benchmark, with the constants and the one DCMDP config the stress profiles compare
HARSH_MATRIX_METHODS = ("grpo_no_is", "tis", "icepop", "seq_mis", "minirl", "minirl_r3", "fixed_penalty_0.1",
                        "fixed_penalty_0.2", "dcmdp_r3_slack0.5_cap0.3")
# the methods measured at N = 1 (int4_async8): the regime's two ends, DCMDP's learner, the constant and the tuned dual
N1_METHODS = ("grpo_no_is", "tis", "minirl_r3", "fixed_penalty_0.2", "dcmdp_r3_slack0.5_cap0.3")
PROFILES: dict[str, Profile] = {
    "smoke": Profile(
        blocks=((("fp32", "noise1"), ("grpo_no_is", "dcmdp_r3"), (2,), (0,)),),
        overrides=("steps=3", "eval_every=2", "cold_start.steps=20", "cold_start.target_accuracy=null",
                   "algo.prompts_per_step=2", "algo.samples_per_prompt=4", "task.eval_size=8",
                   "rollout.max_new_tokens=24", "optim.warmup_steps=0"),
        about="plumbing check: 2 levels x 2 methods, N = 2, 1 seed, 3 steps of 2 prompts x 4 samples, 20-step cold "
              "start"),
    "probe": Profile(
        blocks=((("noise2",), ("grpo_no_is", "tis", "minirl_r3", "dcmdp_r3"), (4,), (0,)),
                (("int4",), ("grpo_no_is", "tis"), (4,), (0,))),
        overrides=(),
        about="where does the uncorrected method break: the four key methods at the harshest level and GRPO without "
              "IS against token TIS at int4, N = 4, one seed"),
    "probe_int4": Profile(
        blocks=((("int4_g64_head",), ("grpo_no_is", "tis", "dcmdp_r3"), (4,), (0,)),),
        overrides=(),
        about="a weight-dependent error past int4 (groups of 64, the LM head quantised too): GRPO without IS, token "
              "TIS and DCMDP + R3, N = 4, one seed"),
    "probe_ppo": Profile(
        blocks=((("noise2",), ("minirl_r3", "minirl_r3_no_dual_clip", "tis", "tis_bypass"), (4,), (0,)),),
        overrides=(),
        about="the dual-clip (MiniRL + R3 with and without clip_ratio_c = 3) and bypass mode (token TIS with pi_old "
              "recomputed or taken from the rollout) at the harshest level, N = 4, one seed"),
    "probe_lr": Profile(
        blocks=((("int4_g64_head",), ("grpo_no_is", "tis"), (4,), (0,)),),
        overrides=("optim.lr=1e-3",),
        about="a ten times larger learning rate (1e-3) past int4: GRPO without IS against token TIS, N = 4, one seed"),
    "probe_lr3": Profile(
        blocks=((("int4_g64_head",), KEY_METHODS, (4,), (0,)),),
        overrides=("optim.lr=3e-4",),
        about="a three times larger learning rate (3e-4) past int4: the four key methods, N = 4, one seed"),
    "probe_floor": Profile(
        blocks=((("int4_g64_head",), ("dcmdp_r3_held_floor",), (4,), (0,)),),
        overrides=("optim.lr=3e-4",),
        about="DCMDP + R3 with its floor held after 5 batches, at lr 3e-4 past int4 (where every method broke and "
              "the floor-following tolerance kept lambda at 0), N = 4, one seed"),
    "probe_floor_lr1e-4": Profile(
        blocks=((("int4_g64_head",), ("dcmdp_r3_held_floor",), (4,), (0,)),),
        overrides=(),
        about="DCMDP + R3 with its floor held after 5 batches at the stress config's lr 1e-4 past int4 (where every "
              "method trains), N = 4, one seed"),
    "probe_async": Profile(
        blocks=((("int4",), ("grpo_no_is", "tis"), (4,), (0, 1, 2)),),
        overrides=("async_rollout.enabled=true", "async_rollout.max_staleness=4", "async_rollout.threads=1"),
        about="asynchronous rollouts up to 4 policy versions stale at int4: GRPO without IS (stale samples taken as "
              "on-policy) against token TIS (pi_old / mu corrects staleness and precision together), N = 4, 3 seeds"),
    "probe_fixed": Profile(
        blocks=((HARSH_TWO, ("fixed_penalty_0.1",), (4,), (0, 1)),),
        overrides=(),
        about="the fixed penalty with lambda = 0.1 (lambda = 1 collapsed every run) at int4 and int4_async4, N = 4, "
              "2 seeds"),
    "probe_cap": Profile(
        blocks=((HARSHEST, ("dcmdp_r3_cap0.3",), (4,), (0, 1)),),
        overrides=(),
        about="DCMDP + R3 with lambda capped at 0.3 at the harshest level, N = 4, 2 seeds"),
    "probe_levers": Profile(
        blocks=((HARSHEST, ("dcmdp_r3_cap0.3", "fixed_penalty_0.1"), (4,), (2, 3)),),
        overrides=(),
        about="seeds 2 and 3 of probe_cap and of probe_fixed's harshest level: DCMDP + R3 with lambda capped at 0.3 "
              "and the fixed penalty at lambda = 0.1, N = 4"),
    "levers": Profile(
        blocks=((HARSHEST, ("minirl_r3", "fixed_penalty_0.1", "dcmdp_r3", "dcmdp_r3_slack0.5_cap0.3",
                            "dcmdp_r3_slack0.5_cap0.1", "dcmdp_r3_slow", "dcmdp_r3_floor0.1"), (4,), (0, 1, 2, 3, 4)),),
        overrides=(),
        about="DCMDP + R3 with a tighter tolerance (slack 0.5) and lambda capped at 0.3 or 0.1, or a ten times "
              "slower dual step capped at 0.3, or lambda kept in [0.1, 0.3], against the fixed "
              "penalty at lambda = 0.1, DCMDP + R3 and MiniRL + R3 at the harshest level, N = 4, 5 seeds (the "
              "full profile's and the probes' finished run folders copied in are reused)"),
    "paper_step": Profile(
        blocks=((HARSHEST, ("minirl_r3", "fixed_penalty_0.1", "dcmdp_r3", "dcmdp_r3_paper_step"), (4,),
                 (0, 1, 2, 3, 4)),),
        overrides=(),
        about="DCMDP + R3 with the paper's dual step (eta = 1 on the absolute violation, fixed c = 0.005, lambda_0 = "
              "0.1) against the fixed penalty at lambda = 0.1, DCMDP + R3 and MiniRL + R3 at the harshest level, N = "
              "4, 5 seeds (the other methods' run folders are the levers profile's, copied in)"),
    "pid": _lever("dcmdp_r3_pid", "the PID rule (a slow integral plus a proportional term, lambda capped at 0.3)"),
    "probe_tail_p90": Profile(
        blocks=((HARSHEST, ("dcmdp_r3_p90",), (4,), (0, 1)),), overrides=(),
        about="a first tail constraint (D-hat the 90th percentile of |pi_theta - mu| over the tokens, with an "
              "automatic tolerance on that percentile) at the harshest level, N = 4, 2 seeds (stopped: lambda sat "
              "at 0)"),
    "tail": _lever("dcmdp_r3_p95", "a tail constraint (D-hat the 95th percentile of |pi_theta - mu| over the tokens, "
                   "not their mean, against a fixed c = 0.005: at most 5% of the tokens outside c)"),
    "mean_form": _lever("dcmdp_r3_mean_form", "the mean penalty form (every token pulled towards mu, not only those "
                        "outside c)"),
    "named_levers": Profile(
        blocks=((HARSHEST, (*LEVER_BASELINES, "dcmdp_r3_at_rollout", "dcmdp_r3_lambda0.05"), (4,), tuple(range(5))),),
        overrides=(),
        about="DCMDP + R3 (tighter tolerance, lambda capped at 0.3) with D-hat measured at the rollout (pi_old vs mu) "
              "instead of at the updates, or with lambda_0 = 0.05, beside MiniRL + R3, the fixed penalty at lambda = "
              "0.1 and the same DCMDP config at the harshest level, N = 4, 5 seeds (the other methods' run folders "
              "are the seeds10 profile's, copied in)"),
    "seeds10": Profile(
        blocks=((HARSHEST, LEVER_BASELINES, (4,), tuple(range(10))),),
        overrides=(),
        about="ten seeds of the three methods the five-seed profiles rank closest: MiniRL + R3, the fixed penalty at "
              "lambda = 0.1 and the best-scoring DCMDP config (tighter tolerance, lambda capped at 0.3) at the "
              "harshest level, N = 4 (seeds 0-4 are the levers profile's run folders, copied in)"),
    "async8": Profile(
        blocks=((("int4_async8",), (*LEVER_BASELINES, "fixed_penalty_0.2"), (4,), tuple(range(5))),),
        overrides=(),
        about="the three methods of seeds10 at int4 rollouts up to 8 policy versions old (twice the harshest "
              "level's staleness), N = 4, 5 seeds: is the constant chosen at int4_async4 (lambda = 0.1) still the "
              "right one when the drift doubles? And the constant at lambda = 0.2, near the dual's mean lambda "
              "there (run after the first three)"),
    "async8_methods": Profile(
        blocks=((("int4_async8",), ("grpo_no_is", "tis"), (4,), tuple(range(5))),
                (("int4_async8",), ("icepop", "seq_mis"), (4,), tuple(range(5))),
                (("int4_async8",), ("minirl",), (4,), tuple(range(5))),
                (("int4_async8",), (*LEVER_BASELINES, "fixed_penalty_0.2"), (4,), tuple(range(5)))),
        overrides=(),
        about="every method of the benchmark at int4_async8 (int4 rollouts up to 8 policy versions old, the harshest "
              "level), N = 4, 5 seeds: the five methods without a penalty that async8 did not run (GRPO without IS and "
              "token TIS first, then IcePop and seq-MIS, then MiniRL without R3) beside async8's four (run folders "
              "copied in)"),
    "async4_methods": Profile(
        blocks=((HARSHEST, ("icepop", "seq_mis"), (4,), tuple(range(5))),
                (HARSHEST, ("minirl",), (4,), tuple(range(5))),
                (HARSHEST, ("grpo_no_is", "tis", *LEVER_BASELINES, "fixed_penalty_0.2"), (4,), tuple(range(5)))),
        overrides=(),
        about="every method of the benchmark at int4_async4 (int4 rollouts up to 4 policy versions old), N = 4, 5 "
              "seeds: IcePop, seq-MIS and MiniRL without R3 (15 new runs) beside the full, seeds10 and constant02 "
              "profiles' run folders (copied in)"),
    "async8_n1": Profile(
        blocks=((("int4_async8",), N1_METHODS, (1,), tuple(range(5))),
                (("int4_async8",), N1_METHODS, (4,), tuple(range(5)))),
        overrides=(),
        about="one update per rollout batch (N = 1: staleness is the only off-policiness) at int4_async8, 5 seeds: "
              "GRPO without IS, token TIS, MiniRL + R3, the constant lambda = 0.2 and the tuned DCMDP + R3 config "
              "(25 new runs), beside the same methods at N = 4 (async8_methods' run folders, copied in)"),
    # the benchmark's matrix at the two harshest levels, assembled: nothing here trains when the run folders of
    # the profiles it names are copied in (from scratch it is 120 runs, ~8 hours with 2 workers)
    "harsh_matrix": Profile(
        blocks=((("int4_async4", "int4_async8"), HARSH_MATRIX_METHODS, (4,), tuple(range(5))),
                (HARSHEST, ("fixed_penalty",), (4,), tuple(range(5))),
                (("int4_async8",), N1_METHODS, (1,), tuple(range(5)))),
        overrides=(),
        about="every method at the two harshest levels (int4 rollouts up to 4 and 8 policy versions old), N = 4, 5 "
              "seeds, and five methods at N = 1 at int4_async8, 5 seeds: the run folders of the full, seeds10, "
              "constant02, async8_methods, async4_methods and async8_n1 profiles, copied in (nothing trains; from "
              "scratch this is 120 runs, ~8 hours with 2 workers)"),
    "probe_seq_mis": Profile(
        blocks=((("int4_async8",), ("seq_mis", "seq_mis_band0.01"), (4,), tuple(range(5))),),
        overrides=(),
        about="seq-MIS at int4_async8 with its geometric band widened ten-fold ([0.99, 1.01]) beside the published "
              "band (async8_methods' run folders, copied in), N = 4, 5 seeds: the preset, or sequence masking?"),
    "average": Profile(
        blocks=((HARSHEST, (*LEVER_BASELINES, "fixed_penalty_0.2", "dcmdp_r3_avg"), (4,), tuple(range(5))),
                (("int4_async8",), (*LEVER_BASELINES, "fixed_penalty_0.2", "dcmdp_r3_avg"), (4,), tuple(range(5)))),
        overrides=(),
        about="DCMDP + R3 with the averaged multiplier (dual.average: the penalty carries the running mean of lambda) "
              "at both staleness levels, beside MiniRL + R3, the constants lambda = 0.1 and 0.2 and the tuned DCMDP "
              "config (run folders of seeds10, constant02 and async8 copied in), N = 4, 5 seeds: 10 new runs"),
    "constant02": Profile(
        blocks=((HARSHEST, (*LEVER_BASELINES, "fixed_penalty_0.2"), (4,), tuple(range(5))),),
        overrides=(),
        about="the constant that matched DCMDP + R3 at int4_async8 (lambda = 0.2) at the harshest level, beside the "
              "seeds10 methods' seeds 0-4 (run folders copied in), N = 4, 5 seeds: the better constant everywhere, "
              "or only at the staler level?"),
    "probe_fp32": Profile(
        blocks=((("fp32",), ("minirl_r3", "fixed_penalty", "fixed_penalty_0.1", "dcmdp_r3_slack0.5_cap0.3"), (4,),
                 (0, 1)),),
        overrides=(),
        about="the no-mismatch control (fp32 rollouts, synchronous): which constant would a user pick where the "
              "engines agree? The fixed penalty at lambda = 1 and 0.1 beside MiniRL + R3 and the tuned DCMDP "
              "config, N = 4, 2 seeds"),
    "sync_int4": Profile(
        blocks=((("int4",), KEY_METHODS, (4,), (0, 1, 2)),),
        overrides=(),
        about="the four key methods at synchronous int4 (the second harshest level), N = 4, 3 seeds (DCMDP + R3's "
              "seeds 0-1 are the full profile's run folders, copied in)"),
    "quick": Profile(
        blocks=((HARSHEST, KEY_METHODS, (4,), (0, 1, 2)),),
        overrides=("steps=150",),
        about="the four key methods at the harshest level, N = 4, 3 seeds, 150 steps (the gap between GRPO without "
              "IS and token TIS is open by step 100 in the probe): 12 runs, ~25 minutes with 2 workers"),
    "full": Profile(
        blocks=((HARSHEST, FULL_METHODS, (4,), (0, 1, 2, 3, 4)),
                (("int4",), ("fixed_penalty", "dcmdp_r3"), (4,), (0, 1))),
        overrides=(),
        about="five methods at the harshest level, N = 4, 5 seeds; the fixed penalty and DCMDP + R3 at synchronous "
              "int4 too, 2 seeds; 250 steps: 29 runs, ~110 minutes with 2 workers (every method at two levels with "
              "N in {1, 4} and 5 seeds would be 160 runs, ~9 hours: see docs/results.md)"),
}


def cell_dir(bench_dir: Path, level: str, method: str, n: int, seed: int) -> Path:
    return bench_dir / f"{level}__{method}__N{n}__seed{seed}"


def cell_overrides(profile: Profile, level: str, method: str, n: int, seed: int, out: Path) -> list[str]:
    """The full dotlist of one run, on top of configs/stress.yaml."""
    return [*profile.overrides, *LEVELS[level], CONSTRAINT, *METHODS[method], f"algo.minibatches={n}",
            f"seed={seed}", f"output_dir={out}", "threads=1", "progress=false", "checkpoint.every=25",
            "checkpoint.keep=1", "checkpoint.resume=auto"]


# ------------------------------------------------------------------------------------------- analysis


# where the late-accuracy window starts, as a share of the run's steps (250 steps, eval_every 50: steps 150-250)
LATE_FROM = 0.6


@dataclass
class Run:
    level: str
    method: str
    n: int
    seed: int
    acc_before: float
    eval_steps: list[int]
    eval_acc: list[float]
    collapsed: bool
    collapse_reason: str
    # per step
    measured: list[float]
    tolerance: list[float]
    lambdas: list[float]
    abs_prob_diff: list[float]
    kl_k3: list[float]
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    finished: float = math.nan  # when the run finished (its summary's mtime, seconds since the epoch)

    @property
    def final(self) -> float:
        return self.eval_acc[-1]

    @property
    def peak(self) -> float:
        return max(self.eval_acc)

    @property
    def late(self) -> float:
        """Mean held-out accuracy over the evaluations from LATE_FROM of the steps on (the final one included): the
        end of the run with less of one evaluation's sampling noise than ``final``."""
        return float(np.mean([a for s, a in zip(self.eval_steps, self.eval_acc)
                              if s >= LATE_FROM * self.eval_steps[-1]]))


def load(out: Path, level: str, method: str, n: int, seed: int, warmup: int) -> Run:
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "history.json").read_text())
    eval_steps, eval_acc = [0], [summary["accuracy_before"]]
    for i, h in enumerate(history):
        if "eval/accuracy" in h:
            eval_steps.append(i + 1), eval_acc.append(h["eval/accuracy"])
    eval_steps.append(summary["steps"]), eval_acc.append(summary["accuracy_after"])
    nonfinite = int(sum(h.get("guard/skipped_updates", 0.0) > 0 for h in history))
    collapsed, reason = stability.collapse_check(eval_acc, [h["reward/accuracy"] for h in history], nonfinite,
                                                 warmup)

    def series(key: str) -> list[float]:
        return [float(h.get(key, math.nan)) for h in history]

    extra = {k: float(np.nanmean(series(k))) for k in ("policy/approx_kl", "policy/entropy", "clip/frac",
                                                      "routing/mismatch", "penalty/loss", "is/weight_max_raw")
             if any(k in h for h in history)}
    # the constraint's metric name: abs_prob_diff, or abs_prob_diff_p90 for a quantile constraint
    name = next((k.removeprefix("dual/lambda/") for h in history for k in h if k.startswith("dual/lambda/")),
                "abs_prob_diff")
    # lambda as the penalty carried it: the running mean under dual.average, else the iterate
    avg_key = f"dual/lambda_avg/{name}"
    lam_key = avg_key if any(avg_key in h for h in history) else f"dual/lambda/{name}"
    return Run(level, method, n, seed, summary["accuracy_before"], eval_steps, eval_acc, collapsed, reason,
               series(f"dual/measured/{name}"), series(f"dual/tolerance/{name}"),
               series(lam_key), series("discrepancy/abs_prob_diff"),
               series("discrepancy/kl_k3"), float(summary["seconds"]), extra, (out / "summary.json").stat().st_mtime)


def _mean_sd(x: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(x, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def aggregate(runs: list[Run], profile: Profile) -> list[dict]:
    cells = []
    for n in profile.minibatches:
        for level in profile.levels:
            for method in profile.methods:
                rs = [r for r in runs if (r.level, r.method, r.n) == (level, method, n)]
                if not rs:
                    continue
                final, final_sd = _mean_sd([r.final for r in rs])
                peak, peak_sd = _mean_sd([r.peak for r in rs])
                late, late_sd = _mean_sd([r.late for r in rs])
                inside = [np.mean(np.asarray(r.measured) <= np.asarray(r.tolerance)) for r in rs]
                cells.append({
                    "level": level, "method": method, "N": n, "seeds": len(rs),
                    "acc_before": float(np.mean([r.acc_before for r in rs])),
                    "final": final, "final_sd": final_sd, "peak": peak, "peak_sd": peak_sd,
                    "finals": [r.final for r in rs], "late": late, "late_sd": late_sd, "lates": [r.late for r in rs],
                    "collapses": int(sum(r.collapsed for r in rs)),
                    "abs_prob_diff": float(np.nanmean([np.nanmean(r.abs_prob_diff) for r in rs])),
                    "kl_k3": float(np.nanmean([np.nanmean(r.kl_k3) for r in rs])),
                    # the discrepancy the level produces at the start (first 5 steps), as the x axis is read
                    "kl_k3_start": float(np.nanmean([np.nanmean(r.kl_k3[:5]) for r in rs])),
                    "inside_share": float(np.mean(inside)),
                    "mean_lambda": float(np.nanmean([np.nanmean(r.lambdas) for r in rs])),
                    "final_lambda": float(np.nanmean([r.lambdas[-1] for r in rs])),
                    "minutes": float(sum(r.seconds for r in rs) / 60),
                    "extra": {k: float(np.nanmean([r.extra.get(k, math.nan) for r in rs]))
                              for k in sorted({k for r in rs for k in r.extra})},
                })
    return cells


def is_dcmdp(method: str) -> bool:
    return method.startswith("dcmdp")


def _welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Welch's t-test p-value of two samples; NaN with fewer than two values on a side."""
    from scipy.stats import ttest_ind

    return float(ttest_ind(a, b, equal_var=False).pvalue) if len(a) > 1 and len(b) > 1 else math.nan


def welch(cells: list[dict]) -> list[dict]:
    """Per (level, N) and DCMDP config: against the best method without the dual by mean final accuracy (Welch's
    t-test), and by late accuracy against the best by late accuracy."""
    out = []
    for key in sorted({(c["level"], c["N"]) for c in cells}, key=lambda k: (k[1], list(LEVELS).index(k[0]))):
        here = [c for c in cells if (c["level"], c["N"]) == key]
        others = [c for c in here if not is_dcmdp(c["method"])]
        if not others:
            continue
        best = max(others, key=lambda c: c["final"])
        best_late = max(others, key=lambda c: c["late"])
        for mine in (c for c in here if is_dcmdp(c["method"])):
            out.append({"level": key[0], "N": key[1], "method": mine["method"], "best_baseline": best["method"],
                        "dcmdp": mine["final"], "baseline": best["final"], "diff": mine["final"] - best["final"],
                        "p": _welch_p(mine["finals"], best["finals"]), "best_late_baseline": best_late["method"],
                        "late_diff": mine["late"] - best_late["late"],
                        "p_late": _welch_p(mine["lates"], best_late["lates"]),
                        "seeds": f"{len(mine['finals'])} vs {len(best['finals'])}"})
    return out


def table(cells: list[dict]) -> list[str]:
    lines = ["| N | level | kl_k3 at start | method | final held-out acc | late held-out acc | peak held-out acc | "
             "collapses | mean abs_prob_diff | steps inside c | mean λ | final λ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['N']} | {c['level']} | {c['kl_k3_start']:.2e} | {c['method']} | "
                     f"{c['final']:.3f} ± {c['final_sd']:.3f} | {c['late']:.3f} ± {c['late_sd']:.3f} | "
                     f"{c['peak']:.3f} ± {c['peak_sd']:.3f} | "
                     f"{c['collapses']}/{c['seeds']} | {c['abs_prob_diff']:.2e} | {c['inside_share']:.0%} | "
                     f"{c['mean_lambda']:.3g} | {c['final_lambda']:.3g} |")
    return lines


def welch_table(rows: list[dict]) -> list[str]:
    lines = ["| N | level | DCMDP config | its final acc | best baseline | its final acc | difference | Welch p | "
             "best by late acc | late difference | late Welch p | seeds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['N']} | {r['level']} | {r['method']} | {r['dcmdp']:.3f} | {r['best_baseline']} | "
                     f"{r['baseline']:.3f} | {r['diff']:+.3f} | {r['p']:.3g} | {r['best_late_baseline']} | "
                     f"{r['late_diff']:+.3f} | {r['p_late']:.3g} | {r['seeds']} |")
    return lines


def plot(runs: list[Run], cells: list[dict], profile: Profile, prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    levels = profile.levels
    ns = profile.minibatches
    fig, axes = plt.subplots(1, len(ns), figsize=(6.5 * len(ns), 4.5), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for k, method in enumerate(profile.methods):
            pts = [(levels.index(c["level"]), c["final"], c["final_sd"]) for c in cells
                   if c["method"] == method and c["N"] == n]
            if not pts:
                continue
            x, y, e = map(np.asarray, zip(*sorted(pts)))
            ax.errorbar(x + (k - len(profile.methods) / 2) * 0.03, y, yerr=e, marker="o", ms=4, capsize=2,
                        label=method, lw=2.2 if is_dcmdp(method) else 1.0, color=f"C{k % 10}")  # one colour per method
        ax.set_xticks(range(len(levels)), levels)
        ax.set_xlabel("rollout deployment (mismatch grows to the right)")
        ax.set_ylabel("final held-out accuracy of the deployed policy")
        ax.set_title(f"N = {n} mini-batches"), ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_accuracy.png"))
    fig.savefig(paths[-1], dpi=120), plt.close(fig)

    # held-out accuracy over the run at the harshest level and largest N: mean over seeds with a +-sd band per method
    # (what the final and late columns summarise; a method whose runs oscillate shows a wide band)
    harsh, n = levels[-1], max(ns)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, method in enumerate(profile.methods):
        rs = [r for r in runs if (r.level, r.method, r.n) == (harsh, method, n)]
        if not rs or len({tuple(r.eval_steps) for r in rs}) != 1:
            continue
        acc = np.asarray([r.eval_acc for r in rs])
        mean, sd = acc.mean(0), acc.std(0, ddof=1) if len(rs) > 1 else np.zeros(acc.shape[1])
        ax.plot(rs[0].eval_steps, mean, marker="o", ms=3, color=f"C{k}", lw=2.2 if is_dcmdp(method) else 1.0,
                label=f"{method} ({len(rs)} seeds)")
        ax.fill_between(rs[0].eval_steps, mean - sd, mean + sd, color=f"C{k}", alpha=0.12)
    ax.axvspan(LATE_FROM * max(r.eval_steps[-1] for r in runs), max(r.eval_steps[-1] for r in runs), color="0.9",
               zorder=0, label="late window")
    ax.set_xlabel("RL step"), ax.set_ylabel("held-out accuracy of the deployed policy")
    ax.set_title(f"{harsh}, N = {n}: mean ± sd over seeds"), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_curves.png"))
    fig.savefig(paths[-1], dpi=120), plt.close(fig)

    # the dual at the harshest level and largest N: D-hat (5-step mean) against c, and lambda, per seed, for the
    # profile's last DCMDP config (the benchmark's own, dcmdp_r3, where it is the only one)
    dual_method = ([m for m in profile.methods if is_dcmdp(m)] or ["dcmdp_r3"])[-1]
    rs = [r for r in runs if (r.level, r.method, r.n) == (harsh, dual_method, n)]
    if rs:
        fig, (ax_d, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
        for k, r in enumerate(rs):
            steps = np.arange(1, len(r.measured) + 1)
            w = min(5, len(r.measured))
            ax_d.plot(steps[w - 1:], np.convolve(r.measured, np.ones(w) / w, mode="valid"), color=f"C{k}",
                      label=f"D̂ seed {r.seed}")
            ax_d.plot(steps, r.tolerance, color=f"C{k}", ls="--", lw=0.8)
            ax_l.plot(steps, r.lambdas, color=f"C{k}", label=f"seed {r.seed}")
        ax_d.set_yscale("log"), ax_d.set_xlabel("RL step"), ax_d.grid(alpha=0.3), ax_d.legend(fontsize=7)
        ax_d.set_ylabel("D̂ fed to the dual (5-step mean); dashed: c in force")
        ax_l.set_xlabel("RL step"), ax_l.set_ylabel("λ"), ax_l.grid(alpha=0.3), ax_l.legend(fontsize=7)
        fig.suptitle(f"{dual_method} at {harsh}, N = {n}"), fig.tight_layout()
        paths.append(prefix.with_name(prefix.name + "_dual.png"))
        fig.savefig(paths[-1], dpi=120), plt.close(fig)
    return paths


def _utc(t: float) -> str:
    return f"{datetime.datetime.fromtimestamp(t, datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def write_results(runs: list[Run], cells: list[dict], profile_name: str, profile: Profile, prefix: Path, cmd: str,
                  wall_s: Optional[float]) -> list[str]:
    import torch
    import transformers

    prefix.parent.mkdir(parents=True, exist_ok=True)
    rows = welch(cells)
    pngs = plot(runs, cells, profile, prefix)
    with open(prefix.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["level", "method", "N", "seed", "acc_before", "final", "peak", "collapsed", "collapse_reason",
                    "mean_abs_prob_diff", "mean_kl_k3", "final_lambda", "seconds"])
        for r in runs:
            w.writerow([r.level, r.method, r.n, r.seed, r.acc_before, r.final, r.peak, r.collapsed,
                        r.collapse_reason, np.nanmean(r.abs_prob_diff), np.nanmean(r.kl_k3), r.lambdas[-1],
                        round(r.seconds, 1)])
    prefix.with_suffix(".json").write_text(json.dumps(
        {"profile": profile_name, "levels": {lv: LEVELS[lv] for lv in profile.levels},
         "methods": {m: METHODS[m] for m in profile.methods}, "constraint": CONSTRAINT,
         "overrides": list(profile.overrides), "cells": cells, "welch": rows,
         "runs": [{"level": r.level, "method": r.method, "N": r.n, "seed": r.seed, "eval_steps": r.eval_steps,
                   "eval_acc": r.eval_acc, "collapsed": r.collapsed, "collapse_reason": r.collapse_reason}
                  for r in runs]}, indent=1))
    lines = table(cells)
    header = [
        f"# Mismatch stress testbed ({profile_name} profile)", "",
        f"- date: written {_utc(datetime.datetime.now(datetime.timezone.utc).timestamp())}; run summaries dated "
        f"{_utc(min(r.finished for r in runs))} to {_utc(max(r.finished for r in runs))} (a run folder copied "
        "without its dates carries the copy's)",
        f"- machine: {platform.node()} {platform.machine()} ({torch.backends.cpu.get_cpu_capability()} kernels), "
        f"{os.cpu_count()} logical CPUs; every run one process with one torch thread",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"- command: `{cmd}` (" + (f"{wall_s / 60:.0f} min wall over the invocations that trained the runs; "
                                   if wall_s is not None else "no run trained here: every run folder was copied in "
                                   "from the profiles named below; ") +
        f"{sum(r.seconds for r in runs) / 60:.0f} run-minutes in all)",
        f"- profile: {profile.about}",
        f"- base: `configs/stress.yaml`{''.join(f' + `{o}`' for o in [' '.join(profile.overrides)] if o)} + the level + "
        f"`{CONSTRAINT}` + the method "
        "+ `algo.minibatches=N seed=S`",
        "- collapse (fixed before the runs, any of): a non-finite update; final held-out accuracy of the deployed "
        "policy < half the run's peak held-out accuracy (step 0 included); mean reward accuracy over the last "
        "W = max(5, steps/20) steps < half the best W-step running mean after the LR warm-up",
        "- columns: held-out accuracy on the task's fixed eval set, sampled at temperature 1 by the rollout engine "
        "(the deployed policy, at the level's precision), final and peak over the eval points, late = the mean of "
        f"the evaluations from {LATE_FROM:.0%} of the steps on (less of one evaluation's sampling noise; added after "
        "the full profile), mean ± sd over seeds; kl_k3 at start = the level's kl_k3 (pi_old vs mu) over the first 5 steps; mean abs_prob_diff over "
        "all steps; steps inside c = share of steps with the D̂ fed to the dual <= the tolerance in force; λ = the "
        "multiplier the penalty carried (its running mean λ̄ under `dual.average`)", "",
        "| level | overrides |", "|---|---|", *[f"| {lv} | `{' '.join(LEVELS[lv])}` |" for lv in profile.levels], "",
        "| method | overrides |", "|---|---|", *[f"| {m} | `{' '.join(METHODS[m])}` |" for m in profile.methods], ""]
    extra_keys = sorted({k for c in cells for k in c["extra"]})
    diag = ["", "Diagnostics (means over steps and seeds):", "",
            "| N | level | method | " + " | ".join(extra_keys) + " |", "|---|---|---|" + "---|" * len(extra_keys)]
    for c in cells:
        diag.append(f"| {c['N']} | {c['level']} | {c['method']} | " + " | ".join(
            "-" if not np.isfinite(c["extra"].get(k, math.nan)) else f"{c['extra'][k]:.3g}" for k in extra_keys) + " |")
    test = ["", "Each DCMDP config against the best method without the dual in its cell (Welch's t-test on final "
            "accuracy; and on late accuracy against the best method by late accuracy):", "",
            *welch_table(rows)]
    plots = [f"![{p.stem}]({p.name})" for p in pngs]
    page = prefix.with_suffix(".md")
    page.write_text("\n".join(header + lines + test + diag + [""] + plots + reading_lines(page)) + "\n")
    return lines + [""] + welch_table(rows)


# ------------------------------------------------------------------------------------------- main


def run(profile_name: str, bench_dir: Path, results_prefix: Path, workers: int,
        argv: Optional[Sequence[str]] = None) -> list[dict]:
    from dcmdp.config import load_config

    profile = PROFILES[profile_name]
    bench_dir.mkdir(parents=True, exist_ok=True)
    # one shared cold start (the base config fixes cold_start.seed): train it once before the workers start
    stability.warm_cold_starts(stability.Profile(seeds=(0,), methods=(), minibatches=(), overrides=profile.overrides,
                                                 about=""), base=BASE_CONFIG)
    jobs = []
    for level, method, n, seed in profile.cells():
        out = cell_dir(bench_dir, level, method, n, seed)
        overrides = cell_overrides(profile, level, method, n, seed, out)
        load_config(BASE_CONFIG, overrides)  # a bad override fails here, before anything trains
        jobs.append(((level, method, n, seed), out, overrides))
    template = stability.mlflow_template(bench_dir)
    todo = [out for _, out, ov in jobs if stability.prepare(out, ov, template, base=BASE_CONFIG)]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already finished; training {len(todo)} with {workers} "
          f"workers", flush=True)
    pool_workers: queue.Queue[stability.Worker] = queue.Queue()
    for k in range(max(1, workers)):
        pool_workers.put(stability.Worker(bench_dir / f"worker{k}.log"))

    def one(out: Path) -> tuple[Path, bool]:
        worker = pool_workers.get()
        try:
            return out, worker.run(out)
        finally:
            pool_workers.put(worker)

    t0 = time.perf_counter()
    failed = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(one, out) for out in todo]
        for i, fut in enumerate(futures):
            out, ok = fut.result()
            if not ok:
                failed.append(out)
            print(f"[{i + 1}/{len(todo)}] {out.name}: {'done' if ok else 'FAILED, see ' + str(out / 'log.txt')} "
                  f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    while not pool_workers.empty():
        pool_workers.get().close()
    wall_file = bench_dir / "wall_seconds.txt"
    wall: Optional[float] = None  # None: nothing ever trained in this folder (an assembled profile)
    if todo or wall_file.exists():
        wall = time.perf_counter() - t0 + (float(wall_file.read_text()) if wall_file.exists() else 0.0)
        wall_file.write_text(f"{wall:.1f}\n")
    warmup = load_config(BASE_CONFIG, list(profile.overrides)).optim.warmup_steps
    runs = [load(out, *key, warmup=warmup) for key, out, _ in jobs
            if (out / "summary.json").exists() and (out / "history.json").exists()]
    cells = aggregate(runs, profile)
    cmd = "OMP_NUM_THREADS=%s .venv/bin/python benchmarks/stress.py %s" % (
        os.environ.get("OMP_NUM_THREADS", "<unset>"), " ".join(argv if argv is not None else sys.argv[1:]))
    lines = write_results(runs, cells, profile_name, profile, results_prefix, cmd, wall)
    print()
    print("\n".join(lines))
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {', '.join(p.name for p in failed)}")
    return cells


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=list(PROFILES), default="quick")
    ap.add_argument("--workers", type=int, default=2, help="runs in parallel, one process and one thread each")
    ap.add_argument("--bench-dir", default=None, help="run folders (default: outputs/stress_<profile>)")
    ap.add_argument("--results", default=None, help="results prefix (default: benchmarks/results/stress_<profile>)")
    args = ap.parse_args(argv)
    bench = Path(args.bench_dir) if args.bench_dir else ROOT / "outputs" / f"stress_{args.profile}"
    results = Path(args.results) if args.results else ROOT / "benchmarks" / "results" / f"stress_{args.profile}"
    run(args.profile, bench.resolve(), results.resolve(), args.workers, argv)


if __name__ == "__main__":
    main()
