"""benchmarks/gpu_check.py's dry run (every GPU step wired, recorded as skipped), its parts' budgets, its comparisons,
and the CPU runs of the code the GPU steps run (benchmarks/speed.py --tiny, benchmarks/lm_head.py --smoke)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# the steps the check took before its steps became data: the train step's five runs, then the other six
STEPS = ["stress_cuda", "stress_cpu", "stress_nccl", "device", "qwen3_8b", "qwen3_30b_a3b", "speed", "lm_head", "mfu",
         "fp8_gemm", "vllm"]
DEVICE_CALL_S = 280  # one device call: the part's steps, the wheels and the start of the runner


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_dry_run_wires_every_step_and_writes_the_page(tmp_path):
    check = _load("gpu_check")
    outcomes = check.main(["--dry-run", "--out", str(tmp_path)])
    assert [o.name for o in outcomes] == STEPS
    vllm_missing = importlib.util.find_spec("vllm") is None
    why = "dry run" if torch.cuda.is_available() else "no CUDA"
    for o in outcomes:
        if o.name == "vllm" and vllm_missing:
            assert o.status == "skipped: vllm not installed"
            continue
        assert o.status.startswith(f"skipped: {why} (") and "NOT WIRED" not in o.status, o.status
        assert (tmp_path / o.log).read_text().startswith("$ ")
    by_name = {o.name: o.status for o in outcomes}
    assert "qwen3-8b, 3 steps, device=cuda" in by_name["qwen3_8b"]
    assert "qwen3-30b-a3b, 3 steps, device=cuda" in by_name["qwen3_30b_a3b"]
    assert "cold start" in by_name["stress_cuda"]  # carried or not, the dry run says which
    for part in (1, 2, 3):
        doc = json.loads((tmp_path / f"part{part}.json").read_text())
        assert doc["env"]["torch"] == torch.__version__ and doc["steps"]
    page = (tmp_path / "summary.md").read_text()
    assert page.count("## Part ") == 3 and "| mfu |" in page and "| stress_nccl |" in page


def test_the_parts_run_cheap_verdicts_first_and_each_fits_a_device_call():
    check = _load("gpu_check")
    steps, spec = check.load_steps()
    assert [s.name for s in steps if s.part == 1] == ["stress_cuda", "stress_cpu", "stress_nccl", "device"]
    assert [s.name for s in steps if s.part == 2] == ["qwen3_8b", "qwen3_30b_a3b", "speed"]
    for part, p in spec["parts"].items():
        limits = sum(s.limit_s for s in steps if s.part == part)
        assert limits <= p["budget_s"] <= DEVICE_CALL_S - 25, (part, limits)
    # the stress runs train no cold start on the GPU: they load the one --prepare trained on the CPU
    out = Path("/tmp/x")
    for s in steps[:3]:
        cmd = s.command(out, spec)
        assert f"model.path={check.cold_start_dir()}" in cmd and "cold_start.steps=1500" in cmd


def test_a_step_file_with_a_bad_step_is_refused(tmp_path):
    check = _load("gpu_check")
    path = tmp_path / "steps.yaml"
    path.write_text("parts: {1: {budget_s: 10, about: a}}\nsteps:\n"
                    "  - {name: x, part: 1, about: b, limit_s: 5, script: benchmarks/speed.py, tests: tests/t.py}\n")
    with pytest.raises(ValueError, match="kinds \\['script', 'tests'\\]"):
        check.load_steps(path)
    path.write_text("parts: {1: {budget_s: 10, about: a}}\nsteps:\n"
                    "  - {name: x, part: 2, about: b, limit_s: 5, script: benchmarks/speed.py}\n")
    with pytest.raises(ValueError, match="part 2"):
        check.load_steps(path)


def test_a_step_whose_script_refuses_its_arguments_is_reported_not_wired(tmp_path):
    check = _load("gpu_check")
    step = check.Step("mfu", 3, "", 10, script="benchmarks/speed.py", args=["--heads", "fp64"])
    with pytest.raises(ValueError, match="invalid choice: 'fp64'"):
        step.wiring(tmp_path, {})


def test_devices_agree_by_welch_or_within_the_band_and_same_runs_to_rounding():
    check = _load("gpu_check")
    block = {"kind": "devices", "a": "gpu", "b": "cpu", "steps": 3, "alpha": 0.01,
             "metrics": [["reward/mean", "abs", 0.05], ["policy/entropy", "rel", 0.1]]}
    gpu = [{"reward/mean": r, "policy/entropy": 1.0 + e} for r, e in ((0.50, 0.0), (0.60, 0.01), (0.40, -0.01))]
    # rewards 0.2 apart in the mean, sd 0.1 on each side: t = 0.2 / sqrt(2 x 0.01 / 3) = 2.45 on 4 degrees of freedom,
    # Welch p = 0.07 > 0.01;
    # entropies 1.0 against 2.0 with a spread of 0.01: far outside both the band and the noise
    cpu = [{"reward/mean": r, "policy/entropy": 2.0 + e} for r, e in ((0.70, 0.0), (0.80, 0.01), (0.60, -0.01))]
    reward, entropy = check.compare(block, {"gpu": gpu, "cpu": cpu})
    assert reward["ok"] and 0.05 < reward["welch_p"] < 0.2 and abs(reward["b"] - reward["a"] - 0.2) < 1e-12
    assert not entropy["ok"] and entropy["welch_p"] < 1e-4
    # within the band, whatever the test says (three identical steps on each side have no spread)
    near = [{"reward/mean": 0.5, "policy/entropy": 1.05}] * 3
    assert all(r["ok"] for r in check.compare(block, {"gpu": gpu, "cpu": near}))
    same = {"kind": "same", "a": "gpu", "b": "cpu", "steps": 2, "atol": 1e-6, "rtol": 1e-2, "metrics": ["reward/mean"]}
    rows = check.compare(same, {"gpu": gpu, "cpu": [{"reward/mean": 0.5049}, {"reward/mean": 0.62}]})
    assert [r["ok"] for r in rows] == [True, False]  # 0.0049 <= 1e-6 + 0.005; 0.02 > 1e-6 + 0.006
    assert check.compare(same, {"gpu": gpu, "cpu": []}) == [{"metric": "no common step", "ok": False}]


def test_mfu_counts_the_active_parameters_of_the_recipes():
    speed = _load("speed")
    from trainers.models import get_preset

    # Qwen3-8B: 36 layers x (attention 4096 x 128 x (2 x 32 + 2 x 8) + MLP 3 x 4096 x 12288) + head 151936 x 4096
    dense = 36 * (4096 * 128 * 80 + 3 * 4096 * 12288) + 151936 * 4096
    assert sum(speed.active_matmul_params(get_preset("qwen3-8b").make_config(100))) == dense
    assert 7.5e9 < dense < 7.6e9  # of the 8.19 B parameters, the embedding's 0.62 B are no matmul
    # Qwen3-30B-A3B at 6 layers: 8 of 128 experts of 3 x 2048 x 768, the router 2048 x 128
    moe = 6 * (2048 * 128 * (2 * 32 + 2 * 4) + 8 * 3 * 2048 * 768 + 2048 * 128) + 151936 * 2048
    assert sum(speed.active_matmul_params(get_preset("qwen3-30b-a3b").make_config(100), 6)) == moe


def test_the_mfu_part_on_the_cpu_matches_the_flop_formula_and_the_counter(tmp_path):
    speed = _load("speed")
    # tiny shape: hidden 64, 2 layers, 2 query heads / 1 KV head of dim 32, MLP 192, vocab 512 (tied head).
    # N_body per layer = q 64*64 + k 64*32 + v 64*32 + o 64*64 + 3 * 64*192 = 49152, x 2 layers = 98304;
    # N_head = 512*64 = 32768. B = 2, S = 32: 6*2*(32*98304 + 31*32768) = 49938432 matmul FLOPs,
    # attention 12 * L 2 * H 2 * Q 32 * B 2 * S^2 1024 = 3145728; total 53084160.
    result = speed.main(["--device", "cpu", "--tiny", "--parts", "mfu", "--repeats", "2", "--out", str(tmp_path)])
    assert result["errors"] == {}
    (row,) = result["mfu"]
    assert (row["n_body"], row["n_head"]) == (98304, 32768) and row["flops_per_step"] == 53084160.0
    # FlopCounterMode counts every matmul and the attention of one real step: the formula is exact here
    assert abs(row["counted_flops"] / row["flops_per_step"] - 1.0) < 1e-6
    for head in ("bf16", "fp32", "bf16x3"):
        m = row[head]
        assert abs(m["tokens_per_s"] * m["step_s"] - 2 * 32) < 1e-6
        assert abs(m["mfu"] - m["tflops"] / row["peak_tflops"]) < 1e-12
    assert json.loads((tmp_path / "speed.json").read_text())["mfu"] == result["mfu"]
    if not torch.cuda.is_available():
        assert speed.main(["--out", str(tmp_path / "none")]) == {}  # device cuda without CUDA: nothing measured


@pytest.mark.slow  # the optimisers' compilation and the tiny models' steps: minutes on a loaded CPU
def test_the_speed_parts_run_on_the_cpu_at_tiny_shapes(tmp_path):
    speed = _load("speed")
    result = speed.main(["--device", "cpu", "--tiny", "--parts", "optimizer,training,decode", "--repeats", "2",
                         "--batch", "2", "--seq", "64", "--decode-prompts", "4", "--decode-tokens", "8", "--out",
                         str(tmp_path), "--budget-s", "1000"])
    assert result["errors"] == {}
    rel = result["optimizer"]["over_torch_fused"]
    assert rel["torch_fused"] == 1.0 and rel["dcmdp_stochastic"] > 0
    # the padded batch holds as many real tokens per row as the unpadded one, in a wider layout
    assert result["padded_batch"]["width_padded"] > result["padded_batch"]["real_tokens_per_row"]
    for key in ("padded_over_unpadded", "padded_masked_over_unpadded", "controller_share_of_step", "r3_over_none"):
        assert 0 < result[key] < 100, key
    assert set(result["decode"]) == {"dynamic", "static"}
    assert 0 < result["decode_fraction_of_bound"] == max(v["fraction_of_bound"] for v in result["decode"].values())


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


@pytest.mark.slow  # a cold start and two tiny runs through dcmdp train
def test_the_train_steps_run_on_the_cpu_at_tiny_size_and_fill_the_page(tmp_path):
    """The 30B recipe's settings as the check runs them (random init, R3 with gradient checkpointing, the engine on
    the trainer's bf16 weights, the bf16x3 head, bf16 stochastic-rounding AdamW), shrunk to tiny-moe on the CPU: the
    run trains without the packages the device image lacks, and the page reads its per-phase times back. --prepare
    trains the stress cold start into the cache the device call carries."""
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
    env = {**os.environ, "PYTHONPATH": str(block), "OMP_NUM_THREADS": "1", "DCMDP_GPU_CHECK_CACHE": str(tmp_path / "c")}
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    done = subprocess.run([sys.executable, script, "--cpu-smoke", "--part", "2", "--only", "qwen3_30b_a3b", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (step,) = json.loads((tmp_path / "part2.json").read_text())["steps"]
    assert step["status"] == "ok", step["tail"]
    run = step["train"]
    assert run["steps"] == 2
    phases = run["phases_s"]
    assert 0 < phases["optimizer"] <= phases["update"] <= phases["step"]
    assert run["params_active"] > 0 and "mfu_step" not in run  # no GPU peak measured on the CPU
    assert "| qwen3_30b_a3b | 2 |" in (tmp_path / "summary.md").read_text()
    done = subprocess.run([sys.executable, script, "--prepare", "--cpu-smoke"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "c" / "stress_cold_start" / "config.json").is_file()


def test_the_page_holds_each_parts_steps_runs_comparisons_and_results(tmp_path):
    check = _load("gpu_check")
    steps, _ = check.load_steps()
    env = {"date": "2026-12-04 00:00 UTC", "git": "abc", "device": "H200", "python": "3.11", "torch": "2.x",
           "cuda": "12", "transformers": "5", "vllm": "0.3"}
    train = {"steps": 3, "peak_gib": 63.3, "plan_gib": 60.0, "tokens_per_s": 1234.0, "mfu_step": 0.25,
             "mfu_update": 0.4, "phases_s": {"generate": 1.0, "step": 7.29}}
    mfu = {"shape": "qwen3-1.7b", "batch": 4, "seq": 2048, "flops_per_step": 2e15, "counted_flops": 2e15,
           "bf16x3": {"step_s": 0.5, "mfu": 0.359, "max_memory_gib": 30.0}}
    doc = {"part": 2, "about": "recipes", "env": env, "peak_bf16_tflops": 800.0, "wall_s": 200.0, "command": "c",
           "steps": [{"name": "qwen3_8b", "status": "ok", "wall_s": 100.0, "log": "qwen3_8b.log", "train": train}],
           "compare": {"stress_cuda_vs_cpu": [{"metric": "reward/mean", "a": 0.5, "b": 0.6, "welch_p": 0.07,
                                               "band": "abs 0.15", "ok": True}]},
           "results": {"speed": {"dense8b_step_mfu": 0.31, "mfu": [mfu]}}}
    (tmp_path / "part2.json").write_text(json.dumps(doc))
    check.write_page(tmp_path, steps)
    page = (tmp_path / "summary.md").read_text()
    assert "## Part 2: recipes" in page and "bf16 matmul peak 800 TFLOP/s" in page
    assert "| qwen3_8b | 3 | 1 | - | - | - | - | - | 7.29 | 1234 | 25.0% | 40.0% | 63.3 | 60.0 |" in page
    assert "| means | reward/mean | 0.5 | 0.6 | 0.07 | abs 0.15 | True |" in page
    assert "| dense8b_step_mfu | 0.31 |" in page and "| qwen3-1.7b | 4 x 2048 | bf16x3 | 0.5000 | 35.9% | 30.0 |" in page
