"""Training throughput: ``dcmdp train`` vs TRL's ``GRPOTrainer`` on the same model, task, batch and CPU.

Both sides start from one tiny Qwen3-MoE directory (``tiny-moe`` preset, supervised cold start on 2-digit
addition from ``trainers.coldstart``, saved with the project's character tokenizer by ``save_model_dir``),
see the same prompts in the same order (each step's prompts are drawn exactly as ``dcmdp.loop.rollout_phase``
draws them), sample ``samples_per_prompt`` completions per prompt at temperature 1 with at most
``max_new_tokens`` tokens, score them with the same ``Task.reward`` and take one AdamW step per rollout batch
(same lr, betas, weight decay, grad-norm clip, constant schedule).

- dcmdp: ``python -m dcmdp.cli train configs/default.yaml`` with DCMDP on (hinge penalty, projected dual
  step on abs_prob_diff), off-policy N = 1 (``algo.minibatches=1``), the embedded torch rollout engine in
  fp32, ``model.path`` = the shared directory. Per-step times come from the run's MLflow store
  (``time/rollout``, ``time/old_logp``, ``time/measure``, ``time/update``, ``time/dual``, ``time/sync``, see
  ``dcmdp.loop._timings``); the step period is the gap between consecutive steps' metric timestamps, so
  logging, progress and everything else between steps is included.
- TRL: ``benchmarks/_trl_runner.py`` in ``.venv-trl`` (``bash benchmarks/setup_trl.sh``), GRPOConfig with
  num_generations = G, one generation batch of P x G completions per optimizer step
  (per_device_train_batch_size = P x G, gradient_accumulation_steps = steps_per_generation = num_iterations
  = 1), beta 0 (no KL, no reference model), loss_type ``dapo`` (token sum / tokens of the batch, dcmdp's
  normalisation), clip 0.2 / 0.28, use_vllm False, report_to none, fp32, no gradient checkpointing.
  Phase times come from timing wrappers around GRPOTrainer's methods; the step period is the gap between
  consecutive ``on_step_end`` callbacks.

Throughput of a run: response tokens (EOS included) of the timed steps / their summed step periods; the
first ``--warmup`` steps of every run are not timed. The sides alternate (A B, then B A, ...) for
``--repeats`` repetitions; the table gives medians over repetitions and the median of the per-repetition
ratios dcmdp / TRL.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trl_throughput.py            # full, writes results/
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trl_throughput.py --smoke    # seconds, dcmdp side only
    .venv/bin/python benchmarks/trl_throughput.py --render benchmarks/results/trl_throughput.json  # md only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from dcmdp.config import load_config  # noqa: E402
from dcmdp.policy import step_seed  # noqa: E402
from trainers.coldstart import cold_start  # noqa: E402
from trainers.models import build_model, save_model_dir  # noqa: E402
from trainers.tasks import TASKS  # noqa: E402
from trainers.tokenizer import build_char_tokenizer  # noqa: E402

CONFIG = ROOT / "configs" / "default.yaml"
TRL_VENV = ROOT / ".venv-trl"
DCMDP_PHASES = ("time/rollout", "time/old_logp", "time/measure", "time/update", "time/dual", "time/sync")
TRL_PHASES = ("time/generate", "time/score", "time/loss_forward", "time/backward", "time/optimizer")


def run_config(args, model_dir: str, output_dir: str) -> list[str]:
    """dcmdp overrides of configs/default.yaml for this benchmark (also the TRL side's settings)."""
    return [f"output_dir={output_dir}", f"steps={args.steps}", f"threads={args.threads}", "progress=false",
            f"seed={args.seed}", f"model.path={model_dir}", "cold_start.steps=0", "rollout.engine=torch",
            "rollout.precision=fp32", "rollout.temperature=1.0", f"rollout.max_new_tokens={args.max_new_tokens}",
            "algo.minibatches=1", f"algo.prompts_per_step={args.prompts}", f"algo.samples_per_prompt={args.samples}",
            "optim.warmup_steps=0", f"task.eval_size={args.eval_size}"]


def prepare_model(args, work: Path) -> tuple[str, dict]:
    """The shared model directory: tiny-moe, cold-started (cached in .dcmdp_cache) unless --coldstart-steps 0."""
    cfg = load_config(str(CONFIG), [f"cold_start.steps={args.coldstart_steps}", f"seed={args.seed}"])
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    task = TASKS[cfg.task.name](cfg.task, cfg.seed)
    model = build_model(cfg.model, len(tokenizer), seed=cfg.seed)
    if cfg.cold_start.steps > 0:
        _, info = cold_start(model, tokenizer, task, cfg.cold_start, cfg.model, seed=cfg.seed,
                             eos_id=tokenizer.eos_token_id, progress=False)
        return str(info.pop("model_dir")), {k: float(v) for k, v in info.items()}
    model_dir = str(work / "model")
    save_model_dir(model, tokenizer, model_dir)
    return model_dir, {}


def step_prompts(args) -> list[list[str]]:
    """[prompt, answer] rows in step order: step s's prompts drawn as dcmdp.loop.rollout_phase draws them."""
    cfg = load_config(str(CONFIG), [f"seed={args.seed}", f"task.eval_size={args.eval_size}"])
    task = TASKS[cfg.task.name](cfg.task, cfg.seed)
    rows = []
    for step in range(args.steps):
        rng = random.Random(step_seed(args.seed, step, 0))
        rows += [[ex.prompt, ex.answer] for ex in task.sample(rng, args.prompts)]
    return rows


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)  # the run's own sqlite store under its output_dir
    return env


def run_dcmdp(args, model_dir: str, work: Path, rep: int) -> dict:
    out = work / f"dcmdp-{rep}"
    cmd = [sys.executable, "-m", "dcmdp.cli", "train", str(CONFIG.relative_to(ROOT)),
           *run_config(args, model_dir, str(out))]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(args.threads), check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return {"steps": read_dcmdp_steps(out, args), "wall": wall, "command": cmd}


def read_dcmdp_steps(out: Path, args) -> list[dict]:
    """Per-step records from the run's local MLflow store: phases, tokens and the step's end time (s).

    Read with sqlite3 from MLflow's ``metrics`` table (run_uuid, key, value, timestamp in ms, step) rather
    than through the mlflow client, whose import alone costs seconds of CPU.
    """
    run_id = json.loads((out / "summary.json").read_text())["run_id"]
    keys = DCMDP_PHASES + ("time/step", "response/length_mean")
    with sqlite3.connect(out / "mlflow.db") as db:
        rows = db.execute(f"SELECT key, value, timestamp, step FROM metrics WHERE run_uuid = ? AND key IN "
                          f"({','.join('?' * len(keys))})", (run_id, *keys)).fetchall()
    by_step: dict[int, dict] = {}
    for key, value, timestamp, step in rows:
        rec = by_step.setdefault(step, {})
        rec[key] = value
        if key == "time/step":
            rec["end"] = timestamp / 1000.0
    steps = []
    for step in sorted(by_step):
        rec = by_step[step]
        rec["tokens"] = rec.pop("response/length_mean") * args.prompts * args.samples
        steps.append(rec)
    return steps


def run_trl(args, model_dir: str, work: Path, rep: int, prompts: list[list[str]]) -> dict:
    cfg = load_config(str(CONFIG), run_config(args, model_dir, str(work)))
    spec = {"model_dir": model_dir, "task": {k: getattr(cfg.task, k) for k in ("name", "digits", "items", "eval_size")},
            "prompts": prompts, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
            "max_new_tokens": args.max_new_tokens, "steps": args.steps, "lr": cfg.optim.lr,
            "betas": list(cfg.optim.betas), "weight_decay": cfg.optim.weight_decay, "grad_clip": cfg.optim.grad_clip,
            "clip_low": cfg.algo.clip_low, "clip_high": cfg.algo.clip_high, "std_normalize": cfg.algo.std_normalize,
            "temperature": cfg.rollout.temperature, "threads": args.threads, "seed": args.seed}
    spec_path, out_path = work / f"trl-{rep}.spec.json", work / f"trl-{rep}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(TRL_VENV / "bin" / "python"), "benchmarks/_trl_runner.py", "--spec", str(spec_path),
           "--out", str(out_path)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(args.threads), check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out_path.read_text())
    expected = [sorted({p for p, _ in prompts[i * args.prompts:(i + 1) * args.prompts]}) for i in range(args.steps)]
    if result["prompts_seen"] != expected:
        raise RuntimeError("TRL did not see the dcmdp run's prompts in the dcmdp run's order")
    result["wall_outer"] = time.perf_counter() - t0
    result["command"] = cmd
    return result


def summarize(steps: list[dict], phases: tuple[str, ...], warmup: int) -> dict:
    """Throughput over the timed steps; per-phase medians; 'other' = period minus the phases."""
    if len(steps) < warmup + 2:
        raise ValueError(f"need at least warmup + 2 = {warmup + 2} steps to time a period, got {len(steps)}")
    timed = steps[warmup + 1:]
    periods = [b["end"] - a["end"] for a, b in zip(steps[warmup:], timed)]
    tokens = sum(s["tokens"] for s in timed)
    out = {"tokens_per_s": tokens / sum(periods), "steps_per_s": len(periods) / sum(periods),
           "tokens_per_step": tokens / len(timed), "period_median": statistics.median(periods)}
    for p in phases:
        out[p] = statistics.median(s[p] for s in timed)
    out["time/other"] = statistics.median(per - sum(s[p] for p in phases) for per, s in zip(periods, timed))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps of every run (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated repetitions per side (default 3)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step P (default 32, configs/default.yaml)")
    ap.add_argument("--samples", type=int, default=16, help="samples per prompt G (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="max response tokens (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both sides (default 1)")
    ap.add_argument("--coldstart-steps", type=int, default=1150, help="supervised steps of the shared model "
                    "(default 1150, configs/default.yaml; cached)")
    ap.add_argument("--eval-size", type=int, default=256, help="held-out prompts of dcmdp's before/after eval "
                    "(outside the timed steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-trl", action="store_true", help="run the dcmdp side only")
    ap.add_argument("--smoke", action="store_true", help="seconds: 3 steps, 4 x 2 samples, random-init model, "
                    "1 repetition, dcmdp side only, results to --out-dir (a temporary folder by default)")
    ap.add_argument("--out-dir", default=None, help="where trl_throughput.{md,json} go (default "
                    "benchmarks/results, or a temporary folder with --smoke)")
    ap.add_argument("--render", default=None, metavar="JSON", help="only rewrite the markdown next to a saved "
                    "trl_throughput.json from it (no runs)")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(argparse.Namespace(**result["args"]), result))
        return result
    if args.smoke:
        args.steps, args.warmup, args.repeats, args.prompts, args.samples = 3, 1, 1, 4, 2
        args.max_new_tokens, args.coldstart_steps, args.eval_size, args.skip_trl = 4, 0, 8, True
    run_trl_side = not args.skip_trl and (TRL_VENV / "bin" / "python").exists()
    if not args.skip_trl and not run_trl_side:
        print(f"{TRL_VENV} not found (bash benchmarks/setup_trl.sh): dcmdp side only", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="trl-throughput-") as tmp:
        work = Path(tmp)
        default_out = work / "results" if args.smoke else ROOT / "benchmarks" / "results"
        out_dir = Path(args.out_dir) if args.out_dir else default_out
        model_dir, coldstart_info = prepare_model(args, work)
        prompts = step_prompts(args)
        runs: dict[str, list[dict]] = {"dcmdp": [], "trl": []}
        for rep in range(args.repeats):
            order = ["dcmdp", "trl"] if rep % 2 == 0 else ["trl", "dcmdp"]
            for side in order:
                if side == "dcmdp":
                    runs["dcmdp"].append(run_dcmdp(args, model_dir, work, rep))
                elif run_trl_side:
                    runs["trl"].append(run_trl(args, model_dir, work, rep, prompts))
                else:
                    continue
                print(f"repetition {rep + 1}/{args.repeats}: {side} done", file=sys.stderr, flush=True)
        result = report(args, runs, coldstart_info, model_dir)
        write_results(args, result, out_dir)
        print(json.dumps(result["summary"], indent=2))
    return result


def report(args, runs: dict[str, list[dict]], coldstart_info: dict, model_dir: str) -> dict:
    per_run = {"dcmdp": [summarize(r["steps"], DCMDP_PHASES, args.warmup) for r in runs["dcmdp"]],
               "trl": [summarize(r["steps"], TRL_PHASES, args.warmup) for r in runs["trl"]]}
    summary = {}
    for side, rows in per_run.items():
        if rows:
            summary[side] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    if per_run["trl"]:
        pairs = list(zip(per_run["dcmdp"], per_run["trl"]))
        summary["ratio"] = {
            "tokens_per_s": statistics.median(d["tokens_per_s"] / t["tokens_per_s"] for d, t in pairs),
            "steps_per_s": statistics.median(d["steps_per_s"] / t["steps_per_s"] for d, t in pairs),
            "per_repetition_tokens_per_s": [d["tokens_per_s"] / t["tokens_per_s"] for d, t in pairs]}
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    trl_versions = runs["trl"][0]["versions"] if runs["trl"] else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{_cpu_model()}, {platform.machine()}, {os.cpu_count()} logical CPUs (shared with other jobs)",
            "args": vars(args), "versions": {"dcmdp_env": versions, "trl_env": trl_versions},
            "coldstart": coldstart_info, "model_dir": model_dir,
            "commands": {"dcmdp": " ".join(runs["dcmdp"][0]["command"]) if runs["dcmdp"] else None,
                         "trl": " ".join(runs["trl"][0]["command"]) if runs["trl"] else None},
            "summary": summary, "per_run": per_run,
            "steps": {side: [r["steps"] for r in rs] for side, rs in runs.items()}}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def write_results(args, result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trl_throughput.json").write_text(json.dumps(result, indent=1))
    (out_dir / "trl_throughput.md").write_text(markdown(args, result))


def markdown(args, result: dict) -> str:
    s, v = result["summary"], result["versions"]
    d, t, r = s.get("dcmdp", {}), s.get("trl", {}), s.get("ratio", {})
    trl_v = v["trl_env"] or {}
    lines = [
        "# Training throughput: dcmdp vs TRL GRPOTrainer (tiny-moe, CPU)", "",
        f"- date: {result['date']}",
        f"- machine: {result['machine']}; torch threads {args.threads} on both sides, one process each",
        f"- dcmdp env: python {v['dcmdp_env']['python']}, torch {v['dcmdp_env']['torch']}, "
        f"transformers {v['dcmdp_env']['transformers']}",
        f"- TRL env (.venv-trl): python {trl_v.get('python', '-')}, torch {trl_v.get('torch', '-')}, "
        f"transformers {trl_v.get('transformers', '-')}, trl {trl_v.get('trl', '-')}",
        f"- benchmark: `OMP_NUM_THREADS={args.threads} .venv/bin/python benchmarks/trl_throughput.py "
        f"--steps {args.steps} --repeats {args.repeats} --threads {args.threads}`",
        f"- dcmdp command: `{result['commands']['dcmdp']}`",
        f"- TRL command: `{result['commands']['trl']}`",
        f"- workload: {args.prompts} prompts x {args.samples} samples per step, max {args.max_new_tokens} new tokens, "
        f"temperature 1, one AdamW step per rollout batch; {args.steps} steps per run, the first {args.warmup} "
        f"untimed; {args.repeats} alternated repetitions per side",
        f"- model: tiny-moe, {args.coldstart_steps} cold-start steps on 2-digit addition "
        f"(sampled accuracy {result['coldstart'].get('coldstart/accuracy', float('nan')):.1%})", "",
        "| | dcmdp | TRL | dcmdp / TRL |", "|---|---|---|---|",
        f"| response tokens / s (median) | {_fmt(d.get('tokens_per_s'))} | {_fmt(t.get('tokens_per_s'))} | "
        f"{_fmt(r.get('tokens_per_s'))} |",
        f"| steps / s (median) | {_fmt(d.get('steps_per_s'))} | {_fmt(t.get('steps_per_s'))} | "
        f"{_fmt(r.get('steps_per_s'))} |",
        f"| response tokens / step | {_fmt(d.get('tokens_per_step'))} | {_fmt(t.get('tokens_per_step'))} | |",
        f"| step period, s (median) | {_fmt(d.get('period_median'))} | {_fmt(t.get('period_median'))} | |", "",
        target_line(r), "",
        "| repetition (order) | dcmdp tokens/s | TRL tokens/s | dcmdp / TRL |", "|---|---|---|---|",
        *repetition_rows(result), "",
        "Where a step's time goes (median seconds per step over timed steps, then over repetitions; "
        "rows side by side are the closest counterparts):", "",
        "| dcmdp phase | s | TRL phase | s |", "|---|---|---|---|",
    ]
    # at N = 1 dcmdp's training forward runs in time/old_logp (it gives pi_old and the update back-propagates it,
    # learner.score_on_policy), so its counterpart there is TRL's scoring plus its loss forward
    pairs = [("time/rollout (sample prompts, generate)", "time/rollout", "time/generate (_generate)", "time/generate"),
             ("time/old_logp (decode, reward, advantages, the training forward that gives pi_old)", "time/old_logp",
              "time/score + time/loss_forward (decode, reward, advantages, training forward)", "_score_forward"),
             ("time/measure (discrepancy measures)", "time/measure", "-", None),
             ("time/update (backward, clip, AdamW)", "time/update", "time/backward + time/optimizer", "_update"),
             ("time/dual (dual step)", "time/dual", "-", None),
             ("time/sync (weights to the rollout engine)", "time/sync", "- (generates with the trained model)", None),
             ("other (logging, between steps)", "time/other", "other (dataloader, logging, between steps)",
              "time/other")]
    derived = {"_score_forward": _trl_sum(t, "time/score", "time/loss_forward"),
               "_update": _trl_sum(t, "time/backward", "time/optimizer")}
    for dl, dk, tl, tk in pairs:
        tv = derived[tk] if tk in derived else (t.get(tk) if tk else None)
        lines.append(f"| {dl} | {_fmt(d.get(dk))} | {tl} | {_fmt(tv)} |")
    if t:
        lines += ["", "TRL update split: " + ", ".join(f"{k} {_fmt(t[k])} s" for k in
                                                        ("time/loss_forward", "time/backward", "time/optimizer")),
                  "", reading(d, t)]
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


def _trl_sum(t: Optional[dict], *keys: str) -> Optional[float]:
    return sum(t.get(k, 0.0) for k in keys) if t else None


def reading(d: dict, t: dict) -> str:
    """The per-phase differences in words (computed, so a rerun rewrites them)."""
    extra = d["time/measure"] + d["time/dual"] + d["time/sync"]
    train_d = d["time/old_logp"] + d["time/update"]
    train_t = t["time/score"] + t["time/loss_forward"] + t["time/backward"] + t["time/optimizer"]
    return (f"Reading: per step dcmdp gains {train_t - train_d:+.3f} s in scoring + training forward, backward and "
            f"optimiser step ({train_d:.3f} vs {train_t:.3f} s) and {t['time/generate'] - d['time/rollout']:+.3f} s "
            f"in generation, and loses {d['time/other'] - t['time/other']:.3f} s between steps (MLflow logging of "
            f"every metric) and {extra:.3f} s to measure + dual + sync. A 2x lead needs a dcmdp step of "
            f"{t['period_median'] / 2:.3f} s; its generation and training forward + backward alone take "
            f"{d['time/rollout'] + train_d:.3f} s of the {d['period_median']:.3f} s it now needs, in the same "
            f"transformers kernels TRL runs.")


def target_line(ratio: dict) -> str:
    if not ratio:
        return "TRL side not run: no ratio."
    x = ratio["tokens_per_s"]
    verdict = "met" if x >= 2.0 else "not met"
    return (f"Target dcmdp >= 2x TRL tokens/s: {verdict} (median ratio {x:.2f}, per repetition "
            f"{min(ratio['per_repetition_tokens_per_s']):.2f} to {max(ratio['per_repetition_tokens_per_s']):.2f}).")


def repetition_rows(result: dict) -> list[str]:
    rows = []
    d_runs, t_runs = result["per_run"]["dcmdp"], result["per_run"]["trl"]
    for i, d in enumerate(d_runs):
        t = t_runs[i] if i < len(t_runs) else None
        order = "dcmdp, TRL" if i % 2 == 0 else "TRL, dcmdp"
        rows.append(f"| {i + 1} ({order}) | {_fmt(d['tokens_per_s'])} | {_fmt(t and t['tokens_per_s'])} | "
                    f"{_fmt(t and d['tokens_per_s'] / t['tokens_per_s'])} |")
    return rows


NOTES = """Settings matched, and where they differ:

- Same model directory and tokenizer, same kernels (sdpa attention, grouped_mm MoE experts), fp32 everywhere,
  same prompts in the same order, same reward function (`Task.reward`), same AdamW (lr, betas, weight decay 0,
  grad-norm clip 1.0, constant lr), temperature 1, top-p 1, no top-k, no KL term (TRL beta 0).
- Loss normalisation: dcmdp divides the token sum by the mini-batch's response tokens; TRL `loss_type="dapo"`
  divides by the active tokens of the global accumulated batch: with one mini-batch and no gradient
  accumulation these are the same. Advantages: both group-centred and divided by the group std
  (configs/default.yaml `std_normalize: true`, TRL `scale_rewards="group"`).
- log pi_old: at N = 1 both sides take it from the training forward (dcmdp `learner.score_on_policy`, TRL
  logp.detach() with num_iterations = 1), so neither runs the model a second time.
- What dcmdp does that TRL does not: the truncated-IS weights pi_old / mu (`tis`), the
  discrepancy measures and the hinge penalty with its dual step (DCMDP on), a separate rollout engine whose
  weights are synced after every step, MLflow logging of ~60 metrics per step, and a held-out eval before and
  after the run (outside the timed steps).
- Generation: dcmdp's embedded engine runs its own KV-cached decode loop (one forward per token, stops when
  every row has emitted EOS); TRL calls `model.generate` (the same stopping rule). Both count response tokens
  with the EOS token.
- Threads: one torch thread per side (`OMP_NUM_THREADS=1`, `threads=1`): the machine's two cores are shared
  with other jobs, and a second thread per side would only add contention.
- Timing: wall-clock periods between consecutive step ends, so everything a step costs is in; processes,
  imports and model loading are outside. The 2-core machine is shared with other jobs, so single numbers
  move; the sides were alternated and compared as per-repetition ratios."""


if __name__ == "__main__":
    main()
