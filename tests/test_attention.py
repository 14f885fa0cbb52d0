"""trainers.attention: grouped KV heads read in place (SDPA enable_gqa) instead of copied per query head."""

import random

import torch

from dcmdp.config import load_config
from dcmdp.policy import build_policy
from trainers.attention import GQA_ATTENTION
from trainers.config import ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import ATTN_IMPLEMENTATION, build_model
from trainers.scoring import response_logprobs

torch.set_num_threads(1)
V = 101


def test_gqa_attention_gives_the_sdpa_values_and_gradients():
    """Same log-probs bitwise on a left- and right-padded batch; gradients to float rounding (the K/V gradient
    sums over the 2 query heads of the tiny preset's KV head in another order)."""
    models = [build_model(ModelConfig(preset="tiny-moe"), V, seed=0) for _ in range(2)]
    models[1].set_attn_implementation(GQA_ATTENTION)
    assert models[0].config.num_attention_heads == 2 * models[0].config.num_key_value_heads
    rng = random.Random(0)
    prompts = [[rng.randrange(5, V) for _ in range(rng.randint(2, 9))] for _ in range(12)]
    rollout = TorchEngine(RolloutConfig(max_new_tokens=10), models[0], eos_id=1, pad_id=0).generate(prompts, seed=0)
    logps, grads = [], []
    for model in models:
        logp_BT, _ = response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS,
                                       rollout.num_prompt_positions, temperature=1.0)
        (logp_BT * rollout.response_mask_BT.float()).sum().backward()
        logps.append(logp_BT.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(logps[0], logps[1])
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6, rtol=1e-5), name


def test_build_policy_switches_the_trainer_after_the_engine_copied_it(tmp_path):
    """model.gqa_attention: the training model attends through GQA_ATTENTION, the torch engine keeps its own
    (rollout.torch.gqa_decode's, or sdpa), and the cold start is not involved."""
    for on in (True, False):
        cfg = load_config("configs/default.yaml", ["cold_start.steps=0", f"model.gqa_attention={str(on).lower()}",
                                                   f"output_dir={tmp_path}"])
        policy = build_policy(cfg, tmp_path)
        assert policy.model.config._attn_implementation == (GQA_ATTENTION if on else ATTN_IMPLEMENTATION)
        assert policy.engine.model.config._attn_implementation != GQA_ATTENTION
