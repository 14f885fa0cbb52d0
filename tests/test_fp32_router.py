"""model.fp32_router: a bf16 model's routers rank experts as float32 routers do on the same hidden states.

The reference is the float32 router: the same (bf16-representable) weights in float32, applied to the same
hidden states upcast to float32, through transformers' own forward. Both upcasts are exact, so the fp32 router
of the bf16 model must reproduce it bit for bit (sets and gates), while the plain bf16 router rounds its
logits to bf16 and breaks the resulting near-ties its own way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from trainers import routing
from trainers.config import ModelConfig, RolloutConfig
from trainers.models import build_model

torch.set_num_threads(1)


def _reference(router: torch.nn.Module, hidden_NH: torch.Tensor):
    """transformers' float32 router on the float32 copy of ``router``: (gates_NK, experts_NK)."""
    ref = copy.deepcopy(router).float()
    routing.set_fp32_router(ref, False)
    with torch.no_grad():
        _, gates, experts = routing._original_forward(ref, hidden_NH.float())
    return gates, experts


def _sets(experts_NK: torch.Tensor) -> torch.Tensor:
    return experts_NK.sort(dim=-1).values


def test_bf16_router_in_fp32_gives_the_fp32_routers_top_k():
    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=64, num_experts=64, num_experts_per_tok=8,
                                               norm_topk_prob=True))
    torch.nn.init.normal_(router.weight, std=0.02)
    router = router.to(torch.bfloat16)
    hidden = torch.randn(4096, 64).to(torch.bfloat16)
    ref_gates, ref_experts = _reference(router, hidden)
    with torch.no_grad():
        _, _, plain = router(hidden)
        routing.set_fp32_router(router, True)
        logits, gates, experts = router(hidden)
    # bf16 logits tie near-equal experts: some tokens get another top-8 set (the case is informative)
    assert (_sets(plain) != _sets(ref_experts)).any(dim=-1).sum() > 0
    assert torch.equal(_sets(experts), _sets(ref_experts))
    assert logits.dtype == gates.dtype == torch.float32
    torch.testing.assert_close(gates, ref_gates, rtol=0, atol=0)


def _router_calls(fp32_router: bool):
    """(router, input, experts) of every router call of a bfloat16 tiny-moe's training forward (under bfloat16
    autocast) and of its torch rollout engine's generation. The routers' expert rows are one shared vector plus 0.3% noise, so that their
    logits are near-tied and bf16 rounding matters (at random init it rarely does in so small a model)."""
    from trainers.engines.torch_engine import TorchEngine

    model = build_model(ModelConfig(preset="tiny-moe", dtype="bfloat16", fp32_router=fp32_router), 64, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r in routing.moe_routers(model):
            shared = torch.randn(1, r.hidden_dim, generator=gen)
            r.weight.copy_(shared + 0.003 * torch.randn(r.weight.shape, generator=gen))
    engine = TorchEngine(RolloutConfig(precision="bf16", max_new_tokens=6), model, eos_id=1, pad_id=0)
    assert routing.fp32_router(model) == routing.fp32_router(engine.model) == fp32_router
    calls = []

    def record(module, args, output):
        calls.append((module, args[0].detach().reshape(-1, module.hidden_dim), output[2].detach()))

    hooks = [m.register_forward_hook(record) for net in (model, engine.model) for m in net.modules()
             if isinstance(m, Qwen3MoeTopKRouter)]
    try:
        torch.manual_seed(1)
        ids = torch.randint(2, 64, (8, 12))
        # the training forward as the learner runs a model.dtype=bfloat16 model: float32 master weights under
        # bfloat16 autocast, which must not reach the fp32 router
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
        engine.generate([row.tolist() for row in ids], seed=0)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) > 2 * len(routing.moe_routers(model))  # training forward + prefill + decode steps
    train_calls = len(routing.moe_routers(model))
    assert all(hidden.dtype == torch.bfloat16 for _, hidden, _ in calls[train_calls:])  # the engine's bf16 copy
    return calls


def _differing_tokens(calls) -> int:
    return sum(int((_sets(experts) != _sets(_reference(module, hidden)[1])).any(dim=-1).sum())
               for module, hidden, experts in calls)


def test_training_model_and_rollout_engine_route_as_fp32_with_the_flag():
    """build_model sets the flag from model.fp32_router and the engine's bf16 copy carries it: every router call
    of both picks the float32 router's experts for its input; without it many near-tied tokens do not."""
    assert _differing_tokens(_router_calls(fp32_router=True)) == 0
    assert _differing_tokens(_router_calls(fp32_router=False)) > 10


@pytest.mark.parametrize("capture", [False, True])
def test_fp32_router_keeps_replay_and_capture(capture):
    """Inside a replay context the replayed sets win and the gates are the float32 softmax over them."""
    torch.manual_seed(2)
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                                               norm_topk_prob=True)).to(torch.bfloat16)
    torch.nn.init.normal_(router.weight, std=0.5)
    holder = torch.nn.ModuleList([router])
    routing.set_fp32_router(holder, True)
    hidden = torch.randn(1, 3, 16).to(torch.bfloat16)
    replay = torch.tensor([[[[0, 1]], [[6, 7]], [[-1, -1]]]])  # (B=1, S=3, L=1, K=2); the last position: own choice
    with routing.replay_routes(holder, replay, capture=capture) as stats, torch.no_grad():
        logits, gates, experts = router(hidden)
    assert stats.replayed_pairs == 2
    _, own = _reference(router, hidden.reshape(3, 16))
    assert experts[:2].tolist() == [[0, 1], [6, 7]] and torch.equal(experts[2], own[2])
    probs = torch.softmax(hidden.reshape(3, 16).float() @ router.weight.float().T, dim=-1)
    expected = probs.gather(-1, experts)
    torch.testing.assert_close(gates, expected / expected.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_cold_start_cache_key_and_cached_load_follow_the_flag(tmp_path):
    """The flag is part of the cold-start key only when on (caches written before it existed stay valid), and a
    model loaded from the cache gets it back."""
    import dataclasses

    from trainers.coldstart import cache_key, cold_start
    from trainers.config import ColdStartConfig, TaskConfig
    from trainers.tasks import TASKS
    from trainers.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    task = TASKS["addition"](TaskConfig(), 0)
    on = ModelConfig(preset="tiny-moe", fp32_router=True)
    off = ModelConfig(preset="tiny-moe")
    without = dataclasses.make_dataclass("ModelConfigBefore", [(f.name, f.type, dataclasses.field(default=f.default))
                                                               for f in dataclasses.fields(ModelConfig)
                                                               if f.name != "fp32_router"])()
    model = build_model(off, len(tok), seed=0)
    cfg = ColdStartConfig(steps=1, batch_size=2, cache_dir=str(tmp_path))
    assert cache_key(model, tok, task, cfg, off, seed=0) == cache_key(model, tok, task, cfg, without, seed=0)
    assert cache_key(model, tok, task, cfg, on, seed=0) != cache_key(model, tok, task, cfg, off, seed=0)
    cold_start(build_model(on, len(tok), seed=0), tok, task, cfg, on, seed=0, eos_id=tok.eos_token_id, progress=False)
    loaded, info = cold_start(build_model(on, len(tok), seed=0), tok, task, cfg, on, seed=0, eos_id=tok.eos_token_id,
                              progress=False)
    assert info["coldstart/cached"] == 1.0 and routing.fp32_router(loaded)
