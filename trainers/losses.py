"""Policy losses and the training-inference IS correction (docs/design.md §"The primal learner" and §"Sources").

Per token, pi_theta / mu = (pi_old / mu) * (pi_theta / pi_old) (Zheng et al., arXiv 2512.01374): the first
factor rho_t = pi_old / mu is the training-inference discrepancy, corrected by an IS weight w_t computed
once per rollout batch (``IS_MODES``); the second, r_t = pi_theta / pi_old, is policy staleness, which the
policy losses clip or mask (``POLICY_LOSSES``). Decoupling the two follows decoupled PPO (Hilton et al.
2021; AReaL, arXiv 2505.24298).

Shapes: B sequences, T response tokens. Log-probs by source: ``rollout_logp_BT`` (mu, rollout engine),
``old_logp_BT`` (pi_old, training engine before the updates), ``logp_BT`` (pi_theta, differentiable).
Masks are True (or nonzero) on valid response tokens.

Signatures, one per registry::

    IS_MODES[name](old_logp_BT, rollout_logp_BT, mask_BT, cfg) -> (weights_BT, kept_BT, metrics)
    POLICY_LOSSES[name](logp_BT, old_logp_BT, advantages_BT, weights_BT, mask_BT, cfg, normalizer)
        -> (loss, metrics)

A policy loss's metrics are 0-d tensors (floats are accepted too): the learner computes the loss once per
micro-batch and reads every metric of an update in one host sync, so a loss that synchronises (``float``,
``.item()``, boolean indexing) stalls each micro-batch's backward behind the device.

``weights_BT`` is detached, in the dtype of ``old_logp_BT``, and 0 outside ``kept_BT``; ``kept_BT`` (bool)
is the input mask minus the tokens the mode drops and minus those the composable rules drop (``cfg.seq_mask``,
``cfg.veto``, ``cfg.reject``; they apply under every mode, as verl's rejection and veto apply under every IS
level). The learner passes ``kept_BT`` as the policy loss's ``mask_BT``.

Aggregation (every loss): loss = sum_t mask_t * l_t / normalizer, with ``normalizer`` the number of valid
tokens of the GLOBAL mini-batch, given by the caller, so gradient accumulation and data parallelism
reproduce the big-batch gradient. No per-sequence length normalisation (Zheng et al.). A normalizer below
1 is taken as 1.

Numerics. Garbage at invalid positions (-inf, NaN) is replaced by 0 with ``torch.where`` before any
arithmetic, so it reaches neither the value nor the gradient. log r is clamped to [-LOG_RATIO_MAX,
LOG_RATIO_MAX] before the exponential (as verl does), so r stays finite in float32; a token with r beyond
e^20 ~ 4.9e8 gets no gradient from the ratio (such a token is already clipped whenever A > 0). A
non-finite ``logp_BT`` on a VALID token is not hidden: it makes the loss non-finite, which the learner
detects (it then skips the update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# log r and sequence-level log ratios are clamped to +-LOG_RATIO_MAX before exp (see the module docstring): the
# measures' bound, where kl_k3 and chi2 turn linear
from constraints.measures import LOG_RATIO_MAX, MEASURES
from trainers.config import AlgoConfig, ClipConfig

_METRIC_LOG_MAX = 700.0  # raw weights reported as metrics saturate at e^700 (float64 stays finite)

ISMode = Callable[[Tensor, Tensor, Tensor, AlgoConfig], tuple[Tensor, Tensor, dict[str, float]]]
PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, AlgoConfig, float],
                      tuple[Tensor, dict[str, Tensor | float]]]


# ------------------------------------------------------------------------------------------ IS correction


@dataclass(frozen=True)
class _Rho:
    """log rho of a batch in float64 (Float64 because log rho of two well-matched engines is ~1e-7 and the sequence
    rules sum it over hundreds of tokens). ``valid_BT`` = mask and log rho finite; every tensor is 0 off it."""

    log_rho_BT: Tensor
    old_BT: Tensor
    rollout_BT: Tensor
    mask_BT: Tensor
    valid_BT: Tensor
    # (B,) sequences with a valid-position token whose log rho is non-finite: their sequence ratio is undefined
    broken_B: Tensor
    # (B, T) valid positions with log rho = -inf (pi_old = 0 < mu): the worst token a veto can see, not a missing one
    zero_BT: Tensor
    nonfinite: int


def _log_rho(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor) -> _Rho:
    mask_BT = mask_BT.bool()
    old_BT = old_logp_BT.detach().double()
    rollout_BT = rollout_logp_BT.detach().double()
    log_rho_BT = old_BT - rollout_BT
    finite_BT = torch.isfinite(log_rho_BT)
    valid_BT = mask_BT & finite_BT
    broken_BT = mask_BT & ~finite_BT
    zero_BT = mask_BT & (log_rho_BT == -math.inf)
    return _Rho(torch.where(valid_BT, log_rho_BT, 0.0), torch.where(valid_BT, old_BT, 0.0),
                torch.where(valid_BT, rollout_BT, 0.0), mask_BT, valid_BT, broken_BT.any(dim=1), zero_BT,
                int(broken_BT.sum()))


def _seq_drops(rho: _Rho, cfg: AlgoConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens dropped by the composable rules, each (B, T) bool on the input mask: (sequence mask, veto, reject).

    - ``seq_mask`` prod: drop sequence i if prod_t rho_t leaves [prod.low, prod.high]; geo: if the geometric
      mean exp(mean_t log rho_t) leaves [geo.low, geo.high] (Liu, Li et al. 2025, geometric rejection). Decided
      on the log scale over the sequence's valid tokens; a sequence with a non-finite log rho is dropped (its
      ratio is undefined).
    - ``veto``: drop sequence i if any of its tokens has rho_t < threshold (log rho = -inf, pi_old = 0,
      included): one catastrophic token condemns the sample, whatever its mean.
    - ``reject``: drop token t if d_t > bound, d_t the per-token value of a ``constraints.measures`` token
      measure of (pi_old, mu).
    """
    mask_BT = rho.mask_BT
    none_BT = torch.zeros_like(mask_BT)
    seq_BT = none_BT
    if cfg.seq_mask.mode != "none":
        log_sum_B = rho.log_rho_BT.sum(dim=1)
        if cfg.seq_mask.mode == "geo":
            band, stat_B = cfg.seq_mask.geo, log_sum_B / rho.valid_BT.sum(dim=1).clamp(min=1)
        else:
            band, stat_B = cfg.seq_mask.prod, log_sum_B
        lo = math.log(band.low) if band.low > 0 else -math.inf
        hi = math.log(band.high)
        out_B = (stat_B < lo) | (stat_B > hi) | rho.broken_B
        seq_BT = mask_BT & out_B[:, None]
    veto_BT = none_BT
    if cfg.veto.threshold is not None:
        low_BT = (rho.valid_BT & (rho.log_rho_BT < math.log(cfg.veto.threshold))) | rho.zero_BT
        veto_BT = mask_BT & low_BT.any(dim=1)[:, None]
    reject_BT = none_BT
    if cfg.reject.measure != "none":
        d_BT = MEASURES[cfg.reject.measure].token(rho.old_BT, rho.rollout_BT)
        reject_BT = rho.valid_BT & (d_BT > cfg.reject.bound)
    return seq_BT, veto_BT, reject_BT


def _is_result(rho: _Rho, weights_BT: Tensor, kept_BT: Tensor, raw_log_BT: Tensor, raw_valid_BT: Tensor,
               truncated_BT: Tensor, cfg: AlgoConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Apply the composable rules (``_seq_drops``) to the mode's ``kept_BT``, zero the weights off the result,
    cast, and compute the shared metrics.

    raw_log_BT: log of the raw (pre-truncation) weight per token, meaningful on raw_valid_BT.
    Fractions are over the valid tokens of the input mask; an empty batch reports 0 everywhere. Each rule's
    share counts the tokens that rule drops on its own (a token may be dropped by several); ``is/masked_frac``
    counts every dropped token once.
    """
    mask_BT = rho.mask_BT
    seq_BT, veto_BT, reject_BT = _seq_drops(rho, cfg)
    mode_BT = mask_BT & ~kept_BT
    kept_BT = kept_BT & ~(seq_BT | veto_BT | reject_BT)
    weights_BT = torch.where(kept_BT, weights_BT, 0.0)
    n_mask = int(mask_BT.sum())
    n_kept = int(kept_BT.sum())
    if bool(raw_valid_BT.any()):
        raw = raw_log_BT[raw_valid_BT]
        raw_max = math.exp(min(float(raw.max()), _METRIC_LOG_MAX))
        raw_min = math.exp(min(float(raw.min()), _METRIC_LOG_MAX))
    else:
        raw_max = raw_min = 0.0

    def share(drop_BT: Tensor) -> float:
        return float(drop_BT.sum()) / n_mask if n_mask else 0.0

    metrics = {
        "is/weight_mean": float(weights_BT[kept_BT].mean()) if n_kept else 0.0,
        "is/weight_max": float(weights_BT[kept_BT].max()) if n_kept else 0.0,
        "is/weight_max_raw": raw_max,
        "is/weight_min_raw": raw_min,
        "is/truncated_frac": share(truncated_BT & kept_BT),
        "is/masked_frac": (n_mask - n_kept) / n_mask if n_mask else 0.0,
        "is/mode_masked_frac": share(mode_BT),
        "is/seq_masked_frac": share(seq_BT),
        "is/vetoed_frac": share(veto_BT),
        "is/rejected_frac": share(reject_BT),
        "is/nonfinite_tokens": float(rho.nonfinite),
    }
    return weights_BT.to(dtype), kept_BT, metrics


def is_none(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, cfg: AlgoConfig):
    """No correction: w_t = 1. Tokens with a non-finite log rho are still dropped (a broken sample).

    Metrics report the raw rho statistics all the same, so a run without correction shows what it ignores.
    """
    rho = _log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    ones_BT = torch.ones_like(rho.log_rho_BT)
    return _is_result(rho, ones_BT, rho.valid_BT, rho.log_rho_BT, rho.valid_BT, torch.zeros_like(rho.valid_BT), cfg,
                      old_logp_BT.dtype)


def is_tis(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, cfg: AlgoConfig):
    """Truncated IS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"): w_t = min(rho_t, C), C = cfg.tis.cap, evaluated as exp(min(log rho_t, log C)).

    Only the upper side is truncated; tokens with a non-finite log rho are dropped.
    """
    rho = _log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    log_cap = math.log(cfg.tis.cap)
    weights_BT = torch.exp(rho.log_rho_BT.clamp(max=log_cap))
    truncated_BT = rho.valid_BT & (rho.log_rho_BT > log_cap)
    return _is_result(rho, weights_BT, rho.valid_BT, rho.log_rho_BT, rho.valid_BT, truncated_BT, cfg,
                      old_logp_BT.dtype)


def is_icepop(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, cfg: AlgoConfig):
    """IcePop (Ring-1T, arXiv 2510.18855): keep token t only if rho_t in [alpha, beta] =
    [cfg.icepop.low, cfg.icepop.high] (paper: [0.5, 5]), with w_t = rho_t there; tokens outside the band are
    masked out (they leave ``kept_BT``, so they contribute neither loss nor gradient). Bounds are inclusive.
    """
    rho = _log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    band = cfg.icepop
    lo = math.log(band.low) if band.low > 0 else -math.inf
    hi = math.log(band.high)
    kept_BT = rho.valid_BT & (rho.log_rho_BT >= lo) & (rho.log_rho_BT <= hi)
    weights_BT = torch.exp(rho.log_rho_BT)
    return _is_result(rho, weights_BT, kept_BT, rho.log_rho_BT, rho.valid_BT, torch.zeros_like(kept_BT), cfg,
                      old_logp_BT.dtype)


def is_seq_tis(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, cfg: AlgoConfig):
    """Sequence-level truncated IS (Liu, Li et al. 2025, "When Speed Kills Stability"):
    w_i = min(prod_t rho_t, C) = exp(min(sum_t log rho_t, log C)), C = cfg.seq_tis.cap, broadcast to the
    sequence's tokens. Only the upper side is truncated, so a long sequence with rho_t slightly below 1 gets
    a small weight. Sequences with a non-finite token are dropped.

    With ``seq_mask.mode=prod`` the mask acts on the same product: where prod.high <= cap the cap never acts
    (verl's sequence IS + sequence rejection preset sets both to 2, making the pair a plain band).
    """
    rho = _log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    seq_valid_BT = rho.mask_BT & ~rho.broken_B[:, None]
    log_sum_B = rho.log_rho_BT.sum(dim=1)
    log_cap = math.log(cfg.seq_tis.cap)
    weights_BT = torch.exp(log_sum_B.clamp(max=log_cap))[:, None].expand(seq_valid_BT.shape)
    raw_log_BT = log_sum_B[:, None].expand(seq_valid_BT.shape)
    truncated_BT = seq_valid_BT & (raw_log_BT > log_cap)
    return _is_result(rho, weights_BT, seq_valid_BT, raw_log_BT, seq_valid_BT, truncated_BT, cfg, old_logp_BT.dtype)


def m2po_keep(m2_N: Tensor, threshold: float) -> Tensor:
    """M2PO's token mask (Zheng, Zhao, Chen 2025, "Prosperity before Collapse", arXiv 2510.01161; AReaL's
    ``m2_threshold``): drop the tokens with the largest second moment M2_t = (log rho_t)^2, one at a time, until
    the mean M2 of the tokens left is below ``threshold`` (strictly); True on the tokens kept.

    Vectorised: with M2 sorted in decreasing order, the greedy removal drops a prefix of that order, so it drops
    the k largest where k is the first index whose suffix mean sum_{j >= k} M2_(j) / (n - k) is below the
    threshold; k = n (everything dropped) when no suffix qualifies, i.e. when even the smallest M2 reaches it.
    Ties are broken by position (a stable sort), so the lowest-indexed of equal values goes first.
    m2_N: (N,) non-negative, finite, float64 recommended (the suffix sums run from the smallest value up).
    """
    n = m2_N.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=m2_N.device)
    sorted_N, order_N = torch.sort(m2_N, descending=True, stable=True)
    suffix_sum_N = sorted_N.flip(0).cumsum(0).flip(0)
    count_N = torch.arange(n, 0, -1, device=m2_N.device, dtype=sorted_N.dtype)
    below_N = suffix_sum_N / count_N < threshold
    k = int(below_N.to(torch.int8).argmax()) if bool(below_N.any()) else n
    keep_sorted_N = torch.arange(n, device=m2_N.device) >= k
    keep_N = torch.empty_like(keep_sorted_N)
    keep_N[order_N] = keep_sorted_N
    return keep_N


def is_m2po(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, cfg: AlgoConfig):
    """M2PO (arXiv 2510.01161), as AReaL applies it with decoupled PPO: keep the tokens of ``m2po_keep`` with
    M2_t = (log rho_t)^2 and tau = cfg.m2po.threshold, w_t = rho_t on them (uncapped, as AReaL's decoupled loss
    without a behaviour-weight cap).

    The ratio: AReaL takes delta = logprobs - prox_logp, the rollout engine's (behaviour) log-prob minus the
    recomputed proximal policy's, so M2 is (log pi_prox / pi_behav)^2, here (log pi_old / mu)^2 = (log rho)^2:
    the same factor as every ``IS_MODES`` entry. The mask is recomputed for every rollout batch over all its
    valid tokens (AReaL: over the tokens of the loss call's batch). Tokens with a non-finite log rho are dropped
    and do not enter M2. Extra metrics: ``is/m2_raw`` and ``is/m2_kept``, the mean M2 before and after.
    """
    rho = _log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    m2_N = rho.log_rho_BT[rho.valid_BT].square()
    keep_N = m2po_keep(m2_N, cfg.m2po.threshold)
    kept_BT = torch.zeros_like(rho.valid_BT)
    kept_BT[rho.valid_BT] = keep_N
    weights_BT = torch.exp(rho.log_rho_BT)
    weights_BT, kept_BT, metrics = _is_result(rho, weights_BT, kept_BT, rho.log_rho_BT, rho.valid_BT,
                                              torch.zeros_like(kept_BT), cfg, old_logp_BT.dtype)
    metrics["is/m2_raw"] = float(m2_N.mean()) if m2_N.numel() else 0.0
    metrics["is/m2_kept"] = float(m2_N[keep_N].mean()) if bool(keep_N.any()) else 0.0
    return weights_BT, kept_BT, metrics


IS_MODES: dict[str, ISMode] = {
    "none": is_none,
    "tis": is_tis,
    "icepop": is_icepop,
    "seq_tis": is_seq_tis,
    "m2po": is_m2po,
}
"""Weights of rho per mode. Every mode then applies the composable rules of ``cfg`` (sequence mask, veto,
token rejection; ``_seq_drops``), so ``IS_MODES[cfg.is_mode]`` is the whole correction. What was ``seq_mis``
is ``is_mode=none`` with ``seq_mask.mode=geo``: w = 1 on kept sequences, because the source uses the geometric
mean for rejection only, not as a weight (verl's geometric rejection follows it)."""


# ------------------------------------------------------------------------------------------ policy losses


def _sanitize(logp_BT: Tensor, old_logp_BT: Tensor, advantages_BT: Tensor, weights_BT: Tensor, mask_BT: Tensor):
    """Zero every input off the mask (before any arithmetic) and bring them to logp's dtype."""
    mask_BT = mask_BT.bool()
    dt = logp_BT.dtype
    logp_BT = torch.where(mask_BT, logp_BT, 0.0)
    old_logp_BT = torch.where(mask_BT, old_logp_BT.detach().to(dt), 0.0)
    advantages_BT = torch.where(mask_BT, advantages_BT.detach().to(dt), 0.0)
    weights_BT = torch.where(mask_BT, weights_BT.detach().to(dt), 0.0)
    return logp_BT, old_logp_BT, advantages_BT, weights_BT, mask_BT


def _clip_masks(ratio_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor, clip: ClipConfig) -> tuple[Tensor, Tensor]:
    """Tokens where the clip is active in the gradient sense: (A > 0, r > 1 + eps_high), (A < 0, r < 1 - eps_low),
    with eps_low = clip.low, eps_high = clip.high (the loss's own sub-config)."""
    high_BT = mask_BT & (advantages_BT > 0) & (ratio_BT > 1.0 + clip.high)
    low_BT = mask_BT & (advantages_BT < 0) & (ratio_BT < 1.0 - clip.low)
    return low_BT, high_BT


def _dual_clip_mask(ratio_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor, cfg: AlgoConfig) -> Tensor:
    """Tokens the dual-clip takes the gradient from: A < 0 and r > c = cfg.clip_ratio_c (none when c is null)."""
    if cfg.clip_ratio_c is None:
        return torch.zeros_like(mask_BT)
    return mask_BT & (advantages_BT < 0) & (ratio_BT > cfg.clip_ratio_c)


@torch.no_grad()
def _loss_metrics(loss: Tensor, log_r_BT: Tensor, ratio_BT: Tensor, low_BT: Tensor, high_BT: Tensor,
                  dual_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """Shared metrics; means over the valid tokens of this (micro-)batch, 0 when it has none. 0-d float64 tensors:
    computing them waits for nothing on the device (no host sync, no boolean indexing); the caller reads them.

    policy/approx_kl is k3 of r on the valid tokens: E[r - 1 - log r], an estimator of KL(pi_old || pi_theta)
    on pi_old-samples (Schulman's k3). policy/ratio_mean is the mean of the ratio the clip acts on.
    clip/frac counts the eps clip (low | high); clip/frac_dual the dual-clip, separately.
    """
    n = mask_BT.sum().clamp_min(1).double()
    log_r_BT = torch.where(mask_BT, log_r_BT.double(), 0.0)
    k3_BT = MEASURES["kl_k3"].token(log_r_BT, torch.zeros_like(log_r_BT))  # the measures' ulp-accurate k3
    return {
        "loss/policy": loss.double(),
        "clip/frac": (low_BT | high_BT).sum() / n,
        "clip/frac_low": low_BT.sum() / n,
        "clip/frac_high": high_BT.sum() / n,
        "clip/frac_dual": dual_BT.sum() / n,
        "policy/approx_kl": torch.where(mask_BT, k3_BT, 0.0).sum() / n,
        "policy/ratio_mean": torch.where(mask_BT, ratio_BT.double(), 0.0).sum() / n,
    }


def ppo_clip_loss(logp_BT: Tensor, old_logp_BT: Tensor, advantages_BT: Tensor, weights_BT: Tensor, mask_BT: Tensor,
                  cfg: AlgoConfig, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL, arXiv 2505.24298; Hilton et al. 2021) with dual-clip (Ye et al. 2020, arXiv
    1912.09729):

        s_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),  r_t = exp(logp_t - old_logp_t)
        s_t <- c A_t  where A_t < 0 and r_t > c (dual-clip, c = cfg.clip_ratio_c; skipped when null)
        l_t = -w_t * s_t

    w_t is the IS weight of rho_t = pi_old / mu (``IS_MODES``), eps_low = cfg.ppo_clip.low, eps_high =
    cfg.ppo_clip.high. loss = sum_t mask_t l_t / normalizer. Gradient: -w_t A_t r_t grad log pi_t where no clip
    is active, 0 where one is (``clip/frac``; ``clip/frac_dual``: A < 0 and r > c, where without the
    dual-clip the term -w A r grows without bound in r).

    For A < 0 and c > 1 the replacement equals Ye et al.'s max(s_t, c A_t) in value. Written as a strict
    r > c rather than a max so that the tie r == c keeps the whole gradient -w A r grad log pi (a max would
    split it in half between its two equal arguments): the dual-clip is inactive at r == c, as in
    ``clip/frac_dual`` and in minirl's mask, whose gradient equals this one token for token.
    """
    logp_BT, old_logp_BT, adv_BT, w_BT, mask_BT = _sanitize(logp_BT, old_logp_BT, advantages_BT, weights_BT, mask_BT)
    log_r_BT = (logp_BT - old_logp_BT).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    ratio_BT = torch.exp(log_r_BT)
    clipped_BT = ratio_BT.clamp(1.0 - cfg.ppo_clip.low, 1.0 + cfg.ppo_clip.high)
    surrogate_BT = torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    dual_BT = _dual_clip_mask(ratio_BT.detach(), adv_BT, mask_BT, cfg)
    if cfg.clip_ratio_c is not None:
        surrogate_BT = torch.where(dual_BT, cfg.clip_ratio_c * adv_BT, surrogate_BT)
    per_token_BT = -w_BT * surrogate_BT
    loss = torch.where(mask_BT, per_token_BT, 0.0).sum() / max(float(normalizer), 1.0)
    low_BT, high_BT = _clip_masks(ratio_BT.detach(), adv_BT, mask_BT, cfg.ppo_clip)
    return loss, _loss_metrics(loss.detach(), log_r_BT.detach(), ratio_BT.detach(), low_BT, high_BT, dual_BT, mask_BT)


def minirl_loss(logp_BT: Tensor, old_logp_BT: Tensor, advantages_BT: Tensor, weights_BT: Tensor, mask_BT: Tensor,
                cfg: AlgoConfig, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
    """MiniRL (Zheng et al., arXiv 2512.01374, Eq. 7): masked, IS-weighted REINFORCE,

        J = sum_t M_t * sg(pi_theta(y_t) / mu(y_t)) * A_t * log pi_theta(y_t),   loss = -J / normalizer,

    with pi_theta / mu = r_t * rho_t: r_t = pi_theta / pi_old is computed here, the training-inference factor
    rho_t enters as ``weights_BT`` (already truncated by the IS mode; the paper truncates at 5, TIS). The
    mask M_t = 0 iff (A_t > 0 and r_t > 1 + eps_high) or (A_t < 0 and r_t < 1 - eps_low), eps_low =
    cfg.minirl.low, eps_high = cfg.minirl.high (paper: eps_high 0.27, eps_low 0.2). The gradient is
    -M_t r_t w_t A_t grad log pi_t, the REINFORCE form -w_t A_t grad log pi_t at r = 1. The loss VALUE is
    -sum M sg(r w) A log pi / N, not a PPO surrogate: compare its gradient, not its value, with the other losses.

    Dual-clip (Ye et al. 2020; not in the paper): also M_t = 0 where A_t < 0 and r_t > c = cfg.clip_ratio_c.
    Derivation: M_t is exactly the set where ppo_clip's surrogate has a non-zero gradient, and there both
    losses have the gradient -w_t A_t r_t grad log pi_t. Dual-clip replaces ppo_clip's surrogate by the
    constant c A_t where A_t < 0 and r_t > c, so its gradient is 0 there; masking the same tokens keeps
    minirl's gradient equal to ppo_clip's, token for token. (Bounding the coefficient at c instead, i.e.
    -w c A grad log pi, would keep pushing down a token whose probability already rose c-fold against a
    negative advantage, the update dual-clip exists to stop.) Without it -r w A is unbounded in r.
    """
    logp_BT, old_logp_BT, adv_BT, w_BT, mask_BT = _sanitize(logp_BT, old_logp_BT, advantages_BT, weights_BT, mask_BT)
    log_r_BT = (logp_BT.detach() - old_logp_BT).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    ratio_BT = torch.exp(log_r_BT)
    low_BT, high_BT = _clip_masks(ratio_BT, adv_BT, mask_BT, cfg.minirl)
    dual_BT = _dual_clip_mask(ratio_BT, adv_BT, mask_BT, cfg)
    active_BT = mask_BT & ~(low_BT | high_BT | dual_BT)
    coef_BT = ratio_BT * w_BT * adv_BT  # sg(pi_theta / mu) * A: no gradient through r
    per_token_BT = -coef_BT * logp_BT
    loss = torch.where(active_BT, per_token_BT, 0.0).sum() / max(float(normalizer), 1.0)
    return loss, _loss_metrics(loss.detach(), log_r_BT, ratio_BT, low_BT, high_BT, dual_BT, mask_BT)


def gspo_loss(logp_BT: Tensor, old_logp_BT: Tensor, advantages_BT: Tensor, weights_BT: Tensor, mask_BT: Tensor,
              cfg: AlgoConfig, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071), in its GSPO-token form:

        s_i     = exp( mean_{t in T_i} (logp_t - old_logp_t) )              (sequence ratio, valid tokens)
        s_{i,t} = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))               (value s_i, grad s_i grad log pi_t)
        l_t     = -w_t * min(s_{i,t} A_t, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_t)

    The clip decision is taken per sequence (the value of s_{i,t} is s_i); with A_t and w_t constant over a
    sequence the gradient equals that of GSPO's sequence objective. GSPO-token is used so that per-token
    advantages (the ``advantage`` penalty form shapes A_t per token) and per-token IS weights keep their
    per-token meaning: the training-inference weight w_t (``IS_MODES``; constant per sequence under seq_tis)
    multiplies each token's term, as in decoupled PPO. ``cfg.clip_ratio_c`` is not applied (as in verl's GSPO):
    the sequence ratio is a geometric mean, which a per-token dual-clip bound does not fit.

    The clip range is gspo's own, eps_low = cfg.gspo.low, eps_high = cfg.gspo.high: on a length-normalised
    ratio it must be about three orders smaller than a token clip's (the GSPO paper's 3e-4 / 4e-4, the
    defaults; 0.2 / 0.28 would almost never clip).

    Aggregation: sum_t mask_t l_t / normalizer like the other losses. Per sequence this is |y_i| times
    GSPO's (1/G) s_i A_i term up to the global constant, i.e. sequences are weighted by their length instead
    of GSPO's per-sequence mean over tokens (no length normalisation, Zheng et al. 2512.01374).
    ``policy/ratio_mean`` reports the token-weighted mean of s_i; ``clip/frac*`` count the tokens of clipped
    sequences.
    """
    logp_BT, old_logp_BT, adv_BT, w_BT, mask_BT = _sanitize(logp_BT, old_logp_BT, advantages_BT, weights_BT, mask_BT)
    log_r_BT = logp_BT - old_logp_BT  # 0 off the mask
    count_B = mask_BT.sum(dim=1).clamp(min=1)
    seq_log_ratio_B = (log_r_BT.sum(dim=1) / count_B).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    s_B = torch.exp(seq_log_ratio_B.detach())
    s_BT = s_B[:, None] * torch.exp(logp_BT - logp_BT.detach())
    clipped_BT = s_BT.clamp(1.0 - cfg.gspo.low, 1.0 + cfg.gspo.high)
    per_token_BT = -w_BT * torch.minimum(s_BT * adv_BT, clipped_BT * adv_BT)
    loss = torch.where(mask_BT, per_token_BT, 0.0).sum() / max(float(normalizer), 1.0)
    seq_ratio_BT = s_B[:, None].expand_as(mask_BT)
    low_BT, high_BT = _clip_masks(seq_ratio_BT, adv_BT, mask_BT, cfg.gspo)
    token_log_r_BT = log_r_BT.detach().clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    no_dual_BT = torch.zeros_like(mask_BT)
    return loss, _loss_metrics(loss.detach(), token_log_r_BT, seq_ratio_BT, low_BT, high_BT, no_dual_BT, mask_BT)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
    "minirl": minirl_loss,
    "gspo": gspo_loss,
}


# ------------------------------------------------------------------------------------------ ESS step scale


def seq_ess_frac(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor) -> tuple[float, int]:
    """Normalised effective sample size of the sequence IS weights, ESS/n = (sum_i w_i)^2 / (n sum_i w_i^2),
    w_i = prod_t rho_t over sequence i's valid tokens (unclipped), n = the sequences with at least one valid token
    and a finite log rho everywhere. Returns (ESS/n, n); (1.0, 0) when n = 0.

    Exact in float64 at any scale: ESS/n is invariant to a common factor, so w_i = exp(log w_i - max_j log w_j).
    """
    rho = _log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    used_B = rho.valid_BT.any(dim=1) & ~rho.broken_B
    n = int(used_B.sum())
    if n == 0:
        return 1.0, 0
    log_w_N = rho.log_rho_BT.sum(dim=1)[used_B]
    w_N = torch.exp(log_w_N - log_w_N.max())
    return float(w_N.sum().square() / (n * w_N.square().sum())), n


def ess_lr_scale(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor) -> tuple[float, dict[str, float]]:
    """VCPO's step rule (Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv
    2602.17616; the released recipe's settings): the learning rate of a mini-batch's optimiser step is multiplied
    by sqrt(min(1, ESS/n)), with ESS/n the normalised effective sample size of the mini-batch's unclipped
    sequence weights w_i = prod_t pi_old / mu (``seq_ess_frac``). The recipe's knobs are fixed at its values
    (``scaling_rule: sqrt``, ``base_ess_ratio: 1``, ``use_clipped: false``), so the rule adds no hyperparameter.
    A batch of equal weights keeps the full step; one sequence carrying all the weight gets 1/sqrt(n) of it.
    """
    frac, n = seq_ess_frac(old_logp_BT, rollout_logp_BT, mask_BT)
    scale = math.sqrt(min(1.0, frac))
    return scale, {"is/seq_ess_frac": frac, "optim/ess_lr_scale": scale}
