"""Model presets: real shapes on the meta device, tiny presets, build/save/load, parameter counts."""

import os

import pytest
import torch

from trainers.config import ModelConfig
from trainers.models import ATTN_IMPLEMENTATION, PRESETS, build_model, compute_dtype, load_model_dir, param_counts, save_model_dir
from trainers.routing import is_moe, moe_routers
from trainers.tokenizer import build_char_tokenizer

torch.set_num_threads(1)


def _meta_model(name: str) -> torch.nn.Module:
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    preset = PRESETS[name]
    cls = Qwen3MoeForCausalLM if preset.is_moe else Qwen3ForCausalLM
    with torch.device("meta"):
        return cls(preset.make_config(101))


def test_qwen3_8b_shapes_and_count():
    model = _meta_model("qwen3-8b")
    total, active = param_counts(model)
    # Qwen3-8B: 8.2B parameters (model card), dense so active == total.
    assert abs(total - 8.2e9) / 8.2e9 < 0.02
    assert active == total
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (151936, 4096, 12288, 36)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert c.rope_parameters["rope_theta"] == 1e6 and c.max_position_embeddings == 40960
    assert not c.tie_word_embeddings


def test_qwen3_30b_a3b_shapes_and_counts():
    model = _meta_model("qwen3-30b-a3b")
    total, active = param_counts(model)
    # Qwen3-30B-A3B: 30.5B total, 3.3B activated (model card).
    assert abs(total - 30.5e9) / 30.5e9 < 0.02
    assert abs(active - 3.3e9) / 3.3e9 < 0.02
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == 128 and attn.q_proj.out_features == 32 * 128 and attn.k_proj.out_features == 4 * 128
    assert len(moe_routers(model)) == 48
    assert model.model.layers[0].mlp.gate.top_k == 8 and model.model.layers[0].mlp.experts.num_experts == 128


def test_tiny_param_counts_by_hand():
    # tiny-dense: V=101, H=64, 2 layers, 2 heads x 32, 1 KV head, intermediate 192, untied head.
    dense = build_model(ModelConfig(preset="tiny-dense"), 101, seed=0)
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 32  # q, k, v, o, q_norm, k_norm
    layer = attn + 3 * 64 * 192 + 2 * 64  # + MLP + two RMSNorms
    expected = 2 * 101 * 64 + 2 * layer + 64  # embeddings, LM head, final norm
    assert param_counts(dense) == (expected, expected)
    # tiny-moe: every layer 8 experts of (gate_up 128x64 + down 64x64), router 8x64, top-2 active.
    moe = build_model(ModelConfig(preset="tiny-moe"), 101, seed=0)
    experts = 8 * (128 * 64 + 64 * 64)
    layer_moe = attn + experts + 8 * 64 + 2 * 64
    total = 2 * 101 * 64 + 2 * layer_moe + 64
    assert param_counts(moe) == (total, total - 2 * experts * 6 // 8)
    assert is_moe(moe) and len(moe_routers(moe)) == 2 and not is_moe(dense)
    assert moe.config.norm_topk_prob and moe.config.num_experts_per_tok == 2


def test_small_param_counts_by_hand_and_forward():
    # small-*: V=101, H=128, 4 layers, 4 query heads x 32 (128), 2 KV heads x 32 (64), untied head.
    attn = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 2 * 32  # q, k, v, o, q_norm, k_norm = 49,216
    outside = 2 * 101 * 128 + 128  # embeddings, LM head, final norm = 25,984
    # small-moe: every layer 16 experts of (gate_up 128x128 + down 128x64) = 393,216, router 16x128, top-2.
    experts = 16 * (2 * 64 * 128 + 64 * 128)
    layer_moe = attn + experts + 16 * 128 + 2 * 128  # 444,736
    total = outside + 4 * layer_moe
    active = total - 4 * experts * 14 // 16  # 14 of 16 experts idle per token
    assert (total, active) == (1_804_928, 428_672)
    moe = build_model(ModelConfig(preset="small-moe"), 101, seed=0)
    assert param_counts(moe) == (total, active)
    assert len(moe_routers(moe)) == 4 and moe.model.layers[0].mlp.gate.top_k == 2
    # small-dense: MLP 3 x 128 x 133 = 51,072 per layer vs small-moe's active 2 x 3 x 128 x 64 + 2,048 = 51,200
    dense = build_model(ModelConfig(preset="small-dense"), 101, seed=0)
    expected = outside + 4 * (attn + 3 * 128 * 133 + 2 * 128)
    assert param_counts(dense) == (expected, expected) == (428_160, 428_160)
    assert abs(expected - active) == 4 * 128  # the closest match: one intermediate unit is 384 weights per layer
    assert not is_moe(dense) and is_moe(moe)
    for model in (moe, dense):
        c = model.config
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
            (4, 128, 4, 2, 32)
        # the longest long_addition prompt (18 tokens) and 96 new tokens fit the context
        assert c.max_position_embeddings >= 18 + 96
        ids = torch.randint(0, 101, (2, 114))
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert logits.shape == (2, 114, 101) and torch.isfinite(logits).all()


def test_build_is_seeded_and_uses_declared_kernel():
    a = build_model(ModelConfig(preset="tiny-moe"), 101, seed=3)
    b = build_model(ModelConfig(preset="tiny-moe"), 101, seed=3)
    c = build_model(ModelConfig(preset="tiny-moe"), 101, seed=4)
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.config._attn_implementation == ATTN_IMPLEMENTATION
    before = torch.random.get_rng_state()
    build_model(ModelConfig(preset="tiny-dense"), 101, seed=5)
    assert torch.equal(before, torch.random.get_rng_state())  # global RNG untouched
    # bfloat16 training: float32 master weights (AdamW's small steps survive), bfloat16 compute under autocast
    bf16 = build_model(ModelConfig(preset="tiny-dense", dtype="bfloat16"), 101, seed=0)
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert compute_dtype(bf16) == torch.bfloat16 and compute_dtype(a) is None
    p = next(bf16.parameters())
    before = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=1e-6, weight_decay=0.0)
    p.grad = torch.ones_like(p)
    opt.step()
    assert (p.detach() != before).float().mean() > 0.99  # in bfloat16 parameters almost none would move


def test_real_presets_need_a_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path"):
        build_model(ModelConfig(preset="qwen3-8b"), 101, seed=0)
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        build_model(ModelConfig(preset="qwen3-8b", path=missing), 101, seed=0)
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'.*tiny-dense"):
        build_model(ModelConfig(preset="qwen9"), 101, seed=0)


def test_save_and_load_round_trip(tmp_path):
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(preset="tiny-moe"), len(tok), seed=1)
    path = tmp_path / "m"
    save_model_dir(model, tok, path)
    save_model_dir(model, tok, path)  # replacing an existing directory works too
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no temporary directories left behind
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    loaded = load_model_dir(path, "float32")
    assert type(loaded) is type(model) and loaded.config._attn_implementation == ATTN_IMPLEMENTATION
    for (n, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), n
    # build_model loads from a path when given one and checks the preset family and vocabulary.
    again = build_model(ModelConfig(preset="tiny-moe", path=str(path)), len(tok), seed=0)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    with pytest.raises(ValueError, match="expects 'qwen3'"):
        build_model(ModelConfig(preset="tiny-dense", path=str(path)), len(tok), seed=0)
    with pytest.raises(ValueError, match="tokenizer has 500 tokens"):
        build_model(ModelConfig(preset="tiny-moe", path=str(path)), 500, seed=0)
