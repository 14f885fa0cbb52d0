"""Left-justified scoring (``trainers.packing``): the log-probs, entropies, gradients and MoE routes of the padded
forward, from a forward without a padding mask over the real width only."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainers import learner, packing
from tests.test_micro_batches import _setup, _step

torch.set_num_threads(1)


def test_justify_by_hand():
    # P = 4, T = 3. Row 0: prompt 2 tokens, response 3; row 1: prompt 4, response 1; row 2: prompt 1, response 0
    prompt = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    response = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    layout = packing.justify(prompt, response)
    assert layout.offset_B.tolist() == [2, 0, 3] and layout.length_B.tolist() == [5, 5, 1] and layout.width == 5
    ids = torch.arange(21).view(3, 7)
    assert layout.to_justified(ids, -1).tolist() == [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [17, -1, -1, -1, -1]]
    back = layout.from_justified(layout.to_justified(ids, -1), 7, -1)
    real = torch.cat([prompt, response], 1)
    assert torch.equal(back, ids.masked_fill(~real, -1))
    # a hole inside a row's real tokens, or a response without a prompt, keeps the padded layout
    assert packing.justify(prompt, torch.tensor([[1, 0, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)) is None
    assert packing.justify(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool), response[:1]) is None
    assert packing.justify(torch.zeros(1, 4, dtype=torch.bool), response[:1]) is None


@pytest.mark.parametrize("preset,replay,minibatches", [("tiny-dense", "none", 1), ("tiny-moe", "none", 1),
                                                       ("tiny-moe", "r2", 2), ("tiny-moe", "r3", 2)])
def test_justified_step_equals_the_padded_step(preset, replay, minibatches, monkeypatch):
    model, rollout, cfg, adv_B = _setup(preset, replay, minibatches)
    ref_model = copy.deepcopy(model)
    masks = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):  # records whether each attention call got a mask
        masks.append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(learner, "ScoringSpec", _with_justify(learner.ScoringSpec, True))
    batch, result, grads, _ = _step(model, rollout, cfg, adv_B, budget=0)
    assert masks and not any(masks)  # every training forward ran unmasked (causal only)
    masks.clear()
    monkeypatch.setattr(learner, "ScoringSpec", _with_justify(learner.ScoringSpec.__wrapped__, False))
    ref_batch, ref_result, ref_grads, _ = _step(ref_model, rollout, cfg, adv_B, budget=0)
    assert all(masks)
    mask_BT = rollout.response_mask_BT.bool()
    # same keys, values and positions in every softmax: float32 rounding only (measured max 1e-6)
    assert torch.allclose(batch.old_logp_BT[mask_BT], ref_batch.old_logp_BT[mask_BT], atol=1e-5, rtol=0)
    assert (batch.old_logp_BT[~mask_BT] == 0).all()
    if replay == "r2":  # the routes captured in the justified columns come back to the rollout's positions
        assert torch.equal(batch.train_experts_BSLK, ref_batch.train_experts_BSLK)
    metrics = result.metrics()
    for key, ref in ref_result.metrics().items():
        if key.startswith("time/"):
            continue
        assert metrics[key] == pytest.approx(ref, rel=1e-4, abs=1e-6), key
    for step, ref_step in zip(grads, ref_grads):
        assert step.keys() == ref_step.keys() and step
        for name, g in step.items():
            assert torch.allclose(g, ref_step[name], atol=1e-6, rtol=1e-4), (name, (g - ref_step[name]).abs().max())


def _with_justify(spec_cls, justify: bool):
    """``ScoringSpec`` with ``justify`` as its default (``_step`` builds its own spec)."""
    def make(*args, **kwargs):
        return spec_cls(*args, **{"justify": justify, **kwargs})
    make.__wrapped__ = spec_cls
    return make


@pytest.mark.parametrize("fp32_lm_head,kernel", [(True, "logits"), (True, "chunked"), (True, "bf16x3"),
                                                 (False, "logits")])
def test_justified_head_paths_equal_the_padded_ones(fp32_lm_head, kernel):
    # the justified forward sends only the N real response tokens through the head, as a (1, N) batch: every head
    # kernel gives the padded forward's log-probs and entropies there (float32 rounding; bf16x3 splits the float32
    # operands into three bfloat16 parts either way) and 0 at padding
    model, rollout, _, _ = _setup("tiny-dense", "none", 1)
    out = {}
    for justify in (True, False):
        spec = learner.ScoringSpec(fp32_lm_head=fp32_lm_head, lm_head_kernel=kernel, justify=justify)
        with torch.no_grad():
            out[justify] = learner._forward_logp(model, rollout, spec, with_entropy=True, replay_experts_BSLK=None,
                                                 capture=False)
    mask_BT = rollout.response_mask_BT.bool()
    for got, ref in zip(out[True][:2], out[False][:2]):
        assert torch.allclose(got[mask_BT], ref[mask_BT], atol=1e-5, rtol=0), (got - ref)[mask_BT].abs().max()
        assert (got[~mask_BT] == 0).all()


def _fsdp_worker(out: str) -> None:
    """One torchrun rank: the tiny MoE (grouped-query attention) FSDP2-sharded, its log-probs and entropies from the
    justified and the masked forward of the same ragged batch, and whether each attention call got a mask; rank 0
    writes the largest differences (to each other and to the unsharded masked forward) to ``out`` (JSON)."""
    import json

    import torch.distributed as dist

    from dcmdp.config import load_config
    from dcmdp.distributed import Dist, shard_model
    from trainers.learner import DataShard, ScoringSpec, _forward_logp_in

    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    d = Dist(rank=rank, world=world, backend="gloo", shard=DataShard(rank=rank, world=world), sharded=True)
    model, rollout, _, _ = _setup("tiny-moe", "none", 1)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    sharded = shard_model(copy.deepcopy(model), load_config(None, []), d)
    masks = {}
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.setdefault(current, []).append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    logp, ent = {}, {}
    for current, net, justify in (("fsdp_justified", sharded, True), ("fsdp_masked", sharded, False),
                                  ("plain_masked", model, False)):
        with torch.no_grad():
            logp[current], ent[current], _ = _forward_logp_in(net, rollout, ScoringSpec(justify=justify),
                                                              with_entropy=True, replay_experts_BSLK=None,
                                                              capture=False)
    F.scaled_dot_product_attention = sdpa
    mask_BT = rollout.response_mask_BT.bool()

    def gap(a: str, b: str) -> float:
        return max(float((logp[a] - logp[b])[mask_BT].abs().max()), float((ent[a] - ent[b])[mask_BT].abs().max()))

    if d.main:
        Path(out).write_text(json.dumps({"justified_vs_masked": gap("fsdp_justified", "fsdp_masked"),
                                         "justified_vs_plain": gap("fsdp_justified", "plain_masked"),
                                         "masks": masks}))
    d.barrier()
    dist.destroy_process_group()


def test_justified_forward_under_fsdp_equals_the_masked_one(tmp_path):
    """2 gloo ranks: an FSDP2-sharded model scores left-justified rows with no attention mask (its registered
    justified forward method gathers the root's embedding and norm), and its log-probs and entropies equal the
    masked forward's, sharded or not, within 1e-5 (float32 rounding of other key and value orders)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "fsdp.json"
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "tests.test_packing", str(out)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["masks"]["fsdp_justified"] and not any(result["masks"]["fsdp_justified"])
    assert all(result["masks"]["fsdp_masked"]) and all(result["masks"]["plain_masked"])
    assert result["justified_vs_masked"] <= 1e-5 and result["justified_vs_plain"] <= 1e-5, result


if __name__ == "__main__":
    _fsdp_worker(sys.argv[1])
