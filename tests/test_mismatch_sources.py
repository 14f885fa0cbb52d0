"""The mismatch by source (constraints/sources.py, dcmdp/mismatch.py) on constructed batches where each source is
known: the engines' floor, the part stale rows add, the drift of the updates, and MoE routing flips."""

from __future__ import annotations

import math

import pytest
import torch

from constraints.config import ConstraintConfig
from constraints.sources import mismatch_sources, routing_flips, stale_token_share

APD = ConstraintConfig(measure="abs_prob_diff")
K1 = ConstraintConfig(measure="kl_k1")


def _logp(probs_BT) -> torch.Tensor:
    return torch.tensor(probs_BT, dtype=torch.float64).log()


def _rows(p: float, rows: int = 4, tokens: int = 3) -> list[list[float]]:
    return [[p] * tokens for _ in range(rows)]


MASK = torch.ones(4, 3, dtype=torch.bool)
FRESH = torch.ones(4, dtype=torch.bool)


def test_identical_weights_the_engines_floor_is_all_there_is():
    # pi_old = 0.5, mu = 0.4 on every token, no update: |0.5 - 0.4| = 0.1 is the engine part alone
    parts = mismatch_sources(APD, _logp(_rows(0.4)), _logp(_rows(0.5)), MASK, FRESH)
    assert parts["engine"] == pytest.approx(0.1, abs=1e-12)
    assert parts["staleness"] == 0 and parts["drift"] == 0
    assert parts["total"] == pytest.approx(0.1, abs=1e-12)


def test_stale_rows_add_their_token_share_times_their_excess():
    # rows 0, 1 fresh: |0.5 - 0.4| = 0.1; rows 2, 3 stale: |0.5 - 0.2| = 0.3; row 3 has one valid token of 3.
    # tokens: 6 fresh, 4 stale; whole batch (0.6 + 1.2) / 10 = 0.18; staleness = 0.18 - 0.1 = 0.4 x (0.3 - 0.1)
    mu = _logp([[0.4] * 3, [0.4] * 3, [0.2] * 3, [0.2] * 3])
    mask = MASK.clone()
    mask[3, 1:] = False
    fresh = torch.tensor([True, True, False, False])
    parts = mismatch_sources(APD, mu, _logp(_rows(0.5)), mask, fresh)
    assert parts["engine"] == pytest.approx(0.1, abs=1e-12)
    assert parts["staleness"] == pytest.approx(0.08, abs=1e-12)
    assert parts["engine"] + parts["staleness"] == pytest.approx(parts["total"], abs=1e-15)
    assert stale_token_share(mask, fresh) == 0.4


def test_the_drift_of_the_updates_and_how_the_parts_add():
    mu, old = _logp(_rows(0.4)), _logp(_rows(0.5))
    # pi_theta = 0.6: drift |0.6 - 0.5| = 0.1 away from mu too, so the parts add: total |0.6 - 0.4| = 0.2
    away = mismatch_sources(APD, mu, old, MASK, FRESH, trained_logp_BT=_logp(_rows(0.6)))
    assert away["drift"] == pytest.approx(0.1, abs=1e-12) and away["total"] == pytest.approx(0.2, abs=1e-12)
    # pi_theta = 0.45, back towards mu: drift 0.05, total 0.05 < engine + drift (the triangle inequality)
    back = mismatch_sources(APD, mu, old, MASK, FRESH, trained_logp_BT=_logp(_rows(0.45)))
    assert back["drift"] == pytest.approx(0.05, abs=1e-12) and back["total"] == pytest.approx(0.05, abs=1e-12)
    assert back["total"] < back["engine"] + back["staleness"] + back["drift"]


def test_log_ratio_parts_sum_to_the_total_exactly():
    # kl_k1 = E[log mu - log pi]: (log mu - log pi_old) + (log pi_old - log pi_theta) = log mu - log pi_theta
    g = torch.Generator().manual_seed(0)
    mu, old, new = (torch.rand(6, 5, generator=g, dtype=torch.float64).log() for _ in range(3))
    mask = torch.rand(6, 5, generator=g) > 0.2
    fresh = torch.tensor([True, False, True, False, False, True])
    parts = mismatch_sources(K1, mu, old, mask, fresh, trained_logp_BT=new)
    assert parts["engine"] + parts["staleness"] + parts["drift"] == pytest.approx(parts["total"], rel=1e-12)
    # and each part is the masked mean of its own log-ratio, worked out directly
    diff = (mu - old)
    fresh_mask = mask & fresh[:, None]
    assert parts["engine"] == pytest.approx(float(diff[fresh_mask].mean()), rel=1e-12)
    assert parts["drift"] == pytest.approx(float((old - new)[mask].mean()), rel=1e-12)


def test_without_fresh_rows_the_running_floor_stands_in_and_bypass_measures_no_engine():
    mu, old = _logp(_rows(0.4)), _logp(_rows(0.5))
    stale = torch.zeros(4, dtype=torch.bool)
    parts = mismatch_sources(APD, mu, old, MASK, stale, floor=0.04)
    assert parts["engine"] == 0.04 and parts["staleness"] == pytest.approx(0.06, abs=1e-12)
    unknown = mismatch_sources(APD, mu, old, MASK, stale)
    assert math.isnan(unknown["engine"]) and math.isnan(unknown["staleness"])
    # algo.old_logp=rollout: pi_old := mu, nothing to split; D-hat at the updates is still measured
    bypass = mismatch_sources(APD, mu, None, MASK, FRESH, trained_logp_BT=_logp(_rows(0.45)))
    assert math.isnan(bypass["engine"]) and math.isnan(bypass["drift"])
    assert bypass["total"] == pytest.approx(0.05, abs=1e-12)


def test_routing_flips_with_and_without_replay():
    # 1 row, 3 positions, 2 MoE layers, top-2: the router's own choice differs from the engine's at one pair of 6
    engine = torch.tensor([[[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]]])  # (1, 3, 2, 2)
    router = engine.clone()
    router[0, 1, 0] = torch.tensor([1, 3])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert routing_flips(engine, router, None, mask) == {"router": pytest.approx(1 / 6), "replayed": pytest.approx(1 / 6)}
    # R2 replays the router's own routes: the same flips reach the updates
    assert routing_flips(engine, router, router, mask)["replayed"] == pytest.approx(1 / 6)
    # R3 replays the engine's: no flip reaches the updates, and the router's own choice is not recorded
    r3 = routing_flips(engine, None, engine, mask)
    assert math.isnan(r3["router"]) and r3["replayed"] == 0
    # a position outside the mask does not count
    mask[0, 1] = False
    assert routing_flips(engine, router, None, mask)["router"] == 0


def test_a_training_run_logs_the_sources_beside_d_hat_and_report_stacks_them(tmp_path, monkeypatch):
    """A tiny MoE run (int8 rollouts, two mini-batches): per step the parts are logged under mismatch/, engine +
    staleness is the pre-update discrepancy, the total is D-hat at the updates, a synchronous run has no staleness,
    and report draws them as one stacked figure."""
    from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
    from dcmdp.config import load_config
    from dcmdp.loop import train
    from dcmdp.report import write_report

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    torch.set_num_threads(1)
    cfg = load_config(None, [
        "model.preset=tiny-moe", "rollout.precision=int8", "cold_start.steps=5",
        f"cold_start.cache_dir={tmp_path / 'cache'}", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
        "algo.minibatches=2", "task.eval_size=4", "steps=3", "threads=1", "progress=false", "rollout.max_new_tokens=6",
        "dual.measure_at=updates", f"output_dir={tmp_path / 'run'}", "checkpoint.every=3",
        # a tolerance no batch meets: the penalty moves the weights even where every reward is 0
        "dual.constraints=[{measure: abs_prob_diff, tolerance: 1e-9, lambda_init: 1.0}]"])
    summary = train(cfg)
    history = load_checkpoint(find_resume_checkpoint(tmp_path / "run" / "checkpoints", "auto"))["history"]
    for h in history:
        parts = {k: h[f"mismatch/abs_prob_diff/{k}"] for k in ("engine", "staleness", "drift", "total")}
        assert parts["staleness"] == 0 and h["mismatch/stale_token_frac"] == 0  # every row fresh
        assert parts["engine"] == pytest.approx(h["discrepancy/abs_prob_diff"], rel=1e-6)
        assert parts["total"] == h["dual/measured/abs_prob_diff"]  # D-hat at the updates, the same number
        assert parts["drift"] > 0  # the second mini-batch trains on weights the first one moved
        assert parts["total"] <= parts["engine"] + parts["drift"] + 1e-7
        assert 0 <= h["mismatch/routing/router"] <= 1 and h["mismatch/routing/replayed"] == h["mismatch/routing/router"]
    md = write_report(["dcmdp"], tmp_path / "rep", tracking_uri=summary.tracking_uri)
    png = tmp_path / "rep" / "mismatch.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![the mismatch by source" in md.read_text()
