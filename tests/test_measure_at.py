"""``dual.measure_at: updates``: D-hat from pi_theta as each mini-batch update saw it, vs mu.

The learner returns ``UpdateResult.trained_logp_BT``, every row's log-probs at the moment its mini-batch was trained;
the reference recomputes them independently (a forward in float64 of the model's weights as they were
right before each optimiser step, read in the optimiser's step pre-hook).
"""

import copy

import pytest
import torch

from dcmdp.config import load_config
from dcmdp.loop import train
from trainers import learner
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model
from trainers.scoring import response_logprobs

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20], [21, 22, 23], [24, 25], [26, 27, 28], [29, 30]]


def _batch(minibatches: int):
    model = build_model(ModelConfig(preset="tiny-dense"), 101, seed=0)
    rollout = TorchEngine(RolloutConfig(max_new_tokens=4, precision="int8"), model, eos_id=1, pad_id=0).generate(
        PROMPTS, seed=0)
    cfg = AlgoConfig(samples_per_prompt=2, prompts_per_step=4, minibatches=minibatches, is_mode="tis")
    adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25])
    batch = learner.score_old(model, rollout, adv_B, cfg, learner.ScoringSpec())
    return model, batch, cfg


def _logp64(model, rollout) -> torch.Tensor:
    m = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logp_BT, _ = response_logprobs(m, rollout.input_ids_BS, rollout.attention_mask_BS,
                                       rollout.num_prompt_positions, temperature=1.0)
    return logp_BT


@pytest.mark.parametrize("minibatches", [1, 4])
def test_trained_logp_is_the_policy_each_minibatch_update_saw(minibatches):
    torch.manual_seed(0)
    model, batch, cfg = _batch(minibatches)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before_step: list[torch.Tensor] = []  # float64 log-probs of every row, at each optimiser step's weights
    opt.register_step_pre_hook(lambda *_: before_step.append(_logp64(model, batch.rollout)))
    trained_BT = learner.update(model, learner.OptimStep(opt), batch, scoring=learner.ScoringSpec(),
                                penalty=learner.PenaltySpec(), cfg=cfg,
                                generator=torch.Generator().manual_seed(0)).trained_logp_BT
    mask_BT = batch.rollout.response_mask_BT.bool()
    parts = learner.minibatch_indices(len(batch.rollout), minibatches, torch.Generator().manual_seed(0))
    assert len(before_step) == minibatches
    for k, rows in enumerate(parts):
        m_BT = mask_BT[rows]
        got, ref = trained_BT[rows][m_BT].double(), before_step[k][rows][m_BT].double()
        # float32 forward vs float64 reference of the same weights
        assert torch.allclose(got, ref, atol=2e-5, rtol=0), (k, (got - ref).abs().max())
    # the first mini-batch is trained at pi_old; later ones after the earlier updates moved the policy
    first = parts[0]
    assert torch.allclose(trained_BT[first][mask_BT[first]], batch.old_logp_BT[first][mask_BT[first]], atol=1e-5)
    if minibatches > 1:
        last = parts[-1]
        drift = (trained_BT[last] - batch.old_logp_BT[last])[mask_BT[last]].abs().max()
        assert drift > 1e-3, drift


def _history(summary, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(tracking_uri=summary.tracking_uri).get_metric_history(summary.run_id, key)
    return [m.value for m in sorted(hist, key=lambda m: m.step)]


TOLERANCE, ETA, LAM0 = 1e-3, 50.0, 0.1


def _run(tmp_path, *overrides: str, constraint: str = ""):
    """A short untrained tiny-dense run (int8 rollouts, 4 x 4 samples) with one abs_prob_diff constraint
    (c = TOLERANCE, eta = ETA, lambda_0 = LAM0, plus ``constraint``'s fields) and ``overrides``; its summary."""
    torch.set_num_threads(1)
    return train(load_config(None, [
        "model.preset=tiny-dense", "rollout.precision=int8", "cold_start.steps=0", "algo.prompts_per_step=4",
        "algo.samples_per_prompt=4", "task.eval_size=8", "threads=1", "progress=false",
        f"output_dir={tmp_path / 'run'}",
        f"dual.constraints=[{{measure: abs_prob_diff, {constraint}tolerance: {TOLERANCE}, lambda_init: {LAM0}, "
        f"lr: {ETA}}}]", *overrides]))


@pytest.mark.parametrize("minibatches", [1, 4])
def test_loop_feeds_the_dual_the_updates_measure(tmp_path, minibatches):
    tolerance, eta, lam0 = TOLERANCE, ETA, LAM0
    summary = _run(tmp_path, f"algo.minibatches={minibatches}", "optim.lr=5e-3", "optim.warmup_steps=0",
                   "algo.entropy_coef=0.1",  # untrained model, zero rewards: the entropy term makes the updates move it
                   "steps=3", "dual.measure_at=updates")
    measured = _history(summary, "dual/measured/abs_prob_diff")
    before = _history(summary, "discrepancy/abs_prob_diff")  # pi_old vs mu, logged as always
    lam = _history(summary, "dual/lambda/abs_prob_diff")
    assert len(measured) == len(before) == len(lam) == 3
    if minibatches == 1:
        # one update per batch, taken at pi_old: the two measures agree
        assert measured == pytest.approx(before, rel=1e-4)
    else:
        # three of four mini-batches are trained after earlier updates moved pi_theta away from mu
        assert all(m > b for m, b in zip(measured, before)), (measured, before)
    # the projected rule steps on the measure it was fed
    prev = [lam0] + lam[:-1]
    for p, m, got in zip(prev, measured, lam):
        assert got == pytest.approx(min(max(p + eta * (m - tolerance), 0.0), 10.0), rel=1e-9, abs=1e-12)


def test_a_quantile_constraint_feeds_the_dual_the_tail_of_the_token_measure(tmp_path):
    """quantile: 0.9 makes D-hat the 90th percentile of |pi_old - mu| over the batch's tokens (logged by the panel as
    discrepancy/abs_prob_diff_p90), under its own metric name, and the projected rule steps on it."""
    tolerance, eta, lam0 = TOLERANCE, ETA, LAM0
    summary = _run(tmp_path, "algo.minibatches=1", "steps=3", "dual.measure_at=rollout", constraint="quantile: 0.9, ")
    measured = _history(summary, "dual/measured/abs_prob_diff_p90")
    tail = _history(summary, "discrepancy/abs_prob_diff_p90")
    mean = _history(summary, "discrepancy/abs_prob_diff")
    lam = _history(summary, "dual/lambda/abs_prob_diff_p90")
    assert len(measured) == len(tail) == len(lam) == 3
    assert measured == pytest.approx(tail, rel=1e-9)
    assert all(t > m for t, m in zip(tail, mean)), (tail, mean)  # int8's |pi - mu| is heavy-tailed
    prev = [lam0] + lam[:-1]
    for p, m, got in zip(prev, measured, lam):
        assert got == pytest.approx(min(max(p + eta * (m - tolerance), 0.0), 10.0), rel=1e-9, abs=1e-12)


def test_loop_logs_the_averaged_multiplier_it_penalises_with(tmp_path):
    """dual.average=true in a run: dual/lambda_avg is the mean of lambda_0 and the logged iterates."""
    summary = _run(tmp_path, "algo.minibatches=2", "steps=4", "dual.average=true")
    lam = _history(summary, "dual/lambda/abs_prob_diff")
    avg = _history(summary, "dual/lambda_avg/abs_prob_diff")
    assert len(lam) == len(avg) == 4
    assert len(set(lam)) > 1  # the iterates moved, so the mean differs from the last one
    for k in range(4):
        assert avg[k] == pytest.approx(sum([LAM0] + lam[:k + 1]) / (k + 2), rel=1e-9)
