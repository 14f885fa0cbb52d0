"""MoE routing replay on tiny-moe: what none / R2 / R3 do to the discrepancy and to the routes of the updates.

Rollouts from the torch engine in bf16 and int8 on tiny-moe (``--sft-steps`` supervised steps); per replay mode
the pi_old routing mismatch and kl_k3(pi_old, mu), and after one Adam step (``--lr``) the update's route drift
and kl_k3(pi_theta, pi_old). R3's cost per step is measured by ``benchmarks/overheads.py``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/routing_replay.py

prints a table last and writes ``benchmarks/results/routing_replay.md``.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._page import command, env_lines  # noqa: E402

from constraints.measures import MEASURES, routing_mismatch  # noqa: E402
from trainers import learner, routing  # noqa: E402
from trainers.coldstart import supervised_finetune  # noqa: E402
from trainers.config import AlgoConfig, ColdStartConfig, ModelConfig, RolloutConfig, TaskConfig  # noqa: E402
from trainers.engines.torch_engine import TorchEngine  # noqa: E402
from trainers.models import build_model  # noqa: E402
from trainers.scoring import response_logprobs  # noqa: E402
from trainers.tasks import TASKS  # noqa: E402
from trainers.tokenizer import build_char_tokenizer  # noqa: E402

TEMP = 1.0


def forward_routes(model, rollout, replay_BSLK):
    """(logp_BT, routes the forward used (B, S, L, K)) of one no-grad forward, replaying if given."""
    B, S = rollout.input_ids_BS.shape
    args = (model, rollout.input_ids_BS, rollout.attention_mask_BS, rollout.num_prompt_positions)
    with torch.no_grad():
        if replay_BSLK is None:
            with routing.capture_routes(model) as cap:
                logp_BT, _ = response_logprobs(*args, temperature=TEMP)
            return logp_BT, cap.experts(B, S)
        with routing.replay_routes(model, replay_BSLK, capture=True) as stats:
            logp_BT, _ = response_logprobs(*args, temperature=TEMP)
        captured = stats._ctx.captured
        used = torch.stack([captured[layer][-1].reshape(B, S, -1) for layer in sorted(captured)], dim=2)
        return logp_BT, used


def discrepancy(model, rollout, mode: str, lr: float) -> dict[str, float]:
    mask_BT, mask_BS = rollout.response_mask_BT, rollout.attention_mask_BS
    kl = MEASURES["kl_k3"].batch
    cfg = AlgoConfig(routing_replay=mode, minibatches=1, is_mode="tis")
    adv_B = torch.tensor([1.0, -1.0]).repeat(len(rollout) // 2)
    scoring = learner.ScoringSpec(temperature=TEMP, fp32_lm_head=True, moe=True)
    batch = learner.score_old(model, rollout, adv_B, cfg, scoring)
    old_logp, old_routes = forward_routes(model, rollout, batch.replay_experts_BSLK if mode == "r3" else None)
    assert torch.allclose(old_logp, batch.old_logp_BT, atol=1e-6)
    out = {"old_mismatch": float(routing_mismatch(old_routes, rollout.rollout_experts_BSLK, mask_BS)),
           "old_kl_k3": float(kl(batch.old_logp_BT, rollout.rollout_logp_BT, mask_BT))}
    trained = copy.deepcopy(model)
    opt = torch.optim.Adam(trained.parameters(), lr=lr)
    learner.update(trained, learner.OptimStep(opt, grad_clip=1.0), batch, scoring=scoring,
                   penalty=learner.PenaltySpec(), cfg=cfg,
                   generator=torch.Generator().manual_seed(0))
    trained.eval()
    new_logp, new_routes = forward_routes(trained, rollout, batch.replay_experts_BSLK)
    out["drift_mismatch"] = float(routing_mismatch(new_routes, old_routes, mask_BS))
    out["drift_kl_k3"] = float(kl(batch.old_logp_BT, new_logp, mask_BT))
    out["old_logp_BT"] = batch.old_logp_BT
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "routing_replay.md"))
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    tok = build_char_tokenizer()
    task = TASKS["addition"](TaskConfig(name="addition", digits=2), args.seed)
    model = build_model(ModelConfig(preset="tiny-moe"), len(tok), seed=args.seed)
    t0 = time.perf_counter()
    losses = []
    if args.sft_steps:
        losses = supervised_finetune(model, tok, task, ColdStartConfig(steps=args.sft_steps, batch_size=64, lr=6e-3),
                                     seed=args.seed, eos_id=tok.eos_token_id, progress=False)
    sft_s = time.perf_counter() - t0
    model.eval()
    rng = random.Random(args.seed)
    prompts = [tok.encode(ex.prompt, add_special_tokens=False) for ex in task.sample(rng, args.prompts)]
    prompts = [p for p in prompts for _ in range(args.samples)]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    rows, r3_shift = [], {}
    for precision in ("bf16", "int8"):
        engine = TorchEngine(RolloutConfig(precision=precision, max_new_tokens=args.max_new_tokens), model,
                             eos_id=tok.eos_token_id, pad_id=pad_id)
        rollout = engine.generate(prompts, seed=args.seed)
        for mode in ("none", "r2", "r3"):
            rows.append({"precision": precision, "mode": mode, **discrepancy(model, rollout, mode, args.lr)})
        none_logp, r3_logp = rows[-3].pop("old_logp_BT"), rows[-1].pop("old_logp_BT")
        rows[-2].pop("old_logp_BT")
        # how much replaying mu's routes moves pi_old at all: route flips between near-tied experts move it little
        r3_shift[precision] = float((none_logp - r3_logp)[rollout.response_mask_BT].abs().max())

    table = ["| rollout | replay | pi_old mismatch | kl_k3(pi_old, mu) | update drift mismatch | kl_k3(pi_theta, pi_old) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['precision']} | {r['mode']} | {r['old_mismatch']:.4f} | {r['old_kl_k3']:.5e} | "
                     f"{r['drift_mismatch']:.4f} | {r['drift_kl_k3']:.3e} |")
    table += [""] + [f"max over response tokens of |log pi_old(none) - log pi_old(R3)|, {p} rollout: {v:.2e}"
                     for p, v in r3_shift.items()]
    cmd = command("routing_replay.py")
    header = [
        "# MoE routing replay: discrepancy and route drift (tiny-moe)", "",
        *env_lines(cmd),
        f"- model: tiny-moe, {args.sft_steps} supervised steps on 2-digit addition "
        f"(final loss {losses[-1]:.3f}, {sft_s:.0f} s)" if losses else "- model: tiny-moe, random init",
        f"- rollouts: torch engine, {args.prompts} prompts x {args.samples} samples, max {args.max_new_tokens} "
        f"new tokens, temperature {TEMP}; trainer fp32 with fp32 LM head",
        f"- update drift: one Adam step, lr {args.lr}, on the whole batch (advantages +-1), then a forward "
        "replaying what the mode replays (none: own routes)",
        "",
        "pi_old mismatch / kl_k3(pi_old, mu): none and R2 compute pi_old the same way (R2 only records the "
        "trainer's routes), so they coincide; R3 replays mu's routes (mismatch 0 by construction, the "
        "kl left is the precision's). Update drift: routes of the forward after one step vs the pi_old "
        "pass's routes; R2 and R3 pin them, none lets them flip (R3's small drift is the last response column, "
        "which the rollout engine never routes, so the router chooses there itself).", ""]
    text = "\n".join(header + table) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
