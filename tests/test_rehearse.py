"""``dcmdp check --rehearse`` (``dcmdp.rehearse``): one step of the tiny recipe on fake tensors, its traced peak by
phase beside the plan's, and the rollout digest's memory caught by the trace when the old whole-field int64 widening
is put back."""

import importlib.util
import re

import pytest

from dcmdp import distributed, rehearse
from dcmdp.check import find_problems, not_here
from dcmdp.cli import main
from dcmdp.config import load_config
from dcmdp.memplan import GIB, PROMPT_TOKENS, model_shapes
from tests.test_memory_plan import TORCHRUN_8
from tests.test_memory_routes import widened_checksum

# A rollout batch of 8 rows keeps the step within seconds on a loaded 2-core machine.
SMALL = ["algo.prompts_per_step=2", "algo.samples_per_prompt=4", "algo.minibatches=2"]
# Relative gap allowed between a figure extrapolated over the rows and the same figure traced whole.
ROWS_FIT_TOL = 0.02


def test_rehearse_tiny_dense_traces_every_phase_beside_the_plan(capsys, tmp_path):
    code = main(["check", "configs/default.yaml", "--gpus", "1", "--gpu-memory", "80", "--rehearse",
                 "model.preset=tiny-dense", f"output_dir={tmp_path / 'run'}", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    # phase -> (traced GiB, plan GiB): "  update  0.054  0.054  0.043"
    rows = {m.group(1): (float(m.group(2)), float(m.group(4)))
            for m in re.finditer(r"^  (\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
    assert set(rehearse.PHASES) <= set(rows), out
    total = re.search(r"^  total \(peak\)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    traced_gib, plan_gib = float(total.group(1)), float(total.group(2))
    cfg = load_config("configs/default.yaml", ["model.preset=tiny-dense"], check=False)
    param_gib = model_shapes(cfg).params * 4 / 2 ** 30  # float32 parameters (optim.precision=fp32)
    assert traced_gib > param_gib
    assert traced_gib == max(rows[p][0] for p in rehearse.PHASES)  # the step's peak is its largest phase's
    assert plan_gib > 0
    assert "largest tensors at the peak" in out and "roofline time (an estimate" in out
    assert "not traced, and why" in out


def test_rehearsal_sees_the_old_int64_widening_of_the_rollout_digest(monkeypatch):
    # the digest runs in SpmdEngine.generate: vLLM under torchrun, here world 2 on a fake process group, with the
    # tiny MoE's routes as the engine reports them
    cfg = load_config("configs/default.yaml", ["rollout.engine=vllm", "rollout.precision=bf16", *SMALL], check=False)
    gpu = rehearse.gpu_for(80)

    def rollout_peak() -> int:
        return rehearse.rehearse_step(cfg, 2, gpu, 2, prompt_tokens=64).phase_peak["rollout"]

    chunked = rollout_peak()
    monkeypatch.setattr(distributed, "field_checksum", widened_checksum)
    widened = rollout_peak()
    # routes: 8 rows x (64 + 8) positions x 2 layers x top-2, int8 for 8 experts. The widened checksum holds three
    # whole-field int64 tensors at once (the index i, the weights w, the widened x, then their product), the chunked
    # one a single int64 w (the field is under one chunk): at least 2 x 8 B per route element more
    route_elements = 8 * (64 + 8) * 2 * 2
    assert widened - chunked >= 2 * 8 * route_elements


def test_rows_fit_matches_the_step_traced_whole():
    # 4 mini-batches of 4 rows (16 rows, one micro-batch each): traced whole, and extrapolated from 2 mini-batches of
    # 2 and 3 rows per rank, as the recipes are; the fit is affine in the step's rows, so the two agree
    cfg = load_config("configs/default.yaml", ["model.preset=tiny-dense", "algo.prompts_per_step=4",
                                               "algo.samples_per_prompt=4", "algo.minibatches=4"], check=False)
    gpu = rehearse.gpu_for(80)
    whole = rehearse.rehearse_step(cfg, 1, gpu, model_shapes(cfg).layers, prompt_tokens=64)
    fitted = rehearse.rehearse(cfg, 1, gpu, prompt_tokens=64)
    assert fitted.reduced_rows == rehearse.ROWS and fitted.reduced_minibatches == 2 and fitted.rows == 16
    assert all(t.layers == model_shapes(cfg).layers for t in fitted.traces)
    peak, _, ms = rehearse._fold(whole.phase_peak, whole.phase_snap, whole.phase_ms)
    for p in rehearse.PHASES:
        assert abs(fitted.phase_peak[p] - peak[p]) <= ROWS_FIT_TOL * peak[p], p
    # the time: every micro-batch's forward and backward, and four optimiser steps from the two traced
    for p in ("old_logp", "update", "optimiser"):
        assert abs(fitted.phase_ms[p] - ms[p]) <= ROWS_FIT_TOL * ms[p], p


def test_a_rehearsal_notes_the_files_and_packages_of_the_launch_machine_and_goes_on():
    # the 8B recipe names its weights, task files and vLLM, none of which is on this machine
    problems = find_problems("configs/qwen3-8b.yaml", ["algo.minibatches=3"])
    stop, elsewhere = not_here("configs/qwen3-8b.yaml", ["algo.minibatches=3"], problems)
    # vLLM is noted only where it is not installed (CI installs it with the test set-up; a plain `make setup` does not)
    engine = set() if importlib.util.find_spec("vllm") is not None else {"rollout.engine"}
    assert {p.key for p in elsewhere} == ({"task.path", "task.eval_path", "model.path"} | engine) - {
        p.key for p in stop}
    assert [p.key for p in stop] == ["algo.minibatches"]  # 3 mini-batches do not divide 512 rows: still refused


@pytest.mark.slow  # two rehearsals of the 30B recipe on 8 x 80 GB: minutes each on two loaded cores
def test_the_30b_rehearsal_sees_the_old_int64_widening_of_the_rollout_digest(monkeypatch):
    cfg = load_config("configs/qwen3-30b-a3b.yaml", TORCHRUN_8, check=False)
    gpu = rehearse.gpu_for(80)
    chunked = rehearse.rehearse(cfg, 8, gpu, prompt_tokens=PROMPT_TOKENS)
    assert chunked.reduced_rows
    # the chunked digest: the rollout phase (where the digest runs) holds the parameters, the routes and one chunk
    assert chunked.phase_peak["rollout"] < 20 * GIB
    monkeypatch.setattr(distributed, "field_checksum", widened_checksum)
    widened = rehearse.rehearse(cfg, 8, gpu, prompt_tokens=PROMPT_TOKENS)
    # the batch's routes: 512 rows x (512 + 8192) positions x 48 layers x top-8, int8; the widened checksum holds at
    # least two whole-field int64 copies of them at once, extrapolated from the reduced runs' rows and depths
    routes = 512 * (PROMPT_TOKENS + 8192) * 48 * 8
    assert widened.phase_peak["rollout"] - chunked.phase_peak["rollout"] >= 2 * 8 * routes  # >= 25.5 GiB
