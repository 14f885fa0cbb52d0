"""The primal learner: recompute log pi_old, then N mini-batch updates of L = L_IS/clip(/RR) + penalty.

Departures from plain GRPO, all from Zheng et al. (arXiv 2512.01374) and DESIGN.md §5: the policy loss
is IS-corrected for the training-inference discrepancy rho = pi_old / mu (``is_mode``), decoupled from the
staleness ratio r = pi_theta / pi_old that the clip acts on; no length normalisation (sum over tokens
divided by the mini-batch's token count); MoE routes may be replayed (R2: the training engine's routes
recorded while computing pi_old; R3: the rollout engine's routes) in the pi_old pass and every update.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from constraints.config import ConstraintConfig
from constraints.measures import routing_mismatch_per_token
from constraints.penalties import PENALTIES
from trainers import guards, routing
from trainers.batch import Rollout
from trainers.config import AlgoConfig
from trainers.losses import IS_MODES, POLICY_LOSSES
from trainers.scoring import response_logprobs


log = logging.getLogger(__name__)


class ReplayError(RuntimeError):
    """A requested routing replay did not replace the expected number of (token, layer) routes."""


@dataclass
class ScoredBatch:
    """A rollout batch with everything the updates need; rows are samples (B = prompts x G)."""

    rollout: Rollout
    # (B, T) log pi_old of the sampled tokens (training engine, weights before this step's updates).
    old_logp_BT: Tensor
    # (B, T) advantages broadcast over response tokens.
    advantages_BT: Tensor
    # (B, S, L, K) routes the training engine chose in the pi_old pass (MoE only).
    train_experts_BSLK: Optional[Tensor]
    # (B, S, L, K) routes to replay in the updates (None: no replay).
    replay_experts_BSLK: Optional[Tensor]


def _forward_logp(model, rollout: Rollout, *, temperature: float, fp32_lm_head: bool, with_entropy: bool,
                  replay_experts_BSLK: Optional[Tensor], capture: bool):
    """One full forward; returns (logp_BT, entropy_BT, captured_experts_BSLK)."""
    ids_BS, mask_BS = rollout.input_ids_BS, rollout.attention_mask_BS
    B, S = ids_BS.shape
    kwargs = dict(temperature=temperature, fp32_lm_head=fp32_lm_head, with_entropy=with_entropy)
    P = rollout.num_prompt_positions
    if replay_experts_BSLK is not None:
        if replay_experts_BSLK.shape[:2] != (B, S):
            raise ReplayError(f"routing replay: routes cover {tuple(replay_experts_BSLK.shape[:2])} positions, the batch "
                              f"has {(B, S)} (positions misaligned)")
        valid_BS = (replay_experts_BSLK >= 0).all(-1).all(-1)
        real_BS = mask_BS.bool()
        # routes only at real tokens, and at every real prompt token: a shifted replay of the same shape fails here
        if (valid_BS & ~real_BS).any() or not torch.equal(valid_BS[:, :P], real_BS[:, :P]):
            raise ReplayError("routing replay: routes do not line up with the attention mask (positions misaligned)")
        with routing.replay_routes(model, replay_experts_BSLK, capture=capture) as stats:
            logp_BT, ent_BT = response_logprobs(model, ids_BS, mask_BS, P, **kwargs)
        expected = routing.expected_replay_pairs(replay_experts_BSLK)
        if stats.replayed_pairs != expected:
            raise ReplayError(f"routing replay replaced {stats.replayed_pairs} (token, layer) routes, "
                              f"expected {expected}: positions are misaligned or the patch is not active")
        return logp_BT, ent_BT, None
    if capture:
        with routing.capture_routes(model) as cap:
            logp_BT, ent_BT = response_logprobs(model, ids_BS, mask_BS, P, **kwargs)
        experts_BSLK = cap.experts(B, S).masked_fill(~mask_BS[:, :, None, None].bool(), -1)
        return logp_BT, ent_BT, experts_BSLK
    logp_BT, ent_BT = response_logprobs(model, ids_BS, mask_BS, P, **kwargs)
    return logp_BT, ent_BT, None


@torch.no_grad()
def score_old(model, rollout: Rollout, advantages_B: Tensor, cfg: AlgoConfig, *, temperature: float,
              fp32_lm_head: bool, moe: bool) -> ScoredBatch:
    """Recompute log pi_old with the training engine (replaying the rollout's routes under R3)."""
    if cfg.routing_replay != "none" and not moe:
        raise ValueError(f"routing_replay={cfg.routing_replay} needs an MoE model")
    r3 = cfg.routing_replay == "r3"
    if r3 and rollout.rollout_experts_BSLK is None:
        raise ValueError("routing_replay=r3 needs the rollout engine's routes, and this engine reported none")
    old_logp_BT, _, train_experts = _forward_logp(
        model, rollout, temperature=temperature, fp32_lm_head=fp32_lm_head, with_entropy=False,
        replay_experts_BSLK=rollout.rollout_experts_BSLK if r3 else None, capture=moe and not r3)
    if r3:
        train_experts = rollout.rollout_experts_BSLK
    replay = {"none": None, "r2": train_experts, "r3": rollout.rollout_experts_BSLK}[cfg.routing_replay]
    advantages_BT = advantages_B[:, None].to(old_logp_BT.dtype).expand_as(old_logp_BT)
    return ScoredBatch(rollout, old_logp_BT.float(), advantages_BT, train_experts, replay)


def drop_rows(batch: ScoredBatch, keep_B: Tensor) -> ScoredBatch:
    """The batch with the samples outside ``keep_B`` masked out (``guards.mask_rows``): zero response mask,
    log-probs and advantages, and no recorded route at their response positions."""
    if bool(keep_B.all()):
        return batch
    keep_B = keep_B.bool()
    P = batch.rollout.num_prompt_positions

    def no_routes(experts_BSLK: Optional[Tensor]) -> Optional[Tensor]:
        if experts_BSLK is None:
            return None
        out = experts_BSLK.clone()
        out[~keep_B, P:] = -1
        return out

    rollout = guards.mask_rows(batch.rollout, keep_B)
    old_logp_BT = torch.where(keep_B[:, None], batch.old_logp_BT, 0.0)
    advantages_BT = torch.where(keep_B[:, None], batch.advantages_BT, 0.0)
    replay = batch.replay_experts_BSLK
    replay = rollout.rollout_experts_BSLK if replay is batch.rollout.rollout_experts_BSLK else no_routes(replay)
    return ScoredBatch(rollout, old_logp_BT, advantages_BT, no_routes(batch.train_experts_BSLK), replay)


def screen_old(batch: ScoredBatch, keep_B: Tensor) -> tuple[ScoredBatch, Tensor, dict[str, float]]:
    """Drop the kept samples whose pi_old log-probs are non-finite (``guards.screen_old_logp``)."""
    keep_B, metrics = guards.screen_old_logp(batch.old_logp_BT, batch.rollout.response_mask_BT, keep_B)
    return drop_rows(batch, keep_B), keep_B, metrics


def minibatch_indices(batch_size: int, num_minibatches: int, generator: torch.Generator) -> list[Tensor]:
    """A seeded permutation of the rows split into ``num_minibatches`` equal parts."""
    perm = torch.randperm(batch_size, generator=generator)
    return list(perm.chunk(num_minibatches))


def update(model, optimizer, scheduler, batch: ScoredBatch, *, lambda_C: Tensor,
           constraints: Sequence[ConstraintConfig], penalty: str, dual_enabled: bool, cfg: AlgoConfig,
           temperature: float, fp32_lm_head: bool, grad_clip: float, generator: torch.Generator) -> list[dict]:
    """N mini-batch optimiser steps on one scored rollout batch; returns one metrics dict per step.

    A mini-batch whose loss or gradient norm is non-finite gets no optimiser step (its gradients are
    zeroed, a warning is logged); 'guard/skipped_update' says so per mini-batch, and the first dict carries
    'guard/skipped_updates', the number skipped in this call.
    """
    rollout = batch.rollout
    mask_BT = rollout.response_mask_BT.bool()
    weights_BT, kept_BT, is_metrics = IS_MODES[cfg.is_mode](batch.old_logp_BT, rollout.rollout_logp_BT.float(),
                                                            mask_BT, cfg)
    routing_BT = None
    if batch.train_experts_BSLK is not None and rollout.rollout_experts_BSLK is not None:
        P = rollout.num_prompt_positions
        routing_BS = routing_mismatch_per_token(batch.train_experts_BSLK, rollout.rollout_experts_BSLK)
        # the route at position s shapes the logits that predict token s + 1
        routing_BT = routing_BS[:, P - 1:-1]
    out = []
    skipped = 0
    model.train()
    for idx in minibatch_indices(len(rollout), cfg.minibatches, generator):
        mb = rollout.select(idx)
        replay = batch.replay_experts_BSLK[idx] if batch.replay_experts_BSLK is not None else None
        logp_BT, ent_BT, _ = _forward_logp(model, mb, temperature=temperature, fp32_lm_head=fp32_lm_head,
                                           with_entropy=True, replay_experts_BSLK=replay, capture=False)
        m_BT = mask_BT[idx]
        normalizer = max(int(m_BT.sum()), 1)
        adv_BT = batch.advantages_BT[idx]
        metrics: dict[str, float] = {}
        pen_loss = logp_BT.new_zeros(())
        if dual_enabled and constraints:
            pen_loss, adv_BT, pen_metrics = PENALTIES[penalty](
                logp_BT, rollout.rollout_logp_BT[idx].float(), adv_BT, m_BT, lambda_C, constraints, normalizer,
                routing_mismatch_BT=routing_BT[idx] if routing_BT is not None else None)
            metrics.update(pen_metrics)
        pg_loss, pg_metrics = POLICY_LOSSES[cfg.loss](logp_BT, batch.old_logp_BT[idx], adv_BT, weights_BT[idx],
                                                      kept_BT[idx], cfg, normalizer)
        entropy = (ent_BT * m_BT).sum() / normalizer
        loss = pg_loss + pen_loss - cfg.entropy_coef * entropy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
        finite = bool(torch.isfinite(loss.detach())) and bool(torch.isfinite(grad_norm))
        if finite:
            optimizer.step()
        else:
            # a non-finite loss or gradient would poison the weights: drop this update, keep going
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            log.warning("non-finite %s in a mini-batch update (loss %s, grad norm %s): optimizer step skipped",
                        "loss" if not bool(torch.isfinite(loss.detach())) else "gradient norm",
                        float(loss.detach()), float(grad_norm))
        if scheduler is not None:
            scheduler.step()
        metrics["guard/skipped_update"] = 0.0 if finite else 1.0
        metrics.update(pg_metrics)
        metrics.update({"loss/total": float(loss.detach()), "policy/entropy": float(entropy.detach()),
                        "optim/grad_norm": float(grad_norm), "optim/lr": optimizer.param_groups[0]["lr"]})
        out.append(metrics)
    out[0].update(is_metrics)
    # a count, carried by the first dict only so that averaging over the mini-batches keeps it a count
    out[0]["guard/skipped_updates"] = float(skipped)
    return out
