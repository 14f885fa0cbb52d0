"""benchmarks/gpu_check.py's dry run (every GPU step wired, recorded as skipped) and benchmarks/lm_head.py --smoke."""

import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_dry_run_wires_every_step_and_writes_the_folder(tmp_path):
    check = _load("gpu_check")
    outcomes = check.main(["--dry-run", "--out", str(tmp_path)])
    assert [o.name for o in outcomes] == [s.name for s in check.steps(tmp_path)]
    vllm_missing = importlib.util.find_spec("vllm") is None
    for o in outcomes:
        if o.name == "vllm" and vllm_missing:
            assert o.status == "skipped: vllm not installed"
            continue
        why = "dry run" if torch.cuda.is_available() else "no CUDA"
        assert o.status.startswith(f"skipped: {why} (") and "NOT WIRED" not in o.status, o.status
        assert (tmp_path / o.log).read_text().startswith("$ ")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == [o.name for o in outcomes]
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["python"].startswith(sys.version.split()[0])
    assert "| mfu |" in (tmp_path / "summary.md").read_text()


def test_a_step_whose_script_refuses_its_arguments_is_reported_not_wired(tmp_path):
    check = _load("gpu_check")
    step = check.Step("mfu", "", script="benchmarks/mfu_gpu.py", args=["--heads", "fp64"])
    try:
        step.wiring()
    except ValueError as exc:
        assert "invalid choice: 'fp64'" in str(exc)
    else:
        raise AssertionError("an unknown head was accepted")


def test_lm_head_smoke_orders_the_heads_by_accuracy(tmp_path):
    bench = _load("lm_head")
    rows = bench.main(["--smoke", "--out", str(tmp_path / "lm_head.md")])
    err = {(r["setting"], r["head"]): r["max_abs_dlogp"] for r in rows}
    for setting in bench.SETTINGS:
        # float32 heads within float32 rounding of the float64 head; bf16x3 within 2^-17 operand splits; bf16 logits
        # at bf16 rounding of the logits
        assert err[setting, "fp32 logits"] < 2e-5 and err[setting, "chunked"] < 2e-5
        assert err[setting, "bf16x3"] < 2e-4
        assert err[setting, "bf16 logits"] > 1e-2
    saved = json.loads((tmp_path / "lm_head.json").read_text())
    assert saved["rows"] == rows
    assert "| bf16 weights | bf16x3 |" in (tmp_path / "lm_head.md").read_text()
