"""The embedded rollout engine: layout, EOS, reproducibility, agreement with the scorer, precisions,
weight sync, MoE routes, and the sampling distribution itself. Also the int8 fake quantisation."""

import random

import pytest
import torch
from scipy import stats

from trainers import routing
from trainers.config import ModelConfig, RolloutConfig, TorchEngineConfig
from trainers.engines import build_engine
from trainers.engines.torch_engine import TorchEngine, nucleus_logp
from trainers.models import build_model
from trainers.quant import cast_for_precision, fake_quantize_int8, quantize_int8_
from trainers.scoring import position_ids, response_logprobs

torch.set_num_threads(1)
EOS, PAD, V = 1, 0, 101


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, V) for _ in range(rng.randint(2, 7))] for _ in range(n)]


def _model(preset: str, seed: int = 0) -> torch.nn.Module:
    return build_model(ModelConfig(preset=preset), V, seed=seed)


@torch.no_grad()
def _boost_eos(model, logit: float) -> None:
    """Give the LM head a bias with EOS at ``logit`` (others ~0 at init): P(EOS) ~ e^l / (e^l + V)."""
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    head.weight.copy_(old.weight)
    head.bias.zero_()
    head.bias[EOS] = logit
    model.lm_head = head


def _scorer_logp(model, rollout, temperature):
    with torch.no_grad():
        logp, _ = response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS,
                                    rollout.num_prompt_positions, temperature=temperature)
    return logp


def test_layout_eos_and_masks():
    model = _model("tiny-dense")
    _boost_eos(model, 3.5)  # P(EOS) ~ 25% per token: some rows stop early, some run to the limit
    engine = build_engine(RolloutConfig(max_new_tokens=8), model, None, eos_id=EOS, pad_id=PAD)
    prompts = _prompts(64)
    r = engine.generate(prompts, seed=0)
    B, P, T = 64, max(map(len, prompts)), r.response_ids_BT.shape[1]
    assert r.prompt_ids_BP.shape == (B, P) and T == 8
    for b, p in enumerate(prompts):
        assert r.prompt_ids_BP[b, P - len(p):].tolist() == p and not r.prompt_mask_BP[b, :P - len(p)].any()
        assert (r.prompt_ids_BP[b, :P - len(p)] == PAD).all()
    ended = 0
    for b in range(B):
        ids, mask = r.response_ids_BT[b].tolist(), r.response_mask_BT[b].tolist()
        n = sum(mask)
        assert mask == [True] * n + [False] * (T - n)  # prefix mask
        if EOS in ids[:n]:
            assert ids.index(EOS) == n - 1  # EOS is the last real token, inside the mask
            ended += 1
        else:
            assert n == T
        assert all(t == PAD for t in ids[n:])
        assert (r.rollout_logp_BT[b, n:] == 0).all() and (r.rollout_logp_BT[b, :n] < 0).all()
    assert 0 < ended < B
    assert r.rollout_experts_BSLK is None and r.version_B.tolist() == [0] * B


def test_early_stop_when_every_row_ended():
    model = _model("tiny-dense")
    _boost_eos(model, 30.0)
    engine = TorchEngine(RolloutConfig(max_new_tokens=8), model, eos_id=EOS, pad_id=PAD)
    r = engine.generate(_prompts(16), seed=0)
    assert r.response_ids_BT.shape == (16, 1) and (r.response_ids_BT == EOS).all()
    assert r.response_mask_BT.all()


def test_reproducible_with_seed():
    engine = TorchEngine(RolloutConfig(max_new_tokens=6, temperature=0.8, top_p=0.9), _model("tiny-moe"),
                         eos_id=EOS, pad_id=PAD)
    prompts = _prompts(32)
    a, b, c = engine.generate(prompts, seed=5), engine.generate(prompts, seed=5), engine.generate(prompts, seed=6)
    assert torch.equal(a.response_ids_BT, b.response_ids_BT) and torch.equal(a.rollout_logp_BT, b.rollout_logp_BT)
    assert torch.equal(a.rollout_experts_BSLK, b.rollout_experts_BSLK)
    assert not torch.equal(a.response_ids_BT, c.response_ids_BT)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_fp32_engine_matches_scorer_and_trainer_routes(preset):
    model = _model(preset)
    _boost_eos(model, 2.5)
    engine = TorchEngine(RolloutConfig(max_new_tokens=8, temperature=0.7), model, eos_id=EOS, pad_id=PAD)
    r = engine.generate(_prompts(48), seed=1)
    valid = r.response_mask_BT
    assert (~valid).any()  # some padding inside the response block
    if routing.is_moe(model):
        with torch.no_grad(), routing.capture_routes(model) as cap:
            logp = _scorer_logp(model, r, 0.7)
        train_BSLK = cap.experts(*r.input_ids_BS.shape)
        e = r.rollout_experts_BSLK
        assert e.shape == (48, r.input_ids_BS.shape[1], 2, 2)
        fed_BS = r.attention_mask_BS.clone()
        fed_BS[:, -1] = False  # the last response column is never fed back
        assert torch.equal((e >= 0).all(-1).all(-1), fed_BS) and torch.equal((e < 0).all(-1).all(-1), ~fed_BS)
        assert torch.equal(train_BSLK[e >= 0], e[e >= 0])
    else:
        logp = _scorer_logp(model, r, 0.7)
    assert (logp - r.rollout_logp_BT)[valid].abs().max() <= 1e-5


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_low_precision_engines_show_a_discrepancy(preset):
    model = _model(preset)
    prompts = _prompts(32)
    gaps = {}
    for precision in ("fp32", "bf16", "fp16", "int8"):
        engine = TorchEngine(RolloutConfig(max_new_tokens=6, precision=precision), model, eos_id=EOS, pad_id=PAD)
        r = engine.generate(prompts, seed=2)
        gaps[precision] = float((_scorer_logp(model, r, 1.0) - r.rollout_logp_BT)[r.response_mask_BT].abs().mean())
    assert gaps["fp32"] < 1e-6
    # bf16 keeps 8 mantissa bits, fp16 11, int8 ~7 bits per weight: clearly above the fp32 rounding floor.
    assert gaps["bf16"] > 2e-4 and gaps["int8"] > 2e-4 and gaps["fp16"] > 2e-5
    assert gaps["fp16"] < gaps["bf16"] and max(gaps.values()) < 0.05


def test_load_weights_follows_trainer_in_place():
    model = _model("tiny-moe")
    engine = TorchEngine(RolloutConfig(max_new_tokens=6), model, eos_id=EOS, pad_id=PAD)
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    prompts = _prompts(32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = engine.generate(prompts, seed=3)
    assert (_scorer_logp(model, stale, 1.0) - stale.rollout_logp_BT)[stale.response_mask_BT].abs().max() > 1e-2
    engine.load_weights(model.state_dict(), version=7)
    fresh = engine.generate(prompts, seed=3)
    assert (_scorer_logp(model, fresh, 1.0) - fresh.rollout_logp_BT)[fresh.response_mask_BT].abs().max() <= 1e-5
    assert fresh.version_B.tolist() == [7] * 32 and engine.version == 7
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs
    with pytest.raises(KeyError, match="lacks"):
        engine.load_weights({}, version=8)


def test_int8_engine_requantizes_on_load():
    model = _model("tiny-dense")
    engine = TorchEngine(RolloutConfig(precision="int8"), model, eos_id=EOS, pad_id=PAD)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    engine.load_weights(model.state_dict(), version=1)
    w = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(engine.model.model.layers[0].mlp.up_proj.weight, fake_quantize_int8(w))
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight)


def test_fake_quantize_int8_by_hand():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-2.54, 1.0, 0.02, 0.01]])
    q = fake_quantize_int8(w)
    # Row 0: scale 1/127; -63.5 rounds half to even -> -64, 31.75 -> 32.
    torch.testing.assert_close(q[0], torch.tensor([127.0, -64.0, 32.0, 0.0]) / 127, rtol=0, atol=1e-7)
    assert torch.equal(q[1], w[1])
    # Row 2: scale 0.02; 1.0/0.02 = 50, 0.02 -> 1, 0.01 -> 0.5 -> 0 (half to even).
    torch.testing.assert_close(q[2], torch.tensor([-127.0, 50.0, 1.0, 0.0]) * 0.02, rtol=0, atol=1e-7)


def test_quantize_int8_touches_linears_and_experts_only():
    model = _model("tiny-moe")
    q = cast_for_precision(model, "int8")
    assert not any(p.requires_grad for p in q.parameters()) and not q.training
    for (name, p), p_q in zip(model.named_parameters(), q.parameters()):
        keep = ("embed_tokens" in name or "norm" in name or name.startswith("lm_head") or name.endswith("gate.weight"))
        if keep:
            assert torch.equal(p, p_q), name
        else:
            assert not torch.equal(p, p_q), name
            # at most 255 grid points per output row (per expert for 3-D expert weights)
            rows = p_q.reshape(-1, p_q.shape[-1])
            scale = rows.abs().amax(-1, keepdim=True) / 127
            assert torch.allclose(rows / scale, torch.round(rows / scale), atol=1e-3), name
    again = quantize_int8_(q)
    for a, b in zip(again.parameters(), cast_for_precision(model, "int8").parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # idempotent up to float rounding


def test_nucleus_renormalises_the_top_mass():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = nucleus_logp(logp, 0.8).exp()
    # 0.5 < 0.8 keeps token 1; mass before token 2 is 0.8, not < 0.8, so tokens 2 and 3 go.
    torch.testing.assert_close(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.equal(nucleus_logp(logp, 1.0), logp)


def test_sampling_frequencies_follow_tempered_softmax():
    model = _model("tiny-dense", seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # a peaked, non-uniform next-token distribution
    prompt = [20, 21, 22, 23]
    n = 20000
    engine = TorchEngine(RolloutConfig(max_new_tokens=1, temperature=0.7), model, eos_id=EOS, pad_id=PAD)
    r = engine.generate([prompt] * n, seed=11)
    counts = torch.bincount(r.response_ids_BT[:, 0], minlength=V).double()
    with torch.no_grad():
        mask = torch.ones(1, 4, dtype=torch.bool)
        h = model.model(input_ids=torch.tensor([prompt]), attention_mask=mask,
                        position_ids=position_ids(mask)).last_hidden_state[0, -1]
        logits = h.double() @ model.lm_head.weight.double().T

    def p_value(temperature: float) -> float:
        probs = torch.softmax(logits / temperature, dim=-1)
        big = probs * n >= 5  # pool the rare tokens into one bin so every expected count is >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([probs[big], probs[~big].sum()[None]]) * n
        return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)

    assert p_value(0.7) > 1e-3
    assert p_value(1.0) < 1e-8 and p_value(0.6) < 1e-4  # the test can tell nearby temperatures apart
    # The reported log-prob is that of the sampled token under softmax(logits / 0.7).
    ref = torch.log_softmax(logits / 0.7, dim=-1)[r.response_ids_BT[:100, 0]]
    torch.testing.assert_close(r.rollout_logp_BT[:100, 0].double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_128_prompts_decode_as_one_batch(preset):
    """Each step is one forward of the decoder and one of the LM head over every row still decoding, never a loop
    over rows (the speed itself: ``benchmarks/speed.py --device cpu --tiny --parts decode``)."""
    engine = TorchEngine(RolloutConfig(max_new_tokens=8), _model(preset), eos_id=EOS, pad_id=PAD)
    model = engine.model  # the engine's own copy
    rows = {"decoder": [], "head": []}  # rows of each forward call
    model.model.register_forward_pre_hook(
        lambda m, args, kwargs: rows["decoder"].append(len(kwargs["input_ids"])), with_kwargs=True)
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: rows["head"].append(len(args[0])))
    r = engine.generate(_prompts(128), seed=0)
    steps = r.response_ids_BT.shape[1]
    live_T = r.response_mask_BT.sum(dim=0).tolist()  # rows that sampled token t
    assert steps > 1 and len(rows["decoder"]) == len(rows["head"]) == steps  # the prompts' forward, then one a step
    assert rows["decoder"][0] == rows["head"][0] == 128
    assert rows["decoder"] == rows["head"] and all(a >= n for a, n in zip(rows["head"], live_T))


def test_int8_engine_routes_replay_in_the_trainer():
    """R3 alignment: every route the engine reports is replayed at the position the trainer sees."""
    model = _model("tiny-moe")
    engine = TorchEngine(RolloutConfig(max_new_tokens=6, precision="int8"), model, eos_id=EOS, pad_id=PAD)
    r = engine.generate(_prompts(32), seed=4)
    e = r.rollout_experts_BSLK
    with torch.no_grad():
        with routing.capture_routes(model) as cap:
            plain = _scorer_logp(model, r, 1.0)
        with routing.replay_routes(model, e) as stats:
            replayed = _scorer_logp(model, r, 1.0)
    own = cap.experts(*r.input_ids_BS.shape)
    valid = (e >= 0).all(-1)
    assert stats.replayed_pairs == routing.expected_replay_pairs(e) == int(valid.sum())
    # The quantised engine routes some (token, layer) pairs differently from the fp32 trainer, and
    # replaying its routes moves the trainer's log-probs.
    differs = (own.sort(-1).values != e.sort(-1).values).any(-1) & valid
    assert differs.any()
    assert (replayed - plain)[r.response_mask_BT].abs().max() > 1e-4


@pytest.mark.parametrize("preset,precision,noise", [("tiny-dense", "fp32", 0.0), ("tiny-moe", "fp32", 0.0),
                                                    ("tiny-moe", "bf16", 0.5)])
def test_dropping_finished_rows_changes_no_token(preset, precision, noise):
    """rollout.torch.drop_finished compacts the decode batch; tokens, masks and routes are those of the path that
    feeds finished rows padding, and log mu agrees to float rounding of matmuls over a smaller batch."""
    model = _model(preset)
    _boost_eos(model, 2.5)  # rows finish after 1 to 16 tokens
    prompts = _prompts(48, seed=3)
    runs = {}
    for drop in (False, True):
        cfg = RolloutConfig(max_new_tokens=16, precision=precision, logit_noise=noise,
                            torch=TorchEngineConfig(drop_finished=drop))
        runs[drop] = TorchEngine(cfg, model, eos_id=EOS, pad_id=PAD).generate(prompts, seed=7)
    kept, dropped = runs[False], runs[True]
    lengths = kept.response_mask_BT.sum(-1)
    assert lengths.min() <= 2 and lengths.max() >= 12  # uneven: compaction happened more than once
    assert torch.equal(kept.response_ids_BT, dropped.response_ids_BT)
    assert torch.equal(kept.response_mask_BT, dropped.response_mask_BT)
    torch.testing.assert_close(dropped.rollout_logp_BT, kept.rollout_logp_BT, rtol=0, atol=1e-5)
    if preset == "tiny-moe":
        assert torch.equal(kept.rollout_experts_BSLK, dropped.rollout_experts_BSLK)


def test_exponential_race_is_multinomial():
    """The engine's sampler draws what torch.multinomial(p, 1) draws from the same generator state."""
    probs_BV = torch.softmax(torch.randn(37, V), dim=-1)
    expected = torch.multinomial(probs_BV, 1, generator=torch.Generator().manual_seed(5)).squeeze(-1)
    race_BV = torch.empty_like(probs_BV).exponential_(1, generator=torch.Generator().manual_seed(5))
    assert torch.equal((probs_BV / race_BV).argmax(-1), expected)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_gqa_decode_attention_is_bitwise_the_copying_path(preset):
    """rollout.torch.gqa_decode reads the shared KV head in place (2 query heads per KV head in the tiny presets): the
    same kernel on the same values, so tokens, log mu and routes are bitwise those of transformers' sdpa path."""
    model = _model(preset)
    _boost_eos(model, 2.5)
    prompts = _prompts(24, seed=4)
    runs = [TorchEngine(RolloutConfig(max_new_tokens=12, torch=TorchEngineConfig(gqa_decode=gqa)), model, eos_id=EOS,
                        pad_id=PAD).generate(prompts, seed=2) for gqa in (False, True)]
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    assert torch.equal(runs[0].response_ids_BT, runs[1].response_ids_BT)
    assert torch.equal(runs[0].rollout_logp_BT, runs[1].rollout_logp_BT)
    if preset == "tiny-moe":
        assert torch.equal(runs[0].rollout_experts_BSLK, runs[1].rollout_experts_BSLK)


@pytest.mark.parametrize("preset,precision,drop", [("tiny-dense", "fp32", True), ("tiny-dense", "bf16", False),
                                                   ("tiny-moe", "fp32", True), ("tiny-moe", "fp32", False)])
def test_static_cache_samples_what_the_dynamic_cache_samples(preset, precision, drop):
    """rollout.torch.kv_cache=static writes every position into a cache of P + max_new_tokens (rounded) positions
    allocated once, the unfilled ones masked: the same keys and values in every softmax, so the same tokens, masks
    and routes from the same seed, and log mu to float rounding (measured max 4.8e-7 in fp32), with and without
    compaction of finished rows. bf16 attention over a longer, partly masked cache rounds differently (log mu within
    2.0e-3 measured, bound 2e-2), and a draw that lands inside that rounding of a token boundary samples another
    token from there on: measured none of 24 rows on an AMD EPYC, 1 of 24 (at its 11th token) on an AVX-512 Xeon.
    In bf16 the test allows 2 of 24 rows to part that way, and compares them up to where they part."""
    model = _model(preset)
    _boost_eos(model, 2.5)  # rows finish after 1 to 16 tokens
    prompts = _prompts(24, seed=5)
    runs = {}
    for kv in ("dynamic", "static"):
        cfg = RolloutConfig(max_new_tokens=16, precision=precision,
                            torch=TorchEngineConfig(kv_cache=kv, drop_finished=drop))
        runs[kv] = TorchEngine(cfg, model, eos_id=EOS, pad_id=PAD).generate(prompts, seed=11)
    dyn, sta = runs["dynamic"], runs["static"]
    lengths = dyn.response_mask_BT.sum(-1)
    assert lengths.min() < lengths.max()  # uneven rows: the static mask carries finished rows' padding
    # a row's tokens agree up to the first token where the two rollouts part (all of it when they never do)
    parts_BT = (dyn.response_ids_BT != sta.response_ids_BT).long().cummax(-1).values.bool()
    parted_B = parts_BT.any(-1)
    assert int(parted_B.sum()) <= (0 if precision == "fp32" else 2), parted_B.nonzero().flatten().tolist()
    before_BT = ~parts_BT & dyn.response_mask_BT  # a row that never parts: all of its mask
    assert torch.equal(before_BT, ~parts_BT & sta.response_mask_BT)
    torch.testing.assert_close(sta.rollout_logp_BT[before_BT], dyn.rollout_logp_BT[before_BT], rtol=0,
                               atol=1e-5 if precision == "fp32" else 2e-2)
    if preset == "tiny-moe":
        assert torch.equal(dyn.rollout_experts_BSLK, sta.rollout_experts_BSLK)
    # the static engine's log mu is still the trainer's log pi in fp32 (the scorer sees the padded layout)
    if precision == "fp32":
        torch.testing.assert_close(_scorer_logp(model, sta, 1.0)[sta.response_mask_BT],
                                   sta.rollout_logp_BT[sta.response_mask_BT], rtol=0, atol=1e-5)


def test_kv_cache_settings_are_checked():
    with pytest.raises(ValueError, match="rollout.torch.kv_cache"):
        TorchEngineConfig(kv_cache="paged").check()
    with pytest.raises(ValueError, match="rollout.torch.decode_graphs"):
        TorchEngineConfig(decode_graphs=True).check()
    # decode graphs are a CUDA path: on the CPU a static-cache engine with them on decodes eagerly, same tokens
    model = _model("tiny-dense")
    cfg = RolloutConfig(max_new_tokens=6, torch=TorchEngineConfig(kv_cache="static", decode_graphs=True))
    engine = TorchEngine(cfg, model, eos_id=EOS, pad_id=PAD)
    assert not engine._decode_graphs()
    plain = TorchEngine(RolloutConfig(max_new_tokens=6), model, eos_id=EOS, pad_id=PAD)
    assert torch.equal(engine.generate(_prompts(4), seed=0).response_ids_BT,
                       plain.generate(_prompts(4), seed=0).response_ids_BT)


@pytest.mark.slow
def test_compiled_decode_step_samples_what_the_eager_one_samples():
    """The decode-graph path compiled on the CPU (inductor, no CUDA graph to capture here; about 35 s of
    compilation): the same tokens as the dynamic-cache engine, log mu to float rounding (measured 4.8e-7), and a
    second rollout of the same shape reuses the compiled step."""
    from torch._dynamo.utils import counters as dynamo_counters

    model = _model("tiny-dense")
    _boost_eos(model, 2.5)
    prompts = _prompts(24, seed=5)
    ref = TorchEngine(RolloutConfig(max_new_tokens=16), model, eos_id=EOS, pad_id=PAD).generate(prompts, seed=11)
    cfg = RolloutConfig(max_new_tokens=16, torch=TorchEngineConfig(kv_cache="static", decode_graphs=True))
    engine = TorchEngine(cfg, model, eos_id=EOS, pad_id=PAD)
    engine._decode_graphs = lambda: True  # the CUDA-only switch, forced on
    before = dynamo_counters["stats"]["unique_graphs"]
    first = engine.generate(prompts, seed=11)
    compiled, graphs = engine._compiled, dynamo_counters["stats"]["unique_graphs"]
    assert graphs > before  # the first rollout compiled the step
    second = engine.generate(prompts, seed=11)
    assert dynamo_counters["stats"]["unique_graphs"] == graphs, "the decode step was compiled again"
    assert engine._compiled is compiled
    assert torch.equal(first.response_ids_BT, ref.response_ids_BT)
    assert torch.equal(second.response_ids_BT, ref.response_ids_BT)
    torch.testing.assert_close(first.rollout_logp_BT, ref.rollout_logp_BT, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decode_graphs_sample_what_the_dynamic_cache_samples():
    """On CUDA, rollout.torch.decode_graphs replays the compiled decode step as CUDA graphs: the same tokens as the
    dynamic-cache engine from the same seed (fp32), log mu to float rounding, twice (the second rollout replays)."""
    model = _model("tiny-dense")
    _boost_eos(model, 2.5)
    model = model.cuda()
    prompts = _prompts(24, seed=5)
    ref = TorchEngine(RolloutConfig(max_new_tokens=16), model, eos_id=EOS, pad_id=PAD).generate(prompts, seed=11)
    cfg = RolloutConfig(max_new_tokens=16, torch=TorchEngineConfig(kv_cache="static", decode_graphs=True))
    engine = TorchEngine(cfg, model, eos_id=EOS, pad_id=PAD)
    assert engine._decode_graphs()
    for _ in range(2):
        got = engine.generate(prompts, seed=11)
        assert got.response_ids_BT.device.type == "cpu"
        assert torch.equal(got.response_ids_BT, ref.response_ids_BT)
        torch.testing.assert_close(got.rollout_logp_BT, ref.rollout_logp_BT, rtol=0, atol=1e-4)
