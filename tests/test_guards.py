"""Non-finite guards: the screening functions by hand, the learner on a tiny real model, and real training runs
in which the real rollout engine's log-probs get NaN written into them (the engine's ``generate`` is wrapped:
the real method runs, then NaN is written into the tensor it returned)."""

from __future__ import annotations

import math

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
from dcmdp.config import ConfigError, load_config
from dcmdp.loop import train
from dcmdp.policy import step_seed
from dcmdp.tracking import local_store_uri
from trainers import guards, learner
from trainers.advantages import ADVANTAGES, STD_EPS
from trainers.batch import Rollout
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model

torch.set_num_threads(1)
NAN, INF = float("nan"), float("inf")
grpo = ADVANTAGES["grpo"]


# ------------------------------------------------------------------------------------------ screening


def test_screen_rows_drops_nonfinite_valid_tokens_and_rewards_only():
    logp_BT = torch.tensor([[-1.0, NAN, -2.0],   # NaN on a valid token: dropped
                            [-1.0, -1.0, NAN],   # NaN on padding: kept
                            [-0.5, -0.5, -0.5],  # inf reward: dropped
                            [0.0, 0.0, 0.0],     # empty response: kept, counted
                            [-INF, -1.0, 0.0]])  # -inf on a valid token: dropped
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    rewards_B = torch.tensor([1.0, 0.0, INF, 0.0, NAN])
    keep_B, m = guards.screen_rows(logp_BT, mask_BT, rewards_B)
    assert keep_B.tolist() == [False, True, False, True, False]
    assert m == {"guard/bad_rollout_logp_samples": 2.0, "guard/bad_reward_samples": 2.0,
                 "guard/empty_response_samples": 1.0}


def test_screen_rows_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"rollout_logp \(2, 3\), mask \(2, 4\)"):
        guards.screen_rows(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool), torch.zeros(2))


def test_screen_old_logp_and_advantages_count_only_still_kept_rows():
    old_BT = torch.tensor([[NAN, -1.0], [-1.0, -1.0], [INF, -1.0]])
    mask_BT = torch.tensor([[1, 1], [1, 1], [1, 1]], dtype=torch.bool)
    keep_B, m = guards.screen_old_logp(old_BT, mask_BT, torch.tensor([True, True, False]))
    assert keep_B.tolist() == [False, True, False] and m == {"guard/bad_old_logp_samples": 1.0}
    keep_B, m = guards.screen_advantages(torch.tensor([NAN, 0.5, NAN]), torch.tensor([True, True, False]))
    assert keep_B.tolist() == [False, True, False] and m == {"guard/bad_advantage_samples": 1.0}


def test_screened_advantages_use_only_finite_rewards_of_each_group():
    # group 0: [1, NaN, 0, 0] -> kept [1, 0, 0], mean 1/3 -> [2/3, 0, -1/3, -1/3]
    # group 1: [1, 1, 0, 0] complete -> mean 1/2 -> [0.5, 0.5, -0.5, -0.5] (as GRPO on its own)
    # group 2: [NaN, inf, NaN, 1] -> one kept sample: its own baseline, advantage 0
    rewards_B = torch.tensor([1, NAN, 0, 0, 1, 1, 0, 0, NAN, INF, NAN, 1], dtype=torch.float64)
    keep_B, _ = guards.screen_rows(torch.zeros(12, 1), torch.ones(12, 1, dtype=torch.bool), rewards_B)
    adv_B, m = guards.screened_advantages(grpo, rewards_B, keep_B, 4, AlgoConfig())
    expected = [2 / 3, 0, -1 / 3, -1 / 3, 0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0]
    torch.testing.assert_close(adv_B, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # row-weighted mean of the calls: complete groups (4 rows, mean 0.5), group 0 (3 rows, 1/3), group 2 (1 row, 1)
    assert m["reward/mean"] == pytest.approx((4 * 0.5 + 3 * (1 / 3) + 1 * 1.0) / 8, rel=1e-12)
    assert all(math.isfinite(v) for v in m.values())


def test_screened_advantages_std_normalised_partial_group_by_hand():
    # kept [1, 0, 0] of group [1, 0, NaN, 0]: mean 1/3, Bessel std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3)
    rewards_B = torch.tensor([1.0, 0.0, NAN, 0.0], dtype=torch.float64)
    keep_B = torch.isfinite(rewards_B)
    adv_B, _ = guards.screened_advantages(grpo, rewards_B, keep_B, 4, AlgoConfig(std_normalize=True))
    s = math.sqrt(1 / 3)
    expected = torch.tensor([2 / 3, -1 / 3, 0.0, -1 / 3], dtype=torch.float64) / (s + STD_EPS)
    expected[2] = 0.0
    torch.testing.assert_close(adv_B, expected, rtol=1e-12, atol=1e-12)


def test_screened_advantages_with_every_sample_kept_is_the_estimator_itself():
    rewards_B = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv_B, m = guards.screened_advantages(grpo, rewards_B, torch.ones(6, dtype=torch.bool), 3, AlgoConfig())
    ref_B, ref_m = grpo(rewards_B, 3, AlgoConfig())
    assert torch.equal(adv_B, ref_B) and m == ref_m
    adv_B, m = guards.screened_advantages(grpo, rewards_B, torch.zeros(6, dtype=torch.bool), 3, AlgoConfig())
    assert torch.equal(adv_B, torch.zeros(6)) and m == {}


def test_mask_rows_zeroes_mask_logp_and_response_routes_of_dropped_rows():
    r = Rollout(prompt_ids_BP=torch.tensor([[0, 7], [8, 9]]), prompt_mask_BP=torch.tensor([[0, 1], [1, 1]]).bool(),
                response_ids_BT=torch.tensor([[5, 1], [6, 0]]), response_mask_BT=torch.tensor([[1, 1], [1, 0]]).bool(),
                rollout_logp_BT=torch.tensor([[NAN, -1.0], [-2.0, 0.0]]),
                rollout_experts_BSLK=torch.arange(16).reshape(2, 4, 1, 2))
    out = guards.mask_rows(r, torch.tensor([False, True]))
    assert out.response_mask_BT.tolist() == [[False, False], [True, False]]
    assert out.rollout_logp_BT.tolist() == [[0.0, 0.0], [-2.0, 0.0]]
    assert out.rollout_experts_BSLK[0, :2].flatten().tolist() == [0, 1, 2, 3]  # prompt routes stay
    assert (out.rollout_experts_BSLK[0, 2:] == -1).all()
    assert torch.equal(out.rollout_experts_BSLK[1], r.rollout_experts_BSLK[1])
    assert torch.equal(out.response_ids_BT, r.response_ids_BT)
    assert guards.mask_rows(r, torch.tensor([True, True])) is r


# ------------------------------------------------------------------------------------------ learner


def _tiny_batch(seed: int = 0):
    model = build_model(ModelConfig(preset="tiny-dense"), 101, seed=seed)
    engine = TorchEngine(RolloutConfig(max_new_tokens=4), model, eos_id=1, pad_id=0)
    rollout = engine.generate([[10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20]], seed=seed)
    return model, rollout


def _update(model, batch, cfg):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return learner.update(model, learner.OptimStep(opt), batch, scoring=learner.ScoringSpec(),
                          penalty=learner.PenaltySpec(), cfg=cfg, generator=torch.Generator().manual_seed(0))


def test_dropped_row_changes_the_update_exactly_like_removing_it():
    cfg = AlgoConfig(samples_per_prompt=2, prompts_per_step=2, minibatches=1, is_mode="tis")
    model, rollout = _tiny_batch()
    adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5])
    poisoned = rollout.with_(rollout_logp_BT=rollout.rollout_logp_BT.clone())
    poisoned.rollout_logp_BT[1, 0] = NAN
    keep_B, m = guards.screen_rows(poisoned.rollout_logp_BT, poisoned.response_mask_BT, torch.zeros(4))
    assert keep_B.tolist() == [True, False, True, True] and m["guard/bad_rollout_logp_samples"] == 1.0
    masked = guards.mask_rows(poisoned, keep_B)

    runs = {}
    for name, r, a in [("masked", masked, torch.where(keep_B, adv_B, 0.0)),
                       ("removed", rollout.select(keep_B), adv_B[keep_B])]:
        m_ = build_model(ModelConfig(preset="tiny-dense"), 101, seed=0)
        batch = learner.score_old(m_, r, a, cfg, learner.ScoringSpec())
        assert _update(m_, batch, cfg).skipped == 0
        runs[name] = m_
    for (n, p), q in zip(runs["masked"].named_parameters(), runs["removed"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)
    moved = sum(float((p - q).detach().abs().sum()) for p, q in zip(runs["masked"].parameters(), model.parameters()))
    assert moved > 0


def test_nonfinite_loss_skips_the_optimizer_step_and_zeroes_grads(caplog):
    cfg = AlgoConfig(samples_per_prompt=2, prompts_per_step=2, minibatches=2)
    model, rollout = _tiny_batch()
    batch = learner.score_old(model, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), cfg, learner.ScoringSpec())
    with torch.no_grad():
        model.model.norm.weight[0] = NAN  # every forward of pi_theta is NaN from here on
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = _update(model, batch, cfg)
    assert [m["guard/skipped_update"] for m in result.steps] == [1.0, 1.0]
    assert result.skipped == 2 and result.metrics()["guard/skipped_updates"] == 2.0
    for n, p in model.named_parameters():
        assert torch.equal(p.nan_to_num(), before[n].nan_to_num()), n  # NaN == NaN only after nan_to_num
        assert p.grad is None
    assert "optimizer step skipped" in caplog.text


def test_guard_max_bad_steps_is_validated():
    assert load_config(None, ["guard.max_bad_steps=3"]).guard.max_bad_steps == 3
    with pytest.raises(ConfigError, match=r"guard.max_bad_steps.*>= 1, got 0"):
        load_config(None, ["guard.max_bad_steps=0"])
    with pytest.raises(ConfigError, match="did you mean 'max_bad_steps'"):
        load_config(None, ["guard.max_bad_step=3"])


# ------------------------------------------------------------------------------------------ real runs


def _overrides(out, steps: int, *extra: str) -> list[str]:
    return ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
            "algo.minibatches=1", "task.eval_size=4", f"steps={steps}", "threads=1", "progress=false",
            "rollout.max_new_tokens=4", f"output_dir={out}", *extra]


def _poison_generate(monkeypatch, rows_by_seed: dict[int, slice]):
    """Wrap the real TorchEngine.generate: for the given seeds write NaN into the first response token's
    rollout log-prob of the given rows (a valid token: every response has at least one)."""
    real = TorchEngine.generate

    def generate(self, prompts, seed):
        rollout = real(self, prompts, seed)
        if seed in rows_by_seed:
            # the engine returns inference-mode tensors: write into a copy
            rollout = rollout.with_(rollout_logp_BT=rollout.rollout_logp_BT.clone())
            rollout.rollout_logp_BT[rows_by_seed[seed], 0] = NAN
        return rollout

    monkeypatch.setattr(TorchEngine, "generate", generate)


def _metric(client, run_id, key) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_nan_rollout_logp_is_dropped_counted_and_lambda_kept(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # step index 1 (logged at step 2): one sample NaN; step index 2 (logged at 3): every sample NaN
    _poison_generate(monkeypatch, {step_seed(0, 1, 1): slice(0, 1), step_seed(0, 2, 1): slice(None)})
    summary = train(load_config(None, _overrides(tmp_path / "out", 4)))
    assert summary.steps == 4

    client = MlflowClient(summary.tracking_uri)
    assert client.get_run(summary.run_id).info.status == "FINISHED"
    bad = _metric(client, summary.run_id, "guard/bad_rollout_logp_samples")
    assert bad == {1: 0.0, 2: 1.0, 3: 4.0, 4: 0.0}
    assert _metric(client, summary.run_id, "guard/skipped_step") == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0}
    assert _metric(client, summary.run_id, "guard/consecutive_bad_steps") == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0}
    assert _metric(client, summary.run_id, "dual/skipped") == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0}
    assert _metric(client, summary.run_id, "guard/skipped_updates") == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    assert _metric(client, summary.run_id, "guard/dropped_samples") == {1: 0.0, 2: 1.0, 3: 4.0, 4: 0.0}
    lam = _metric(client, summary.run_id, "dual/lambda/abs_prob_diff")
    # fp32 engine: D ~ 1e-9 << c = 0.005, so a finite measurement moves lambda down by ~0.005 (lr 1)
    assert lam[2] == pytest.approx(lam[1] - 0.005, abs=1e-6) and lam[4] == pytest.approx(lam[3] - 0.005, abs=1e-6)
    assert lam[3] == lam[2]  # the step whose every sample was dropped leaves lambda where it was
    measured = _metric(client, summary.run_id, "dual/measured/abs_prob_diff")
    assert math.isfinite(measured[2]) and math.isnan(measured[3])
    assert "every sample dropped" in caplog.text and "1 for a non-finite rollout_logp" in caplog.text
    state = load_checkpoint(find_resume_checkpoint(tmp_path / "out" / "checkpoints", "auto"))
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_consecutive_bad_steps_stop_the_cli_after_a_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _poison_generate(monkeypatch, {step_seed(0, s, 1): slice(None) for s in range(1, 10)})
    out = tmp_path / "out"
    rc = cli.main(["train", *_overrides(out, 10, "guard.max_bad_steps=2")])
    err = capsys.readouterr().err
    assert rc == 4
    # step 1 good, steps 2 and 3 bad -> stop after step 3 with its checkpoint
    ckpt = out / "checkpoints" / "step_00000003"
    assert "2 consecutive bad steps up to step 3" in err and "guard.max_bad_steps=2" in err
    assert "guard/bad_rollout_logp_samples=4" in err and f"checkpoint of step 3 written to {ckpt}" in err
    state = load_checkpoint(ckpt)
    assert state["step"] == 3 and state["guard"] == {"consecutive_bad_steps": 2}
    assert [h["guard/skipped_step"] for h in state["history"]] == [0.0, 1.0, 1.0]
    client = MlflowClient(local_store_uri(out))
    run = client.search_runs(client.get_experiment_by_name("dcmdp").experiment_id)[0]
    assert run.info.status == "FAILED"
    assert _metric(client, run.info.run_id, "guard/consecutive_bad_steps") == {1: 0.0, 2: 1.0, 3: 2.0}
