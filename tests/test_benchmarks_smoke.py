def test_trl_throughput_smoke(tmp_path):
    """benchmarks/trl_throughput.py --smoke: a real 3-step `dcmdp train` timed from its MLflow store.

    Checks the throughput arithmetic on hand-made steps, then that the smoke run's numbers are
    consistent with each other and within the bounds the workload allows.
    """
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "trl_throughput.py"
    spec = importlib.util.spec_from_file_location("trl_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["trl_throughput"] = bench  # its dataclass resolves annotations through the module
    spec.loader.exec_module(bench)

    # Steps end at 0, 1, 3, 4 s; warm-up 1 leaves steps 2 and 3 timed, with periods 3 - 1 = 2 s and 4 - 3 = 1 s:
    # tokens/s = (30 + 60) / 3 = 30, steps/s = 2 / 3, other = median(2 - 0.5, 1 - 0.25) = 1.125.
    steps = [{"end": 0.0, "tokens": 99, "time/a": 9.0}, {"end": 1.0, "tokens": 99, "time/a": 9.0},
             {"end": 3.0, "tokens": 30, "time/a": 0.5}, {"end": 4.0, "tokens": 60, "time/a": 0.25}]
    s = bench.summarize(steps, ("time/a",), warmup=1)
    assert abs(s["tokens_per_s"] - 30.0) < 1e-12 and abs(s["steps_per_s"] - 2 / 3) < 1e-12
    assert s["tokens_per_step"] == 45.0 and s["period_median"] == 1.5 and s["time/other"] == 1.125

    result = bench.main(["--smoke", "--out-dir", str(tmp_path)])
    run = result["workloads"]["smoke"]
    d = run["summary"]["dcmdp"]
    assert "trl" not in run["summary"]  # smoke runs the dcmdp side only
    w = run["workload"]
    P, G, T = w["prompts"], w["samples"], w["max_new_tokens"]
    assert len(run["steps"]["dcmdp"][0]) == w["steps"]
    # every response has between 1 token (an immediate EOS) and max_new_tokens tokens
    assert P * G <= d["tokens_per_step"] <= P * G * T
    # one repetition: tokens/s = (tokens / timed steps) x (timed steps / seconds)
    assert abs(d["tokens_per_s"] - d["tokens_per_step"] * d["steps_per_s"]) < 1e-9 * d["tokens_per_s"]
    for phase in bench.DCMDP_PHASES:
        assert d[phase] >= 0.0
    # the phases lie inside the step period (MLflow's timestamp is taken after them); 1 ms timestamp resolution
    assert d["time/other"] >= -0.002
    assert sum(d[p] for p in bench.DCMDP_PHASES) <= d["period_median"] + 0.002
    # the limit columns: a measured peak and bandwidth, and achieved rates below them
    limits, achieved = result["limits"], run["limits"]["dcmdp"]
    assert limits["matmul_gflops"] > 0 and limits["copy_gb_s"] > 0
    assert 0 < achieved["train_share_of_peak"] < 1 and achieved["decode_gb_s"] > 0
    saved = json.loads((tmp_path / "trl_throughput.json").read_text())
    assert saved["workloads"]["smoke"]["summary"]["dcmdp"] == d
    assert "| response tokens / s (median) |" in (tmp_path / "trl_throughput.md").read_text()


def _load_benchmark(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overheads_smoke(tmp_path):
    """benchmarks/overheads.py on a 2 x 2 batch: real loop steps through dcmdp.loop.setup, R3 pairs."""
    import json

    bench = _load_benchmark("overheads")
    out = tmp_path / "overheads.md"
    rows = bench.main(["--steps", "3", "--warmup", "1", "--repeats", "3", "--no-larger", "--out", str(out),
                       "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
                       "algo.minibatches=1"])
    (row,) = rows
    c, r3 = row["controller"], row["r3"]
    assert c["steps"] == 2  # 3 steps, the first one dropped
    # the controller is part of the step: every per-step share lies in (0, 1)
    assert 0.0 < c["share"] <= c["share_max"] < 1.0
    assert c["measure_ms"] > 0 and c["dual_ms"] > 0 and c["measure_ms"] + c["dual_ms"] < c["step_ms"]
    # 2 prompts x 2 samples, 1 to 8 response tokens each
    assert 4 <= c["tokens"] <= 32
    # the R3 pass runs on one mini-batch of the 4 rows; the ratio of two timings of the same work is near 1
    assert r3["rows"] == 4 and r3["base_ms"] > 0 and 0.5 < r3["ratio"] < 2.0
    assert json.loads(out.with_suffix(".json").read_text())["rows"][0]["controller"] == c
    assert "| controller share" in out.read_text().splitlines()[-3] and out.with_suffix(".png").stat().st_size > 0


def test_discrepancy_smoke(tmp_path):
    """benchmarks/discrepancy.py on random-init tiny models: fp32 rollouts match the fp32 trainer, bf16 do not; the
    fp16 trainer scores the same rollouts; fp32_router rows come with their paired table."""
    bench = _load_benchmark("discrepancy")
    out = tmp_path / "discrepancy.md"
    rows = bench.main(["--presets", "tiny-dense", "tiny-moe", "--precisions", "fp32", "bf16", "--batches", "2",
                       "--prompts", "3", "--samples", "2", "--cold-start-steps", "0", "--cache-dir",
                       str(tmp_path / "cache"), "--fp16-train-precisions", "fp32", "--fp32-router-precisions", "bf16",
                       "--no-vllm", "--out", str(out)])
    by = {(r["model"], r["precision"], r["trainer"], r["fp32_router"], r["replay"]): r for r in rows}
    moe = [("tiny-moe", p, t, f, m) for p, t, f in (("fp32", "fp32", False), ("fp32", "fp16", False),
                                                    ("bf16", "fp32", False), ("bf16", "fp32", True))
           for m in ("none", "r3")]
    assert set(by) == {("tiny-dense", "fp32", "fp32", None, "none"), ("tiny-dense", "fp32", "fp16", None, "none"),
                       ("tiny-dense", "bf16", "fp32", None, "none"), *moe}
    kl = {k: r["stats"]["discrepancy/kl_k3"][0] for k, r in by.items()}
    for model, flag in (("tiny-dense", None), ("tiny-moe", False)):
        fp32 = kl[(model, "fp32", "fp32", flag, "none")]
        # identical weights and fp32 on both sides: only float rounding (log-probs agree to ~1e-6)
        assert fp32 < 1e-10
        # bf16 weights in the engine: a discrepancy orders of magnitude above the fp32 floor
        assert kl[(model, "bf16", "fp32", flag, "none")] > 1e3 * fp32
        # the fp16 trainer scores the very same fp32 rollouts, and its float16 forwards round
        fp16 = by[(model, "fp32", "fp16", flag, "none")]
        assert fp16["tokens"] == by[(model, "fp32", "fp32", flag, "none")]["tokens"]
        assert kl[(model, "fp32", "fp16", flag, "none")] > 1e3 * fp32
    for r in rows:
        assert len(r["values"]["discrepancy/kl_k3"]) == 2  # one value per batch
        mean, lo, hi = r["stats"]["discrepancy/kl_k3"]
        assert lo <= mean <= hi
    # dense models report no routes; R3 replays the rollout's routes, so their mismatch is 0 by construction
    assert "routing/mismatch" not in by[("tiny-dense", "bf16", "fp32", None, "none")]["values"]
    for flag in (False, True):
        assert by[("tiny-moe", "bf16", "fp32", flag, "r3")]["values"]["routing/mismatch"] == [0.0, 0.0]
    text = out.read_text()
    assert "| tiny-moe | torch | bf16 | fp32 | on | r3 |" in text
    assert "| tiny-dense | torch | fp32 | fp16 | - | none |" in text
    assert "\n| bf16 | fp32 | " in text  # the fp32_router on vs off row
    assert "\n| tiny-moe | torch | fp32 | r3 | " in text  # the fp16 vs fp32 trainer row


def test_mfu_dry_run(tmp_path, capsys):
    """benchmarks/mfu_gpu.py --cpu-dry-run: the FLOP formula by hand and against torch's FLOP counter."""
    import torch

    bench = _load_benchmark("mfu_gpu")
    # tiny shape: hidden 64, 2 layers, 2 query heads / 1 KV head of dim 32, MLP 192, vocab 512 (tied head).
    # N_body per layer = q 64*64 + k 64*32 + v 64*32 + o 64*64 + 3 * 64*192 = 49152, x 2 layers = 98304;
    # N_head = 512*64 = 32768. B = 2, S = 32: 6*2*(32*98304 + 31*32768) = 49938432 matmul FLOPs,
    # attention 12 * L 2 * H 2 * Q 32 * B 2 * S^2 1024 = 3145728; total 53084160.
    rows = bench.main(["--cpu-dry-run", "--out", str(tmp_path / "mfu.md")])
    (row,) = rows
    assert (row["n_body"], row["n_head"]) == (98304, 32768)
    assert row["flops_per_step"] == 53084160.0
    # FlopCounterMode counts every matmul and the attention of one real step: the formula is exact here
    assert abs(row["counted_flops"] / row["flops_per_step"] - 1.0) < 1e-6
    for key in ("bf16_head", "fp32_head", "bf16x3_head"):
        m = row[key]
        assert abs(m["tokens_per_s"] * m["step_s"] - 2 * 32) < 1e-6
        assert abs(m["mfu"] - m["tflops"] / row["peak_tflops"]) < 1e-12
    assert "| tiny | 0M | 2 x 32 | fp32 |" in (tmp_path / "mfu.md").read_text()
    assert "| tiny | 0M | 2 x 32 | fp32 bf16x3 |" in (tmp_path / "mfu.md").read_text()
    if not torch.cuda.is_available():
        capsys.readouterr()
        assert bench.main([]) == []
        assert capsys.readouterr().out.strip() == "no CUDA device: skipped"


def _load_stability():
    """benchmarks/stability.py as a module (benchmarks/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "stability.py"
    spec = importlib.util.spec_from_file_location("bench_stability", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_stability_smoke(tmp_path):
    """benchmarks/stability.py --profile smoke: 2 methods x 3 steps through real worker processes."""
    import csv
    import json

    stability = _load_stability()
    prefix = tmp_path / "results" / "stability_smoke"
    bench = tmp_path / "runs"
    stability.main(["--profile", "smoke", "--workers", "1", "--bench-dir", str(bench), "--results", str(prefix)])

    profile = stability.PROFILES["smoke"]
    rows = list(csv.DictReader(open(prefix.with_suffix(".csv"))))
    assert sorted((r["method"], int(r["N"]), int(r["seed"])) for r in rows) == sorted(
        (m, n, s) for m in profile.methods for n in profile.minibatches for s in profile.seeds)
    for method in profile.methods:
        out = stability.cell_dir(bench, method, 2, 0)
        history = json.loads((out / "history.json").read_text())
        assert len(history) == 3  # 3 RL steps, one entry each
        assert not (out / "checkpoints").exists()  # removed once the history is extracted
        lam = [h["dual/lambda/abs_prob_diff"] for h in history]
        measured = [h["dual/measured/abs_prob_diff"] for h in history]
        if method == "minirl":  # dual off: lambda stays 0, the constraint is still measured
            assert lam == [0.0, 0.0, 0.0]
        else:  # projected ascent, eta = 1: lambda_k = lambda_{k-1} + (D_k - c), clipped at 0
            expected, prev = [], stability.LAMBDA_INIT
            for d in measured:
                prev = max(0.0, prev + stability.DUAL_LR * (d - stability.TOLERANCE))
                expected.append(prev)
            assert all(abs(a - b) < 1e-9 for a, b in zip(lam, expected))
        # R3 replays mu's routes in the pi_old pass: no route differs between the engines
        if method == "dcmdp_r3":
            assert all(h["routing/mismatch"] == 0.0 for h in history)

    data = json.loads(prefix.with_suffix(".json").read_text())
    assert {c["method"] for c in data["cells"]} == set(profile.methods)
    for c in data["cells"]:  # the change column pairs each seed's final accuracy with its own start
        mine = [r for r in rows if r["method"] == c["method"] and int(r["N"]) == c["N"]]
        delta = sum(float(r["acc_after"]) - float(r["acc_before"]) for r in mine) / len(mine)
        assert abs(c["delta_mean"] - delta) < 1e-12
    for r in data["runs"]:  # held-out eval at step 0, every eval_every = 2 steps (not at the last), and after
        assert r["eval_steps"] == [0, 2, 3]
        assert all(0.0 <= a <= 1.0 for a in r["eval_acc"])
    md = prefix.with_suffix(".md").read_text()
    assert "| 2 | minirl |" in md and "| 2 | dcmdp_r3 |" in md and str(stability.TOLERANCE) in md
    assert prefix.with_name("stability_smoke_accuracy_N2.png").stat().st_size > 0
    assert prefix.with_name("stability_smoke_final_accuracy.png").stat().st_size > 0
    assert prefix.with_name("stability_smoke_dual_N2.png").stat().st_size > 0  # dcmdp_r3's D-hat and lambda

    # a second invocation finds every cell finished and trains nothing
    mtime = (stability.cell_dir(bench, "minirl", 2, 0) / "summary.json").stat().st_mtime
    stability.main(["--profile", "smoke", "--workers", "1", "--bench-dir", str(bench), "--results", str(prefix)])
    assert (stability.cell_dir(bench, "minirl", 2, 0) / "summary.json").stat().st_mtime == mtime


def test_stability_collapse_rule():
    stability = _load_stability()
    flat = [0.5] * 40
    assert stability.collapse_check([0.3, 0.4, 0.35], flat, 0, warmup=0) == (False, "")
    assert stability.collapse_check([0.3, 0.4, 0.35], flat, 2, warmup=0)[0]  # non-finite updates
    assert stability.collapse_check([0.3, 0.6, 0.29], flat, 0, warmup=0)[0]  # 0.29 < 0.6 / 2
    assert not stability.collapse_check([0.3, 0.6, 0.30], flat, 0, warmup=0)[0]  # exactly half is not below
    # running reward, W = max(5, 40 // 20) = 5: peak window 0.8, last window 0.2 < 0.4
    falling = [0.8] * 20 + [0.2] * 20
    assert stability.collapse_check([0.3, 0.3], falling, 0, warmup=0)[0]
    # the peak is only taken after the warm-up: a high start inside the warm-up does not count
    assert not stability.collapse_check([0.3, 0.3], [0.8] * 5 + [0.3] * 35, 0, warmup=5)[0]


def test_stability_probe_overrides():
    """Each probe method's dotlist replaces the matrix constraint / learning rate as its name says."""
    from pathlib import Path

    from dcmdp.config import load_config

    stability = _load_stability()
    profile = stability.PROFILES["probe"]

    def cfg(method):
        return load_config(stability.BASE_CONFIG, stability.cell_overrides(profile, method, 8, 0, Path("unused")))

    (c,) = cfg("dcmdp_r3_c1e-3_eta100").dual.constraints
    assert (c.tolerance, c.lambda_init, c.lr) == (1e-3, 0.1, 100.0)
    fixed = cfg("fixed_r3_lambda1")
    assert fixed.dual.rule == "fixed" and fixed.dual.constraints[0].lambda_init == 1.0
    assert fixed.algo.routing_replay == "r3"
    for method in ("grpo_no_is_lr1e-3", "minirl_r3_lr1e-3", "dcmdp_r3_lr1e-3"):
        c = cfg(method)
        assert c.optim.lr == 1e-3 and c.dual.constraints[0].tolerance == stability.TOLERANCE
    # the matrix methods keep the matrix constraint
    assert cfg("dcmdp_r3").dual.constraints[0].lr == stability.DUAL_LR and cfg("dcmdp_r3").optim.lr == 2e-4
    # probe_updates: the dual reads the updates' log-probs; c and eta as the names say; the probe profile
    # keeps its own seven methods
    upd = stability.PROFILES["probe_updates"]
    for method in upd.methods:
        c = load_config(stability.BASE_CONFIG, stability.cell_overrides(upd, method, 8, 0, Path("unused")))
        (con,) = c.dual.constraints
        assert c.dual.measure_at == "updates" and c.algo.routing_replay == "r3" and c.cold_start.seed == 0
        assert con.tolerance == (1e-2 if "c1e-2" in method else stability.TOLERANCE)
        assert con.lr == (100.0 if "eta100" in method else stability.DUAL_LR)
        assert c.optim.lr == (1e-3 if method.endswith("lr1e-3") else 2e-4)
    assert not any("_upd" in m for m in profile.methods) and len(profile.methods) == 7
    # probe_penalty: the penalty form as the name says (hinge where none is named); c = 1e-2 on the updates measure
    pen = stability.PROFILES["probe_penalty"]
    for method in pen.methods:
        c = load_config(stability.BASE_CONFIG, stability.cell_overrides(pen, method, 8, 0, Path("unused")))
        form = "mean" if "_mean" in method else "advantage" if "_adv" in method else "hinge"
        assert c.dual.penalty == form and c.cold_start.seed == 0
        assert c.dual.measure_at == ("updates" if "_upd" in method else "rollout")
        assert c.dual.constraints[0].tolerance == (1e-2 if "c1e-2" in method else stability.TOLERANCE)
        assert c.optim.lr == (1e-3 if method.endswith("lr1e-3") else 2e-4)
    # quick_bf16: bf16 rollouts and its own calibrated tolerance on every method, named in the results header
    bf16 = stability.PROFILES["quick_bf16"]
    assert bf16.precision == "bf16" and profile.precision == "int8" and bf16.tolerance != stability.TOLERANCE
    for method in bf16.methods:
        c = load_config(stability.BASE_CONFIG, stability.cell_overrides(bf16, method, 8, 0, Path("unused")))
        assert c.rollout.precision == "bf16" and c.dual.constraints[0].tolerance == bf16.tolerance


def _load_benchmark(name: str):
    """benchmarks/<name>.py as a module, with benchmarks/ importable for its own imports."""
    import importlib.util
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench_dir / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_stress_smoke(tmp_path):
    """benchmarks/stress.py --profile smoke: 2 levels x 2 methods x 3 steps through real worker processes; the
    dual's trajectory is re-derived from the logged measurements (relative step, automatic tolerance)."""
    import csv
    import json
    import shutil

    stress = _load_benchmark("stress")
    prefix = tmp_path / "results" / "stress_smoke"
    bench = tmp_path / "runs"
    prefix.parent.mkdir(parents=True)
    reading = "## Reading\n\nA hand-written reading survives the re-run."
    prefix.with_name("stress_smoke_reading.md").write_text(reading + "\n")
    stress.main(["--profile", "smoke", "--workers", "1", "--bench-dir", str(bench), "--results", str(prefix)])

    profile = stress.PROFILES["smoke"]
    rows = list(csv.DictReader(open(prefix.with_suffix(".csv"))))
    assert sorted((r["level"], r["method"], int(r["N"])) for r in rows) == sorted(
        (lv, m, n) for lv, m, n, _ in profile.cells())
    eta, slack, ema, lam0 = 0.5, 1.0, 0.9, 0.1  # stress.CONSTRAINT
    assert f"lr: {eta}" in stress.CONSTRAINT and f"floor_slack: {slack}" in stress.CONSTRAINT
    for level in ("fp32", "noise1"):
        for method in ("grpo_no_is", "dcmdp_r3"):
            history = json.loads((stress.cell_dir(bench, level, method, 2, 0) / "history.json").read_text())
            assert len(history) == 3
            lam = [h["dual/lambda/abs_prob_diff"] for h in history]
            tol = [h["dual/tolerance/abs_prob_diff"] for h in history]
            floor = [h["discrepancy/abs_prob_diff"] for h in history]  # pi_old vs mu before the updates
            # the automatic tolerance: c_1 = 2 F_1 (the first floor), then c_k = 2 F_{k-1}, F an EMA of the floor
            f = floor[0]
            assert abs(tol[0] - 2 * f) <= 1e-12 * max(f, 1e-30) and abs(tol[1] - 2 * f) <= 1e-12 * max(f, 1e-30)
            f = ema * f + (1 - ema) * floor[1]
            assert abs(tol[2] - 2 * f) <= 1e-9 * max(f, 1e-30)
            if method == "grpo_no_is":
                assert lam == [0.0, 0.0, 0.0]
            else:  # relative projected ascent on the updates' measure: lambda += eta (D - c) / c, clipped at 0
                measured = [h["dual/measured/abs_prob_diff"] for h in history]
                prev = lam0
                for d, c, got in zip(measured, tol, lam):
                    prev = min(10.0, max(0.0, prev + eta * (d - c) / c))
                    assert abs(got - prev) <= 1e-9 * max(1.0, prev)
                assert all(h["routing/mismatch"] == 0.0 for h in history)  # R3
    noisy = json.loads((stress.cell_dir(bench, "noise1", "grpo_no_is", 2, 0) / "history.json").read_text())
    clean = json.loads((stress.cell_dir(bench, "fp32", "grpo_no_is", 2, 0) / "history.json").read_text())
    # logit noise of std 1 opens a discrepancy that fp32 rollouts (same weights, same kernels) do not have
    assert min(h["discrepancy/kl_k3"] for h in noisy) > 100 * max(h["discrepancy/kl_k3"] for h in clean)
    md = prefix.with_suffix(".md").read_text()
    assert "| 2 | noise1 |" in md and "Welch" in md
    assert md.endswith("\n\n" + reading + "\n")  # the reading comes last, once
    assert prefix.with_name("stress_smoke_accuracy.png").stat().st_size > 0
    assert prefix.with_name("stress_smoke_dual.png").stat().st_size > 0
    assert "min wall over the invocations that trained the runs" in md

    # an assembled page: the finished run folders copied into a fresh folder render without training anything,
    # and the page says that no run trained there instead of quoting a wall time
    assembled = tmp_path / "assembled"
    assembled.mkdir()
    for level, method, n, seed in profile.cells():
        shutil.copytree(stress.cell_dir(bench, level, method, n, seed),
                        stress.cell_dir(assembled, level, method, n, seed))
    stress.main(["--profile", "smoke", "--workers", "1", "--bench-dir", str(assembled), "--results", str(prefix)])
    assert not (assembled / "wall_seconds.txt").exists()
    md2 = prefix.with_suffix(".md").read_text()
    assert "no run trained here" in md2 and "min wall" not in md2
    assert md2.split("Welch")[0].split("| N | level")[1] == md.split("Welch")[0].split("| N | level")[1]


def test_seq_mask_probe_smoke(tmp_path):
    """benchmarks/seq_mask_probe.py on a 20-step cold start, 2 batches of 2 prompts x 4 samples, rollouts with
    logit noise of std 1: a band that holds every ratio keeps every sequence, the published band fewer, and the
    kept and dropped sides partition the sequences and their (group-centred) GRPO advantages."""
    import json

    probe = _load_benchmark("seq_mask_probe")
    out = tmp_path / "seq_mask_probe"
    probe.main(["--level", "noise1", "--batches", "2", "--bands", "0.999,1.001", "0,1e9", "--out", str(out),
                "cold_start.steps=20", "cold_start.target_accuracy=null", "algo.prompts_per_step=2",
                "algo.samples_per_prompt=4", "rollout.max_new_tokens=24"])
    result = json.loads(out.with_suffix(".json").read_text())
    narrow, wide = result["bands"]
    assert result["sequences"] == 16
    assert wide["kept"]["n"] == 16 and wide["kept_share"] == 1.0
    assert narrow["kept"]["n"] + narrow["dropped"]["n"] == 16 and narrow["kept"]["n"] < 16
    for band in (narrow, wide):  # GRPO advantages are centred per group: kept + dropped sum to ~0
        assert abs(band["kept"]["adv_sum"] + band["dropped"]["adv_sum"]) < 1e-4
    assert "| [0.999, 1.001] |" in out.with_suffix(".md").read_text()
