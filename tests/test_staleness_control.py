"""The staleness bound as the dual's second action (async_rollout.max_staleness: auto), what a too-stale batch gets
(wait, drop), forced staleness (schedule, heavy-tailed draws), their config errors and metrics.

Rule tests use hand-computed float64 values; run tests are tiny-moe with int8 rollouts, one torch thread and fixed
seeds, so everything but wall-clock timings is deterministic and compared exactly (==).
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dcmdp.async_config import (AsyncRolloutConfig, GeometricConfig, PowerLawConfig, StalenessAutoConfig,
                                 StalenessPhase)
from dcmdp.async_rollout import (bounded_version, draw_staleness, scheduled_staleness, staleness_histogram,
                                 staleness_pmf)
from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
from dcmdp.cli import main
from dcmdp.config import ConfigError, load_config
from dcmdp.dual import (DualState, bound_in_force, init_state, staleness_bound, staleness_nu_step, staleness_step,
                        with_staleness)
from dcmdp.loop import train
from tests.test_metrics_doc import documented_patterns

REPO = Path(__file__).parents[1]
AUTO_ONLY = ("async/nu", "async/bound_next", "async/staleness_tolerance")


def _overrides(out, cache, steps, *extra):
    return ["model.preset=tiny-moe", "rollout.precision=int8", "cold_start.steps=5", f"cold_start.cache_dir={cache}",
            "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "algo.minibatches=2", "task.eval_size=8",
            f"steps={steps}", "threads=1", "progress=false", f"output_dir={out}", "async_rollout.enabled=true", *extra]


def _run(out, cache, steps, *extra):
    torch.set_num_threads(1)
    train(load_config(None, _overrides(out, cache, steps, *extra)))
    return load_checkpoint(find_resume_checkpoint(out / "checkpoints", "auto"))


def _drop(history, *prefixes):
    """The history without wall-clock metrics (and any other ``prefixes``)."""
    skip = ("time/", "throughput/", *prefixes)
    return [{k: v for k, v in h.items() if not k.startswith(skip)} for h in history]


# ------------------------------------------------------------------------------------------------- the rule


def test_bound_moves_the_right_way_on_a_scripted_d_hat_sequence():
    # s_min 1, s_max 5, eta_s 0.5, nu_max 1, nu_0 = nu_max (the run starts at s_min), c_s = 0.01
    auto = StalenessAutoConfig(min=1, max=5, lr=0.5, nu_max=1.0, constraint=0, tolerance=None)
    c = 0.01
    d_hat = [0.005, 0.005, 0.002, 0.015, 0.03, float("nan"), 0.0]
    # nu <- clip(nu + 0.5 (D - c) / c, 0, 1); s = 1 + floor(4 (1 - nu) + 0.5)
    #   D 0.005: (0.005 - 0.01) / 0.01 = -0.5 -> nu 1 - 0.25 = 0.75;   s = 1 + floor(1.0 + 0.5) = 2   (inside: rises)
    #   D 0.005: -0.5                        -> nu 0.5;                 s = 1 + floor(2.0 + 0.5) = 3
    #   D 0.002: -0.8                        -> nu 0.5 - 0.4 = 0.1;     s = 1 + floor(3.6 + 0.5) = 5
    #   D 0.015: +0.5                        -> nu 0.1 + 0.25 = 0.35;   s = 1 + floor(2.6 + 0.5) = 4   (exceeds: falls)
    #   D 0.03:  +2                          -> nu 1.35, clipped to 1;  s = 1
    #   D nan:   skipped                     -> nu 1;                   s = 1
    #   D 0:     -1                          -> nu 0.5;                 s = 3
    expected_nu = [0.75, 0.5, 0.1, 0.35, 1.0, 1.0, 0.5]
    expected_bound = [2, 3, 5, 4, 1, 1, 3]
    state = with_staleness(DualState(lambda_C=torch.zeros(1, dtype=torch.float64)), auto)
    assert state.staleness == {"nu": 1.0} and bound_in_force(state, auto) == 1
    nus, bounds = [], []
    for d in d_hat:
        state, metrics = staleness_step(state, torch.tensor([d], dtype=torch.float64),
                                        torch.tensor([c], dtype=torch.float64), auto)
        nus.append(state.staleness["nu"])
        bounds.append(bound_in_force(state, auto))
        assert metrics["async/nu"] == nus[-1] and metrics["async/bound_next"] == bounds[-1]
        assert metrics["async/staleness_tolerance"] == c
    assert nus == pytest.approx(expected_nu, rel=1e-12, abs=1e-15)
    assert bounds == expected_bound
    assert state.lambda_C.tolist() == [0.0]  # the lambda rule is untouched


def test_rule_pieces_by_hand():
    auto = StalenessAutoConfig(min=0, max=8, lr=1.0, nu_max=2.0)
    # s = floor(8 (1 - nu / 2) + 0.5): nu 0 -> 8, 2 -> 0, 1 -> 4, 0.125 -> floor(7.5 + 0.5) = 8 (half rounds up)
    assert [staleness_bound(nu, auto) for nu in (0.0, 2.0, 1.0, 0.125, 0.375)] == [8, 0, 4, 8, 7]
    # an explicit c_s overrides the constraint's tolerance; constraint 1 of two is the one bounded
    auto2 = StalenessAutoConfig(min=0, max=4, lr=0.1, nu_max=1.0, nu_init=0.5, constraint=1, tolerance=0.02)
    state = with_staleness(DualState(lambda_C=torch.zeros(2, dtype=torch.float64)), auto2)
    state, m = staleness_step(state, torch.tensor([9.0, 0.03], dtype=torch.float64),
                              torch.tensor([1.0, 1.0], dtype=torch.float64), auto2)
    # nu = 0.5 + 0.1 (0.03 - 0.02) / 0.02 = 0.55; s = floor(4 * 0.45 + 0.5) = floor(2.3) = 2
    assert state.staleness["nu"] == pytest.approx(0.55, rel=1e-12)
    assert m["async/bound_next"] == 2 and m["async/staleness_tolerance"] == 0.02
    assert staleness_nu_step(0.3, float("inf"), 0.01, auto) == 0.3


def test_min_equal_max_holds_the_bound_whatever_d_hat():
    auto = StalenessAutoConfig(min=3, max=3, lr=1.0)
    state = with_staleness(DualState(lambda_C=torch.zeros(1, dtype=torch.float64)), auto)
    for d in (0.0, 1.0, 1e-9, 5.0):
        state, _ = staleness_step(state, torch.tensor([d]), torch.tensor([0.01]), auto)
        assert bound_in_force(state, auto) == 3


def test_bounded_version_is_the_first_version_whose_bound_reaches_the_batch():
    # bounds published: v0 -> 3, v1 -> 0, v2 -> 0, v3 -> 2: v0 samples batches 0..3, v3 (3 + 2 = 5) batches 4 and 5,
    # and no published bound reaches batch 6 yet
    bounds = {0: 3, 1: 0, 2: 0, 3: 2}
    assert [bounded_version(k, bounds) for k in range(7)] == [0, 0, 0, 0, 3, 3, None]
    # a constant bound s is the fixed lag max(k0, k - s)
    const = {v: 2 for v in range(4, 20)}
    assert [bounded_version(k, const) for k in range(4, 12)] == [max(4, k - 2) for k in range(4, 12)]


def test_staleness_state_round_trips_and_older_states_load():
    auto = StalenessAutoConfig(min=0, max=4, nu_init=0.25)
    cfg = load_config(None, [])
    state = with_staleness(init_state(cfg.dual), auto)
    back = DualState.from_state_dict(state.state_dict())
    assert back.staleness == {"nu": 0.25} and bound_in_force(back, auto) == bound_in_force(state, auto) == 3
    old = state.state_dict()
    del old["staleness"]  # a checkpoint written before the controller existed
    loaded = DualState.from_state_dict(old)
    assert loaded.staleness is None and torch.equal(loaded.lambda_C, state.lambda_C)
    assert with_staleness(loaded, auto).staleness == {"nu": 0.25}
    assert DualState.from_state_dict(init_state(cfg.dual).state_dict()).staleness is None


# ------------------------------------------------------------------------------------------ forced staleness


def test_schedule_phases_by_hand():
    cfg = AsyncRolloutConfig(enabled=True, max_staleness=8, forced="schedule", schedule=[
        StalenessPhase(until_step=50, staleness=0), StalenessPhase(until_step=150, staleness=8),
        StalenessPhase(staleness=2)])
    cfg.check()
    assert [scheduled_staleness(cfg, k) for k in (0, 49, 50, 149, 150, 10_000)] == [0, 0, 8, 8, 2, 2]


def test_heavy_tailed_pmfs_in_closed_form():
    # power law a = 1, S = 2: (1, 1/2, 1/3) / (11/6) = (6/11, 3/11, 2/11)
    pl = AsyncRolloutConfig(enabled=True, max_staleness=2, forced="power_law", power_law=PowerLawConfig(exponent=1.0))
    assert staleness_pmf(pl) == pytest.approx([6 / 11, 3 / 11, 2 / 11], rel=1e-15)
    # geometric p = 1/2, S = 2: (1/2, 1/4, 1/8) / (7/8) = (4/7, 2/7, 1/7)
    geo = AsyncRolloutConfig(enabled=True, max_staleness=2, forced="geometric", geometric=GeometricConfig(p=0.5))
    assert staleness_pmf(geo) == pytest.approx([4 / 7, 2 / 7, 1 / 7], rel=1e-15)


@pytest.mark.parametrize("forced", ["power_law", "geometric"])
def test_draws_follow_the_closed_form_and_are_seeded(forced):
    cfg = AsyncRolloutConfig(enabled=True, max_staleness=8, forced=forced)
    pmf = np.asarray(staleness_pmf(cfg))
    n = 20_000
    draws = np.array([draw_staleness(pmf.tolist(), 7, k) for k in range(n)])
    assert draws.min() >= 0 and draws.max() <= 8
    freq = np.bincount(draws, minlength=9) / n
    # every frequency within 4 binomial standard deviations sqrt(p (1 - p) / n) of its probability
    # (a false alarm has probability < 9 * 6.4e-5 for a correct sampler)
    sd = np.sqrt(pmf * (1 - pmf) / n)
    assert np.all(np.abs(freq - pmf) <= 4 * sd), (freq, pmf)
    # seeded per (seed, step): the same draws again, other draws under another seed
    assert [draw_staleness(pmf.tolist(), 7, k) for k in range(200)] == draws[:200].tolist()
    assert [draw_staleness(pmf.tolist(), 8, k) for k in range(200)] != draws[:200].tolist()


def test_staleness_histogram_counts_every_value_up_to_the_cap():
    h = staleness_histogram(torch.tensor([10, 10, 9, 7]), step=10, cap=3)
    assert h == {"async/staleness_count/0": 2.0, "async/staleness_count/1": 1.0, "async/staleness_count/2": 0.0,
                 "async/staleness_count/3": 1.0}


# --------------------------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("overrides, match", [
    (["async_rollout.max_staleness=auto", "async_rollout.auto.min=3", "async_rollout.auto.max=1"],
     r"async_rollout\.auto': the range needs min <= max"),
    (["async_rollout.max_staleness=auto", "async_rollout.auto.min=-1"], r"async_rollout\.auto\.min"),
    (["async_rollout.max_staleness=sometimes"], r"async_rollout\.max_staleness.*integer >= 0 or auto"),
    (["async_rollout.max_staleness=auto", "async_rollout.auto.nu_init=2"], r"async_rollout\.auto\.nu_init"),
    (["async_rollout.max_staleness=auto", "async_rollout.auto.constraint=3"], r"async_rollout\.auto\.constraint"),
    (["async_rollout.max_staleness=auto", "async_rollout.too_stale=skip"], r"async_rollout\.too_stale"),
    (["async_rollout.max_staleness=auto", "async_rollout.forced=power_law"], r"async_rollout\.forced.*not auto"),
    (["async_rollout.max_staleness=4", "async_rollout.forced=schedule"], r"schedule.*at least one phase"),
    (["async_rollout.max_staleness=4", "async_rollout.forced=schedule",
      "async_rollout.schedule=[{until_step: 5, staleness: 1}]"], r"schedule\[0\]\.until_step.*last phase"),
    (["async_rollout.max_staleness=4", "async_rollout.forced=schedule",
      "async_rollout.schedule=[{until_step: 5, staleness: 1}, {until_step: 3, staleness: 1}, {staleness: 0}]"],
     r"schedule\[1\]\.until_step.*> the previous"),
    (["async_rollout.max_staleness=4", "async_rollout.forced=schedule",
      "async_rollout.schedule=[{until_step: 5, staleness: 6}, {staleness: 0}]"], r"schedule\[0\]\.staleness"),
    (["async_rollout.max_staleness=4", "async_rollout.schedule=[{staleness: 1}]"], r"set async_rollout\.forced"),
    (["async_rollout.max_staleness=4", "async_rollout.forced=geometric", "async_rollout.geometric.p=0"],
     r"geometric\.p"),
    (["async_rollout.max_staleness=4", "async_rollout.forced=schedule",
      "async_rollout.schedule=[{stalenes: 1}]"], r"did you mean 'staleness'"),
])
def test_bad_staleness_configs_raise_with_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["async_rollout.enabled=true", *overrides])


def test_bad_range_exits_2_from_the_command_line(capsys):
    code = main(["train", str(REPO / "configs" / "default.yaml"), "async_rollout.enabled=true", "async_rollout.max_staleness=auto",
                 "async_rollout.auto.min=4", "async_rollout.auto.max=2"])
    assert code == 2
    assert "async_rollout.auto" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"async_rollout\.max_staleness.*enabled=true"):
        load_config(None, ["async_rollout.max_staleness=auto"])


# ------------------------------------------------------------------------------------------------------ runs


def test_auto_with_min_equal_max_is_the_fixed_bound_bit_for_bit(tmp_path):
    cache = tmp_path / "cache"
    fixed = _run(tmp_path / "fixed", cache, 8, "async_rollout.max_staleness=2", "checkpoint.every=5")["history"]
    auto = _run(tmp_path / "auto", cache, 8, "async_rollout.max_staleness=auto", "async_rollout.auto.min=2",
                "async_rollout.auto.max=2", "checkpoint.every=5")["history"]
    assert [h["async/staleness_max"] for h in fixed] == [0, 1, 2, 2, 2, 0, 1, 2]
    assert all(h["async/bound"] == 2 and h["async/bound_next"] == 2 for h in auto)
    assert _drop(auto, *AUTO_ONLY) == _drop(fixed)
    assert any(h["async/nu"] != auto[0]["async/nu"] for h in auto)  # nu moved; the bound could not


def test_auto_bound_moves_with_d_hat_and_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    # c_s inside the range of this run's D-hat (about 5e-6 to 7e-6 here), a large step: the bound moves both ways
    c_s, lr = 6e-6, 3.0
    on = ("async_rollout.max_staleness=auto", "async_rollout.auto.min=0", "async_rollout.auto.max=3",
          "async_rollout.auto.nu_init=0.5", f"async_rollout.auto.lr={lr}", f"async_rollout.auto.tolerance={c_s}",
          "dual.measure_at=updates", "checkpoint.every=4")
    full = _run(tmp_path / "full", cache, 10, *on)
    h = full["history"]
    # nu by the rule from the logged D-hat, in float64; s = floor(3 (1 - nu) + 0.5); nu_0 = 0.5 -> s_0 = 2
    nu, bound = 0.5, 2
    for x in h:
        d = x["dual/measured/abs_prob_diff"]
        assert x["async/bound"] == bound and x["async/staleness_max"] <= bound
        nu = nu if not math.isfinite(d) else min(max(nu + lr * (d - c_s) / c_s, 0.0), 1.0)
        assert x["async/nu"] == pytest.approx(nu, rel=1e-12, abs=1e-15)
        new_bound = math.floor(3 * (1 - nu) + 0.5)
        assert x["async/bound_next"] == new_bound
        # the right way: up (or held at max) inside c_s, down (or held at min) beyond it
        assert new_bound >= bound if d < c_s else new_bound <= bound
        bound = new_bound
    assert len({x["async/bound"] for x in h}) > 1, "the bound never moved: the test no longer exercises the rule"
    assert full["dual"]["staleness"]["nu"] == pytest.approx(nu, rel=1e-12, abs=1e-15)
    # stop at a checkpoint (step 8) and resume: the continuation is the uninterrupted run, bitwise
    part = tmp_path / "part"
    _run(part, cache, 8, *on)
    resumed = _run(part, cache, 10, *on, "checkpoint.resume=auto")
    assert _drop(resumed["history"]) == _drop(h)
    assert resumed["dual"] == full["dual"]


@pytest.mark.parametrize("too_stale", ["wait", "drop"])
def test_too_stale_batches_wait_or_drop(tmp_path, too_stale):
    # nu_0 = 0: bound 3, so the worker samples batches 0..3 with version 0; the first D-hat exceeds c_s = 1e-9 by
    # far, nu jumps to nu_max and the bound falls to 0, leaving batches 1, 2, 3 staler than the bound
    h = _run(tmp_path / too_stale, tmp_path / "cache", 6, "async_rollout.max_staleness=auto",
             "async_rollout.auto.min=0", "async_rollout.auto.max=3", "async_rollout.auto.nu_init=0",
             "async_rollout.auto.tolerance=1e-9", f"async_rollout.too_stale={too_stale}")["history"]
    assert [x["async/bound"] for x in h] == [3, 0, 0, 0, 0, 0]
    assert [x["async/too_stale"] for x in h] == [0, 1, 1, 1, 0, 0]
    if too_stale == "wait":
        # sampled again with the trainer's weights: every batch trained on is fresh, every step updates
        assert [x["async/resampled"] for x in h] == [0, 1, 1, 1, 0, 0]
        assert all(x["async/staleness_max"] == 0 and x["async/dropped_batches"] == 0 for x in h)
        assert all(x["guard/skipped_step"] == 0 for x in h)
    else:
        assert [x["async/dropped_batches"] for x in h] == [0, 1, 1, 1, 0, 0]
        assert [x["async/staleness_max"] for x in h] == [0, 1, 2, 3, 0, 0]
        assert [x["async/dropped"] for x in h] == [0, 8, 8, 8, 0, 0]
        # the dropped steps train on nothing and leave lambda and nu, but are not bad steps for the guard
        assert [x["guard/skipped_step"] for x in h] == [0, 1, 1, 1, 0, 0]
        assert all(x["guard/bad_step"] == 0 for x in h)
        lam = [x["dual/lambda/abs_prob_diff"] for x in h]
        assert lam[1] == lam[2] == lam[3] == lam[0] and [x["async/nu"] for x in h[1:4]] == [1.0] * 3
    # every emitted name is documented
    pats = documented_patterns()
    missing = sorted({k for x in h for k in x if not any(p.match(k) for p in pats)})
    assert not missing, f"metrics emitted but not in docs/metrics.md: {missing}"


def test_forced_schedule_and_draws_set_the_staleness(tmp_path):
    cache = tmp_path / "cache"
    h = _run(tmp_path / "schedule", cache, 8, "async_rollout.max_staleness=2", "async_rollout.forced=schedule",
             "async_rollout.schedule=[{until_step: 3, staleness: 0}, {until_step: 6, staleness: 2}, {staleness: 1}]"
             )["history"]
    assert [x["async/staleness_forced"] for x in h] == [0, 0, 0, 2, 2, 2, 1, 1]
    assert [x["async/staleness_max"] for x in h] == [0, 0, 0, 2, 2, 2, 1, 1]
    # drawn: staleness s_k = min(draw, k) from a start at 0; versions k - s_k jump back and forth, so the worker
    # must keep older snapshots; a resumed run repeats the draws and the run
    on = ("async_rollout.max_staleness=3", "async_rollout.forced=power_law", "async_rollout.power_law.exponent=0.5",
          "checkpoint.every=5")
    full = _run(tmp_path / "drawn", cache, 9, *on)["history"]
    cfg = load_config(None, _overrides(tmp_path, cache, 9, *on))
    pmf = staleness_pmf(cfg.async_rollout)
    draws = [draw_staleness(pmf, cfg.seed, k) for k in range(9)]
    assert [x["async/staleness_forced"] for x in full] == draws
    assert [x["async/staleness_max"] for x in full] == [min(s, k if k < 5 else k - 5) for k, s in enumerate(draws)]
    assert len(set(draws)) > 1
    part = tmp_path / "part"
    _run(part, cache, 5, *on)
    assert _drop(_run(part, cache, 9, *on, "checkpoint.resume=auto")["history"]) == _drop(full)
