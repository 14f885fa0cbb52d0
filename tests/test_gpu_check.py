"""benchmarks/gpu_check.py's dry run (every GPU step wired, recorded as skipped) and benchmarks/lm_head.py --smoke."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_the_train_step_checks_every_runs_config_in_its_dry_run(tmp_path, capsys):
    train = _load("gpu_train")
    doc = train.main(["--dry-run", "--out", str(tmp_path)])
    assert doc["dry_run"] and [line.split(":")[0] for line in doc["checked"]] == [
        "qwen3_8b", "qwen3_30b_a3b", "stress_cuda", "stress_cpu", "stress_nccl"]
    assert "qwen3-8b, 3 steps, device=cuda" in doc["checked"][0]


@pytest.mark.slow  # the train step's dry run checks every run's config by default
def test_the_train_steps_recipe_runs_train_on_the_cpu_at_tiny_size_and_fill_the_page(tmp_path):
    """The 30B recipe's settings as the GPU check runs them (random init, R3 with gradient checkpointing, the engine
    on the trainer's bf16 weights, the bf16x3 head, bf16 stochastic-rounding AdamW), shrunk to tiny-moe on the CPU:
    the run trains without the packages the device image lacks, and the page reads its per-phase times back."""
    # as on the device image: no mlflow, cvxpy, optuna, vllm or math_verify (imported, they fail)
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'mlflow', 'cvxpy', 'optuna', 'vllm', 'math_verify'}:\n"
        "            raise ModuleNotFoundError(f'{name} is not installed on the device image')\n"
        "sys.meta_path.insert(0, _Block())\n")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_train.py"), "--cpu-smoke", "--only",
                           "qwen3_30b_a3b", "--out", str(tmp_path), "--work", str(tmp_path / "w")],
                          env={**os.environ, "PYTHONPATH": str(block), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads((tmp_path / "train.json").read_text())
    (run,) = doc["runs"]
    assert run["status"] == "ok", run["log_tail"]
    assert len(run["steps"]) == 2
    assert all(s["routing/mismatch"] == 0.0 for s in run["steps"])  # R3 on shared weights: the same routes
    phases = run["phases_s"]
    assert 0 < phases["optimizer"] <= phases["update"] <= phases["step"]
    assert run["params_active"] > 0 and run["mfu_step"] is None  # no GPU peak measured on the CPU
    assert "| qwen3_30b_a3b | ok | 2 |" in (tmp_path / "train.md").read_text()


def test_mfu_counts_the_active_parameters_of_the_recipes():
    train = _load("gpu_train")
    # Qwen3-8B: 36 layers x (attention 4096 x 128 x (2 x 32 + 2 x 8) + MLP 3 x 4096 x 12288) + head 151936 x 4096
    dense = 36 * (4096 * 128 * 80 + 3 * 4096 * 12288) + 151936 * 4096
    assert train.matmul_params_per_token("qwen3-8b", None, 100) == dense
    assert 7.5e9 < dense < 7.6e9  # of the 8.19 B parameters, the embedding's 0.62 B are no matmul
    # Qwen3-30B-A3B at 6 layers: 8 of 128 experts of 3 x 2048 x 768, the router 2048 x 128
    moe = 6 * (2048 * 128 * (2 * 32 + 2 * 4) + 8 * 3 * 2048 * 768 + 2048 * 128) + 151936 * 2048
    assert train.matmul_params_per_token("qwen3-30b-a3b", 6, 100) == moe
