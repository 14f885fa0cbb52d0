"""docs/extending.md, one test per kind: a toy measure, IS mode, policy loss, penalty form, dual rule, rollout engine
and task, each registered with one registry line (``monkeypatch.setitem``, undone after the test), is accepted by
the config checks and used by the code that reads the registry."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from constraints.config import ConstraintConfig
from constraints.measures import MEASURES, Measure
from constraints.penalties import PENALTIES, PenaltyForm
from dcmdp.config import ConfigError, DualConfig, load_config
from dcmdp.dual import DUAL_RULES, DualRule, DualState, dual_step, init_state, project
from trainers import learner, losses
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig, TaskConfig
from trainers.engines import ENGINES, EngineCapabilities, EngineEntry
from trainers.engines.torch_engine import TorchEngine
from trainers.losses import IS_MODES, POLICY_LOSSES
from trainers.models import build_model
from trainers.tasks import TASKS, Example
from runs import metric_history

torch.set_num_threads(1)


def _tiny_run(tmp_path, *overrides: str) -> list[str]:
    """Overrides of a one-step run of an untrained tiny-dense model (no cold start)."""
    return ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
            "task.eval_size=4", "steps=1", "threads=1", "progress=false", f"output_dir={tmp_path / 'run'}", *overrides]


def _scored_batch(cfg: AlgoConfig, seed: int = 0):
    model = build_model(ModelConfig(preset="tiny-dense"), 101, seed=seed)
    rollout = TorchEngine(RolloutConfig(max_new_tokens=4, precision="bf16"), model, eos_id=1, pad_id=0).generate(
        [[10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20]], seed=seed)
    batch = learner.score_old(model, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), cfg, learner.ScoringSpec())
    return model, batch


def _update(model, batch, cfg: AlgoConfig, penalty: learner.PenaltySpec = learner.PenaltySpec()):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return learner.update(model, learner.OptimStep(opt), batch, scoring=learner.ScoringSpec(), penalty=penalty, cfg=cfg,
                          generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------- measure


def _sq_log_ratio_token(logp_train_BT: Tensor, logp_rollout_BT: Tensor) -> Tensor:
    """(log rho)^2 per token."""
    return (logp_train_BT - logp_rollout_BT) ** 2


def _sq_log_ratio(logp_train_BT: Tensor, logp_rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """E_t (log rho_t)^2 over the valid tokens (float64)."""
    m = mask_BT.bool()
    d = _sq_log_ratio_token(logp_train_BT.double(), logp_rollout_BT.double())
    return torch.where(m, d, 0.0).sum() / m.sum().clamp_min(1)


def test_a_new_measure_is_a_constraint_of_a_training_step(tmp_path, monkeypatch):
    monkeypatch.setitem(MEASURES, "sq_log_ratio", Measure("sq_log_ratio", _sq_log_ratio, _sq_log_ratio_token, "token"))
    tolerance, lam0, eta = 1e-6, 0.1, 10.0
    cfg = load_config(None, _tiny_run(tmp_path, "rollout.precision=int8", f"dual.constraints=[{{measure: sq_log_ratio, "
                                      f"tolerance: {tolerance}, lambda_init: {lam0}, lr: {eta}}}]"))
    from dcmdp.loop import train

    summary = train(cfg)
    (measured,) = metric_history(summary, "dual/measured/sq_log_ratio")
    # the panel logs every registered measure, and the dual step moved lambda by eta (D - c)
    assert metric_history(summary, "discrepancy/sq_log_ratio") == [pytest.approx(measured)]
    assert measured > tolerance
    assert summary.final_lambda["sq_log_ratio"] == pytest.approx(lam0 + eta * (measured - tolerance), rel=1e-6)
    assert metric_history(summary, "penalty/loss")[0] > 0  # its token form went into the hinge penalty


# ---------------------------------------------------------------------------------------------- IS mode


def is_clip(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, cfg: AlgoConfig):
    """w_t = clip(rho_t, 1/2, 2): a two-sided truncation. ``_log_rho`` and ``_is_result`` give it the composable
    rules (sequence mask, veto, rejection) and the is/ metrics of every mode."""
    rho = losses._log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    log_w_BT = rho.log_rho_BT.clamp(math.log(0.5), math.log(2.0))
    truncated_BT = rho.valid_BT & (log_w_BT != rho.log_rho_BT)
    return losses._is_result(rho, log_w_BT.exp(), rho.valid_BT, rho.log_rho_BT, rho.valid_BT, truncated_BT, cfg,
                             old_logp_BT.dtype)


def test_a_new_is_mode_weights_the_update(monkeypatch):
    monkeypatch.setitem(IS_MODES, "clip", is_clip)
    assert load_config(None, ["algo.is_mode=clip"]).algo.is_mode == "clip"
    cfg = AlgoConfig(is_mode="clip", samples_per_prompt=2, prompts_per_step=2)
    model, batch = _scored_batch(cfg)
    # a rollout engine far off the training engine: some rho outside [1/2, 2]
    off = batch.rollout.with_(rollout_logp_BT=batch.rollout.rollout_logp_BT + torch.tensor([[1.0], [-1.0], [0.0],
                                                                                               [0.0]]))
    batch = learner.ScoredBatch(off, batch.old_logp_BT, batch.advantages_BT, None, None)
    result = _update(model, batch, cfg)
    assert 0.5 - 1e-6 <= result.is_metrics["is/weight_max"] <= 2.0 + 1e-6
    assert result.is_metrics["is/weight_max_raw"] > 2.0 and result.is_metrics["is/truncated_frac"] > 0


# ---------------------------------------------------------------------------------------------- policy loss


def reinforce_loss(logp_BT: Tensor, old_logp_BT: Tensor, advantages_BT: Tensor, weights_BT: Tensor, mask_BT: Tensor,
                   cfg: AlgoConfig, normalizer: float) -> tuple[Tensor, dict[str, float]]:
    """Plain IS-weighted REINFORCE: -sum_t w_t A_t log pi_theta(y_t) / normalizer (no clip)."""
    loss = -(weights_BT * advantages_BT * logp_BT).masked_fill(~mask_BT.bool(), 0.0).sum() / normalizer
    return loss, {"loss/policy": float(loss.detach()), "loss/reinforce": float(loss.detach())}


def test_a_new_policy_loss_trains(monkeypatch):
    monkeypatch.setitem(POLICY_LOSSES, "reinforce", reinforce_loss)
    assert load_config(None, ["algo.loss=reinforce"]).algo.loss == "reinforce"
    cfg = AlgoConfig(loss="reinforce", samples_per_prompt=2, prompts_per_step=2)
    model, batch = _scored_batch(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    result = _update(model, batch, cfg)
    assert result.steps[0]["loss/reinforce"] == result.steps[0]["loss/total"]  # no penalty, no entropy term
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ---------------------------------------------------------------------------------------------- penalty form


def squared_hinge_term(d_BT: Tensor, tolerance: float) -> Tensor:
    """relu(d_t - c)^2."""
    return torch.relu(d_BT - tolerance) ** 2


def test_a_new_penalty_form_enters_the_loss(monkeypatch):
    monkeypatch.setitem(PENALTIES, "squared_hinge", PenaltyForm(squared_hinge_term))
    assert load_config(None, ["dual.penalty=squared_hinge"]).dual.penalty == "squared_hinge"
    cfg = AlgoConfig(samples_per_prompt=2, prompts_per_step=2)
    con = ConstraintConfig(measure="abs_log_ratio", tolerance=0.0)
    model, batch = _scored_batch(cfg)
    mask_BT = batch.rollout.response_mask_BT.bool()
    off = batch.rollout.with_(rollout_logp_BT=torch.where(mask_BT, batch.old_logp_BT - 0.5, 0.0))
    batch = learner.ScoredBatch(off, batch.old_logp_BT, batch.advantages_BT, None, None)
    result = _update(model, batch, cfg, learner.PenaltySpec(torch.tensor([2.0]), (con,), "squared_hinge"))
    # one mini-batch, trained at pi_old: |log pi_theta - log mu| = 0.5 at every valid token, penalty 2 * 0.5^2
    assert result.steps[0]["penalty/loss"] == pytest.approx(2.0 * 0.25, rel=1e-4)


# ---------------------------------------------------------------------------------------------- dual rule


def _sign_init(cfg: DualConfig) -> dict:
    return {"raised": [0] * len(cfg.constraints)}


def _sign_step(lambda_C: Tensor, state: dict, measured_C: Tensor, tolerance_C: Tensor, cfg: DualConfig):
    """lambda <- Pi(lambda + eta sign(D - c)): a step of fixed size; the state counts the raises per constraint."""
    finite_C = torch.isfinite(measured_C)
    sign_C = torch.where(finite_C, torch.sign(measured_C - tolerance_C), torch.zeros_like(measured_C))
    eta_C = torch.tensor([c.lr for c in cfg.constraints], dtype=torch.float64)
    new_C = project(lambda_C + eta_C * sign_C, cfg)
    return new_C, {"raised": [n + int(s > 0) for n, s in zip(state["raised"], sign_C.tolist())]}


def test_a_new_dual_rule_owns_its_state(monkeypatch):
    monkeypatch.setitem(DUAL_RULES, "sign", DualRule(_sign_init, _sign_step))
    cfg = load_config(None, ["dual.rule=sign",
                             "dual.constraints=[{measure: kl_k3, tolerance: 0.01, lambda_init: 0.5, lr: 0.25}]"]).dual
    state = init_state(cfg)
    for d in (0.02, 0.5, 0.0):
        state, metrics = dual_step(state, torch.tensor([d]), cfg)
    assert state.lambda_C.tolist() == pytest.approx([0.5 + 0.25 + 0.25 - 0.25])
    assert metrics["dual/lambda/kl_k3"] == pytest.approx(0.75)
    # the checkpoint stores the rule's state without knowing its fields
    assert DualState.from_state_dict(state.state_dict()).rule == {"raised": [2]}


# ---------------------------------------------------------------------------------------------- rollout engine


class CountingEngine(TorchEngine):
    """The torch engine under another name, counting its batches."""

    name = "counting"
    batches = 0

    def generate(self, prompts, seed):
        CountingEngine.batches += 1
        return super().generate(prompts, seed)


def build_counting_engine(cfg, model, model_dir, *, eos_id: int, pad_id: int, every_rank: bool = False):
    return CountingEngine(cfg, model, eos_id=eos_id, pad_id=pad_id)


def test_a_new_engine_is_read_by_its_capabilities(tmp_path, monkeypatch):
    caps = EngineCapabilities(unsupported_precisions={"int4": "the counting engine has no int4 kernels"},
                              async_worker=False)
    monkeypatch.setitem(ENGINES, "counting", EngineEntry(f"{__name__}:build_counting_engine", caps))
    with pytest.raises(ConfigError, match="'rollout.precision': the counting engine has no int4 kernels"):
        load_config(None, ["rollout.engine=counting", "rollout.precision=int4"])
    with pytest.raises(ConfigError, match="async_rollout.enabled.*not the counting engine"):
        load_config(None, ["rollout.engine=counting", "async_rollout.enabled=true"])
    from dcmdp.loop import train

    CountingEngine.batches = 0
    summary = train(load_config(None, _tiny_run(tmp_path, "rollout.engine=counting")))
    assert CountingEngine.batches == 3  # held-out evaluation before, one rollout batch, evaluation after
    assert summary.steps == 1


# ---------------------------------------------------------------------------------------------- task


@dataclass
class ReverseTask:
    """Reverse a word of 3 lower-case letters: prompt "R:abc=", answer "cba"."""

    cfg: TaskConfig
    seed: int
    name = "reverse"

    def _draw(self, rng: random.Random) -> Example:
        word = "".join(rng.choice("abcdefgh") for _ in range(3))
        return Example(prompt=f"R:{word}=", answer=word[::-1])

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        held_out = {ex.prompt for ex in self.eval_set()}
        out: list[Example] = []
        while len(out) < n:
            ex = self._draw(rng)
            if ex.prompt not in held_out:
                out.append(ex)
        return out

    def eval_set(self) -> list[Example]:
        rng = random.Random("reverse-eval")
        return [self._draw(rng) for _ in range(self.cfg.eval_size)]

    def reward(self, completion: str, example: Example) -> float:
        return float(completion.strip() == example.answer)

    def demonstration(self, example: Example) -> str:
        return example.answer


def test_a_new_task_trains(tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "reverse", ReverseTask)
    cfg = load_config(None, _tiny_run(tmp_path, "task.name=reverse", "cold_start.steps=5", "cold_start.batch_size=8",
                                      f"cold_start.cache_dir={tmp_path / 'cache'}"))
    from dcmdp.loop import train

    summary = train(cfg)
    assert summary.steps == 1 and 0.0 <= summary.accuracy_after <= 1.0
    assert len(metric_history(summary, "reward/accuracy")) == 1
