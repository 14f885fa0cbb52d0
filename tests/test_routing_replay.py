"""MoE routing replay through the learner: R3 reproduces the rollout engine's log-probs, R2 leaves the
first mini-batch untouched and pins later ones to the recorded routes, the router keeps its gradient,
and a replay that is misaligned or does nothing raises."""

import copy
import random

import pytest
import torch

from constraints.measures import routing_mismatch
from trainers import learner, routing
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model
from trainers.scoring import response_logprobs

torch.set_num_threads(1)
EOS, PAD, V = 1, 0, 101
TEMP = 1.0
SCORING = learner.ScoringSpec(temperature=TEMP, fp32_lm_head=True, moe=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, V) for _ in range(rng.randint(2, 7))] for _ in range(n)]


def _model(seed: int = 0) -> torch.nn.Module:
    return build_model(ModelConfig(preset="tiny-moe"), V, seed=seed)


def _gates(model) -> list[torch.nn.Parameter]:
    return [r.weight for r in routing.moe_routers(model)]


@torch.no_grad()
def _perturb_routers(model, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for w in _gates(model):
        w.add_(std * torch.randn(w.shape, generator=gen).to(w.dtype))


def _rollout(model, *, precision: str = "fp32", perturb: float = 0.0, n: int = 16, seed: int = 0):
    engine = TorchEngine(RolloutConfig(precision=precision, max_new_tokens=6), model, eos_id=EOS, pad_id=PAD)
    if perturb:
        _perturb_routers(engine.model, perturb, seed=123)
    return engine.generate(_prompts(n, seed), seed=seed)


def _score(model, rollout, mode: str, minibatches: int = 1):
    cfg = AlgoConfig(routing_replay=mode, minibatches=minibatches, is_mode="none")
    adv_B = torch.tensor([1.0, -1.0]).repeat(len(rollout) // 2)
    return learner.score_old(model, rollout, adv_B, cfg, SCORING), cfg


def _update(model, batch, cfg, lr: float = 1e-2) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """learner.update with Adam; returns its metrics and the gradients each optimiser step applied."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    grads: list[dict[str, torch.Tensor]] = []
    names = {p: n for n, p in model.named_parameters()}

    def record(optimizer, args, kwargs):
        grads.append({names[p]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None})

    opt.register_step_pre_hook(record)
    result = learner.update(model, learner.OptimStep(opt), batch, scoring=SCORING, penalty=learner.PenaltySpec(),
                            cfg=cfg, generator=torch.Generator().manual_seed(0))
    return result.steps, grads


def _replayed_forward(model, rollout, experts_BSLK):
    """(logp_BT, routes the replayed forward used, replayed pair count)."""
    B, S = rollout.input_ids_BS.shape
    with torch.no_grad(), routing.replay_routes(model, experts_BSLK, capture=True) as stats:
        logp_BT, _ = response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS,
                                       rollout.num_prompt_positions, temperature=TEMP)
        used_BSLK = torch.stack([torch.cat(stats._ctx.captured[layer]).reshape(B, S, -1)
                                 for layer in range(experts_BSLK.shape[2])], dim=2)
    return logp_BT, used_BSLK, stats.replayed_pairs


def _own_routes(model, rollout):
    B, S = rollout.input_ids_BS.shape
    with torch.no_grad(), routing.capture_routes(model) as cap:
        response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS, rollout.num_prompt_positions,
                          temperature=TEMP)
    return cap.experts(B, S)


def _gap(old_logp_BT, rollout) -> float:
    m = rollout.response_mask_BT
    return float((old_logp_BT - rollout.rollout_logp_BT)[m].abs().mean())


def test_r3_fp32_reproduces_rollout_logp():
    model = _model()
    rollout = _rollout(model)
    batch, _ = _score(model, rollout, "r3")
    m = rollout.response_mask_BT
    assert m.sum() > 40
    torch.testing.assert_close(batch.old_logp_BT[m], rollout.rollout_logp_BT[m], atol=1e-5, rtol=0)
    assert torch.equal(batch.replay_experts_BSLK, rollout.rollout_experts_BSLK)


def test_r3_removes_routing_part_of_the_gap_with_a_perturbed_engine_router():
    model = _model()
    # Router logits at init are ~0.02 * |h| apart: a 0.01 nudge of the engine's router flips many top-2
    # sets while the gate values (softmax of nearly equal logits) barely move.
    rollout = _rollout(model, perturb=0.01)
    none, _ = _score(model, rollout, "none")
    r3, _ = _score(model, rollout, "r3")
    mask_BS = rollout.attention_mask_BS
    mismatch_none = float(routing_mismatch(none.train_experts_BSLK, rollout.rollout_experts_BSLK, mask_BS))
    assert mismatch_none > 0.05
    gap_none, gap_r3 = _gap(none.old_logp_BT, rollout), _gap(r3.old_logp_BT, rollout)
    assert gap_none > 1e-4
    # the replayed forward really routed through the rollout's sets at every position the engine routed
    _, used_BSLK, pairs = _replayed_forward(model, rollout, rollout.rollout_experts_BSLK)
    assert pairs == routing.expected_replay_pairs(rollout.rollout_experts_BSLK) > 0
    assert float(routing_mismatch(used_BSLK, rollout.rollout_experts_BSLK, mask_BS)) == 0.0
    # what is left is the gate-value difference of the nudged router: far below the route flips' share
    assert gap_r3 < 0.5 * gap_none


def test_r3_with_int8_rollouts_zero_replayed_mismatch_and_smaller_gap():
    model = _model()
    rollout = _rollout(model, precision="int8")
    none, _ = _score(model, rollout, "none")
    r3, _ = _score(model, rollout, "r3")
    mask_BS = rollout.attention_mask_BS
    assert float(routing_mismatch(none.train_experts_BSLK, rollout.rollout_experts_BSLK, mask_BS)) > 0
    _, used_BSLK, _ = _replayed_forward(model, rollout, rollout.rollout_experts_BSLK)
    assert float(routing_mismatch(used_BSLK, rollout.rollout_experts_BSLK, mask_BS)) == 0.0
    assert _gap(r3.old_logp_BT, rollout) < _gap(none.old_logp_BT, rollout)


def test_r2_first_minibatch_equals_no_replay():
    model = _model()
    rollout = _rollout(model)
    model_r2, model_none = copy.deepcopy(model), copy.deepcopy(model)
    batch_r2, cfg_r2 = _score(model_r2, rollout, "r2", minibatches=2)
    batch_none, cfg_none = _score(model_none, rollout, "none", minibatches=2)
    # R2 records the pi_old pass's routes and leaves pi_old itself alone
    assert torch.equal(batch_r2.old_logp_BT, batch_none.old_logp_BT)
    assert torch.equal(batch_r2.replay_experts_BSLK, batch_none.train_experts_BSLK)
    metrics_r2, grads_r2 = _update(model_r2, batch_r2, cfg_r2)
    metrics_none, grads_none = _update(model_none, batch_none, cfg_none)
    assert len(grads_r2) == len(grads_none) == 2
    # step 1 runs on the pi_old weights: the recorded routes are the ones the router picks anyway
    assert metrics_r2[0]["loss/total"] == pytest.approx(metrics_none[0]["loss/total"], abs=1e-7)
    assert grads_r2[0].keys() == grads_none[0].keys()
    for name in grads_none[0]:
        torch.testing.assert_close(grads_r2[0][name], grads_none[0][name], atol=1e-7, rtol=1e-5)
    assert any(grads_r2[0][w].abs().sum() > 0 for w in grads_r2[0] if w.endswith("mlp.gate.weight"))


def test_r2_later_minibatches_use_the_recorded_routes():
    model = _model()
    rollout = _rollout(model)
    batch, cfg = _score(model, rollout, "r2", minibatches=2)
    recorded_BSLK = batch.replay_experts_BSLK
    # a deliberate change to the routers between the pi_old pass and the updates
    _perturb_routers(model, 0.02, seed=7)
    half = rollout.select(slice(8, 16))
    recorded_half = recorded_BSLK[8:16]
    _, used_BSLK, pairs = _replayed_forward(model, half, recorded_half)
    assert pairs == routing.expected_replay_pairs(recorded_half) == int(half.attention_mask_BS.sum()) * 2
    mask_BS = half.attention_mask_BS
    assert float(routing_mismatch(used_BSLK, recorded_half, mask_BS)) == 0.0
    assert float(routing_mismatch(_own_routes(model, half), recorded_half, mask_BS)) > 0.05
    # the learner replays per mini-batch and checks the count: both updates go through
    metrics, grads = _update(model, batch, cfg)
    assert len(metrics) == 2 and all(m["guard/skipped_update"] == 0.0 for m in metrics)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_router_weights_get_gradients(mode):
    model = _model()
    rollout = _rollout(model, precision="bf16")
    batch, cfg = _score(model, rollout, mode)
    _, grads = _update(model, batch, cfg)
    gate_grads = [g for n, g in grads[0].items() if n.endswith("mlp.gate.weight")]
    assert len(gate_grads) == 2
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in gate_grads)


def test_routes_shifted_by_one_position_raise():
    model = _model()
    rollout = _rollout(model)
    batch, cfg = _score(model, rollout, "r3")
    shifted = batch.replay_experts_BSLK[:, 1:]  # position s gets the route of s + 1, one position short
    with pytest.raises(RuntimeError, match="misaligned"):
        learner.score_old(model, rollout.with_(rollout_experts_BSLK=shifted), torch.ones(len(rollout)), cfg, SCORING)
    with pytest.raises(RuntimeError, match="misaligned"):
        _update(model, learner.ScoredBatch(**{**batch.__dict__, "replay_experts_BSLK": shifted}), cfg)


def test_replay_that_does_nothing_raises(monkeypatch):
    model = _model()
    rollout = _rollout(model)
    batch, cfg = _score(model, rollout, "r3")
    # the router forward without dcmdp's patch: nothing is replayed, and the learner must notice
    monkeypatch.setattr(routing._ROUTER_CLS, "forward", routing._original_forward)
    with pytest.raises(learner.ReplayError, match="expected"):
        learner.score_old(model, rollout, torch.ones(len(rollout)), cfg, SCORING)
    with pytest.raises(learner.ReplayError):
        _update(model, batch, cfg)


def test_same_shape_shift_is_detected():
    """A shift that keeps the shape and the replayed count is caught by the check against the attention mask."""
    model = _model()
    rollout = _rollout(model)
    batch, cfg = _score(model, rollout, "r3")
    e = batch.replay_experts_BSLK
    shifted = torch.cat([torch.full_like(e[:, :1], -1), e[:, :-1]], dim=1)
    with pytest.raises(learner.ReplayError, match="line up"):
        learner.score_old(model, rollout.with_(rollout_experts_BSLK=shifted), torch.ones(len(rollout)), cfg, SCORING)


@pytest.mark.parametrize("capture", [False, True])
def test_replay_survives_activation_checkpointing(capture):
    # the recipes turn on R3 and gradient checkpointing together: the backward recomputes each decoder layer
    # after replay_routes has closed, and must route the recomputation like the forward (same gradients as
    # without checkpointing, routes captured and replayed pairs counted once)
    models = {gc: build_model(ModelConfig(preset="tiny-moe", gradient_checkpointing=gc), V, seed=0).train()
              for gc in (False, True)}
    rollout = _rollout(models[False])
    B, S = rollout.input_ids_BS.shape
    own_BSLK = _own_routes(models[False], rollout)
    # routes none of the routers would pick (the experts after their own top-2, mod E): a replay that the
    # recomputation ignored gives other gradients (or a CheckpointError)
    E = models[False].config.num_experts
    replay_BSLK = (own_BSLK + 2) % E
    grads, counts = {}, {}
    for gc, model in models.items():
        model.zero_grad()
        with routing.replay_routes(model, replay_BSLK, capture=capture) as stats:
            logp_BT, _ = response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS,
                                           rollout.num_prompt_positions, temperature=TEMP)
        loss = -(logp_BT * rollout.response_mask_BT.clone()).sum()  # the engine made the mask in inference mode
        loss.backward()
        grads[gc] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        counts[gc] = (stats.replayed_pairs, [len(stats._ctx.captured.get(layer, [])) for layer in range(2)])
    assert counts[True] == counts[False] == (routing.expected_replay_pairs(replay_BSLK),
                                             [1, 1] if capture else [0, 0])
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-5, atol=1e-6, msg=name)
