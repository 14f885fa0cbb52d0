"""``dcmdp check --rehearse`` (``dcmdp.rehearse``): one step of the tiny recipe on fake tensors, its traced peak by
phase beside the plan's, and the rollout digest's memory caught by the trace when the old whole-field int64 widening
is put back."""

import re

from dcmdp import distributed, rehearse
from dcmdp.cli import main
from dcmdp.config import load_config
from dcmdp.memplan import model_shapes
from tests.test_memory_routes import widened_checksum

# A rollout batch of 8 rows keeps the step within seconds on a loaded 2-core machine.
SMALL = ["algo.prompts_per_step=2", "algo.samples_per_prompt=4", "algo.minibatches=2"]


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
