"""Stability matrix: which methods keep RL stable under a real training-inference discrepancy, as
off-policiness grows (Zheng et al. arXiv 2512.01374; DCMDP, Liu et al. arXiv 2606.08779).

Every run is ``configs/default.yaml`` (tiny-moe, 2-digit addition, int8 weight-only rollouts from the
torch engine against an fp32 trainer, 1150-step cached cold start, lr 2e-4, 32 prompts x 16 samples)
plus the overrides of its method (``METHODS``, data: name -> dotlist), its off-policiness N
(``algo.minibatches``: one optimiser step per mini-batch, N = 1 is on-policy) and its seed. Every method
carries the same constraint (``abs_prob_diff <= TOLERANCE``) so the same measurement is logged for all;
only the methods with the dual on let lambda act.

Methods:

* ``grpo_no_is``: the MiniRL loss (group-mean advantages, clip mask on r = pi_theta / pi_old) with no
  training-inference IS correction (w = 1): the one-factor ablation of IS.
* ``minirl``: Zheng et al. Eq. 7: TIS weight min(pi_old / mu, 5) and the clip mask; ``_r2`` / ``_r3`` add
  routing replay.
* ``fixed_penalty``: MiniRL plus the hinge penalty with a constant lambda = LAMBDA_INIT (``dual.rule=fixed``):
  a fixed-coefficient penalty, no dual controller.
* ``dcmdp_r2`` / ``dcmdp_r3``: MiniRL plus the hinge penalty, lambda from projected dual ascent
  (lambda_0 = LAMBDA_INIT, eta = 1, the paper's settings) with R2 / R3.

Tolerance, fixed before any matrix run: c = the ``dcmdp calibrate`` proposal on the default config
(seed 0, routing none, 8 batches with identical weights): floor 2.145e-3 x (1 + 0.25 slack) = 2.68e-3,
rounded to TOLERANCE = 2.7e-3.

Per run: held-out accuracy (``task.eval_size`` prompts, sampled at temperature 1) before, every
``eval_every`` steps and after; reward accuracy, discrepancy, lambda and guard metrics per step.
A run COLLAPSES (``collapsed``) if any of: (a) some update had a non-finite loss (``guard/skipped_update``);
(b) the final held-out accuracy is below half the best held-out accuracy of the run (step 0 included);
(c) the mean reward accuracy over the last W steps is below half the best W-step running mean after the
LR warm-up (W = max(5, steps // 20)).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stability.py --profile quick [--workers 2]

runs the missing cells (a cell whose ``summary.json`` and ``history.json`` exist is skipped; a killed run
resumes from its last checkpoint), prints a table last, and writes ``benchmarks/results/stability_<profile>``
(.md, .csv, .json and two plots). ``--profile smoke`` runs 2 methods x 3 steps on a tiny batch. The ``probe`` and
``probe_n1`` profiles run the ``PROBE_METHODS`` (an active dual, a 10x fixed penalty, a 5x learning rate) used to
read why DCMDP does or does not separate from its baselines; ``probe_updates`` feeds the dual the discrepancy the
updates trained on (``dual.measure_at=updates``); ``probe_penalty`` tries the ``mean`` and ``advantage`` penalty
forms; ``quick_bf16`` is the quick matrix with bf16 rollouts (a larger discrepancy) and its own calibrated
tolerance (``Profile.tolerance``); ``probe_lr`` runs the seven methods at 3x the learning rate. A hand-written
``benchmarks/results/stability_<profile>_reading.md``, when present, is appended to the results page.
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
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks._reading import reading_lines  # noqa: E402

BASE_CONFIG = ROOT / "configs" / "default.yaml"
TOLERANCE = 2.7e-3
LAMBDA_INIT = 0.1
DUAL_LR = 1.0

_MINIRL = ["algo.loss=minirl", "algo.is_mode=tis"]
METHODS: dict[str, list[str]] = {
    "grpo_no_is": ["algo.loss=minirl", "algo.is_mode=none", "dual.rule=off"],
    "minirl": _MINIRL + ["dual.rule=off"],
    "minirl_r2": _MINIRL + ["dual.rule=off", "algo.routing_replay=r2"],
    "minirl_r3": _MINIRL + ["dual.rule=off", "algo.routing_replay=r3"],
    "fixed_penalty": _MINIRL + ["dual.rule=fixed"],
    "dcmdp_r2": _MINIRL + ["algo.routing_replay=r2"],
    "dcmdp_r3": _MINIRL + ["algo.routing_replay=r3"],
}


def _constraint(tolerance: float, lambda_init: float, lr: float) -> str:
    return (f"dual.constraints=[{{measure: abs_prob_diff, tolerance: {tolerance}, lambda_init: {lambda_init}, "
            f"lr: {lr}}}]")


# Probes of why DCMDP does or does not differ from its baselines (profile ``probe``), not part of the matrix.
# Each replaces the matrix's constraint (a later dotlist entry wins) or stresses the learner.
PROBE_METHODS: dict[str, list[str]] = {
    # a dual that can act within 100 steps: c below the measured int8 floor, eta 100
    "dcmdp_r3_c1e-3_eta100": METHODS["dcmdp_r3"] + [_constraint(1e-3, 0.1, 100.0)],
    # the same hinge penalty with a 10x larger constant coefficient
    "fixed_r3_lambda1": _MINIRL + ["algo.routing_replay=r3", "dual.rule=fixed", _constraint(2.7e-3, 1.0, 1.0)],
    # stress: 5x the RL learning rate (configs/default.yaml notes 1e-3 "drifts or degrades the policy")
    "grpo_no_is_lr1e-3": METHODS["grpo_no_is"] + ["optim.lr=1e-3"],
    "minirl_r3_lr1e-3": METHODS["minirl_r3"] + ["optim.lr=1e-3"],
    "dcmdp_r3_lr1e-3": METHODS["dcmdp_r3"] + ["optim.lr=1e-3"],
    # does a penalty with bite (fixed 1, or the active dual) hold the 5x learning rate?
    "fixed_r3_lambda1_lr1e-3": _MINIRL + ["algo.routing_replay=r3", "dual.rule=fixed", _constraint(2.7e-3, 1.0, 1.0),
                                          "optim.lr=1e-3"],
    "dcmdp_r3_c1e-3_eta100_lr1e-3": METHODS["dcmdp_r3"] + [_constraint(1e-3, 0.1, 100.0), "optim.lr=1e-3"],
    # the dual fed the discrepancy the updates trained on (pi_theta vs mu: engine floor + update drift)
    "dcmdp_r3_upd": METHODS["dcmdp_r3"] + ["dual.measure_at=updates"],
    "dcmdp_r3_upd_eta100": METHODS["dcmdp_r3"] + ["dual.measure_at=updates", _constraint(2.7e-3, 0.1, 100.0)],
    "dcmdp_r3_upd_eta100_lr1e-3": METHODS["dcmdp_r3"] + ["dual.measure_at=updates", _constraint(2.7e-3, 0.1, 100.0),
                                                         "optim.lr=1e-3"],
    # the same with c at the drift level the N = 8 updates reach (~1e-2) instead of the engines' floor
    "dcmdp_r3_upd_c1e-2_eta100": METHODS["dcmdp_r3"] + ["dual.measure_at=updates", _constraint(1e-2, 0.1, 100.0)],
    "dcmdp_r3_upd_c1e-2_eta100_lr1e-3": METHODS["dcmdp_r3"] + ["dual.measure_at=updates",
                                                               _constraint(1e-2, 0.1, 100.0), "optim.lr=1e-3"],
    # the other penalty forms (DESIGN.md 4): mean pulls every token's pi_theta towards mu, advantage shapes A_t
    "dcmdp_r3_mean": METHODS["dcmdp_r3"] + ["dual.penalty=mean"],
    "dcmdp_r3_adv": METHODS["dcmdp_r3"] + ["dual.penalty=advantage"],
    "dcmdp_r3_mean_upd_c1e-2_eta100": METHODS["dcmdp_r3"] + ["dual.penalty=mean", "dual.measure_at=updates",
                                                             _constraint(1e-2, 0.1, 100.0)],
    "dcmdp_r3_mean_lr1e-3": METHODS["dcmdp_r3"] + ["dual.penalty=mean", "optim.lr=1e-3"],
    "dcmdp_r3_adv_lr1e-3": METHODS["dcmdp_r3"] + ["dual.penalty=advantage", "optim.lr=1e-3"],
    "dcmdp_r3_mean_upd_c1e-2_eta100_lr1e-3": METHODS["dcmdp_r3"] + ["dual.penalty=mean", "dual.measure_at=updates",
                                                                    _constraint(1e-2, 0.1, 100.0), "optim.lr=1e-3"],
}
ALL_METHODS = {**METHODS, **PROBE_METHODS}


# how TOLERANCE was fixed (int8 rollouts, the default config)
TOLERANCE_RULE = ("c = `dcmdp calibrate configs/default.yaml` proposal, floor of abs_prob_diff with identical weights "
                  "(2.145e-3, seed 0, 8 batches, p90 2.84e-3) x 1.25, rounded")


@dataclass(frozen=True)
class Profile:
    seeds: tuple[int, ...]
    methods: tuple[str, ...]
    minibatches: tuple[int, ...]
    # dotlist overrides on top of configs/default.yaml, applied before the method's
    overrides: tuple[str, ...]
    about: str
    # the tolerance every method carries (a probe method's own constraint replaces it), and how it was fixed
    tolerance: float = TOLERANCE
    tolerance_rule: str = TOLERANCE_RULE

    @property
    def precision(self) -> str:
        """The rollout precision the profile runs (configs/default.yaml: int8 unless an override sets it)."""
        given = [o.split("=", 1)[1] for o in self.overrides if o.startswith("rollout.precision=")]
        return given[-1] if given else "int8"


# the quick matrix's run: 100 RL steps of 16 prompts x 8 samples, held-out eval every 20 steps
_QUICK = ("steps=100", "eval_every=20", "algo.prompts_per_step=16", "algo.samples_per_prompt=8")

PROFILES: dict[str, Profile] = {
    "smoke": Profile(
        seeds=(0,), methods=("minirl", "dcmdp_r3"), minibatches=(2,),
        overrides=("steps=3", "eval_every=2", "cold_start.steps=20", "algo.prompts_per_step=4",
                   "algo.samples_per_prompt=4", "task.eval_size=16", "optim.warmup_steps=0"),
        about="plumbing check: 1 seed, 2 methods, N = 2, 3 steps of 4 prompts x 4 samples, 20-step cold start"),
    "quick": Profile(
        seeds=(0, 1, 2), methods=tuple(METHODS), minibatches=(1, 8),
        overrides=_QUICK,
        about="all 7 methods, N in {1, 8}, 3 seeds, 100 RL steps of 16 prompts x 8 samples "
              "(the default run: 650 steps of 32 x 16), held-out eval every 20 steps"),
    "full": Profile(
        seeds=(0, 1, 2), methods=tuple(METHODS), minibatches=(1, 4, 8),
        overrides=("eval_every=50", "cold_start.seed=0"),
        about="all 7 methods, N in {1, 4, 8}, 3 seeds, the default run (650 steps of 32 prompts x 16 samples) from "
              "one shared cold start (cold_start.seed=0; the seeds differ in RL sampling only), held-out eval "
              "every 50 steps"),
    "probe": Profile(
        seeds=(0, 1, 2),
        methods=("dcmdp_r3_c1e-3_eta100", "fixed_r3_lambda1", "grpo_no_is_lr1e-3", "minirl_r3_lr1e-3",
                 "dcmdp_r3_lr1e-3", "fixed_r3_lambda1_lr1e-3", "dcmdp_r3_c1e-3_eta100_lr1e-3"),
        minibatches=(8,),
        overrides=_QUICK,
        about="the quick profile's runs at N = 8 for the probe methods (PROBE_METHODS): an active dual, a 10x "
              "fixed penalty, a 5x learning rate, and both penalties under the 5x learning rate"),
    "probe_n1": Profile(
        seeds=(0, 1, 2), methods=("minirl_r3_lr1e-3", "dcmdp_r3_lr1e-3"), minibatches=(1,),
        overrides=_QUICK,
        about="the 5x learning-rate probes on-policy (N = 1): is the collapse at N = 8 from off-policiness?"),
    "probe_updates": Profile(
        seeds=(0, 1, 2), methods=("dcmdp_r3_upd", "dcmdp_r3_upd_eta100", "dcmdp_r3_upd_eta100_lr1e-3",
                                  "dcmdp_r3_upd_c1e-2_eta100", "dcmdp_r3_upd_c1e-2_eta100_lr1e-3"),
        minibatches=(8,),
        overrides=(*_QUICK, "cold_start.seed=0"),
        about="quick_shared's runs at N = 8 with dual.measure_at=updates (D-hat = pi_theta at each token's update "
              "vs mu): c = 2.7e-3 with eta 1 and 100, c = 1e-2 with eta 100, and both eta-100 duals under the 5x "
              "learning rate"),
    "probe_penalty": Profile(
        seeds=(0, 1, 2, 3, 4),
        methods=("minirl_r3", "fixed_penalty", "dcmdp_r3", "dcmdp_r3_mean", "dcmdp_r3_adv",
                 "dcmdp_r3_mean_upd_c1e-2_eta100", "minirl_r3_lr1e-3", "dcmdp_r3_lr1e-3", "dcmdp_r3_mean_lr1e-3",
                 "dcmdp_r3_adv_lr1e-3", "dcmdp_r3_mean_upd_c1e-2_eta100_lr1e-3"),
        minibatches=(8,),
        overrides=(*_QUICK, "cold_start.seed=0"),
        about="quick_shared's runs at N = 8 with the other penalty forms (dual.penalty=mean, advantage; the mean "
              "form also on the updates measure with c = 1e-2, eta 100) next to the hinge (dcmdp_r3) and two "
              "baselines, each DCMDP form and MiniRL + R3 also under the 5x learning rate; 5 seeds"),
    "probe_lr": Profile(
        seeds=(0, 1, 2, 3, 4), methods=tuple(METHODS), minibatches=(8,),
        overrides=(*_QUICK, "cold_start.seed=0", "optim.lr=6e-4"),
        about="quick_shared's seven methods at N = 8 with 3x the learning rate (6e-4; 1e-3 collapses every method in "
              "the probes): does any method hold where the others break? 5 seeds"),
    "quick_bf16": Profile(
        seeds=(0, 1, 2, 3, 4), methods=tuple(METHODS), minibatches=(1, 8),
        overrides=(*_QUICK, "cold_start.seed=0", "rollout.precision=bf16"),
        about="quick_shared with bf16 rollouts (a larger discrepancy than int8: ~3x the abs_prob_diff floor, ~20x "
              "kl_k3, ~3x the routing mismatch at the shared start), its own tolerance, 5 seeds",
        tolerance=5.2e-3,
        tolerance_rule="c = `dcmdp calibrate --batches 8 configs/default.yaml threads=1 cold_start.seed=0 "
                       "rollout.precision=bf16` proposal: floor of abs_prob_diff with identical weights (4.2e-3, "
                       "95% CI 3.78e-3 to 4.96e-3, p90 4.92e-3) x 1.25, rounded"),
    "quick_shared": Profile(
        seeds=(0, 1, 2), methods=tuple(METHODS), minibatches=(1, 8),
        overrides=(*_QUICK, "cold_start.seed=0"),
        about="the quick matrix from one shared cold start (cold_start.seed=0, stopped at 30% sampled accuracy): "
              "the seeds differ in RL sampling only"),
}

# per-step metrics kept in history.json (the checkpoint's history has every metric)
_KEEP_PREFIXES = ("reward/", "eval/", "discrepancy/", "dual/", "penalty/", "policy/", "guard/", "loss/", "routing/",
                  "async/", "is/", "clip/", "time/step")


def constraint_override(profile: Profile) -> str:
    return _constraint(profile.tolerance, LAMBDA_INIT, DUAL_LR)


# The matrix's dual, pinned against later changes of configs/default.yaml's dual block (which since measures D-hat
# at the updates with a relative step): D-hat of pi_old vs mu, absolute step; profiles and methods may override it.
MATRIX_DUAL = ("dual.measure_at=rollout", "dual.relative=false")


def cell_overrides(profile: Profile, method: str, n: int, seed: int, output_dir: Path) -> list[str]:
    """The full dotlist of one run, on top of configs/default.yaml."""
    return [*MATRIX_DUAL, *profile.overrides, constraint_override(profile), *ALL_METHODS[method], f"algo.minibatches={n}",
            f"seed={seed}", f"output_dir={output_dir}", "threads=1", "progress=false", "checkpoint.every=25", "checkpoint.keep=1",
            "checkpoint.resume=auto"]


def cell_dir(bench_dir: Path, method: str, n: int, seed: int) -> Path:
    return bench_dir / f"{method}__N{n}__seed{seed}"


# ------------------------------------------------------------------------------------------- one run


def run_cell(out: Path) -> None:
    """Worker: train the run described by ``out/cell.json`` and write ``out/history.json``."""
    from dcmdp.config import load_config
    from dcmdp.loop import train

    spec = json.loads((out / "cell.json").read_text())
    if not (out / "summary.json").exists():
        train(load_config(spec.get("base", BASE_CONFIG), spec["overrides"]))
    write_history(out)


def write_history(out: Path) -> None:
    """history.json from the final checkpoint (train() keeps the per-step history only there and in MLflow)."""
    from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint

    ckpt = find_resume_checkpoint(out / "checkpoints", "auto")
    if ckpt is None:
        raise FileNotFoundError(f"{out}: summary.json but no checkpoint to read the history from")
    history = load_checkpoint(ckpt)["history"]
    kept = [{k: v for k, v in h.items() if k.startswith(_KEEP_PREFIXES)} for h in history]
    tmp = out / "history.json.tmp"
    tmp.write_text(json.dumps(kept))
    tmp.replace(out / "history.json")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


class Worker:
    """A long-lived worker process (one torch thread) that trains the cells it is sent, one at a time.

    Importing torch / transformers / mlflow costs seconds per process, so cells share a process. Protocol:
    a cell folder per stdin line; the worker answers ``@@ok`` or ``@@fail`` on stdout (other stdout lines are
    ignored) and appends the run's log to ``<cell>/log.txt``.
    """

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        log = open(self.log_path, "a")
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)

    def run(self, out: Path) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{out}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line.strip() == "@@ok"
        return False  # the worker died; the next run starts a fresh one

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def serve() -> None:
    """Worker mode: train the cell folders read from stdin (see ``Worker``)."""
    import logging
    import traceback

    logging.basicConfig(level=logging.INFO)
    for line in sys.stdin:
        out = Path(line.strip())
        handler = logging.FileHandler(out / "log.txt")
        logging.getLogger().addHandler(handler)
        try:
            run_cell(out)
            ok = True
        except Exception:  # a failed cell is reported and the matrix goes on
            logging.getLogger("stability").error("run failed:\n%s", traceback.format_exc())
            ok = False
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        print("@@ok" if ok else "@@fail", flush=True)


def mlflow_template(bench_dir: Path) -> Path:
    """An empty MLflow sqlite store, created once: a fresh store runs its schema migrations (~5-20 s each)."""
    path = bench_dir / "mlflow_template.db"
    if not path.exists():
        from mlflow.tracking import MlflowClient

        tmp = bench_dir / "mlflow_template.tmp.db"
        tmp.unlink(missing_ok=True)
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()
        tmp.replace(path)
    return path


def prepare(out: Path, overrides: list[str], template: Path, base: Path = BASE_CONFIG) -> bool:
    """Write the cell's spec (base config + dotlist); False when the cell already finished."""
    if (out / "summary.json").exists() and (out / "history.json").exists():
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / "cell.json").write_text(json.dumps({"base": str(base), "overrides": overrides}, indent=1))
    if not (out / "mlflow.db").exists():
        shutil.copyfile(template, out / "mlflow.db")
    return True


def warm_cold_starts(profile: Profile, base: Path = BASE_CONFIG) -> None:
    """Train (or find cached) each seed's cold start once, before parallel workers could race on it."""
    from dcmdp.config import load_config
    from trainers.coldstart import cold_start
    from trainers.models import build_model
    from trainers.tasks import TASKS
    from trainers.tokenizer import build_char_tokenizer

    import torch

    torch.set_num_threads(1)  # the runs' threads=1: the cold start (and its cache key) depend on the thread count
    for seed in profile.seeds:
        cfg = load_config(base, [*profile.overrides, f"seed={seed}", "progress=false"])
        if cfg.cold_start.steps == 0:
            continue
        tok = build_char_tokenizer()
        cs_seed = seed if cfg.cold_start.seed is None else cfg.cold_start.seed  # as dcmdp.loop.setup does
        model = build_model(cfg.model, len(tok), seed=cs_seed)
        cold_start(model, tok, TASKS[cfg.task.name](cfg.task, seed), cfg.cold_start, cfg.model, seed=cs_seed,
                   eos_id=tok.eos_token_id, progress=False)


# ------------------------------------------------------------------------------------------- analysis


@dataclass
class RunResult:
    method: str
    n: int
    seed: int
    steps: int
    acc_before: float
    acc_after: float
    eval_steps: list[int]
    eval_acc: list[float]
    collapsed: bool
    collapse_reason: str
    mean_discrepancy: float
    inside_share: float
    final_lambda: float
    nonfinite_updates: int
    seconds: float
    # means over steps of the DIAGNOSTICS metrics (nan where a method does not log one)
    diagnostics: dict[str, float]
    # per step: the D-hat the dual was fed, its tolerance, lambda after the dual step
    measured: list[float] = field(default_factory=list)
    tolerance: float = float("nan")
    lambdas: list[float] = field(default_factory=list)


# diagnostics table: column -> (metric, over which steps: "all" or "last10")
DIAGNOSTICS: dict[str, tuple[str, str]] = {
    "mean λ": ("dual/lambda/abs_prob_diff", "all"),
    "penalty loss": ("penalty/loss", "all"),
    "tokens outside c in updates": ("dual/outside_frac/abs_prob_diff", "all"),
    "|policy loss|": ("loss/policy", "all"),
    "approx KL(π_old‖π_θ)": ("policy/approx_kl", "all"),
    "clip frac": ("clip/frac", "all"),
    "routing mismatch": ("routing/mismatch", "all"),
    "entropy, last 10 steps": ("policy/entropy", "last10"),
}


def diagnostics(history: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for col, (key, which) in DIAGNOSTICS.items():
        rows = history[-10:] if which == "last10" else history
        vals = [abs(h[key]) if key == "loss/policy" else h[key] for h in rows if key in h]
        out[col] = float(np.mean(vals)) if vals else math.nan
    return out


def collapse_check(eval_acc: Sequence[float], reward_acc: Sequence[float], nonfinite: int,
                   warmup: int) -> tuple[bool, str]:
    """(collapsed, reason) by the module docstring's rule (a) non-finite, (b) held-out, (c) running reward."""
    if nonfinite > 0:
        return True, f"{nonfinite} non-finite updates"
    if eval_acc and eval_acc[-1] < 0.5 * max(eval_acc):
        return True, f"held-out {eval_acc[-1]:.3f} < half of peak {max(eval_acc):.3f}"
    r = np.asarray(reward_acc, dtype=np.float64)
    w = max(5, len(r) // 20)
    if len(r) >= w + warmup:
        running = np.convolve(r, np.ones(w) / w, mode="valid")  # running[i] = mean of r[i : i + w]
        peak = running[warmup:].max()
        if running[-1] < 0.5 * peak:
            return True, f"reward accuracy {running[-1]:.3f} < half of peak {peak:.3f}"
    return False, ""


def load_run(out: Path, method: str, n: int, seed: int, warmup: int) -> RunResult:
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "history.json").read_text())
    eval_steps, eval_acc = [0], [summary["accuracy_before"]]
    for i, h in enumerate(history):
        if "eval/accuracy" in h:
            eval_steps.append(i + 1), eval_acc.append(h["eval/accuracy"])
    eval_steps.append(summary["steps"]), eval_acc.append(summary["accuracy_after"])
    nonfinite = int(sum(h.get("guard/skipped_update", 0.0) > 0 for h in history))
    collapsed, reason = collapse_check(eval_acc, [h["reward/accuracy"] for h in history], nonfinite, warmup)
    measured = np.array([h["dual/measured/abs_prob_diff"] for h in history])
    tol = np.array([h["dual/tolerance/abs_prob_diff"] for h in history])
    return RunResult(method, n, seed, summary["steps"], summary["accuracy_before"], summary["accuracy_after"],
                     eval_steps, eval_acc, collapsed, reason,
                     float(np.mean([h["discrepancy/abs_prob_diff"] for h in history])),
                     float(np.mean(measured <= tol)), float(summary["final_lambda"].get("abs_prob_diff", 0.0)),
                     nonfinite, float(summary["seconds"]), diagnostics(history), measured.tolist(), float(tol[-1]),
                     [h["dual/lambda/abs_prob_diff"] for h in history])


def aggregate(runs: list[RunResult], profile: Profile) -> list[dict]:
    cells = []
    for n in profile.minibatches:
        for method in profile.methods:
            rs = [r for r in runs if r.method == method and r.n == n]
            if not rs:
                continue
            acc = np.array([r.acc_after for r in rs])
            # paired by seed: the cold start (and so the starting accuracy) differs a lot between seeds
            delta = np.array([r.acc_after - r.acc_before for r in rs])
            cells.append({"method": method, "N": n, "seeds": len(rs),
                          "acc_before": float(np.mean([r.acc_before for r in rs])),
                          "acc_mean": float(acc.mean()), "acc_sd": float(acc.std(ddof=1)) if len(rs) > 1 else 0.0,
                          "delta_mean": float(delta.mean()),
                          "delta_sd": float(delta.std(ddof=1)) if len(rs) > 1 else 0.0,
                          "collapses": int(sum(r.collapsed for r in rs)),
                          "mean_discrepancy": float(np.mean([r.mean_discrepancy for r in rs])),
                          "inside_share": float(np.mean([r.inside_share for r in rs])),
                          "final_lambda": float(np.mean([r.final_lambda for r in rs])),
                          "minutes": float(np.sum([r.seconds for r in rs]) / 60),
                          "diagnostics": {k: float(np.nanmean([r.diagnostics[k] for r in rs]))
                                          if any(np.isfinite(r.diagnostics[k]) for r in rs) else math.nan
                                          for k in DIAGNOSTICS}})
    return cells


def table(cells: list[dict]) -> list[str]:
    lines = ["| N | method | held-out acc before | final held-out acc (mean ± sd) | change (after − before, "
             "mean ± sd) | collapses | mean abs_prob_diff | steps inside c | final λ |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['N']} | {c['method']} | {c['acc_before']:.3f} | {c['acc_mean']:.3f} ± {c['acc_sd']:.3f} | "
                     f"{c['delta_mean']:+.3f} ± {c['delta_sd']:.3f} | "
                     f"{c['collapses']}/{c['seeds']} | {c['mean_discrepancy']:.3e} | {c['inside_share']:.0%} | "
                     f"{c['final_lambda']:.3g} |")
    return lines


def diagnostics_table(cells: list[dict]) -> list[str]:
    lines = ["| N | method | " + " | ".join(DIAGNOSTICS) + " |", "|---|---|" + "---|" * len(DIAGNOSTICS)]
    for c in cells:
        vals = ["-" if not np.isfinite(v) else f"{v:.3g}" for v in c["diagnostics"].values()]
        lines.append(f"| {c['N']} | {c['method']} | " + " | ".join(vals) + " |")
    return lines


def plot(runs: list[RunResult], cells: list[dict], profile: Profile, prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    n_max = max(profile.minibatches)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in profile.methods:
        rs = [r for r in runs if r.method == method and r.n == n_max]
        if not rs:
            continue
        steps = rs[0].eval_steps
        acc = np.mean([r.eval_acc for r in rs if r.eval_steps == steps], axis=0)
        ax.plot(steps, acc, marker="o", ms=3, label=f"{method} ({len(rs)} seeds)")
    ax.set_xlabel("RL step"), ax.set_ylabel("held-out accuracy (mean over seeds)")
    ax.set_title(f"tiny-moe, {profile.precision} rollouts, N = {n_max} mini-batches")
    ax.grid(alpha=0.3), ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_accuracy_N%d.png" % n_max))
    fig.savefig(paths[-1], dpi=120), plt.close(fig)

    paths.append(plot_final_accuracy(cells, profile, prefix.with_name(prefix.name + "_final_accuracy.png")))

    # the dual at the largest N: D-hat (5-step running mean, mean over seeds) against c, and lambda
    dual_methods = [m for m in profile.methods if any(r.method == m and r.n == n_max and any(r.lambdas) for r in runs)]
    if dual_methods:
        fig, (ax_d, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
        for k, method in enumerate(dual_methods):
            rs = [r for r in runs if r.method == method and r.n == n_max]
            steps = min(len(r.measured) for r in rs)
            color = f"C{k}"
            d = np.mean([r.measured[:steps] for r in rs], axis=0)
            w = min(5, steps)
            ax_d.plot(np.arange(w, steps + 1), np.convolve(d, np.ones(w) / w, mode="valid"), color=color, label=method)
            ax_d.axhline(rs[0].tolerance, color=color, ls="--", lw=0.8)
            ax_l.plot(np.arange(1, steps + 1), np.mean([r.lambdas[:steps] for r in rs], axis=0), color=color,
                      label=method)
        ax_d.set_yscale("log"), ax_d.set_xlabel("RL step"), ax_d.grid(alpha=0.3)
        ax_d.set_ylabel("D̂ fed to the dual (5-step mean; dashed: c)")
        ax_l.set_xlabel("RL step"), ax_l.set_ylabel("λ (mean over seeds)"), ax_l.grid(alpha=0.3)
        ax_l.legend(fontsize=7)
        fig.suptitle(f"the dual at N = {n_max}"), fig.tight_layout()
        paths.append(prefix.with_name(prefix.name + "_dual_N%d.png" % n_max))
        fig.savefig(paths[-1], dpi=120), plt.close(fig)
    return paths



def plot_final_accuracy(cells: list[dict], profile: Profile, path: Path) -> Path:
    """Bars of the final held-out accuracy per method and N (mean ± sd over seeds), the legend above the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(profile.minibatches)
    x = np.arange(len(profile.methods))
    top = 0.0
    for j, n in enumerate(profile.minibatches):
        by = {c["method"]: c for c in cells if c["N"] == n}
        mean = [by[m]["acc_mean"] if m in by else np.nan for m in profile.methods]
        sd = [by[m]["acc_sd"] if m in by else 0.0 for m in profile.methods]
        top = max(top, np.nanmax(np.add(mean, sd)) if not np.all(np.isnan(mean)) else 0.0)
        ax.bar(x + (j - (len(profile.minibatches) - 1) / 2) * width, mean, width, yerr=sd, capsize=2, label=f"N = {n}")
    before = np.mean([c["acc_before"] for c in cells])
    ax.axhline(before, color="k", ls="--", lw=1, label="before RL (mean)")
    ax.set_xticks(x, profile.methods, rotation=20), ax.set_ylabel("final held-out accuracy (mean ± sd)")
    ax.set_ylim(0, max(top, before, 0.05) * 1.22)
    ax.grid(axis="y", alpha=0.3), ax.legend(fontsize=8, loc="upper center", ncol=len(profile.minibatches) + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120), plt.close(fig)
    return path

def write_results(runs: list[RunResult], cells: list[dict], profile_name: str, profile: Profile, prefix: Path,
                  cmd: str, wall_s: float) -> list[str]:
    import torch
    import transformers

    prefix.parent.mkdir(parents=True, exist_ok=True)
    lines = table(cells)
    pngs = plot(runs, cells, profile, prefix)
    with open(prefix.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "N", "seed", "steps", "acc_before", "acc_after", "collapsed", "collapse_reason",
                    "mean_abs_prob_diff", "inside_share", "final_lambda", "nonfinite_updates", "seconds"])
        for r in runs:
            w.writerow([r.method, r.n, r.seed, r.steps, r.acc_before, r.acc_after, r.collapsed, r.collapse_reason,
                        r.mean_discrepancy, r.inside_share, r.final_lambda, r.nonfinite_updates, round(r.seconds, 1)])
    prefix.with_suffix(".json").write_text(json.dumps(
        {"profile": profile_name, "tolerance": profile.tolerance,
         "methods": {m: ALL_METHODS[m] for m in profile.methods},
         "overrides": list(profile.overrides), "cells": cells,
         "runs": [{"method": r.method, "N": r.n, "seed": r.seed, "eval_steps": r.eval_steps, "eval_acc": r.eval_acc,
                   "collapsed": r.collapsed, "collapse_reason": r.collapse_reason} for r in runs]}, indent=1))
    methods = ["| method | overrides (on top of the profile) |", "|---|---|"]
    methods += [f"| {m} | `{' '.join(ALL_METHODS[m])}` |" for m in profile.methods]
    header = [
        f"# Stability matrix ({profile_name} profile): tiny-moe, {profile.precision} rollouts, off-policiness N", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: {platform.node()} {platform.machine()} ({torch.backends.cpu.get_cpu_capability()} kernels), "
        f"{os.cpu_count()} logical CPUs shared with other workers; every run one process with one torch thread",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"- command: `{cmd}` ({wall_s / 60:.0f} min wall over the invocations that trained the runs; "
        f"{sum(r.seconds for r in runs) / 60:.0f} run-minutes in all)",
        f"- profile: {profile.about}",
        f"- base: `configs/default.yaml` + `{' '.join(profile.overrides)}` + the constraint "
        f"`abs_prob_diff <= {profile.tolerance}` (lambda_0 {LAMBDA_INIT}, eta {DUAL_LR}) + the method + "
        "`algo.minibatches=N seed=S`",
        f"- tolerance rule (fixed before the runs): {profile.tolerance_rule}: {profile.tolerance}",
        "- collapse (any of): a non-finite loss in some update; final held-out accuracy < half the run's best "
        "held-out accuracy (step 0 included); mean reward accuracy over the last W = max(5, steps/20) steps < half "
        "the best W-step running mean after the LR warm-up",
        "- columns: held-out accuracy on the task's fixed eval set, sampled at temperature 1, before RL and after "
        "the last step (mean ± sd over seeds); mean abs_prob_diff = pi_old vs mu before the updates, mean over "
        "steps and seeds; steps inside c = share of steps with that batch value <= c; final λ = mean over seeds "
        "(0 where the dual is off)", "",
        *methods, ""]
    plots = [f"![{p.stem}]({p.name})" for p in pngs]
    diag = ["", "Diagnostics (means over steps and seeds; penalty loss and tokens outside c are logged only where "
            "the penalty is on; approx KL and clip frac measure how far the N mini-batch updates move π_θ from "
            "π_old):", "", *diagnostics_table(cells)]
    page = prefix.with_suffix(".md")
    page.write_text("\n".join(header + lines + diag + [""] + plots + reading_lines(page)) + "\n")
    return lines


# ------------------------------------------------------------------------------------------- main


def run_matrix(profile_name: str, bench_dir: Path, results_prefix: Path, workers: int,
               argv: Optional[Sequence[str]] = None) -> list[dict]:
    from dcmdp.config import load_config

    profile = PROFILES[profile_name]
    bench_dir.mkdir(parents=True, exist_ok=True)
    warm_cold_starts(profile)
    jobs = []
    # largest N first, then seed-major: a partial matrix has every method at the most off-policy N first
    for n in sorted(profile.minibatches, reverse=True):
        for seed in profile.seeds:
            for method in profile.methods:
                out = cell_dir(bench_dir, method, n, seed)
                overrides = cell_overrides(profile, method, n, seed, out)
                load_config(BASE_CONFIG, overrides)  # a bad override fails here, before anything trains
                jobs.append(((method, n, seed), out, overrides))
    template = mlflow_template(bench_dir)
    todo = [(out, ov) for _, out, ov in jobs if prepare(out, ov, template)]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already finished; training {len(todo)} with {workers} "
          f"workers", flush=True)
    pool_workers: queue.Queue[Worker] = queue.Queue()
    for k in range(max(1, workers)):
        pool_workers.put(Worker(bench_dir / f"worker{k}.log"))

    def one(out: Path) -> tuple[Path, bool]:
        worker = pool_workers.get()
        try:
            return out, worker.run(out)
        finally:
            pool_workers.put(worker)

    t0 = time.perf_counter()
    failed = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(one, out) for out, _ in todo]
        for i, fut in enumerate(futures):
            out, ok = fut.result()
            if not ok:
                failed.append(out)
            print(f"[{i + 1}/{len(todo)}] {out.name}: {'done' if ok else 'FAILED, see ' + str(out / 'log.txt')} "
                  f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    while not pool_workers.empty():
        pool_workers.get().close()
    # wall time summed over the invocations that trained this bench dir's runs (a resumed matrix adds up)
    wall_file = bench_dir / "wall_seconds.txt"
    wall = time.perf_counter() - t0 + (float(wall_file.read_text()) if wall_file.exists() else 0.0)
    wall_file.write_text(f"{wall:.1f}\n")
    warmup = load_config(BASE_CONFIG, list(profile.overrides)).optim.warmup_steps
    runs = [load_run(out, *key, warmup=warmup) for key, out, _ in jobs
            if (out / "summary.json").exists() and (out / "history.json").exists()]
    cells = aggregate(runs, profile)
    cmd = "OMP_NUM_THREADS=%s .venv/bin/python benchmarks/stability.py %s" % (
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
    ap.add_argument("--bench-dir", default=None, help="run folders (default: outputs/stability_<profile>)")
    ap.add_argument("--results", default=None,
                    help="results prefix (default: benchmarks/results/stability_<profile>)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # worker mode (see Worker)
    args = ap.parse_args(argv)
    if args.serve:
        serve()
        return
    bench = Path(args.bench_dir) if args.bench_dir else ROOT / "outputs" / f"stability_{args.profile}"
    results = Path(args.results) if args.results else ROOT / "benchmarks" / "results" / f"stability_{args.profile}"
    run_matrix(args.profile, bench.resolve(), results.resolve(), args.workers, argv)


if __name__ == "__main__":
    main()
