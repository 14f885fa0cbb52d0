"""Capture and replay of MoE routes in transformers' Qwen3-MoE: the one place dcmdp patches a model.

We patch ``Qwen3MoeTopKRouter.forward`` (one class, once, at import). Outside a ``capture_routes`` /
``replay_routes`` context the patched forward calls the original. Inside a replay context the router
still computes its logits ``s`` and softmax, but the *set* of experts per token comes from the replayed
indices; the gates are ``g_i = I_i e^{s_i} / sum_j I_j e^{s_j}`` when ``norm_topk_prob`` (Ma et al.
2025, arXiv 2510.11370), or the unrenormalised softmax values otherwise, exactly as the model's config
says. The router keeps its gradient through the gate values.

Replayed rows whose indices are ``-1`` (padding, positions the rollout engine never routed) fall back
to the router's own top-k; the number of replayed (token, layer) pairs is counted so that a replay that
silently does nothing is detected by the caller.

``set_fp32_router`` (``model.fp32_router``) makes a model's routers compute their logits, softmax and top-k
in float32 whatever the parameter dtype, inside or outside a context: the bf16 inputs and weights are upcast
exactly, so a bf16 model ranks experts as a float32 router does on the same hidden states, and near-tied
logits no longer collapse to bf16 ties that each engine breaks its own way. The flag is a module attribute,
so the rollout engine's copy of the model (``copy.deepcopy``) carries it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor

try:
    from transformers.models.qwen3_moe import modeling_qwen3_moe as _qmoe
except ImportError as exc:  # pragma: no cover - depends on the installed transformers
    raise ImportError(f"dcmdp needs transformers' Qwen3-MoE model (transformers {transformers.__version__} "
                      f"has none): {exc}") from exc

_ROUTER_CLS = getattr(_qmoe, "Qwen3MoeTopKRouter", None)
_REQUIRED_ATTRS = ("top_k", "num_experts", "norm_topk_prob", "hidden_dim", "weight")


def _check_router_class() -> None:
    """Fail at import with a clear message if transformers changed the router we patch."""
    if _ROUTER_CLS is None:
        raise ImportError(
            f"transformers {transformers.__version__}: Qwen3MoeTopKRouter not found in modeling_qwen3_moe; "
            "dcmdp's routing capture/replay supports transformers 5.19.x (pinned in setup.cfg)")
    src = inspect.getsource(_ROUTER_CLS.forward)
    init_src = inspect.getsource(_ROUTER_CLS.__init__)
    expected = ("F.linear(hidden_states, self.weight)", "softmax", "torch.topk", "norm_topk_prob",
                "return router_logits, router_scores, router_indices")
    missing = [e for e in expected if e not in src]
    missing += [a for a in _REQUIRED_ATTRS if f"self.{a}" not in init_src]
    if missing:
        raise ImportError(
            f"transformers {transformers.__version__}: Qwen3MoeTopKRouter changed (no {missing}); dcmdp's "
            "routing patch was written against transformers 5.19.x (pinned in setup.cfg)")


_check_router_class()
_original_forward = _ROUTER_CLS.forward


@dataclass
class _RouteContext:
    # layer index -> list of (N, K) indices chosen in each router call, in call order
    captured: dict[int, list[Tensor]] = field(default_factory=dict)
    capture: bool = False
    # layer index -> (N, K) indices to replay for the next call; -1 rows use the router's own choice
    replay: Optional[dict[int, Tensor]] = None
    # replayed (token, layer) pairs, summed on the device (no host sync per router call); int(...) reads it
    replayed_pairs: int | Tensor = 0
    router_calls: int = 0


# The active context is per thread: the asynchronous rollout worker (dcmdp.async_rollout) captures the
# rollout engine's routes while the trainer captures or replays its own in the main thread.
_LOCAL = threading.local()


def _patched_forward(self, hidden_states: Tensor):
    ctx = getattr(_LOCAL, "active", None)
    layer = getattr(self, "_dcmdp_layer", None)
    fp32 = getattr(self, "_dcmdp_fp32", False)
    if ctx is not None and layer is None:
        ctx = None  # a router the context did not tag (not part of its model)
    if ctx is None and not fp32:
        return _original_forward(self, hidden_states)
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    if fp32:
        # float32 even under the learner's 16-bit autocast (model.dtype=bfloat16/float16), which would cast back
        with torch.autocast(hidden_states.device.type, enabled=False):
            router_logits = F.linear(hidden_states.float(), self.weight.float())  # (N, E), float32
    else:
        router_logits = F.linear(hidden_states, self.weight)  # (N, E)
    router_probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    _, own_idx_NK = torch.topk(router_probs, self.top_k, dim=-1)
    idx_NK = own_idx_NK
    if ctx is not None and ctx.replay is not None and layer in ctx.replay:
        replay_NK = ctx.replay[layer].to(own_idx_NK.device, torch.long)  # routes are stored narrow
        if replay_NK.shape != own_idx_NK.shape:
            raise RuntimeError(f"routing replay: layer {layer} got routes of shape {tuple(replay_NK.shape)} "
                               f"for {tuple(own_idx_NK.shape)} router outputs (positions misaligned)")
        valid_N = (replay_NK >= 0).all(dim=-1)
        idx_NK = torch.where(valid_N[:, None], replay_NK, own_idx_NK)
        ctx.replayed_pairs = ctx.replayed_pairs + valid_N.sum()
    top_value_NK = router_probs.gather(-1, idx_NK)
    if self.norm_topk_prob:
        top_value_NK = top_value_NK / top_value_NK.sum(dim=-1, keepdim=True)
    if ctx is not None:
        ctx.router_calls += 1
        if ctx.capture:
            ctx.captured.setdefault(layer, []).append(idx_NK.detach().to(route_dtype(self.num_experts)))
    return router_logits, top_value_NK.to(router_logits.dtype), idx_NK


_ROUTER_CLS.forward = _patched_forward


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer dtype that holds expert ids 0..num_experts-1 and the -1 of "no route": int8 up to
    128 experts (Qwen3-30B-A3B: [B, S, L, K] routes at 1 byte each instead of int64's 8)."""
    top = int(num_experts) - 1
    return torch.int8 if top <= 127 else torch.int16 if top <= 32767 else torch.int32


def model_route_dtype(model: torch.nn.Module) -> torch.dtype:
    """``route_dtype`` of ``model``'s routers (int8 for a model without any)."""
    routers = moe_routers(model)
    return route_dtype(routers[0].num_experts if routers else 1)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Qwen3-MoE routers in layer order, each tagged with its MoE-layer index."""
    routers = [m for m in model.modules() if isinstance(m, _ROUTER_CLS)]
    for i, r in enumerate(routers):
        r._dcmdp_layer = i
    return routers


def is_moe(model: torch.nn.Module) -> bool:
    return any(isinstance(m, _ROUTER_CLS) for m in model.modules())


def set_fp32_router(model: torch.nn.Module, enabled: bool) -> None:
    """Compute the router logits, softmax and top-k of every Qwen3-MoE router of ``model`` in float32
    (``model.fp32_router``; prime-rl's default). With float32 parameters this changes nothing. The gates
    are returned in float32 too; the experts multiply them into their bf16 outputs before casting back."""
    for router in (m for m in model.modules() if isinstance(m, _ROUTER_CLS)):
        router._dcmdp_fp32 = bool(enabled)


def fp32_router(model: torch.nn.Module) -> bool:
    """Whether ``set_fp32_router`` is on for ``model``'s routers (False for a dense model)."""
    return any(getattr(m, "_dcmdp_fp32", False) for m in model.modules() if isinstance(m, _ROUTER_CLS))


@contextlib.contextmanager
def _activate(ctx: _RouteContext) -> Iterator[_RouteContext]:
    if getattr(_LOCAL, "active", None) is not None:
        raise RuntimeError("routing capture/replay contexts cannot be nested")
    _LOCAL.active = ctx
    try:
        yield ctx
    finally:
        _LOCAL.active = None


def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant): the recomputation of a checkpointed layer
    during ``backward()`` runs under the routing context its forward ran under.

    Activation checkpointing recomputes each decoder layer in the backward pass, after ``replay_routes`` or
    ``capture_routes`` has closed; without this the recomputed routers would take their own top-k instead of
    the replayed routes (a different graph: torch raises ``CheckpointError``, or with equal shapes the
    gradient of another routing). The recomputation replays the same routes but neither captures nor counts
    again, so ``RouteCapture`` and ``ReplayStats`` see each forward once."""
    ctx = getattr(_LOCAL, "active", None)
    return contextlib.nullcontext(), _recomputing(ctx)


@contextlib.contextmanager
def _recomputing(ctx: Optional[_RouteContext]) -> Iterator[None]:
    # runs in the thread that recomputes (on a GPU, an autograd worker thread), whatever context it holds
    before = getattr(_LOCAL, "active", None)
    _LOCAL.active = None if ctx is None else _RouteContext(replay=ctx.replay)
    try:
        yield
    finally:
        _LOCAL.active = before


class RouteCapture:
    """Routes recorded by ``capture_routes``; ``experts(B, S)`` stacks a single full forward."""

    def __init__(self, ctx: _RouteContext, num_layers: int, top_k: int):
        self._ctx = ctx
        self.num_layers = num_layers
        self.top_k = top_k

    def calls(self, layer: int) -> list[Tensor]:
        return self._ctx.captured.get(layer, [])

    def experts(self, batch: int, seq: int, call: int = -1) -> Tensor:
        """(B, S, L, K) routes of router call ``call`` (default: the last) of every layer."""
        per_layer = []
        for layer in range(self.num_layers):
            calls = self.calls(layer)
            if not calls:
                raise RuntimeError(f"routing capture: MoE layer {layer} was never called")
            per_layer.append(calls[call].reshape(batch, seq, self.top_k))
        return torch.stack(per_layer, dim=2)


@contextlib.contextmanager
def capture_routes(model: torch.nn.Module) -> Iterator[RouteCapture]:
    """Record the experts every MoE router of ``model`` selects inside the block."""
    routers = moe_routers(model)
    ctx = _RouteContext(capture=True)
    top_k = routers[0].top_k if routers else 0
    with _activate(ctx):
        yield RouteCapture(ctx, len(routers), top_k)


class ReplayStats:
    def __init__(self, ctx: _RouteContext):
        self._ctx = ctx

    @property
    def replayed_pairs(self) -> int:
        """(token, layer) pairs whose expert set came from the replayed routes."""
        return int(self._ctx.replayed_pairs)


@contextlib.contextmanager
def replay_routes(model: torch.nn.Module, experts_BSLK: Tensor, *, capture: bool = False) -> Iterator[ReplayStats]:
    """Replay ``experts_BSLK`` (-1 = router's own choice) in one full forward of ``model``."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError("routing replay requested on a model without MoE layers")
    B, S, L, K = experts_BSLK.shape
    if L != len(routers) or K != routers[0].top_k:
        raise ValueError(f"routing replay: routes have {L} layers x top-{K}, the model has "
                         f"{len(routers)} MoE layers x top-{routers[0].top_k}")
    replay = {layer: experts_BSLK[:, :, layer, :].reshape(B * S, K) for layer in range(L)}
    ctx = _RouteContext(capture=capture, replay=replay)
    with _activate(ctx):
        yield ReplayStats(ctx)


def expected_replay_pairs(experts_BSLK: Tensor) -> int:
    """Number of (token, layer) pairs a replay of ``experts_BSLK`` must replace."""
    return int((experts_BSLK >= 0).all(dim=-1).sum())
