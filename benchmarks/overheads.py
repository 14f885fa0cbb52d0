"""What the DCMDP machinery costs: the dual controller's share of a training step, and R3's overhead.

(a) (time/measure + time/dual) / time/step over ``--steps`` real steps of ``configs/default.yaml`` run through
the loop's ``_train_step`` (median after ``--warmup``; target <= 1%). (b) ``r3_overhead``: one learner forward +
backward with and without route replay, alternated, median ratio (target <= 3%). (c) ``--larger``: the same on
a bigger random MoE swapped into the Setup.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overheads.py

prints a table last and writes ``benchmarks/results/overheads.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402

from benchmarks._page import OtherLoad, command, env_lines, save_figure  # noqa: E402
from dcmdp.config import load_config  # noqa: E402
from dcmdp.loop import Setup, _train_step, rollout_phase, setup  # noqa: E402
from trainers import learner  # noqa: E402
from trainers.engines import build_engine  # noqa: E402
from trainers.models import model_from_config, param_counts  # noqa: E402

PHASES = ("rollout", "old_logp", "measure", "update", "dual", "sync")


class _NoBar:
    """Stands in for the tqdm bar ``_train_step`` writes its postfix to."""

    disable = False  # a shown bar: the loop writes no console line per log_every steps

    def set_postfix(self, **_):
        pass


def larger_moe_config(vocab_size: int) -> Qwen3MoeConfig:
    """A Qwen3-MoE between tiny-moe and the real ones: hidden 256, 4 layers, 32 experts, top-4."""
    return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
                          moe_intermediate_size=128, intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=True, router_aux_loss_coef=0.0, max_position_embeddings=128,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
                          tie_word_embeddings=False)


def swap_model(s: Setup, model: torch.nn.Module) -> None:
    """Replace the Setup's model (and its engine and optimiser) by ``model``, keeping everything else."""
    cfg = s.cfg
    s.policy.engine.close()
    s.policy.model = model
    s.policy.engine = build_engine(cfg.rollout, model, None, eos_id=s.policy.tokenizer.eos_token_id,
                                   pad_id=s.policy.tokenizer.pad_token_id)
    s.optim = learner.OptimStep(torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                                  weight_decay=cfg.optim.weight_decay), grad_clip=cfg.optim.grad_clip)


def controller_share(s: Setup, steps: int, warmup: int) -> dict:
    """Run ``steps`` real training steps; per-phase medians (ms) and the median per-step controller share."""
    start = len(s.state.history)
    for step in range(steps):
        _train_step(s, step, _NoBar())
    hist = s.state.history[start + warmup:]
    shares = [(h["time/measure"] + h["time/dual"]) / h["time/step"] for h in hist]
    out = {f"{p}_ms": 1e3 * statistics.median(h[f"time/{p}"] for h in hist) for p in PHASES + ("step",)}
    out.update(share=statistics.median(shares), share_max=max(shares), steps=len(hist),
               share_measure=statistics.median(h["time/measure"] / h["time/step"] for h in hist),
               share_dual=statistics.median(h["time/dual"] / h["time/step"] for h in hist),
               tokens=statistics.median(h["throughput/response_tokens_per_s"] * h["time/step"] for h in hist))
    return out


def r3_overhead(s: Setup, repeats: int) -> dict:
    """On the first mini-batch of a fresh rollout of ``s``: the median time of one learner forward + backward with
    and without replaying the rollout's routes, and the median of the per-pair ratios R3 / none over ``repeats``
    alternated pairs after 3 warm-up pairs."""
    _, rollout = rollout_phase(s.policy, s.cfg, 10**6)
    size = len(rollout) // s.cfg.algo.minibatches
    rollout, model = rollout.select(torch.arange(size)), s.policy.model
    model.train()
    scoring = learner.ScoringSpec(temperature=1.0, fp32_lm_head=True, moe=True)
    mask_BT = rollout.response_mask_BT.clone()  # the engine returns inference-mode tensors

    def step(replay):
        t0 = time.perf_counter()
        logp_BT, ent_BT, _ = learner._forward_logp(model, rollout, scoring, with_entropy=True,
                                                   replay_experts_BSLK=replay, capture=False)
        ((-logp_BT - 0.01 * ent_BT) * mask_BT).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(3):
        step(None), step(rollout.rollout_experts_BSLK)
    base, r3, ratios = [], [], []
    for i in range(repeats):
        # alternate which goes first so drifts in machine load hit both alike
        first, second = (None, rollout.rollout_experts_BSLK)[:: 1 if i % 2 == 0 else -1]
        t_first, t_second = step(first), step(second)
        a, b = (t_first, t_second) if first is None else (t_second, t_first)
        base.append(a), r3.append(b), ratios.append(b / a)
    return {"base_ms": 1e3 * statistics.median(base), "r3_ms": 1e3 * statistics.median(r3),
            "ratio": statistics.median(ratios), "ratio_q1": statistics.quantiles(ratios, n=4)[0],
            "ratio_q3": statistics.quantiles(ratios, n=4)[2], "rows": size}


def model_row(name: str, s: Setup, steps: int, warmup: int, repeats: int) -> dict:
    total, active = param_counts(s.policy.model)
    print(f"[{name}] {total / 1e6:.2f}M params ({active / 1e6:.2f}M active): {steps} steps", flush=True)
    t0 = time.perf_counter()
    ctrl = controller_share(s, steps, warmup)
    r3 = r3_overhead(s, repeats)
    print(f"[{name}] done in {time.perf_counter() - t0:.0f} s: share {ctrl['share']:.4%}, R3 {r3['ratio']:.4f}",
          flush=True)
    return {"model": name, "params": total, "active_params": active, "controller": ctrl, "r3": r3}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * len(rows)))
    for i, r in enumerate(rows):
        c = r["controller"]
        left = 0.0
        for p in PHASES:
            share = c[f"{p}_ms"] / c["step_ms"]
            ax.barh(i, share, left=left, label=p if i == 0 else None,
                    color={"measure": "tab:red", "dual": "black"}.get(p))
            left += share
    ax.set_yticks(range(len(rows)), [r["model"] for r in rows])
    ax.set_xlabel("share of the median training step (phase medians)")
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) > 1 else -0.6))
    fig.tight_layout()
    save_figure(fig, path)


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | params (active) | resp. tokens / step | step ms | measure ms | dual ms | controller share "
             "(median, max) | R3 fwd+bwd rows | none ms | R3 ms | R3 / none (IQR) |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        c, o = r["controller"], r["r3"]
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M ({r['active_params'] / 1e6:.2f}M) | "
                     f"{c['tokens']:.0f} | "
                     f"{c['step_ms']:.1f} | {c['measure_ms']:.3f} | {c['dual_ms']:.3f} | "
                     f"{c['share']:.3%} ({c['share_max']:.3%}) | {o['rows']} | {o['base_ms']:.2f} | {o['r3_ms']:.2f} | "
                     f"{o['ratio']:.4f} ({o['ratio_q1']:.4f} - {o['ratio_q3']:.4f}) |")
    return lines


def write_results(out: Path, header: list[str], lines: list[str], payload: dict, plot_fn) -> None:
    """``out`` (.md: header + table), its .json (payload) and .png (``plot_fn(rows, path)``); prints the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header + lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    plot_fn(payload["rows"], out.with_suffix(".png"))
    print("\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--steps", type=int, default=40, help="training steps per model (incl. warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--repeats", type=int, default=60, help="alternating none / R3 fwd+bwd pairs")
    ap.add_argument("--larger-steps", type=int, default=10, help="training steps of the larger MoE")
    ap.add_argument("--larger-repeats", type=int, default=30, help="R3 pairs of the larger MoE")
    ap.add_argument("--larger", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure the larger MoE shape")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overheads.md"))
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    if args.warmup >= min(args.steps, args.larger_steps if args.larger else args.steps):
        ap.error("--warmup must be smaller than --steps and --larger-steps")

    with tempfile.TemporaryDirectory(prefix="dcmdp_overheads_") as tmp:
        cfg = load_config(args.config, [f"output_dir={tmp}", "progress=false", "threads=1", "eval_every=0",
                                        *args.overrides])
        s = setup(cfg)
        try:
            with OtherLoad() as load:
                rows = [model_row(cfg.model.preset, s, args.steps, args.warmup, args.repeats)]
                if args.larger:
                    swap_model(s, model_from_config(larger_moe_config(len(s.policy.tokenizer)), seed=cfg.seed))
                    rows.append(model_row("larger-moe (h256, L4, E32 top-4)", s, args.larger_steps, args.warmup,
                                          args.larger_repeats))
        finally:
            s.tracker.finish()
            s.policy.engine.close()

    cmd = command("overheads.py", argv)
    c = cfg
    header = [
        "# DCMDP overheads: dual controller share of a training step, R3 replay overhead", "", *env_lines(cmd),
        f"- run: {Path(args.config).name} (+ overrides {args.overrides or 'none'}): {c.model.preset}, "
        f"cold start {c.cold_start.steps} steps, {c.rollout.engine} engine {c.rollout.precision} rollouts, "
        f"{c.algo.prompts_per_step} prompts x {c.algo.samples_per_prompt} samples, {c.algo.minibatches} mini-batches, "
        f"constraints {[x.measure for x in c.dual.constraints]}, rule {c.dual.rule}",
        f"- controller: {args.steps} real steps ({args.larger_steps} for larger-moe) through "
        f"`dcmdp.loop._train_step`, first {args.warmup} dropped; share = (time/measure + time/dual) / time/step "
        "of the same step, median (and max) over steps; the phase columns are per-phase medians",
        f"- R3: `r3_overhead`, {args.repeats} ({args.larger_repeats} for larger-moe) "
        "alternating pairs after 3 warm-up pairs, one learner forward + backward (with entropy) on the first "
        "mini-batch of a fresh rollout",
        "- larger-moe: random init swapped into the same Setup (same tokenizer, task, batch, config); its responses "
        "run to the token limit more often, hence more tokens per step", "",
        f"- load: other jobs used {'an unmeasured share of the CPU' if load.cores is None else f'{load.cores:.2f} cores'}"
        " on average while the steps ran (/proc/stat less this process)", "",
        "Targets: controller share <= 1%, R3 / none <= 1.03. Ratios are taken within one step (share) or from "
        "alternated pairs (R3) so that load drifts hit both sides; the IQR of the R3 ratio is machine noise.", ""]
    if len(rows) == 2:
        (a, b), (ra, rb) = (r["controller"] for r in rows), rows
        header += [f"Scale: the controller's work follows the response tokens ({a['tokens']:.0f} -> "
                   f"{b['tokens']:.0f} per step), the step's the model ({ra['active_params'] / 1e6:.2f}M -> "
                   f"{rb['active_params'] / 1e6:.2f}M active parameters): the step grows "
                   f"{b['step_ms'] / a['step_ms']:.1f}x, the controller "
                   f"{(b['measure_ms'] + b['dual_ms']) / (a['measure_ms'] + a['dual_ms']):.1f}x, and its share falls "
                   f"from {a['share']:.3%} to {b['share']:.3%}.", ""]
    write_results(Path(args.out), header, table(rows), {"command": cmd, "rows": rows}, plot)
    return rows


if __name__ == "__main__":
    main()
