"""Training–inference discrepancy measures (docs/design.md §"Measures"): pure torch functions of the engines' log-probs.

Per token, rho_t = pi_old(y_t) / mu(y_t) is the ratio of the training engine's probability to the rollout
engine's probability of the sampled token, computed in log space: ``log rho = logp_train - logp_rollout``.
Every measure works on the RAW ratio (no truncation, unlike the IS weights of the learner).

Shapes: ``logp_train_BT``, ``logp_rollout_BT``, ``mask_BT`` are ``[B, T]`` (B sequences, T response tokens;
the mask is True, or nonzero, on valid tokens). MoE routes are ``[B, S, L, K]`` (S input positions, L MoE
layers, K experts per token, -1 where no route was recorded).

Conventions shared by every measure:

- Batch values are computed in float64 whatever the input dtype: the measures of two well-matched
  engines are tiny (DCMDP's tolerance is c = 0.0037 on |pi_old - mu|) and log rho can be ~1e-12.
- Masked means are over all valid tokens of the batch (token mean, not a mean of per-sequence means).
  A batch without any valid token gives 0 for the mean-type measures (no evidence of a discrepancy,
  never a NaN that would reach the dual controller); all-masked rows are simply ignored.
- Invalid positions are replaced by 0 *before* any arithmetic (``torch.where``), so padding that holds
  garbage (-inf, NaN) neither leaks into the values nor into the gradients.
- exp(log rho) overflows for log rho > ~88 (float32) / ~709 (float64), and such ratios occur with
  log-probs down to -1e4 on a broken engine. Measures that exponentiate (kl_k3, chi2) evaluate the
  exponential at min(log rho, LOG_RATIO_MAX) and continue the function *linearly* above it
  (f(x) = f(X) + f'(X) (x - X) for x > X = LOG_RATIO_MAX): values stay finite even in float32 and the
  gradient keeps its sign, instead of vanishing as it would under a plain clamp. Only ratios above
  e^20 ~ 4.9e8 are affected. abs_prob_diff needs no clamp (it is written as exp(max) * (1 - exp(-|diff|)),
  all factors in [0, 1] for log-probs <= 0), ess is scale-invariant (exact with a max shift).
- At the other end (rho << 1) the token forms of abs_prob_diff and chi2 keep their gradient's relative
  precision down to log rho ~ -700 (``_expm1``); torch's expm1 backward would round it to 0 below ~ -37.
- The panel (``discrepancy_metrics``) logs every measure of ``MEASURES`` at its ``metric_key``, so a measure
  added to the registry is logged, constrainable and calibrated without another list to keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from constraints.config import ConstraintConfig

LOG_RATIO_MAX = 20.0
"""Above this log rho, kl_k3 and chi2 are continued linearly (see the module docstring); trainers.losses clamps its
log ratios to +-LOG_RATIO_MAX before exp."""

# |log rho| below which k3 = exp(x) - 1 - x is summed as its Taylor series x^2/2! + ... + x^17/17! (Horner): there
# expm1(x) - x loses ~2 / |x| ulps to cancellation. The first omitted term, x^18/18!, is below 6e-21 of the value
# on the branch (2 * 0.5^16 / 18! of x^2/2 at |x| = 0.5), far under float64's 2^-53; at and above 0.5, expm1(x) - x
# cancels at most a factor ~5 (x = -0.5), a couple of ulps.
_K3_SERIES_BELOW = 0.5
_K3_SERIES = tuple(1.0 / math.factorial(k) for k in range(2, 18))
_LOG_PPL_MAX = 700.0  # log perplexities are capped here, where exp is still finite in float64


@dataclass(frozen=True)
class Measure:
    name: str
    # (logp_train_BT, logp_rollout_BT, mask_BT, **params) -> 0-dim float64 tensor (batch value).
    batch: Callable[..., Tensor]
    # (logp_train_BT, logp_rollout_BT) -> d_BT per-token value, differentiable in logp_train; None when the
    # measure has no per-token differentiable form (sequence level, indicator, routing).
    token: Optional[Callable[[Tensor, Tensor], Tensor]]
    # "token" (masked mean of a per-token value) | "max" (largest per-token value) | "sequence" (aggregates
    # over sequences / the batch) | "routing" (MoE expert sets; needs the routes, not the log-probs).
    kind: str
    # Keyword parameters ``batch`` takes, by name; ``measure_constraint`` fills them from the constraint
    # config (``tau``) or from the routes it was given.
    params: tuple[str, ...] = ()
    # Metric key of the per-step panel (``discrepancy_metrics``); empty: 'discrepancy/<name>'.
    metric: str = ""
    # Constraint-config values the panel measures with (e.g. tau = 2 for extreme_rate), as (field, value) pairs.
    panel: tuple[tuple[str, float], ...] = ()

    @property
    def metric_key(self) -> str:
        return self.metric or f"discrepancy/{self.name}"


# ---------------------------------------------------------------------------------------------- token forms


def _expm1(x: Tensor) -> Tensor:
    """exp(x) - 1 with relative precision in the value AND the gradient for every x.

    torch's expm1 backward is grad * (expm1(x) + 1), which cancels to 0 once expm1(x) rounds to -1 (x < -37 in
    float64, x < -17 in float32), although the true derivative e^x is a normal number down to x = -708. Below
    -log 2, exp(x) - 1 has no cancellation in the value (e^x < 1/2) and its backward is exp(x) itself.
    """
    return torch.where(x < -math.log(2.0), torch.exp(x) - 1.0, torch.expm1(x))


def abs_prob_diff_token(logp_train_BT: Tensor, logp_rollout_BT: Tensor) -> Tensor:
    """|pi_old(y_t) - mu(y_t)| (DCMDP, Liu et al. arXiv 2606.08779), as exp(max) * (1 - exp(-|log rho|)).

    The factor 1 - exp(-d) = -expm1(-d) keeps differences of 1e-12 between the log-probs, and log-probs of -1e4
    never reach exp of a large argument. d/d logp_train = sign(pi_old - mu) * pi_old, with relative precision
    even where pi_old << mu (``_expm1``: at log rho = -40 the gradient is -e^-40, not 0).
    """
    top_BT = torch.maximum(logp_train_BT, logp_rollout_BT)
    return torch.exp(top_BT) * -_expm1(-(logp_train_BT - logp_rollout_BT).abs())


def kl_k1_token(logp_train_BT: Tensor, logp_rollout_BT: Tensor) -> Tensor:
    """log mu - log pi_old = -log rho: the k1 estimator of KL(mu || pi_old) on mu-samples (may be < 0)."""
    return logp_rollout_BT - logp_train_BT


def _k3(x: Tensor) -> Tensor:
    """exp(x) - 1 - x >= 0, linear above LOG_RATIO_MAX; within a few ulps in value and gradient (e^x - 1).

    For |x| < 0.5 the Taylor series sum_{k=2}^{17} x^k / k! (``_K3_SERIES_BELOW``), where expm1(x) - x cancels;
    expm1(x) - x elsewhere. tests/test_measures.py bounds both, value and autograd gradient, against a
    200-bit reference over |x| in [1e-12, 20].
    """
    xc = x.clamp(max=LOG_RATIO_MAX)
    small = xc.abs() < _K3_SERIES_BELOW
    # the series sees 0 off its branch: x^17 of a large |x| would overflow and turn where's zero gradient into NaN
    xs = torch.where(small, xc, torch.zeros_like(xc))
    # x^2 / 2 is its own term, with its own x * x, so its gradient x is exact and the rest's a small correction
    # (a shared x * x would round 0.5 + x * tail before the 2x: 3-4 ulps of the gradient). Built before the tail:
    # autograd runs later nodes first, so the tail's small contributions are summed before x joins them.
    lead = (xs * xs) * 0.5
    tail = torch.full_like(xs, _K3_SERIES[-1])  # x^3 / 3! + ... as x^3 * tail, Horner
    for coef in reversed(_K3_SERIES[1:-1]):
        tail = tail * xs + coef
    value = torch.where(small, lead + (xs * xs) * (xs * tail), torch.expm1(xc) - xc)
    # relu(x - X) rather than (x - xc): the latter's gradient 1 - 1 is summed with the huge slope and cancels
    return value + math.expm1(LOG_RATIO_MAX) * torch.relu(x - LOG_RATIO_MAX)


def kl_k3_token(logp_train_BT: Tensor, logp_rollout_BT: Tensor) -> Tensor:
    """rho - 1 - log rho >= 0: the k3 estimator of KL(mu || pi_old) (Schulman 2020), low variance."""
    return _k3(logp_train_BT - logp_rollout_BT)


def _chi2(x: Tensor) -> Tensor:
    """expm1(x)^2, gradient 2 (e^x - 1) e^x precise for x << 0 (``_expm1``), linear above LOG_RATIO_MAX."""
    xc = x.clamp(max=LOG_RATIO_MAX)
    slope = 2.0 * math.expm1(LOG_RATIO_MAX) * math.exp(LOG_RATIO_MAX)  # d/dx expm1(x)^2 at the cap
    return _expm1(xc).square() + slope * torch.relu(x - LOG_RATIO_MAX)


def chi2_token(logp_train_BT: Tensor, logp_rollout_BT: Tensor) -> Tensor:
    """(rho - 1)^2 = expm1(log rho)^2: per-token Pearson chi^2(pi_old || mu) on mu-samples; linear above the cap."""
    return _chi2(logp_train_BT - logp_rollout_BT)


def abs_log_ratio_token(logp_train_BT: Tensor, logp_rollout_BT: Tensor) -> Tensor:
    """|log rho| = |log pi_old - log mu|."""
    return (logp_train_BT - logp_rollout_BT).abs()


# ---------------------------------------------------------------------------------------------- batch values


def _clean(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 log-probs with invalid positions set to 0, and the boolean mask."""
    if logp_train_BT.shape != logp_rollout_BT.shape or logp_train_BT.shape != mask_BT.shape:
        raise ValueError(f"measures need logp_train, logp_rollout and mask of one shape, got "
                         f"{tuple(logp_train_BT.shape)}, {tuple(logp_rollout_BT.shape)}, {tuple(mask_BT.shape)}")
    valid_BT = mask_BT.bool()
    zero = torch.zeros((), dtype=torch.float64, device=logp_train_BT.device)
    return (torch.where(valid_BT, logp_train_BT.double(), zero),
            torch.where(valid_BT, logp_rollout_BT.double(), zero), valid_BT)


def _masked_mean(value_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """Mean over valid tokens; 0 when there is none."""
    total = torch.where(valid_BT, value_BT, torch.zeros((), dtype=value_BT.dtype, device=value_BT.device)).sum()
    return total / valid_BT.sum().clamp_min(1)


def _token_mean(token: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def batch(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
        train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
        return _masked_mean(token(train_BT, rollout_BT), valid_BT)

    batch.__doc__ = f"Masked mean over valid tokens of: {token.__doc__}"
    return batch


def seq_log_ratio(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """E_seq |sum_t log rho_t|, over sequences with at least one valid token (0 if there is none).

    The SUM, not the geometric mean |mean_t log rho_t|: exp(sum_t log rho_t) = prod_t rho_t is the
    sequence-level ratio pi_old(y) / mu(y) that sequence-level IS (seq_tis / seq_mask, Liu, Li et al.
    2025) weights by, and the token-level objective is a first-order approximation of the sequence-level
    one only while that product stays near 1 (Zheng et al. arXiv 2512.01374). Per-token mismatch
    compounds with length, and the sum shows it; the geometric mean divides it away (and is
    abs_log_ratio-like in scale: use abs_log_ratio for a per-token view).
    """
    train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    seq_B = (train_BT - rollout_BT).sum(dim=1).abs()
    has_token_B = valid_BT.any(dim=1)
    total = torch.where(has_token_B, seq_B, torch.zeros_like(seq_B)).sum()
    return total / has_token_B.sum().clamp_min(1)


def _seq_mean(value_B: Tensor, has_token_B: Tensor) -> Tensor:
    """Mean over the sequences with at least one valid token; 0 when there is none."""
    return torch.where(has_token_B, value_B, torch.zeros_like(value_B)).sum() / has_token_B.sum().clamp_min(1)


def _per_seq_mean(value_BT: Tensor, valid_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(mean_t value over each sequence's valid tokens, has_token_B); 0 for a sequence without one."""
    count_B = valid_BT.sum(dim=1)
    total_B = torch.where(valid_BT, value_BT, torch.zeros_like(value_BT)).sum(dim=1)
    return total_B / count_B.clamp_min(1), count_B > 0


def _ppl(logp_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """E_seq exp(-mean_t logp): the mean per-sequence perplexity (verl's training_ppl / rollout_ppl). The log
    perplexity is capped at 700 so that a broken engine (log-probs of -1e4) gives a large finite value."""
    mean_B, has_token_B = _per_seq_mean(logp_BT, valid_BT)
    ppl_B = torch.exp((-mean_B).clamp(max=_LOG_PPL_MAX))
    value = _seq_mean(ppl_B, has_token_B)
    return torch.where(has_token_B.any(), value, torch.ones_like(value))


def training_ppl(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Perplexity of the training engine on the sampled responses, E_seq exp(-mean_t log pi_old(y_t)).

    Not a discrepancy but the scale to read the others against (a sharper policy has smaller gaps in
    probability); 1 for a batch without valid tokens (the smallest possible perplexity).
    """
    train_BT, _, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    return _ppl(train_BT, valid_BT)


def rollout_ppl(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Perplexity of the rollout engine, E_seq exp(-mean_t log mu(y_t)); 1 for a batch without valid tokens."""
    _, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    return _ppl(rollout_BT, valid_BT)


def log_ppl_diff(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """E_seq [mean_t log mu(y_t) - mean_t log pi_old(y_t)] = E_seq [log ppl_pi_old - log ppl_mu] = -E_seq mean_t
    log rho_t: verl's rollout_corr log_ppl_diff, sign included (> 0 when the rollout engine is the more
    confident, i.e. the training engine's perplexity is the higher). Per-sequence means, so every sequence
    counts once, unlike kl_k1's token mean of the same log mu - log pi_old. 0 for a batch without valid tokens."""
    train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    mean_B, has_token_B = _per_seq_mean(rollout_BT - train_BT, valid_BT)
    return _seq_mean(mean_B, has_token_B)


def log_ppl_abs_diff(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """E_seq |mean_t log rho_t|: log_ppl_diff without the cancellation between sequences (verl's
    log_ppl_abs_diff), the log of the geometric-mean ratio that ``algo.seq_mask.mode=geo`` bounds."""
    train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    mean_B, has_token_B = _per_seq_mean(train_BT - rollout_BT, valid_BT)
    return _seq_mean(mean_B.abs(), has_token_B)


def chi2_seq(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """E_seq (prod_t rho_t - 1)^2: Pearson chi^2(pi_old || mu) of whole responses, on mu-samples.

    The variance of sequence-level IS weights (Liu, Li et al. 2025): it compounds with length where the
    token-level chi2 does not. verl's chi2_seq is E[(prod rho)^2] - 1, which has the same expectation under mu
    but can be negative on a batch; this form is >= 0. Linear above prod rho = e^LOG_RATIO_MAX like chi2.
    """
    train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    log_prod_B = torch.where(valid_BT, train_BT - rollout_BT, torch.zeros_like(train_BT)).sum(dim=1)
    return _seq_mean(_chi2(log_prod_B), valid_BT.any(dim=1))


def _token_max(token: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def batch(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
        train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
        value_BT = token(train_BT, rollout_BT)
        # every token value is >= 0, so 0 off the mask never wins and an empty batch gives 0
        return torch.where(valid_BT, value_BT, torch.zeros_like(value_BT)).max()

    batch.__doc__ = f"Largest value over valid tokens (0 without one) of: {token.__doc__}"
    return batch


def extreme_rate(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor, tau: float = 2.0) -> Tensor:
    """F(tau): share of valid tokens with max(rho, 1/rho) > tau, i.e. |log rho| > log tau (R3, arXiv 2510.11370).

    Decided on |log rho| so no ratio is ever exponentiated; 0 for a batch without valid tokens.
    """
    if not tau > 1:
        raise ValueError(f"extreme_rate needs tau > 1, got {tau}")
    train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    outside_BT = ((train_BT - rollout_BT).abs() > math.log(tau)).double()
    return _masked_mean(outside_BT, valid_BT)


def ess(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) of w = rho over the n valid tokens, in (0, 1].

    1 when every ratio is equal (no discrepancy), 1/n when one token carries all the weight; 1/ess - 1
    is the empirical variance of rho over its squared mean. Higher is better, so this is a diagnostic
    and not a D <= c constraint. Scale invariant: computed exactly with w = exp(log rho - max log rho).
    1 for a batch without valid tokens (the value of a perfectly matched batch).
    """
    train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    log_w_BT = torch.where(valid_BT, train_BT - rollout_BT, torch.full_like(train_BT, -math.inf))
    top = log_w_BT.max()
    # the largest weight is exactly 1, so sum w^2 >= 1 whenever a token is valid
    w_BT = torch.exp(log_w_BT - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    n = valid_BT.sum()
    value = w_BT.sum().square() / (n * w_BT.square().sum())
    return torch.where(n > 0, value, torch.ones_like(value))  # no device sync for the empty case


# ---------------------------------------------------------------------------------------------- routing


# Route elements compared at a time: a chunk's sorts hold int64 indices of 8x it (16 MiB), never of the whole routes
# (the 30B recipe's are ~1.7e9 elements; a whole-tensor sort held ~10x them).
ROUTE_CHUNK = 1 << 20


def _route_counts(experts_train_BSLK: Tensor, experts_rollout_BSLK: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """(differ_BS, valid_BS) int32: per position, the MoE layers whose top-k SETS differ (order-insensitive) and those
    where neither side has a -1 (a differing layer counts only where valid). None when the two are one tensor (R3
    trains on the engine's own routes): nothing can differ, and nothing is computed. Taken ``ROUTE_CHUNK`` route
    elements at a time, so the sorts' temporaries are a chunk's."""
    if experts_train_BSLK.shape != experts_rollout_BSLK.shape or experts_train_BSLK.dim() != 4:
        raise ValueError(f"routing_mismatch needs two [B, S, L, K] expert tensors of one shape, got "
                         f"{tuple(experts_train_BSLK.shape)} and {tuple(experts_rollout_BSLK.shape)}")
    if experts_train_BSLK is experts_rollout_BSLK:
        return None
    B, S, L, K = experts_train_BSLK.shape
    train_NLK, rollout_NLK = experts_train_BSLK.reshape(B * S, L, K), experts_rollout_BSLK.reshape(B * S, L, K)
    differ_N = torch.empty(B * S, dtype=torch.int32, device=experts_train_BSLK.device)
    valid_N = torch.empty_like(differ_N)
    step = max(1, ROUTE_CHUNK // max(1, L * K))
    for start in range(0, B * S, step):
        train, rollout = train_NLK[start:start + step], rollout_NLK[start:start + step]
        valid = (train >= 0).all(dim=-1) & (rollout >= 0).all(dim=-1)
        # a top-k set holds distinct experts, so sorted tuples are equal iff the sets are
        differ = (train.sort(dim=-1).values != rollout.sort(dim=-1).values).any(dim=-1) & valid
        differ_N[start:start + step] = differ.sum(dim=-1)
        valid_N[start:start + step] = valid.sum(dim=-1)
    return differ_N.reshape(B, S), valid_N.reshape(B, S)


def routing_mismatch(experts_train_BSLK: Tensor, experts_rollout_BSLK: Tensor,
                     mask_BS: Optional[Tensor] = None) -> Tensor:
    """Share of valid (position, MoE layer) pairs whose top-k expert sets differ between the engines.

    R3 (Ma et al. arXiv 2510.11370) reports ~10% of routers disagreeing. Pairs where either side has a
    -1 (no route recorded) are excluded, as are positions outside ``mask_BS`` when given. 0 (float64)
    when no pair is valid, and, without comparing anything, when the two are one tensor (R3 replays the engine's
    routes: 0 by construction).
    """
    counts = _route_counts(experts_train_BSLK, experts_rollout_BSLK)
    if counts is None:
        return torch.zeros((), dtype=torch.float64, device=experts_train_BSLK.device)
    differ_BS, valid_BS = counts
    if mask_BS is not None:
        keep_BS = mask_BS.bool()
        differ_BS, valid_BS = differ_BS * keep_BS, valid_BS * keep_BS
    return differ_BS.sum().double() / valid_BS.sum().clamp_min(1)


def routing_mismatch_per_token(experts_train_BSLK: Tensor, experts_rollout_BSLK: Tensor) -> Tensor:
    """(B, S) share of the valid MoE layers of each position whose top-k sets differ; 0 where none is valid, and
    0 everywhere, without comparing, when the two are one tensor (R3).

    The routes of position s produce the logits of the token at s + 1: slice accordingly before using
    this as a per-response-token value.
    """
    dtype = torch.get_default_dtype()
    counts = _route_counts(experts_train_BSLK, experts_rollout_BSLK)
    if counts is None:
        return torch.zeros(experts_train_BSLK.shape[:2], dtype=dtype, device=experts_train_BSLK.device)
    differ_BS, valid_BS = counts
    return differ_BS.to(dtype) / valid_BS.clamp_min(1).to(dtype)


def _routing_batch(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor, *,
                   experts_train_BSLK: Optional[Tensor] = None, experts_rollout_BSLK: Optional[Tensor] = None,
                   mask_BS: Optional[Tensor] = None) -> Tensor:
    """routing_mismatch as a registry measure: the log-probs are not used, the routes are required."""
    if experts_train_BSLK is None or experts_rollout_BSLK is None:
        raise ValueError("measure 'routing_mismatch' needs the MoE routes of both engines "
                         "(experts_train_BSLK and experts_rollout_BSLK); this batch has none: dense model, "
                         "or a rollout engine that does not report routed experts")
    return routing_mismatch(experts_train_BSLK, experts_rollout_BSLK, mask_BS)


# ---------------------------------------------------------------------------------------------- registry

MEASURES: dict[str, Measure] = {
    "abs_prob_diff": Measure("abs_prob_diff", _token_mean(abs_prob_diff_token), abs_prob_diff_token, "token"),
    "kl_k1": Measure("kl_k1", _token_mean(kl_k1_token), kl_k1_token, "token"),
    "kl_k3": Measure("kl_k3", _token_mean(kl_k3_token), kl_k3_token, "token"),
    "chi2": Measure("chi2", _token_mean(chi2_token), chi2_token, "token"),
    "abs_log_ratio": Measure("abs_log_ratio", _token_mean(abs_log_ratio_token), abs_log_ratio_token, "token"),
    # max over tokens of a per-token value: the hinge penalty on that value is exact (max_t d_t <= c iff every
    # d_t <= c), so these take the token form of their mean counterpart
    "max_abs_prob_diff": Measure("max_abs_prob_diff", _token_max(abs_prob_diff_token), abs_prob_diff_token, "max"),
    "max_abs_log_ratio": Measure("max_abs_log_ratio", _token_max(abs_log_ratio_token), abs_log_ratio_token, "max"),
    "seq_log_ratio": Measure("seq_log_ratio", seq_log_ratio, None, "sequence"),
    "chi2_seq": Measure("chi2_seq", chi2_seq, None, "sequence"),
    "log_ppl_diff": Measure("log_ppl_diff", log_ppl_diff, None, "sequence"),
    "log_ppl_abs_diff": Measure("log_ppl_abs_diff", log_ppl_abs_diff, None, "sequence"),
    "training_ppl": Measure("training_ppl", training_ppl, None, "sequence"),
    "rollout_ppl": Measure("rollout_ppl", rollout_ppl, None, "sequence"),
    "extreme_rate": Measure("extreme_rate", extreme_rate, None, "sequence", params=("tau",),
                            metric="discrepancy/extreme_rate_2", panel=(("tau", 2.0),)),
    "ess": Measure("ess", ess, None, "sequence", metric="is/ess_frac"),
    "routing_mismatch": Measure("routing_mismatch", _routing_batch, None, "routing",
                                params=("experts_train_BSLK", "experts_rollout_BSLK", "mask_BS"),
                                metric="routing/mismatch"),
}

_NOT_A_CONSTRAINT = {"ess": "ess is a diagnostic where higher is better (1 = matched engines), so D <= c makes no "
                            "sense; constrain chi2 instead (1/ess - 1 is the variance of rho over its squared mean)"}


def measure_constraint(cfg: ConstraintConfig, logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor, *,
                       experts_train_BSLK: Optional[Tensor] = None, experts_rollout_BSLK: Optional[Tensor] = None,
                       mask_BS: Optional[Tensor] = None) -> Tensor:
    """D_i: the batch value of constraint ``cfg``'s measure (0-dim float64), the dual controller's input.

    ``cfg.tau`` goes to extreme_rate; routing_mismatch needs both engines' routes (ValueError without). With
    ``cfg.quantile = q`` the value is the q-quantile of the per-token measure (``token_quantiles``), not its mean.
    """
    if cfg.measure not in MEASURES:
        raise ValueError(f"unknown measure {cfg.measure!r}; known: {', '.join(MEASURES)}")
    if cfg.measure in _NOT_A_CONSTRAINT:
        raise ValueError(f"measure {cfg.measure!r} cannot be a constraint: {_NOT_A_CONSTRAINT[cfg.measure]}")
    measure = MEASURES[cfg.measure]
    if cfg.quantile is not None:
        if measure.token is None:
            raise ValueError(f"a quantile constraint needs a measure with a per-token form; {cfg.measure!r} is "
                             f"{measure.kind}-level")
        return token_quantiles(cfg.measure, logp_train_BT, logp_rollout_BT, mask_BT, qs=(cfg.quantile,))[0]
    available = {"tau": cfg.tau, "experts_train_BSLK": experts_train_BSLK,
                 "experts_rollout_BSLK": experts_rollout_BSLK, "mask_BS": mask_BS}
    return measure.batch(logp_train_BT, logp_rollout_BT, mask_BT, **{p: available[p] for p in measure.params})


QUANTILES = (0.5, 0.9, 0.99)
"""Quantiles of a per-token measure in the panel (``token_quantiles``), logged as '<metric>_p50' etc."""


def token_quantiles(name: str, logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor,
                    qs: Sequence[float] = QUANTILES) -> Tensor:
    """(len(qs),) float64 quantiles of measure ``name``'s per-token value over the valid tokens, with numpy's
    default (linear) interpolation between order statistics; 0 for a batch without valid tokens.

    The batch value of a token measure is a mean: these say whether it comes from all tokens or a tail.
    """
    measure = MEASURES[name]
    if measure.token is None:
        raise ValueError(f"measure {name!r} has no per-token form to take quantiles of")
    train_BT, rollout_BT, valid_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    values = measure.token(train_BT, rollout_BT).masked_select(valid_BT).sort().values
    n = values.numel()
    if n == 0:
        return torch.zeros(len(qs), dtype=torch.float64, device=values.device)
    pos = torch.tensor([q * (n - 1) for q in qs], dtype=torch.float64, device=values.device)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def panel_constraints() -> dict[str, ConstraintConfig]:
    """Metric key of ``discrepancy_metrics`` -> a constraint config measuring the same value, for every measure
    that can be a constraint (``dcmdp calibrate`` proposes a tolerance for each)."""
    return {m.metric_key: ConstraintConfig(measure=name, **dict(m.panel))
            for name, m in MEASURES.items() if name not in _NOT_A_CONSTRAINT}


@torch.no_grad()
def discrepancy_metrics(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor, *,
                        experts_train_BSLK: Optional[Tensor] = None, experts_rollout_BSLK: Optional[Tensor] = None,
                        mask_BS: Optional[Tensor] = None, quantiles_of: Sequence[str] = ()) -> dict[str, float]:
    """Every measure of the registry at its ``metric_key`` ('discrepancy/<name>'; extreme_rate at tau = 2 as
    'discrepancy/extreme_rate_2'; ess as 'is/ess_frac'; 'routing/mismatch' only when both engines' routes are
    given), and for each measure named in ``quantiles_of`` that has a per-token form, '<metric_key>_p50',
    '_p90', '_p99' (``token_quantiles``)."""
    # cast and clean once: every measure's own _clean then finds float64 inputs (no copy)
    logp_train_BT, logp_rollout_BT, mask_BT = _clean(logp_train_BT, logp_rollout_BT, mask_BT)
    keys, values = [], []
    for name, m in MEASURES.items():
        if m.kind == "routing":
            continue
        keys.append(m.metric_key)
        values.append(m.batch(logp_train_BT, logp_rollout_BT, mask_BT, **dict(m.panel)))
    for name in dict.fromkeys(quantiles_of):
        if name in MEASURES and MEASURES[name].token is not None:
            keys += [f"{MEASURES[name].metric_key}_p{round(q * 100)}" for q in QUANTILES]
            values += list(token_quantiles(name, logp_train_BT, logp_rollout_BT, mask_BT).to(values[0].device))
    if experts_train_BSLK is not None and experts_rollout_BSLK is not None:
        keys.append(MEASURES["routing_mismatch"].metric_key)
        values.append(routing_mismatch(experts_train_BSLK, experts_rollout_BSLK, mask_BS).to(values[0].device))
    return dict(zip(keys, torch.stack(values).tolist()))  # one device sync for all metrics
