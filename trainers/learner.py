"""The primal learner: recompute log pi_old, then N mini-batch updates of L = L_IS/clip(/RR) + penalty.

Departures from plain GRPO (Zheng et al., arXiv 2512.01374; docs/design.md §"The primal learner"): the policy loss
is IS-corrected for the training-inference discrepancy rho = pi_old / mu (``is_mode``), decoupled from the
staleness ratio r = pi_theta / pi_old that the clip acts on; no length normalisation (sum over tokens
divided by the mini-batch's token count); MoE routes may be replayed (R2: the training engine's routes
recorded while computing pi_old; R3: the rollout engine's routes) in the pi_old pass and every update.

Data parallelism (``DataShard``, world > 1 under ``torchrun`` with an FSDP2-sharded model): every rank holds
the whole rollout batch but runs the model only on its own block of rows; the per-token log-probs are
all-gathered, so everything computed from them (pi_old screening, measures, IS weights, every metric) is
the full-batch value on every rank, and each loss is the rank's token sum divided by the GLOBAL token
count of the mini-batch, so the summed gradients equal the single-process gradient.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from constraints.config import ConstraintConfig
from constraints.measures import routing_mismatch_per_token
from constraints.penalties import PENALTIES
from trainers import guards, packing, routing
from trainers.batch import Rollout
from trainers.config import AlgoConfig
from trainers.losses import IS_MODES, POLICY_LOSSES, ess_lr_scale
from trainers.models import compute_dtype
from trainers.optim import Float32Grads
from trainers.scoring import response_logprobs


log = logging.getLogger(__name__)


class ReplayError(RuntimeError):
    """A requested routing replay did not replace the expected number of (token, layer) routes."""


@dataclass(frozen=True)
class DataShard:
    """This process's share of a batch under data parallelism: rank ``rank`` of ``world`` takes the
    ``rank``-th of ``world`` equal contiguous blocks of rows. ``world == 1``: the whole batch, no collective."""

    rank: int = 0
    world: int = 1

    def rows(self, n: int) -> Tensor:
        """Indices of this rank's block of ``n`` rows (``n`` must divide evenly)."""
        if n % self.world:
            raise ValueError(f"{n} rows do not split evenly over {self.world} ranks")
        k = n // self.world
        return torch.arange(self.rank * k, (self.rank + 1) * k)

    def gather_rows(self, local: Tensor) -> Tensor:
        """Concatenation over ranks (in rank order) of every rank's ``local`` block: the full-batch tensor."""
        if self.world == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts)


@dataclass(frozen=True)
class ScoringSpec:
    """How the training engine scores a rollout: the tempered distribution the rollout engine sampled from, in
    the LM-head precision of the run, on this rank's share of the rows."""

    # Sampling temperature of the rollout engine (rollout.temperature): the scored distribution is tempered alike.
    temperature: float = 1.0
    # LM head and log-softmax in float32 (model.fp32_lm_head).
    fp32_lm_head: bool = True
    # How the float32 head computes log-probs (model.lm_head_kernel).
    lm_head_kernel: str = "logits"
    # The model is a mixture of experts: its routes are recorded (R2, routing_mismatch) or replayed (R3).
    moe: bool = False
    # This process's rows under data parallelism.
    shard: DataShard = DataShard()
    # Token budget of one training forward (algo.micro_batch_tokens): rows sorted by length, cut into micro-batches
    # of at most this many padded positions, each trimmed to its longest row. 0: one forward over the padded batch.
    micro_batch_tokens: int = 0
    # Score left-justified rows (``trainers.packing``): pads only at the right, no padding mask, the LM head on real
    # response tokens only. False: the padded layout with its mask (the same log-probs to float rounding).
    justify: bool = True


@dataclass(frozen=True)
class PenaltySpec:
    """The penalty term of every mini-batch loss of one rollout batch (``constraints.penalties``); no constraints:
    no penalty term and no penalty metrics."""

    # (C,) multipliers lambda_i, fixed for the whole rollout batch.
    lambda_C: Tensor = field(default_factory=lambda: torch.zeros(0))
    # The constraints with the tolerances in force.
    constraints: tuple[ConstraintConfig, ...] = ()
    # Penalty form: a name of constraints.penalties.PENALTIES.
    form: str = "hinge"
    # What the per-token measure compares pi_theta with: rollout (mu) | old (pi_old, ``dual.measure_at: drift``).
    anchor: str = "rollout"


@dataclass
class OptimStep:
    """What turns a mini-batch loss into a weight update; the four always travel together."""

    optimizer: torch.optim.Optimizer
    # LR schedule, stepped once per mini-batch update (None: constant lr).
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
    # Dynamic loss scaling of model.dtype=float16 training (None otherwise).
    scaler: Optional[torch.amp.GradScaler] = None
    # Global gradient-norm clip (optim.grad_clip; 0: no clip, the norm is still logged).
    grad_clip: float = 0.0


@dataclass
class UpdateResult:
    """What ``update`` did to one scored rollout batch."""

    # One dict per mini-batch optimiser step: loss terms ('loss/total', 'penalty/loss', the policy loss's own),
    # 'policy/entropy', optim/ and guard/ values.
    steps: list[dict[str, float]]
    # IS weight metrics of the batch (``IS_MODES``), computed once before the mini-batches.
    is_metrics: dict[str, float]
    # (B, T) log pi_theta of every row as its mini-batch update saw it, before that update's optimiser step
    # (detached): the policy the penalty acted on (``dual.measure_at: updates``). With N = 1 it is pi_old.
    trained_logp_BT: Tensor
    # Mini-batch updates skipped for a non-finite loss or gradient norm.
    skipped: int = 0

    def metrics(self) -> dict[str, float]:
        """The step metrics averaged over the mini-batches (the time/ ones summed: seconds of the whole step), the IS
        metrics, and 'guard/skipped_updates' (a count)."""
        keys = dict.fromkeys(k for d in self.steps for k in d)
        reduce = {k: np.sum if k.startswith("time/") else np.mean for k in keys}
        mean = {k: float(reduce[k]([d[k] for d in self.steps if k in d])) for k in keys}
        return {**mean, **self.is_metrics, "guard/skipped_updates": float(self.skipped)}


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

    def routes(self) -> dict[str, Tensor]:
        """The keyword arguments of the routing measures (``constraints.measures``): both engines' routes and the
        attention mask; empty unless both engines' routes are known."""
        r = self.rollout
        if self.train_experts_BSLK is None or r.rollout_experts_BSLK is None:
            return {}
        return dict(experts_train_BSLK=self.train_experts_BSLK, experts_rollout_BSLK=r.rollout_experts_BSLK,
                    mask_BS=r.attention_mask_BS.bool())


def length_buckets(lengths_B: Tensor, token_budget: int) -> list[Tensor]:
    """Row indices sorted by length, longest first, cut into consecutive micro-batches whose padded size (rows x
    the longest row) stays within ``token_budget``; a row longer than the budget is a micro-batch of its own.

    verl's dynamic batch size (``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``) packs by the same budget."""
    lengths = lengths_B.tolist()  # one host sync for the whole plan
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their row order
    groups: list[list[int]] = []
    for i in order:
        # sorted longest first: a group's first row is its longest
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def _trim(rollout: Rollout, prompt_len: int, response_len: int) -> Rollout:
    """The rollout's last ``prompt_len`` prompt and first ``response_len`` response columns (the rest padding)."""
    P = rollout.num_prompt_positions
    experts = rollout.rollout_experts_BSLK
    return replace(rollout, prompt_ids_BP=rollout.prompt_ids_BP[:, P - prompt_len:],
                   prompt_mask_BP=rollout.prompt_mask_BP[:, P - prompt_len:],
                   response_ids_BT=rollout.response_ids_BT[:, :response_len],
                   response_mask_BT=rollout.response_mask_BT[:, :response_len],
                   rollout_logp_BT=rollout.rollout_logp_BT[:, :response_len],
                   rollout_experts_BSLK=None if experts is None else experts[:, P - prompt_len:P + response_len])


@dataclass(frozen=True)
class MicroBatch:
    """One token-budget micro-batch of a rollout: its rows, the rollout cut to the prompt and response columns they
    use, and the routes to replay over those columns."""

    # (b,) row indices into the rollout the micro-batch was cut from.
    rows: Tensor
    rollout: Rollout
    replay_experts_BSLK: Optional[Tensor]
    # Prompt and response columns kept (the last ``prompt_len`` prompt, the first ``response_len`` response columns).
    prompt_len: int
    response_len: int


def _equal_count(groups: list[Tensor], count: int) -> list[Tensor]:
    """``groups`` split (the largest first, in halves) until there are ``count`` of them: FSDP2 ranks must run the
    same number of forwards and backwards, and every rank has as many rows as any other, so ``count`` (the most any
    rank needs) never exceeds a rank's rows."""
    groups = list(groups)
    while len(groups) < count:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        if len(groups[i]) < 2:
            raise ValueError(f"cannot split {sum(len(g) for g in groups)} rows into {count} micro-batches")
        half = (len(groups[i]) + 1) // 2
        groups[i:i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def micro_batches(rollout: Rollout, replay_experts_BSLK: Optional[Tensor], spec: ScoringSpec) -> list[MicroBatch]:
    """The rollout's rows in ``length_buckets`` micro-batches of ``spec.micro_batch_tokens`` padded positions, each
    cut to the columns its rows use; one micro-batch of the whole rollout (uncut) without a budget. Under data
    parallelism every rank gets the same number of micro-batches (``_equal_count``; one all-reduce)."""
    budget = spec.micro_batch_tokens
    B = len(rollout)
    if budget <= 0:
        return [MicroBatch(torch.arange(B), rollout, replay_experts_BSLK, rollout.num_prompt_positions,
                           rollout.response_ids_BT.shape[1])]
    P = rollout.num_prompt_positions
    # the plan's lengths on the host in one sync: nothing per micro-batch waits for the device
    prompt_len, response_len = torch.stack([rollout.prompt_mask_BP.sum(-1), rollout.response_mask_BT.sum(-1)]).tolist()
    groups = length_buckets(torch.tensor(prompt_len) + torch.tensor(response_len), budget)
    if spec.shard.world > 1:
        count = torch.tensor([len(groups)], device=rollout.input_ids_BS.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        groups = _equal_count(groups, int(count))
    out = []
    for rows in groups:
        picked = rows.tolist()
        p, t = max(prompt_len[i] for i in picked), max(max(response_len[i] for i in picked), 1)
        replay = None if replay_experts_BSLK is None else replay_experts_BSLK[rows][:, P - p:P + t]
        out.append(MicroBatch(rows, _trim(rollout.select(rows), p, t), replay, p, t))
    return out


def _forward_logp(model, rollout: Rollout, spec: ScoringSpec, *, with_entropy: bool,
                  replay_experts_BSLK: Optional[Tensor], capture: bool):
    """The forward of ``rollout``: (logp_BT, entropy_BT, captured_experts_BSLK) in the rollout's (B, T) / (B, S)
    layout, values 0 (routes -1) at padding.

    With ``spec.micro_batch_tokens`` the rows go through ``micro_batches``, each cut to the prompt and response
    columns its rows use; the log-probs are the same function of each row (position ids and masks follow the real
    tokens), so they equal the padded forward's to float rounding (tests/test_micro_batches.py). A forward that keeps
    its graph keeps every micro-batch's: the updates go through ``_accumulate`` instead, one backward each."""
    B, T = rollout.response_ids_BT.shape
    P = rollout.num_prompt_positions
    parts = micro_batches(rollout, replay_experts_BSLK, spec)
    if len(parts) == 1 and parts[0].prompt_len == P and parts[0].response_len == T:
        return _forward_logp_amp(model, rollout, spec, with_entropy=with_entropy,
                                 replay_experts_BSLK=replay_experts_BSLK, capture=capture)
    logp_parts, ent_parts, experts_BSLK = [], [], None
    for mb in parts:
        p, t = mb.prompt_len, mb.response_len
        logp, ent, experts = _forward_logp_amp(model, mb.rollout, spec, with_entropy=with_entropy,
                                               replay_experts_BSLK=mb.replay_experts_BSLK, capture=capture)
        logp_parts.append(torch.nn.functional.pad(logp, (0, T - t)))
        ent_parts.append(None if ent is None else torch.nn.functional.pad(ent, (0, T - t)))
        if experts is not None:
            if experts_BSLK is None:
                experts_BSLK = experts.new_full((B, P + T, *experts.shape[2:]), -1)
            experts_BSLK[mb.rows, P - p:P + t] = experts
    inverse_B = torch.argsort(torch.cat([mb.rows for mb in parts]))
    logp_BT = torch.cat(logp_parts)[inverse_B]
    ent_BT = None if ent_parts[0] is None else torch.cat(ent_parts)[inverse_B]
    return logp_BT, ent_BT, experts_BSLK


def _forward_logp_amp(model, rollout: Rollout, spec: ScoringSpec, *, with_entropy: bool,
                      replay_experts_BSLK: Optional[Tensor], capture: bool):
    """One full forward; returns (logp_BT, entropy_BT, captured_experts_BSLK). Under float16 autocast for a
    ``model.dtype=float16`` model (``trainers.models.compute_dtype``); the LM head keeps ``spec.fp32_lm_head``."""
    amp = compute_dtype(model)
    device = rollout.input_ids_BS.device.type
    with torch.autocast(device_type=device, dtype=amp or torch.float32, enabled=amp is not None):
        return _forward_logp_in(model, rollout, spec, with_entropy=with_entropy,
                                replay_experts_BSLK=replay_experts_BSLK, capture=capture)


_LOGGED_LAYOUTS: set[bool] = set()


def _log_layout(justified: bool, why: str, *, cuda: bool) -> None:
    """Say once per process which attention path the training forward takes: on CUDA, sdpa's flash and efficient
    kernels refuse a mask with grouped KV heads, so the padded layout's masked attention runs the math kernel
    (S x S scores per head) at full length."""
    if justified in _LOGGED_LAYOUTS:
        return
    _LOGGED_LAYOUTS.add(justified)
    if justified:
        log.info("training forward: left-justified rows, causal attention without a padding mask")
    else:
        (log.warning if cuda else log.info)(
            "training forward: padded rows with an attention mask (%s): on CUDA, masked grouped-query attention "
            "takes sdpa's math kernel, whose memory grows with the square of the length", why)


def _forward_logp_in(model, rollout: Rollout, spec: ScoringSpec, *, with_entropy: bool,
                     replay_experts_BSLK: Optional[Tensor], capture: bool):
    ids_BS, mask_BS = rollout.input_ids_BS, rollout.attention_mask_BS
    B, S = ids_BS.shape
    kwargs = dict(temperature=spec.temperature, fp32_lm_head=spec.fp32_lm_head, lm_head_kernel=spec.lm_head_kernel,
                  with_entropy=with_entropy)
    P = rollout.num_prompt_positions
    layout = packing.justify(rollout.prompt_mask_BP, rollout.response_mask_BT) if spec.justify else None
    S_model = S if layout is None else layout.width
    if layout is None:
        _log_layout(False, "scoring.justify is off" if not spec.justify else "a row is not one run of tokens",
                    cuda=ids_BS.device.type == "cuda")
    else:
        _log_layout(True, "", cuda=ids_BS.device.type == "cuda")

    def score() -> tuple[Tensor, Optional[Tensor]]:
        if layout is None:
            return response_logprobs(model, ids_BS, mask_BS, P, **kwargs)
        return packing.justified_response_logprobs(model, layout, ids_BS, rollout.response_mask_BT, **kwargs)

    if replay_experts_BSLK is not None:
        if replay_experts_BSLK.shape[:2] != (B, S):
            raise ReplayError(f"routing replay: routes cover {tuple(replay_experts_BSLK.shape[:2])} positions, the batch "
                              f"has {(B, S)} (positions misaligned)")
        valid_BS = (replay_experts_BSLK >= 0).all(-1).all(-1)
        real_BS = mask_BS.bool()
        # routes only at real tokens, and at every real prompt token: a shifted replay of the same shape fails here
        if (valid_BS & ~real_BS).any() or not torch.equal(valid_BS[:, :P], real_BS[:, :P]):
            raise ReplayError("routing replay: routes do not line up with the attention mask (positions misaligned)")
        replay_model = replay_experts_BSLK if layout is None else layout.to_justified(replay_experts_BSLK, -1)
        with routing.replay_routes(model, replay_model, capture=capture) as stats:
            logp_BT, ent_BT = score()
        expected = routing.expected_replay_pairs(replay_experts_BSLK)
        if stats.replayed_pairs != expected:
            raise ReplayError(f"routing replay replaced {stats.replayed_pairs} (token, layer) routes, "
                              f"expected {expected}: positions are misaligned or the patch is not active")
        return logp_BT, ent_BT, None
    if capture:
        with routing.capture_routes(model) as cap:
            logp_BT, ent_BT = score()
        experts_BSLK = cap.experts(B, S_model)
        if layout is not None:
            experts_BSLK = layout.from_justified(experts_BSLK, S, -1)
        experts_BSLK = experts_BSLK.masked_fill(~mask_BS[:, :, None, None].bool(), -1)
        return logp_BT, ent_BT, experts_BSLK
    logp_BT, ent_BT = score()
    return logp_BT, ent_BT, None


@dataclass
class OnPolicyForward:
    """The graph-carrying forward of ``score_on_policy``: this rank's rows (``shard.rows``) in batch order.
    ``update`` back-propagates it as its single mini-batch instead of running the model again."""

    logp_BT: Tensor
    ent_BT: Tensor


def fuses_old_pass(cfg: AlgoConfig) -> bool:
    """With one mini-batch the update runs on the weights pi_old is defined by, so one forward serves both."""
    return cfg.minibatches == 1


def place(model, rollout: Rollout, *tensors: Tensor) -> tuple:
    """``rollout`` and ``tensors`` on the device of ``model``'s parameters (the same objects when already there): the
    one way train, calibrate and eval put a batch where the model scores it (engines and rewards work on the host)."""
    device = next(model.parameters()).device
    return (rollout.to(device), *(t.to(device) for t in tensors))


@torch.no_grad()
def score_old(model, rollout: Rollout, advantages_B: Tensor, cfg: AlgoConfig, spec: ScoringSpec) -> ScoredBatch:
    """Recompute log pi_old with the training engine (replaying the rollout's routes under R3).

    Under data parallelism each rank scores its block of rows and the results are gathered: every rank
    returns the full batch.
    """
    return _score(model, rollout, advantages_B, cfg, spec, with_grad=False)[0]


def score_on_policy(model, rollout: Rollout, advantages_B: Tensor, cfg: AlgoConfig, spec: ScoringSpec
                    ) -> tuple[ScoredBatch, OnPolicyForward]:
    """``score_old`` for one mini-batch per rollout batch (``fuses_old_pass``): the forward keeps its graph and
    computes the entropy, so ``update(..., forward=...)`` back-propagates it instead of running the model a
    second time on the same weights and rows. log pi_old is that forward's detached value."""
    if not fuses_old_pass(cfg):
        raise ValueError(f"score_on_policy needs algo.minibatches = 1, got {cfg.minibatches}")
    model.train()
    with torch.enable_grad():
        return _score(model, rollout, advantages_B, cfg, spec, with_grad=True)


def _score(model, rollout: Rollout, advantages_B: Tensor, cfg: AlgoConfig, spec: ScoringSpec, *, with_grad: bool
           ) -> tuple[ScoredBatch, Optional[OnPolicyForward]]:
    moe, shard = spec.moe, spec.shard
    if cfg.routing_replay != "none" and not moe:
        raise ValueError(f"routing_replay={cfg.routing_replay} needs an MoE model")
    r3 = cfg.routing_replay == "r3"
    if r3 and rollout.rollout_experts_BSLK is None:
        raise ValueError("routing_replay=r3 needs the rollout engine's routes, and this engine reported none")
    rollout, advantages_B = place(model, rollout, advantages_B)
    local = rollout.select(shard.rows(len(rollout))) if shard.world > 1 else rollout
    logp_BT, ent_BT, train_experts = _forward_logp(
        model, local, spec, with_entropy=with_grad, replay_experts_BSLK=local.rollout_experts_BSLK if r3 else None,
        capture=moe and not r3)
    forward = OnPolicyForward(logp_BT, _entropy_term(ent_BT, cfg)) if with_grad else None
    old_logp_BT = shard.gather_rows(logp_BT.detach())
    if train_experts is not None:
        train_experts = shard.gather_rows(train_experts)
    if r3:
        train_experts = rollout.rollout_experts_BSLK
    replay = {"none": None, "r2": train_experts, "r3": rollout.rollout_experts_BSLK}[cfg.routing_replay]
    advantages_BT = advantages_B[:, None].to(old_logp_BT.dtype).expand_as(old_logp_BT)
    return ScoredBatch(rollout, old_logp_BT.float(), advantages_BT, train_experts, replay), forward


def score_bypass(rollout: Rollout, advantages_B: Tensor, cfg: AlgoConfig) -> ScoredBatch:
    """``algo.old_logp: rollout`` (bypass): log pi_old := log mu, no training-engine forward before the updates.

    The clip then acts on r = pi_theta / mu, which holds the engines' discrepancy and the staleness at once, and
    the IS weight pi_old / mu is exactly 1. R3 replays the rollout's routes in the updates; R2 has no pi_old pass
    to record routes in (a config error).
    """
    if cfg.routing_replay == "r2":
        raise ValueError("routing_replay=r2 records the routes of the pi_old forward, which old_logp=rollout skips")
    r3 = cfg.routing_replay == "r3"
    if r3 and rollout.rollout_experts_BSLK is None:
        raise ValueError("routing_replay=r3 needs the rollout engine's routes, and this engine reported none")
    old_logp_BT = rollout.rollout_logp_BT.float()
    advantages_BT = advantages_B[:, None].to(old_logp_BT.dtype).expand_as(old_logp_BT)
    experts = rollout.rollout_experts_BSLK if r3 else None
    return ScoredBatch(rollout, old_logp_BT, advantages_BT, experts, experts)


def old_from_rollout(batch: ScoredBatch) -> ScoredBatch:
    """The batch with log pi_old replaced by log mu (bypass after a fused forward, see ``score_bypass``)."""
    return replace(batch, old_logp_BT=batch.rollout.rollout_logp_BT.float().masked_fill(
        ~batch.rollout.response_mask_BT.bool(), 0.0))


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
    # routes that are the engine's own (R3) stay the masked rollout's: one copy, and the route measures see one
    # tensor, 0 by construction, instead of comparing two equal ones
    engine = batch.rollout.rollout_experts_BSLK
    replay, train = (rollout.rollout_experts_BSLK if routes is engine else no_routes(routes)
                     for routes in (batch.replay_experts_BSLK, batch.train_experts_BSLK))
    return ScoredBatch(rollout, old_logp_BT, advantages_BT, train, replay)


def screen_old(batch: ScoredBatch, keep_B: Tensor, forward: Optional[OnPolicyForward] = None
               ) -> tuple[ScoredBatch, Tensor, Optional[OnPolicyForward], dict[str, float]]:
    """Drop the kept samples whose pi_old log-probs are non-finite (``guards.screen_old_logp``).

    ``forward`` (from ``score_on_policy``) comes back as it is when no sample was dropped here, and as None
    otherwise: the dropped samples' values are in its graph, so the update then runs its own forward."""
    kept_before = int(keep_B.sum())
    keep_B, metrics = guards.screen_old_logp(batch.old_logp_BT, batch.rollout.response_mask_BT, keep_B)
    if int(keep_B.sum()) != kept_before:
        forward = None
    return drop_rows(batch, keep_B), keep_B, forward, metrics


@dataclass
class OldPass:
    """log pi_old of one rollout batch, taken where ``algo.old_logp`` says (``old_pass``)."""

    # The screened batch; its old_logp_BT is the pi_old the updates' clip and IS weight use.
    batch: ScoredBatch
    # (B,) samples kept after the pi_old screen.
    keep_B: Tensor
    # The graph-carrying forward the single update back-propagates (N = 1), or None.
    forward: Optional[OnPolicyForward]
    # (B, T) the training engine's log-probs at the rollout weights, to measure against mu before the updates; None
    # when no forward ran (a bypass with N > 1: the discrepancy is then measured on each token's update).
    train_logp_BT: Optional[Tensor]
    # The screen's guard/ metrics.
    metrics: dict[str, float]


def _one_micro_batch(rollout: Rollout, spec: ScoringSpec) -> bool:
    """This rank's rows of ``rollout`` make up a single micro-batch (no budget, or all within it) on every rank."""
    local = rollout.select(spec.shard.rows(len(rollout))) if spec.shard.world > 1 else rollout
    return len(micro_batches(local, None, spec)) == 1


def old_pass(model, rollout: Rollout, advantages_B: Tensor, keep_B: Tensor, cfg: AlgoConfig, spec: ScoringSpec
             ) -> OldPass:
    """log pi_old for the updates: recomputed by the training engine (``algo.old_logp: recompute``), or log mu
    itself (``rollout``, the bypass: no forward before the updates unless N = 1 fuses it with the update's).

    With one mini-batch (``fuses_old_pass``) that is one micro-batch too (``_one_micro_batch``) the pi_old forward
    keeps its graph and is the update's forward; a larger batch is scored without a graph and the update then runs
    one forward and backward per micro-batch, so the memory of a step does not grow with the batch. Samples with
    non-finite pi_old log-probs are dropped (``screen_old``)."""
    bypass = cfg.old_logp == "rollout"
    forward = None
    fuse = fuses_old_pass(cfg) and _one_micro_batch(rollout, spec)
    if fuse:
        batch, forward = score_on_policy(model, rollout, advantages_B, cfg, spec)
    elif bypass:
        batch = score_bypass(rollout, advantages_B, cfg)
    else:
        batch = score_old(model, rollout, advantages_B, cfg, spec)
    batch, keep_B, forward, metrics = screen_old(batch, keep_B, forward)
    train_logp_BT = batch.old_logp_BT if not bypass or fuse else None
    if bypass:
        batch = old_from_rollout(batch)
    return OldPass(batch, keep_B, forward, train_logp_BT, metrics)


def minibatch_indices(batch_size: int, num_minibatches: int, generator: torch.Generator) -> list[Tensor]:
    """A seeded permutation of the rows split into ``num_minibatches`` equal parts."""
    perm = torch.randperm(batch_size, generator=generator)
    return list(perm.chunk(num_minibatches))


@dataclass(frozen=True)
class _BatchWeights:
    """Per-token values of the whole rollout batch that every mini-batch loss reads."""

    # (B, T) IS weights of rho = pi_old / mu (``IS_MODES``) and the tokens they keep.
    weights_BT: Tensor
    kept_BT: Tensor
    # (B, T) share of MoE layers whose experts differ between the engines at each token (None: not known).
    routing_BT: Optional[Tensor]


def _minibatch_terms(logp_BT: Tensor, ent_BT: Tensor, rows: Tensor, normalizer: int, batch: ScoredBatch,
                     weights: _BatchWeights, penalty: PenaltySpec, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of the batch rows ``rows`` (whose current log-probs and entropies are ``logp_BT``, ``ent_BT``):
    policy loss + penalty - entropy_coef * entropy, each a token sum over these rows / ``normalizer``. Each term is
    computed once, and nothing waits for the device: the metrics are 0-d tensors (``_host_metrics`` reads them)."""
    rollout = batch.rollout
    m_BT = rollout.response_mask_BT.bool()[rows]
    adv_BT = batch.advantages_BT[rows]
    metrics: dict[str, Tensor] = {}
    pen_loss = logp_BT.new_zeros(())
    if penalty.constraints:
        routing_BT = weights.routing_BT[rows] if weights.routing_BT is not None else None
        anchor_BT = batch.old_logp_BT[rows] if penalty.anchor == "old" else rollout.rollout_logp_BT[rows].float()
        pen_loss, adv_BT, pen_metrics = PENALTIES[penalty.form](
            logp_BT, anchor_BT, adv_BT, m_BT, penalty.lambda_C, penalty.constraints,
            normalizer, routing_mismatch_BT=routing_BT)
        metrics.update(pen_metrics)
    pg_loss, pg_metrics = POLICY_LOSSES[cfg.loss](logp_BT, batch.old_logp_BT[rows], adv_BT, weights.weights_BT[rows],
                                                  weights.kept_BT[rows], cfg, normalizer)
    metrics.update(pg_metrics)
    entropy = (ent_BT * m_BT).sum() / normalizer
    loss = pg_loss + pen_loss - cfg.entropy_coef * entropy
    metrics.update({"loss/total": loss.detach(), "policy/entropy": entropy.detach()})
    return loss, metrics


def _host_metrics(steps: list[dict]) -> list[dict[str, float]]:
    """The mini-batches' metrics as floats, their tensors read in one host sync (a registered loss may also give
    floats)."""
    keys = [(i, k) for i, m in enumerate(steps) for k, v in m.items() if isinstance(v, Tensor)]
    if keys:
        device = steps[keys[0][0]][keys[0][1]].device
        values = torch.stack([steps[i][k].detach().to(device, torch.float64).reshape(()) for i, k in keys]).tolist()
        for (i, k), value in zip(keys, values):
            steps[i][k] = value
    return [{k: float(v) for k, v in m.items()} for m in steps]


def _batch_weights(batch: ScoredBatch, cfg: AlgoConfig) -> tuple[_BatchWeights, dict[str, float]]:
    rollout = batch.rollout
    weights_BT, kept_BT, is_metrics = IS_MODES[cfg.is_mode](batch.old_logp_BT, rollout.rollout_logp_BT.float(),
                                                            rollout.response_mask_BT.bool(), cfg)
    routing_BT = None
    if batch.train_experts_BSLK is not None and rollout.rollout_experts_BSLK is not None:
        P = rollout.num_prompt_positions
        routing_BS = routing_mismatch_per_token(batch.train_experts_BSLK, rollout.rollout_experts_BSLK)
        # the route at position s shapes the logits that predict token s + 1
        routing_BT = routing_BS[:, P - 1:-1]
    return _BatchWeights(weights_BT, kept_BT, routing_BT), is_metrics


def _global_norm(grad_norm: Tensor) -> Tensor:
    """The gradient norm as a plain tensor (FSDP2 returns the norm of sharded gradients as a DTensor)."""
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm


def _entropy_term(ent_BT: Tensor, cfg: AlgoConfig) -> Tensor:
    """The entropy as the loss reads it: without its graph when ``algo.entropy_coef`` is 0 (with the ``logits`` head
    the graph would keep a (tokens, vocab) float32 ``exp`` alive until the backward)."""
    return ent_BT if cfg.entropy_coef else ent_BT.detach()


def _accumulate(model, rollout: Rollout, replay_experts_BSLK: Optional[Tensor], rows_B: Tensor, spec: ScoringSpec,
                scaler: Optional[torch.amp.GradScaler], terms: dict) -> tuple[Tensor, Tensor]:
    """Forward and backward of ``rollout`` (the batch's rows ``rows_B``) one ``micro_batches`` micro-batch at a time,
    the gradients accumulating: only one micro-batch's activations are alive at once. Each micro-batch's loss is its
    token sum over the mini-batch's global ``normalizer``, so the accumulated gradient is the mini-batch's.

    Several micro-batches of lower-precision parameters sum their gradients in float32 (``Float32Grads``), rounded
    to the parameters' dtype once, after the last one. Nothing in the loop waits for the device (the micro-batch
    plan reads the lengths once; the loss terms' metrics are not read).

    Returns the detached (B, T) log-probs and entropies of ``rollout``'s rows (0 at padding)."""
    B, T = rollout.response_ids_BT.shape
    logp_BT = torch.zeros(B, T, dtype=torch.float32, device=rollout.response_ids_BT.device)
    ent_BT = torch.zeros_like(logp_BT)
    parts = micro_batches(rollout, replay_experts_BSLK, spec)
    with Float32Grads(model.parameters()) if len(parts) > 1 else contextlib.nullcontext():
        for mb in parts:
            logp, ent, _ = _forward_logp_amp(model, mb.rollout, spec, with_entropy=True,
                                             replay_experts_BSLK=mb.replay_experts_BSLK, capture=False)
            pad = (0, T - mb.response_len)
            logp = torch.nn.functional.pad(logp, pad)
            ent = torch.nn.functional.pad(_entropy_term(ent, terms["cfg"]), pad)
            loss, _ = _minibatch_terms(logp, ent, rows_B[mb.rows], **terms)
            (loss if scaler is None else scaler.scale(loss)).backward()
            logp_BT[mb.rows] = logp.detach().float()
            ent_BT[mb.rows] = ent.detach().float()
    return logp_BT, ent_BT


def update(model, optim: OptimStep, batch: ScoredBatch, *, scoring: ScoringSpec, penalty: PenaltySpec,
           cfg: AlgoConfig, generator: torch.Generator, forward: Optional[OnPolicyForward] = None) -> UpdateResult:
    """N mini-batch optimiser steps on one scored rollout batch.

    ``optim.scaler`` (``model.dtype=float16``): dynamic loss scaling. The loss is scaled before the backward and the
    gradients unscaled before the clip; an overflow (non-finite gradients at a finite loss) is the scaler's
    business, not a bad update: that step is skipped, the scale halves ('optim/loss_scale',
    'optim/scale_overflow') and the guard does not count it.

    ``forward`` (N = 1 only, from ``score_on_policy`` on this ``batch``): the single mini-batch is the whole
    batch in row order and back-propagates that forward instead of running the model again.

    A mini-batch whose loss or gradient norm is non-finite gets no optimiser step (its gradients are
    zeroed, a warning is logged); 'guard/skipped_update' says so per mini-batch, ``UpdateResult.skipped``
    counts them.

    Under data parallelism (``scoring.shard.world > 1``) the mini-batches are the single-process ones (same
    seeded permutation); each rank back-propagates its block of every mini-batch with the mini-batch's global
    token count as normalizer (the FSDP gradient reduction sums), and the metrics, the loss included, are
    recomputed from the gathered per-token log-probs and entropies, so they are the full mini-batch's on
    every rank and every rank takes the same skip decision.
    """
    rollout = batch.rollout
    shard = scoring.shard
    optimizer, scheduler, scaler, grad_clip = optim.optimizer, optim.scheduler, optim.scaler, optim.grad_clip
    mask_BT = rollout.response_mask_BT.bool()
    weights, is_metrics = _batch_weights(batch, cfg)
    # the multipliers on the device once, not copied there (a host sync on CUDA) at every micro-batch's penalty
    penalty = replace(penalty, lambda_C=torch.as_tensor(penalty.lambda_C).to(mask_BT.device))
    trained_logp_BT = batch.old_logp_BT.clone()
    steps = []
    skipped = 0
    model.train()
    if forward is not None and not fuses_old_pass(cfg):
        raise ValueError(f"update: a fused pi_old forward needs algo.minibatches = 1, got {cfg.minibatches}")
    parts = [torch.arange(len(rollout))] if forward is not None else minibatch_indices(len(rollout), cfg.minibatches,
                                                                                        generator)
    for idx in parts:
        local = idx[shard.rows(len(idx))] if shard.world > 1 else idx
        normalizer = max(int(mask_BT[idx].sum()), 1)
        terms = dict(normalizer=normalizer, batch=batch, weights=weights, penalty=penalty, cfg=cfg)
        optimizer.zero_grad(set_to_none=True)
        if forward is not None:
            loss, _ = _minibatch_terms(forward.logp_BT, _entropy_term(forward.ent_BT, cfg), local, **terms)
            (loss if scaler is None else scaler.scale(loss)).backward()
            logp_BT, ent_BT = forward.logp_BT.detach(), forward.ent_BT.detach()
        else:
            replay = batch.replay_experts_BSLK[local] if batch.replay_experts_BSLK is not None else None
            logp_BT, ent_BT = _accumulate(model, rollout.select(local), replay, local, scoring, scaler, terms)
        full_logp_BT = shard.gather_rows(logp_BT)
        with torch.no_grad():  # the whole mini-batch's loss and metrics, from the detached per-token values
            full_loss, metrics = _minibatch_terms(full_logp_BT, shard.gather_rows(ent_BT), idx, **terms)
        trained_logp_BT[idx] = full_logp_BT.to(trained_logp_BT.dtype)
        base_lrs = [group["lr"] for group in optimizer.param_groups]
        if cfg.ess_lr_scale:
            # VCPO: the step shrinks with the mini-batch's sequence ESS; restored below, before the scheduler
            lr_scale, ess_metrics = ess_lr_scale(batch.old_logp_BT[idx], rollout.rollout_logp_BT[idx].float(),
                                                 mask_BT[idx])
            metrics.update(ess_metrics)
            for group in optimizer.param_groups:
                group["lr"] *= lr_scale
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = _global_norm(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                grad_clip if grad_clip > 0 else float("inf")))
        finite = bool(torch.isfinite(full_loss)) and bool(torch.isfinite(grad_norm))
        t_opt = time.perf_counter()
        if scaler is not None:
            overflow = bool(torch.isfinite(full_loss)) and not bool(torch.isfinite(grad_norm))
            metrics["optim/scale_overflow"] = float(overflow)
            metrics["optim/loss_scale"] = float(scaler.get_scale())
            if finite or overflow:
                scaler.step(optimizer)  # skips the step itself when the unscaled gradients hold an inf or NaN
            scaler.update()
            finite = finite or overflow
        elif finite:
            optimizer.step()
        if grad_norm.device.type == "cuda":  # the step's kernels are queued: wait for them to time it
            torch.cuda.synchronize(grad_norm.device)
        metrics["time/optimizer"] = time.perf_counter() - t_opt
        if not finite:
            # a non-finite loss or gradient would poison the weights: drop this update, keep going
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            log.warning("non-finite %s in a mini-batch update (loss %s, grad norm %s): optimizer step skipped",
                        "loss" if not bool(torch.isfinite(full_loss)) else "gradient norm",
                        float(full_loss), float(grad_norm))
        # the gradients are not needed past the step: freed here, not at the next mini-batch or rollout
        optimizer.zero_grad(set_to_none=True)
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr
        if scheduler is not None:
            scheduler.step()
        metrics["guard/skipped_update"] = 0.0 if finite else 1.0
        metrics.update({"optim/grad_norm": float(grad_norm), "optim/lr": optimizer.param_groups[0]["lr"]})
        steps.append(metrics)
    return UpdateResult(_host_metrics(steps), is_metrics, trained_logp_BT, skipped)
