"""What each speed switch pays, alternated in one process: the phase it acts on, with the switch on and off.

On trl_throughput.py's ``long-small-moe`` workload, ``--rounds`` rounds each time every variant once; speed-up =
median (time off) / (time on). Generation: ``rollout.torch.drop_finished`` x ``gqa_decode`` (tokens checked
equal); training step: ``algo.micro_batch_tokens`` x ``model.gqa_attention``; logging: ``tracking.async_log``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed_switches.py            # writes results/speed_switches.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._page import cpu_model, rel  # noqa: E402
from dcmdp.config import TrackingConfig, load_config  # noqa: E402
from dcmdp.policy import encode_prompt  # noqa: E402
from dcmdp.tracking import Tracker  # noqa: E402
from trainers import learner  # noqa: E402
from trainers.attention import GQA_ATTENTION  # noqa: E402
from trainers.config import AlgoConfig, RolloutConfig, TorchEngineConfig  # noqa: E402
from trainers.engines.torch_engine import TorchEngine  # noqa: E402
from trainers.models import ATTN_IMPLEMENTATION, load_model_dir  # noqa: E402
from trainers.tasks import TASKS  # noqa: E402
from trainers.tokenizer import build_char_tokenizer  # noqa: E402


def _throughput_module():
    spec = importlib.util.spec_from_file_location("trl_throughput", ROOT / "benchmarks" / "trl_throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_throughput"] = module
    spec.loader.exec_module(module)
    return module


def alternate(variants: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of every variant (a callable) per round, variants in turn within a round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def speedups(times: dict[str, list[float]], base: str) -> dict[str, dict]:
    return {name: {"median_s": statistics.median(ts),
                   "speedup": statistics.median(b / t for b, t in zip(times[base], ts)),
                   "per_round": [b / t for b, t in zip(times[base], ts)]} for name, ts in times.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speed_switches.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bench = _throughput_module()
    w = bench.WORKLOADS["long-small-moe"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, _ = bench.prepare_model(w, argparse.Namespace(seed=0, threads=1), Path(tmp))
    model = load_model_dir(model_dir, "float32")
    cfg = load_config(str(ROOT / w.config), [])
    task = TASKS[cfg.task.name](cfg.task, 0)
    tokenizer = build_char_tokenizer()
    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in task.sample(random.Random(0), w.prompts)
               for _ in range(w.samples)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    # generation
    engines = {f"drop_finished={d}, gqa_decode={g}": TorchEngine(
        RolloutConfig(max_new_tokens=w.max_new_tokens, torch=TorchEngineConfig(drop_finished=d, gqa_decode=g)),
        model, eos_id=eos, pad_id=pad) for d in (False, True) for g in (False, True)}
    rollouts = {}
    gen_times = alternate({name: (lambda n=name, e=engine: rollouts.__setitem__(n, e.generate(prompts, seed=1)))
                           for name, engine in engines.items()}, args.rounds)
    base_gen = "drop_finished=False, gqa_decode=False"
    ref = rollouts[base_gen]
    for name, r in rollouts.items():
        if not torch.equal(r.response_ids_BT, ref.response_ids_BT):
            raise RuntimeError(f"{name}: other tokens than {base_gen}")
    logp_diff = {name: float((r.rollout_logp_BT - ref.rollout_logp_BT).abs().max()) for name, r in rollouts.items()}

    # training step
    algo = AlgoConfig(minibatches=1, samples_per_prompt=w.samples, prompts_per_step=w.prompts)
    adv_B = torch.randn(len(ref), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)

    def train_step(budget: int, gqa: bool):
        model.set_attn_implementation(GQA_ATTENTION if gqa else ATTN_IMPLEMENTATION)
        spec = learner.ScoringSpec(moe=True, micro_batch_tokens=budget)
        batch, forward = learner.score_on_policy(model, ref, adv_B, algo, spec)
        learner.update(model, learner.OptimStep(optimizer, grad_clip=1.0), batch, scoring=spec,
                       penalty=learner.PenaltySpec(), cfg=algo, generator=torch.Generator().manual_seed(0),
                       forward=forward)

    train_times = alternate({f"micro_batch_tokens={b}, gqa_attention={g}": (lambda b=b, g=g: train_step(b, g))
                             for b in (0, 4096) for g in (False, True)}, args.rounds)
    base_train = "micro_batch_tokens=0, gqa_attention=False"

    # logging: seconds inside log_metrics per step
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    log_times: dict[str, list[float]] = {"async_log=False": [], "async_log=True": []}
    for _ in range(args.rounds):
        for async_log in (False, True):
            with tempfile.TemporaryDirectory() as d:
                tracker = Tracker(TrackingConfig(async_log=async_log), d)
                tracker.start({"seed": "0"})
                calls = []
                for step in range(20):
                    metrics = {f"group{i // 10}/metric{i}": step + i / 7 for i in range(60)}
                    t0 = time.perf_counter()
                    tracker.log_metrics(metrics, step)
                    calls.append(time.perf_counter() - t0)
                    time.sleep(0.05)
                tracker.finish()
            log_times[f"async_log={async_log}"].append(statistics.median(calls))

    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs (shared with other jobs)",
              "torch": torch.__version__, "rounds": args.rounds, "model_dir": rel(model_dir),
              "response_tokens": int(ref.response_mask_BT.sum()), "rows": len(ref),
              "generation": speedups(gen_times, base_gen), "logp_max_abs_diff": logp_diff,
              "training": speedups(train_times, base_train), "logging": speedups(log_times, "async_log=False")}
    Path(args.out).write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    lines = ["# What each speed switch pays (alternated in one process)", "",
             f"- date: {r['date']}; machine: {r['machine']}; torch {r['torch']}, 1 thread; "
             f"{r['rounds']} rounds, variants in turn",
             "- command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed_switches.py`",
             f"- batch: the long-small-moe workload of trl_throughput.py, {r['rows']} rows, {r['response_tokens']} "
             f"response tokens, model {r['model_dir']}", ""]
    for phase, note in (("generation", "one engine.generate of the batch; same tokens in every variant, max |log mu "
                                       "- log mu(both off)| in the last column"),
                        ("training", "score_on_policy + update (N = 1, AdamW)"),
                        ("logging", "median seconds a step spends in log_metrics (60 metrics)")):
        lines += [f"## {phase}: {note}", "", "| variant | median s | speed-up vs all off, median (range) |"
                  + (" max abs log mu diff |" if phase == "generation" else ""),
                  "|---|---|---|" + ("---|" if phase == "generation" else "")]
        for name, v in r[phase].items():
            rng = f"{v['speedup']:.2f} ({min(v['per_round']):.2f} to {max(v['per_round']):.2f})"
            extra = f" {r['logp_max_abs_diff'][name]:.1e} |" if phase == "generation" else ""
            lines.append(f"| {name} | {v['median_s']:.4g} | {rng} |{extra}")
        lines.append("")
    lines.append("The machine's 2 cores were shared with other jobs: single times move, the per-round ratios less.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
