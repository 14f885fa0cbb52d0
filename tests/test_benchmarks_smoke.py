import dataclasses
import math
import re
from pathlib import Path

import pytest


def _runner():
    """The experiment runner: the package ``benchmarks/runner/`` behind ``benchmarks/run.py``."""
    import importlib
    import sys

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks.runner")


EXPERIMENTS = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"
EXPERIMENT_FILES = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


# the experiments of the current round by default, the older ones' smoke profiles on request
SMOKE_BY_DEFAULT = ("constraint", "default_dual", "stress")


@pytest.fixture(scope="module", params=[p if p in SMOKE_BY_DEFAULT else pytest.param(p, marks=pytest.mark.slow)
                                        for p in EXPERIMENT_FILES])
def smoke_run(request, tmp_path_factory):
    """Each experiment file's smoke profile, trained once through real worker processes."""
    run = _runner()
    tmp = tmp_path_factory.mktemp(request.param)
    prefix, bench = tmp / "results" / f"{request.param}_smoke", tmp / "runs"
    run.main([request.param, "--profile", "smoke", "--workers", "1", "--bench-dir", str(bench),
              "--results", str(prefix)])
    return run, run.load_experiment(request.param), prefix, bench


def test_experiment_smoke(smoke_run):
    """Every experiment's smoke profile: one row and one 3-step history per cell, a page, plots, and a second
    invocation that trains nothing."""
    import csv
    import json

    run, exp, prefix, bench = smoke_run
    cells = exp.cells("smoke")
    rows = list(csv.DictReader(open(prefix.with_suffix(".csv"))))
    assert sorted((r["level"], r["method"], int(r["N"]), int(r["seed"])) for r in rows) == sorted(cells)
    for cell in cells:
        out = exp.cell_dir(bench, *cell)
        assert len(json.loads((out / "history.json").read_text())) == 3  # 3 RL steps, one entry each
        assert not (out / "checkpoints").exists()  # removed once the history is extracted
    for r in run.read_record(prefix)["runs"]:
        assert r["eval_steps"] == [0, 2, 3] and all(0.0 <= a <= 1.0 for a in r["eval_acc"])
    md = prefix.with_suffix(".md").read_text()
    level, method, n, _ = cells[0]
    assert f"| {n} | {level} |" in md and "Welch" in md and f"benchmarks/experiments/{exp.name}.yaml" in md
    assert str(run.ROOT) not in md  # repository-relative paths only
    for suffix in ("_accuracy.png", "_curves.png", "_dual.png", "_lambda.png"):
        assert prefix.with_name(prefix.name + suffix).stat().st_size > 0
    # the figures are not tracked: the page names the command that draws them again, from the record alone
    assert (f"`.venv/bin/python benchmarks/run.py {exp.name} --profile smoke --figures` draws "
            f"`{prefix.name}_accuracy.png`") in md
    figures = sorted(prefix.parent.glob(f"{prefix.name}_*.png"))
    for path in figures:
        path.unlink()
    run.main([exp.name, "--profile", "smoke", "--results", str(prefix), "--figures"])
    assert sorted(prefix.parent.glob(f"{prefix.name}_*.png")) == figures
    assert all(path.stat().st_size > 0 for path in figures)
    first = exp.cell_dir(bench, *cells[0]) / "summary.json"
    mtime = first.stat().st_mtime
    run.main([exp.name, "--profile", "smoke", "--workers", "1", "--bench-dir", str(bench), "--results", str(prefix)])
    assert first.stat().st_mtime == mtime


def test_a_page_goes_to_its_experiments_folder_by_default():
    run = _runner()
    assert run.results_prefix("stress", "quick") == run.ROOT / "benchmarks" / "results" / "stress" / "stress_quick"


def test_each_experiments_pages_lie_in_its_folder_beside_their_records():
    """benchmarks/results/ holds LOG.md and a folder per experiment; each page of an experiment of
    benchmarks/experiments/ lies in that experiment's folder beside its record, which ``--no-train`` and
    ``--figures`` read."""
    run = _runner()
    results = run.ROOT / "benchmarks" / "results"
    assert [p.name for p in results.iterdir() if p.is_file()] == ["LOG.md"]
    pages = [page for name in EXPERIMENT_FILES for page in (results / name).glob(f"{name}_*.md")]
    assert len(pages) > 40  # the walk saw the pages
    assert not [page for page in pages if not run.record_path(page.with_suffix("")).exists()]


def test_no_figure_a_record_draws_again_is_tracked():
    """The figures ``--figures`` draws from a page's record are not tracked (.gitignore); the headline is."""
    import subprocess

    run = _runner()
    if not (run.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=run.ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    redrawn = [p for p in tracked if p.endswith(".png") and any(
        run.record_path(run.ROOT / p.removesuffix(suffix)).exists()
        for suffix in ("_accuracy.png", "_curves.png", "_dual.png", "_lambda.png", "_front.png") if p.endswith(suffix))]
    assert not redrawn, f"tracked, though --figures draws them from the record: {redrawn}"


def _histories(exp, bench):
    import json

    return {cell: json.loads((exp.cell_dir(bench, *cell) / "history.json").read_text()) for cell in exp.cells("smoke")}


@pytest.mark.parametrize("smoke_run", ["stability"], indirect=True)
def test_stability_smoke_dual(smoke_run):
    """Stability: the dual off leaves lambda at 0; on, projected ascent with eta = 1 on the logged D-hat."""
    run, exp, _, bench = smoke_run
    for (_, method, _, _), history in _histories(exp, bench).items():
        lam = [h["dual/lambda/abs_prob_diff"] for h in history]
        if method == "minirl":
            assert lam == [0.0, 0.0, 0.0]
        else:  # lambda_k = max(0, lambda_{k-1} + (D_k - c)), lambda_0 = 0.1, c = 2.7e-3
            prev = 0.1
            for h, got in zip(history, lam):
                prev = max(0.0, prev + 1.0 * (h["dual/measured/abs_prob_diff"] - 2.7e-3))
                assert abs(got - prev) < 1e-9
            assert all(h["routing/mismatch"] == 0.0 for h in history)  # R3: no route differs between the engines


@pytest.mark.parametrize("smoke_run", ["staleness"], indirect=True)
def test_staleness_smoke_throughput_section(smoke_run):
    """The staleness experiment's page: end-to-end tokens/s re-derived from each run's steps, as a ratio to the
    synchronous reference at the same seed (exactly 1 for the reference), the bound each setting held, and the
    throughput-accuracy plot."""
    run, exp, prefix, bench = smoke_run
    assert exp.reference == "bound_0"
    saved = run.read_record(prefix)
    speed = {r["method"]: r for r in saved["throughput"]}
    tokens = {}
    for (level, method, n, seed), history in _histories(exp, bench).items():
        step_s = [h["time/step"] for h in history]
        tokens[method] = sum(h["throughput/response_tokens_per_s"] * t for h, t in zip(history, step_s)) / sum(step_s)
        assert abs(speed[method]["tokens_per_s"] - tokens[method]) <= 1e-9 * tokens[method]
        bounds = [h["async/bound"] for h in history]
        if method.startswith("bound_"):
            assert bounds == [float(method.split("_")[1])] * 3
        else:  # auto starts at its min (nu_init = nu_max) and stays within its range
            assert bounds[0] == 0.0 and all(0 <= b <= 8 for b in bounds)
    for method, r in speed.items():
        assert abs(r["ratio"][0] - tokens[method] / tokens["bound_0"]) <= 1e-9
    assert speed["bound_0"]["ratio"] == [1.0, 0.0]
    assert "ratio to bound_0" in prefix.with_suffix(".md").read_text()
    assert prefix.with_name(prefix.name + "_front.png").stat().st_size > 0


@pytest.mark.parametrize("smoke_run", ["stress"], indirect=True)
def test_stress_smoke_dual_and_assembled_page(smoke_run, tmp_path, capsys):
    """Stress: the automatic tolerance and the relative dual step re-derived from the logged measurements; logit
    noise opens a discrepancy fp32 rollouts lack; copied run folders render without training."""
    import csv
    import shutil

    run, exp, prefix, bench = smoke_run
    eta, ema, lam0 = 0.5, 0.9, 0.1  # the experiment's constraint: lr 0.5, floor_slack 1.0 (c = 2 x floor)
    hist = _histories(exp, bench)
    for (level, method, _, _), history in hist.items():
        lam = [h["dual/lambda/abs_prob_diff"] for h in history]
        tol = [h["dual/tolerance/abs_prob_diff"] for h in history]
        floor = [h["discrepancy/abs_prob_diff"] for h in history]  # pi_old vs mu before the updates
        f = floor[0]  # c_1 = 2 F_1, then c_k = 2 F_{k-1}, F an EMA of the floor
        assert abs(tol[0] - 2 * f) <= 1e-12 * max(f, 1e-30) and abs(tol[1] - 2 * f) <= 1e-12 * max(f, 1e-30)
        f = ema * f + (1 - ema) * floor[1]
        assert abs(tol[2] - 2 * f) <= 1e-9 * max(f, 1e-30)
        if method == "grpo_no_is":
            assert lam == [0.0, 0.0, 0.0]
        else:  # relative projected ascent on the updates' measure: lambda += eta (D - c) / c, in [0, 10]
            prev = lam0
            for h, c, got in zip(history, tol, lam):
                prev = min(10.0, max(0.0, prev + eta * (h["dual/measured/abs_prob_diff"] - c) / c))
                assert abs(got - prev) <= 1e-9 * max(1.0, prev)
    kl = {cell[0]: [h["discrepancy/kl_k3"] for h in hist[cell]] for cell in hist if cell[1] == "grpo_no_is"}
    assert min(kl["noise1"]) > 100 * max(kl["fp32"])
    md = prefix.with_suffix(".md").read_text()
    assert "min wall over the invocations that trained the runs; " in md  # this profile's own count
    assert (bench / "wall_seconds.smoke.txt").exists() and not (bench / "wall_seconds.txt").exists()
    # the README's one-panel plot, rendered from the page's JSON without training
    run.main(["stress", "--profile", "smoke", "--results", str(prefix), "--headline", "grpo_no_is,dcmdp_r3"])
    assert prefix.with_name("stress_smoke_headline.png").stat().st_size > 0

    assembled, page = tmp_path / "assembled", tmp_path / "stress_smoke"
    for cell in exp.cells("smoke"):
        shutil.copytree(exp.cell_dir(bench, *cell), exp.cell_dir(assembled, *cell))
    run.main(["stress", "--profile", "smoke", "--workers", "1", "--bench-dir", str(assembled), "--results", str(page)])
    md2 = page.with_suffix(".md").read_text()
    assert "no run trained here" in md2 and not list(assembled.glob("wall_seconds*"))
    assert md2.split("Welch")[0].split("| N | level")[1] == md.split("Welch")[0].split("| N | level")[1]
    # a folder counted before walls were kept per profile: its total is shown, and said to cover other profiles
    (assembled / "wall_seconds.txt").write_text("600.0\n")
    run.main(["stress", "--profile", "smoke", "--no-train", "--bench-dir", str(assembled), "--results", str(page)])
    md3 = page.with_suffix(".md").read_text()
    assert "(10 min wall over the invocations that trained the runs and other profiles in the same folder; " in md3

    # a profile in progress: --no-train writes the page from the finished runs and trains none of the others
    partial, page3 = tmp_path / "partial", tmp_path / "stress_partial"
    first, *rest = exp.cells("smoke")
    shutil.copytree(exp.cell_dir(bench, *first), exp.cell_dir(partial, *first))
    run.main(["stress", "--profile", "smoke", "--no-train", "--bench-dir", str(partial), "--results", str(page3)])
    assert f"in progress: 1 of the profile's {len(rest) + 1} runs have finished" in page3.with_suffix(".md").read_text()
    assert not any(exp.cell_dir(partial, *cell).exists() for cell in rest)

    # a profile in parts: --levels trains only the runs at those levels (here read from the finished folder)
    page4 = tmp_path / "stress_fp32"
    run.main(["stress", "--profile", "smoke", "--levels", "fp32", "--bench-dir", str(assembled), "--results", str(page4)])
    rows = page4.with_suffix(".csv").read_text().splitlines()[1:]
    assert rows and all(r.startswith("fp32,") for r in rows)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run.main(["stress", "--profile", "smoke", "--levels", "int8", "--bench-dir", str(assembled),
                  "--results", str(page4)])
    assert stopped.value.code == 2 and "has no level int8" in capsys.readouterr().err
    # and --methods the runs of those methods (both filters together: both must match)
    page5 = tmp_path / "stress_one_method"
    method = exp.cells("smoke")[0][1]
    run.main(["stress", "--profile", "smoke", "--levels", "fp32", "--methods", method, "--bench-dir", str(assembled),
              "--results", str(page5)])
    rows = page5.with_suffix(".csv").read_text().splitlines()[1:]
    assert rows and all(r.startswith("fp32,") and f",{method}," in r for r in rows)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run.main(["stress", "--profile", "smoke", "--methods", "ghost", "--bench-dir", str(assembled),
                  "--results", str(page4)])
    assert stopped.value.code == 2 and "has no method ghost" in capsys.readouterr().err
    # the next part adds its runs to the page: the fp32 runs come from page4's record, the others from their folders
    noise_only = tmp_path / "noise_only"
    for cell in (c for c in exp.cells("smoke") if c[0] != "fp32"):
        shutil.copytree(exp.cell_dir(bench, *cell), exp.cell_dir(noise_only, *cell))
    run.main(["stress", "--profile", "smoke", "--levels", "noise1", "--bench-dir", str(noise_only),
              "--results", str(page4)])
    rows = list(csv.DictReader(open(page4.with_suffix(".csv"))))
    assert sorted((r["level"], r["method"], int(r["seed"])) for r in rows) == sorted(
        (lv, m, s) for lv, m, _, s in exp.cells("smoke"))
    assert f"{sum(c[0] == 'fp32' for c in exp.cells('smoke'))} runs read from the page's earlier record" in \
        page4.with_suffix(".md").read_text()


@pytest.mark.parametrize("smoke_run", ["stress"], indirect=True)
def test_page_record_renders_the_page_without_run_folders(smoke_run, tmp_path):
    """A page's JSON record holds every run (curves, λ and the discrepancy per step, diagnostics, the overrides it
    was trained with): rendered from it alone the page's cells match the folders' to the record's 4 significant
    digits; a run the experiment file would now train with other overrides is left off."""
    import json
    import shutil

    import yaml

    run, exp, prefix, bench = smoke_run
    again = tmp_path / "again" / prefix.name
    again.parent.mkdir()
    for suffix in (".json.gz", ".csv"):
        shutil.copyfile(prefix.with_name(prefix.name + suffix), again.with_name(again.name + suffix))
    run.main(["stress", "--profile", "smoke", "--no-train", "--bench-dir", str(tmp_path / "none"),
              "--results", str(again)])
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())
    first, second = (run.read_record(p) for p in (prefix, again))
    for record in first["runs"]:
        assert record["config"] == exp.run_config("smoke", record["level"], record["method"], record["N"],
                                                  record["seed"])
        assert len(record["measured"]) == len(record["lambda"]) == 3 and record["seconds"] > 0
    assert [(c["level"], c["method"]) for c in first["cells"]] == [(c["level"], c["method"]) for c in second["cells"]]
    for a, b in zip(first["cells"], second["cells"]):
        assert a["finals"] == b["finals"] and a["lates"] == b["lates"] and a["collapses"] == b["collapses"]
        for key in ("abs_prob_diff", "kl_k3_start", "inside_share", "mean_lambda", "final_lambda"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-12), key
        assert b["extra"] == pytest.approx(a["extra"], rel=1e-5)
    md = again.with_suffix(".md").read_text()
    assert f"{len(first['runs'])} runs read from the page's earlier record" in md and "in progress" not in md
    # each run records the machine kind that trained it; a page whose runs all trained on this kind says nothing more
    from benchmarks._page import machine_kind

    assert {r.get("machine") for r in first["runs"]} == {machine_kind()} and "trained on" not in md
    assert all((exp.cell_dir(bench, *c) / run.MACHINE_FILE).read_text().strip() == machine_kind()
               for c in exp.cells("smoke"))
    # a run recorded from another kind: the page lists the kinds with their counts
    page = run.read_record(again)
    page["runs"][0]["machine"] = "riscv64 (test kernels, no CPU)"
    del page["runs"][1]["machine"]  # a run recorded before runs carried their machine
    again.with_name(again.name + ".json").write_text(json.dumps(page))  # plain, as an older runner wrote it
    run.main(["stress", "--profile", "smoke", "--no-train", "--bench-dir", str(tmp_path / "none"),
              "--results", str(again)])
    assert (f"the runs were trained on riscv64 (test kernels, no CPU) (1 runs), {machine_kind()} "
            f"({len(first['runs']) - 2} runs), a kind not recorded (1 runs)") in again.with_suffix(".md").read_text()
    # the record is the result: a fresh folder (another machine, scratch cleaned) trains none of the recorded runs
    fresh = tmp_path / "fresh"
    run.main(["stress", "--profile", "smoke", "--bench-dir", str(fresh), "--results", str(again)])
    assert not fresh.exists() or not any(fresh.iterdir())
    assert f"{len(first['runs'])} runs read from the page's earlier record" in again.with_suffix(".md").read_text()
    # --retrain trains them anew (here one level and method): those come from the folder, the rest from the record
    level, method = exp.cells("smoke")[0][:2]
    chosen = [c for c in exp.cells("smoke") if c[:2] == (level, method)]
    run.main(["stress", "--profile", "smoke", "--retrain", "--levels", level, "--methods", method, "--workers", "1",
              "--bench-dir", str(fresh), "--results", str(again)])
    assert all((exp.cell_dir(fresh, *c) / "summary.json").exists() for c in chosen)
    assert f"{len(first['runs']) - len(chosen)} runs read from the page's earlier record" in \
        again.with_suffix(".md").read_text()

    # an edited method: its recorded runs no longer hold for the experiment file, the others still do
    raw = yaml.safe_load((run.EXPERIMENTS / "stress.yaml").read_text())
    edited = exp.cells("smoke")[0][1]
    raw["methods"][edited]["overrides"] = [*raw["methods"][edited]["overrides"], "optim.lr=3.0e-4"]
    path = tmp_path / "stress.yaml"
    path.write_text(yaml.safe_dump(raw))
    run.main([str(path), "--profile", "smoke", "--no-train", "--bench-dir", str(tmp_path / "none"),
              "--results", str(again)])
    kept = run.read_record(again)["runs"]
    assert kept and {r["method"] for r in kept} == {m for _, m, _, _ in exp.cells("smoke")} - {edited}


def test_a_page_record_reads_gzipped_and_plain_and_is_written_gzipped(tmp_path):
    """run.py writes a page's record gzipped, reads a plain one too, and a plain one beside a gzipped one (written by
    a runner that wrote plain JSON, so after it) wins until the next write replaces both."""
    import gzip
    import json

    run = _runner()
    prefix = tmp_path / "exp_profile"
    assert run.write_record(prefix, json.dumps({"runs": [1]})) == tmp_path / "exp_profile.json.gz"
    assert json.loads(gzip.decompress((tmp_path / "exp_profile.json.gz").read_bytes())) == {"runs": [1]}
    assert run.read_record(prefix) == {"runs": [1]}
    (tmp_path / "exp_profile.json").write_text(json.dumps({"runs": [2]}))
    assert run.record_path(prefix).name == "exp_profile.json" and run.read_record(prefix) == {"runs": [2]}
    run.write_record(prefix, json.dumps({"runs": [3]}))
    assert not (tmp_path / "exp_profile.json").exists() and run.read_record(prefix) == {"runs": [3]}
    first = (tmp_path / "exp_profile.json.gz").read_bytes()
    run.write_record(prefix, json.dumps({"runs": [3]}))
    assert (tmp_path / "exp_profile.json.gz").read_bytes() == first  # no timestamp in the gzip header


def test_method_and_profile_from_yaml_only(tmp_path):
    """A method that extends another and a profile, written in a new experiment file, run on the smoke settings."""
    import json

    import yaml

    from dcmdp.config import load_config

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["methods"]["minirl_lr3e-4"] = {"about": "MiniRL at a 1.5x learning rate", "extends": "minirl",
                                      "overrides": ["optim.lr=3e-4"]}
    raw["profiles"] = {"mine": {"about": "the new method, smoke settings",
                                "overrides": raw["profiles"]["smoke"]["overrides"],
                                "cells": [{"levels": ["int8"], "methods": ["minirl_lr3e-4"], "N": [1], "seeds": [0]}]}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    bench, prefix = tmp_path / "runs", tmp_path / "results" / "mine_mine"
    run.main([str(path), "--profile", "mine", "--workers", "1", "--bench-dir", str(bench), "--results", str(prefix)])
    out = bench / "minirl_lr3e-4__N1__seed0"
    spec = json.loads((out / "cell.json").read_text())
    cfg = load_config(spec["base"], spec["overrides"])
    assert cfg.optim.lr == 3e-4 and cfg.algo.is_mode == "tis" and cfg.dual.rule == "off" and cfg.algo.minibatches == 1
    assert len(json.loads((out / "history.json").read_text())) == 3
    assert "| minirl_lr3e-4 | `algo.loss=minirl algo.is_mode=tis dual.rule=off optim.lr=3e-4` |" in \
        prefix.with_suffix(".md").read_text()


def test_method_overrides_at_a_level_apply_there_only_and_are_inherited(tmp_path):
    """A method's ``at_level`` adds overrides in the cells of that level alone, after the method's own; a method
    that extends it inherits them (its own per-level extras after)."""
    import yaml

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["levels"]["int4"] = {"about": "int4 rollouts", "overrides": ["rollout.precision=int4"]}
    raw["methods"]["minirl"]["at_level"] = {"int4": ["optim.lr=1e-4"]}
    raw["methods"]["minirl_r2"]["extends"] = "minirl"
    raw["methods"]["minirl_r2"]["at_level"] = {"int4": ["optim.lr=2e-4"], "int8": ["steps=7"]}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    exp = run.load_experiment(path)
    out = tmp_path / "cell"
    mine = exp.cell_overrides("smoke", "int4", "minirl", 1, 0, out)
    assert mine[mine.index("optim.lr=1e-4") - 1] == exp.methods["minirl"][-1]
    assert "optim.lr=1e-4" not in exp.cell_overrides("smoke", "int8", "minirl", 1, 0, out)
    child = exp.cell_overrides("smoke", "int4", "minirl_r2", 1, 0, out)
    assert child.index("optim.lr=1e-4") < child.index("optim.lr=2e-4") and "steps=7" not in child
    assert "steps=7" in exp.cell_overrides("smoke", "int8", "minirl_r2", 1, 0, out)


def test_every_profile_cell_is_a_valid_config(tmp_path):
    """Each (profile, level, method) of every experiment file loads and validates: a typo in a pre-registered config
    fails here, not after hours of runs."""
    from dcmdp.config import load_config

    run = _runner()
    checked = 0
    for path in sorted(run.EXPERIMENTS.glob("*.yaml")):
        exp = run.load_experiment(path)
        for profile in (p for p in exp.profiles if not exp.profiles[p].pool):  # a pooled one's parts are checked
            pairs = {(lv, m, n) for lv, m, n, _ in exp.cells(profile)}
            for lv, m, n in sorted(pairs):
                load_config(exp.base, exp.cell_overrides(profile, lv, m, n, 0, tmp_path / "cell"))
                checked += 1
    assert checked > 50


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["methods"]["minirl"].update(at_level={"int9": ["steps=1"]}), "methods.minirl.at_level"),
    (lambda raw: raw["methods"]["minirl"].update(extends="nope"), "methods.minirl.extends: no method 'nope'"),
    (lambda raw: raw["methods"]["minirl"].update(extends="minirl_r2"), "extends cycle"),
    (lambda raw: raw["methods"]["minirl"].pop("about"), "methods.minirl.about"),
    (lambda raw: raw["profiles"]["smoke"].update(seed=1), "profiles.smoke: unknown key(s) ['seed']"),
    (lambda raw: raw["profiles"]["smoke"]["cells"][0]["methods"].append("ghost"),
     "profiles.smoke.cells[0].methods: unknown ['ghost']"),
])
def test_experiment_file_errors(tmp_path, capsys, edit, message):
    """A malformed experiment file: the error names the key, and the command exits 2 before anything trains."""
    import yaml

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["methods"]["minirl_r2"]["extends"] = "minirl"
    edit(raw)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(run.ExperimentError, match=re.escape(message)):
        run.load_experiment(path)
    with pytest.raises(SystemExit) as exit_info:
        run.main([str(path), "--profile", "smoke", "--bench-dir", str(tmp_path / "runs")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_collapse_rule():
    run = _runner()
    flat = [0.5] * 40
    assert run.collapse_check([0.3, 0.4, 0.35], flat, 0, warmup=0) == (False, "")
    assert run.collapse_check([0.3, 0.4, 0.35], flat, 2, warmup=0)[0]  # non-finite updates
    assert run.collapse_check([0.3, 0.6, 0.29], flat, 0, warmup=0)[0]  # 0.29 < 0.6 / 2
    assert not run.collapse_check([0.3, 0.6, 0.30], flat, 0, warmup=0)[0]  # exactly half is not below
    # running reward, W = max(5, 40 // 20) = 5: peak window 0.8, last window 0.2 < 0.4
    assert run.collapse_check([0.3, 0.3], [0.8] * 20 + [0.2] * 20, 0, warmup=0)[0]
    # the peak is only taken after the warm-up: a high start inside the warm-up does not count
    assert not run.collapse_check([0.3, 0.3], [0.8] * 5 + [0.3] * 35, 0, warmup=5)[0]


def test_welch_p_against_its_closed_form_and_undefined_without_spread():
    """Two samples of three: Welch's t = (mean_a - mean_b) / sqrt(v_a/3 + v_b/3), Welch-Satterthwaite df, two-sided p
    from Student's t (scipy.stats.t, float64); NaN with one value on a side or no spread on both sides."""
    from scipy.stats import t as student

    run = _runner()
    a, b = [0.70, 0.74, 0.75], [0.60, 0.66, 0.71]
    ma, mb = sum(a) / 3, sum(b) / 3
    va, vb = (sum((x - ma) ** 2 for x in a) / 2) / 3, (sum((x - mb) ** 2 for x in b) / 2) / 3
    t, df = (ma - mb) / math.sqrt(va + vb), (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    assert run.welch_p(a, b) == pytest.approx(2 * student.sf(abs(t), df), rel=1e-9)
    assert math.isnan(run.welch_p([0.7578125] * 2, [0.76171875] * 2))  # scipy alone reads this p = 0
    assert math.isnan(run.welch_p([0.7], b)) and math.isnan(run.welch_p([0.5, 0.5], [0.5, 0.5]))
    assert 0 < run.welch_p([0.5, 0.5], [0.55, 0.75]) < 1  # one side with spread is a test


def _fake_run(run, level, method, seed, late, seconds=60.0, collapsed=False):
    """A finished run with the given late and final accuracy (the evaluations are flat at ``late``)."""
    return run.Run(level, method, 4, seed, 0.3, [0, 100], [late, late], collapsed, "", [1e-3], [2e-3], [0.1], [1e-3],
                   [1e-3], seconds, late, late, late)


def test_compare_block_picks_each_roles_best_candidate_and_tests_it(tmp_path):
    """``compare``: per level the role's candidates (a level's own list, else the '*' list), the one with the best
    late mean is the rival; the late difference and Welch p are those of the two samples; reading is ahead / behind
    only at p < 0.05; compute sums a group's runs per level."""
    import yaml
    from scipy.stats import ttest_ind

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["levels"]["fp8"] = {"about": "fp8 rollouts", "overrides": ["rollout.precision=fp8"]}
    raw["compare"] = {"about": "the bar", "configs": ["dcmdp_r3"],
                      "rivals": {"constant": {"int8": ["minirl", "minirl_r2"]}, "plain": ["minirl"]},
                      "compute": {"tuned": ["minirl", "minirl_r2"]}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    exp = run.load_experiment(path)
    mine, a, b = [0.80, 0.82, 0.84], [0.60, 0.62, 0.61], [0.70, 0.71, 0.69]
    runs = ([_fake_run(run, "int8", "dcmdp_r3", s, x) for s, x in enumerate(mine)]
            + [_fake_run(run, "int8", "minirl", s, x, seconds=30.0) for s, x in enumerate(a)]
            + [_fake_run(run, "int8", "minirl_r2", s, x, seconds=90.0) for s, x in enumerate(b)]
            + [_fake_run(run, "fp8", "dcmdp_r3", s, x) for s, x in enumerate([0.5, 0.6, 0.7])]
            + [_fake_run(run, "fp8", "minirl", s, x) for s, x in enumerate([0.55, 0.6, 0.65])])
    cells = run.aggregate(runs, [(lv, m, 4) for lv in ("int8", "fp8") for m in ("dcmdp_r3", "minirl", "minirl_r2")])
    rows = {(r["level"], r["role"]): r for r in run.compare_rows(exp.compare, cells)}
    assert set(rows) == {("int8", "constant"), ("int8", "plain"), ("fp8", "plain")}  # fp8 has no constant candidate
    r = rows[("int8", "constant")]
    assert r["rival"] == "minirl_r2"  # the better late mean of the two candidates
    assert abs(r["late_diff"] - (sum(mine) - sum(b)) / 3) < 1e-12
    assert abs(r["p_late"] - ttest_ind(mine, b, equal_var=False).pvalue) < 1e-12 and r["reading"] == "ahead"
    assert rows[("fp8", "plain")]["reading"] == "level"
    assert run.reading(-0.1, 0.01) == "behind" and run.reading(0.1, float("nan")) == "untested"
    compute = {(c["level"], c["what"]): c for c in run.compute_rows(exp.compare, runs)}
    assert compute[("int8", "tuned")]["runs"] == 6 and abs(compute[("int8", "tuned")]["run_minutes"] - 6.0) < 1e-12
    assert compute[("int8", "minirl")]["run_minutes"] == 1.5 and ("fp8", "tuned") in compute


def test_extreme_share_counts_steps_at_a_runs_lowest_or_highest_lambda():
    """λ at its extremes: per run, the share of steps within 1% of the run's λ range from its min or max; the mean
    over runs whose λ moves; a constant λ is left out, and NaN when no run's λ moves."""
    run = _runner()
    bang = [0.0, 0.3, 0.3, 0.0, 0.15, 0.298, 0.002, 0.1]  # range 0.3, margin 0.003: 6 of 8 at an extreme
    smooth = [0.1, 0.12, 0.14, 0.16, 0.18, 0.2]  # only its own min and max: 2 of 6
    assert abs(run.extreme_share([bang]) - 6 / 8) < 1e-15
    assert abs(run.extreme_share([bang, smooth, [0.3] * 5, [math.nan, 0.3, 0.3]]) - (6 / 8 + 2 / 6) / 2) < 1e-15
    assert math.isnan(run.extreme_share([[0.3] * 4, []]))


def test_bar_checks_each_clause_and_leaves_an_unfinished_cell_undecided(tmp_path):
    """The ``bar``: per (level, config) each clause from the measured cell - a "level" role is met by level or ahead,
    an "ahead" role only by ahead; collapses; the share of steps with D-hat <= c; the share with λ below lambda_max -
    and the verdict names the failed clauses; a cell with runs missing is not decided whatever its clauses say."""
    import yaml

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["levels"]["fp8"] = {"about": "fp8 rollouts", "overrides": ["rollout.precision=fp8"]}
    raw["compare"] = {"about": "the bar", "configs": ["dcmdp_r3"],
                      "rivals": {"swept": ["minirl", "minirl_r2"], "transfer": ["minirl"]},
                      "bar": {"roles": {"swept": "level", "transfer": "ahead"}, "collapses": 0, "inside_c": 0.7,
                              "below_cap": 0.5}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    exp = run.load_experiment(path)

    def dual_run(level, seed, late, measured, lambdas, collapsed=False):
        return dataclasses.replace(_fake_run(run, level, "dcmdp_r3", seed, late, collapsed=collapsed),
                                   measured=measured, tolerance=[1.0] * len(measured), lambdas=lambdas)

    # int8: level with the swept pick (minirl_r2), ahead of the transfer constant (minirl); inside c on 3 of 4 steps
    # (75%), λ at its cap 0.3 on 1 of 4 (below on 75%): every clause met
    runs = [dual_run("int8", s, x, [0.5, 0.5, 0.5, 2.0], [0.0, 0.1, 0.2, 0.3]) for s, x in enumerate([0.70, 0.71, 0.69])]
    runs += [_fake_run(run, "int8", "minirl", s, x) for s, x in enumerate([0.40, 0.42, 0.41])]
    runs += [_fake_run(run, "int8", "minirl_r2", s, x) for s, x in enumerate([0.70, 0.72, 0.69])]
    # fp8: level with the transfer constant (not ahead), inside c on 1 of 4 steps, λ at its cap on 3 of 4, a collapse
    runs += [dual_run("fp8", s, x, [0.5, 2.0, 2.0, 2.0], [0.1, 0.3, 0.3, 0.3], collapsed=s == 0)
             for s, x in enumerate([0.5, 0.6, 0.7])]
    runs += [_fake_run(run, "fp8", m, s, x) for m in ("minirl", "minirl_r2") for s, x in enumerate([0.55, 0.6, 0.65])]
    keys = [(lv, m, 4) for lv in ("int8", "fp8") for m in ("dcmdp_r3", "minirl", "minirl_r2")]
    cells = run.aggregate(runs, keys, caps={"dcmdp_r3": 0.3})
    compared = run.compare_rows(exp.compare, cells)
    rows = {r["level"]: r for r in run.bar_rows(exp.compare, cells, compared, {})}
    met = {c["clause"]: c["met"] for c in rows["int8"]["clauses"]}
    assert met == {"vs swept (level)": True, "vs transfer (ahead)": True, "collapses (<= 0)": True,
                   "inside c (>= 70%)": True, "λ below its cap (>= 50%)": True} and rows["int8"]["verdict"] == "met"
    fp8 = {c["clause"]: c for c in rows["fp8"]["clauses"]}
    assert fp8["vs swept (level)"]["met"] and not fp8["vs transfer (ahead)"]["met"]
    assert fp8["collapses (<= 0)"]["value"] == "1/3" and fp8["inside c (>= 70%)"]["value"] == "25%"
    assert fp8["λ below its cap (>= 50%)"]["value"] == "25%"
    assert rows["fp8"]["verdict"] == ("not met: vs transfer (ahead); collapses (<= 0); inside c (>= 70%); "
                                      "λ below its cap (>= 50%)")
    # the same cells with one of int8's runs unfinished: not decided, though every clause is met
    undecided = {r["level"]: r for r in run.bar_rows(exp.compare, cells, compared, {("int8", 4): 1, ("int4", 4): 7})}
    assert undecided["int8"]["verdict"].startswith("not decided") and undecided["fp8"]["verdict"].startswith("not met")
    # a level none of whose runs has finished is listed as not decided, not left off
    assert undecided["int4"]["verdict"] == "not decided (7 of the cell's runs not finished)"
    # ... for the configs the profile runs there only
    assert not [r for r in run.bar_rows(exp.compare, cells, compared, {("int4", 4): 7}, {("int4", "minirl", 4)})
                if r["level"] == "int4"]
    table = "\n".join(run.bar_table(list(rows.values())))
    assert "**not met**" in table and "| met |" in table
    # the dual-acting clause: int8's λ is above 0.01 on 3 of 4 steps (75%), fp8's on 4 of 4
    acting = dataclasses.replace(exp.compare, bar=run.Bar({}, acting=0.8))
    clause = {r["level"]: r["clauses"][0] for r in run.bar_rows(acting, cells, compared, {})}
    assert clause["int8"] == {"clause": "λ > 0.01 (>= 80%)", "value": "75%", "met": False}
    assert clause["fp8"] == {"clause": "λ > 0.01 (>= 80%)", "value": "100%", "met": True}
    # the clause across levels: ahead of the transfer constant at int8 (met), of the swept pick nowhere (not met; not
    # decided while a level has runs missing); only for the configs the profile runs
    def across(roles, missing=None, configs=None):
        cmp = dataclasses.replace(exp.compare, bar=run.Bar({}, ahead_somewhere=roles))
        return [(r["role"], r["met"]) for r in run.bar_across(cmp, compared, missing or {}, configs)]

    assert across(("transfer", "swept")) == [("transfer", True), ("swept", False)]
    assert across(("swept",), {("int4", 4): 7}) == [("swept", None)]
    assert across(("swept",), configs={"minirl"}) == []
    line = run.bar_across_lines(run.bar_across(dataclasses.replace(exp.compare, bar=run.Bar({}, ahead_somewhere=(
        "swept",))), compared, {}))
    assert line[0].startswith("- dcmdp_r3 ahead of the swept on at least one level: **not met** (level at int8, ")
    assert "; level at fp8, " in line[0]


def test_a_profile_bar_replaces_the_experiments_on_its_page_only(tmp_path):
    """A profile's own ``bar`` (a lever's pre-registered bar) is the one its page checks; the other profiles keep the
    compare block's; the cells are read the same way. A profile bar names the compare block's roles."""
    import yaml

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["compare"] = {"about": "the bar", "configs": ["dcmdp_r3"],
                      "rivals": {"swept": ["minirl_r2"], "transfer": ["minirl"]},
                      "bar": {"roles": {"swept": "level", "transfer": "ahead"}}}
    raw["profiles"]["lever"] = {**raw["profiles"]["smoke"], "about": "a lever", "bar": {"roles": {"swept": "level"},
                                                                                          "collapses": 0}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    exp = run.load_experiment(path)
    assert run.page_compare(exp, "smoke").bar == exp.compare.bar
    lever = run.page_compare(exp, "lever")
    assert lever.bar == run.Bar({"swept": "level"}, collapses=0) and lever.rivals == exp.compare.rivals
    # level with minirl_r2, level (not ahead) with minirl: the experiment's bar fails, the lever's holds
    runs = [_fake_run(run, "int8", "dcmdp_r3", s, x) for s, x in enumerate([0.60, 0.62, 0.61])]
    runs += [_fake_run(run, "int8", m, s, x) for m in ("minirl", "minirl_r2") for s, x in enumerate([0.6, 0.61, 0.62])]
    cells = run.aggregate(runs, [("int8", m, 4) for m in ("dcmdp_r3", "minirl", "minirl_r2")])
    compared = run.compare_rows(exp.compare, cells)
    assert run.bar_rows(exp.compare, cells, compared, {})[0]["verdict"].startswith("not met")
    assert run.bar_rows(lever, cells, compared, {})[0]["verdict"] == "met"
    raw["profiles"]["lever"]["bar"] = {"roles": {"ghost": "level"}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(run.ExperimentError, match=re.escape("profiles.lever.bar.roles: 'ghost' is not a rival role")):
        run.load_experiment(path)
    del raw["compare"]
    raw["profiles"]["lever"]["bar"] = {"collapses": 0}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(run.ExperimentError, match=re.escape("profiles.lever.bar: a bar needs the experiment's compare")):
        run.load_experiment(path)


@pytest.mark.parametrize("bar, message", [
    ({"roles": {"ghost": "level"}}, "compare.bar.roles: 'ghost' is not a rival role"),
    ({"roles": {"c": "better"}}, "compare.bar.roles.c: expected level or ahead"),
    ({"inside_c": 70}, "compare.bar.inside_c: expected a share in [0, 1]"),
    ({"collapses": -1}, "compare.bar.collapses: expected an integer >= 0"),
    ({"inside": 0.7}, "compare.bar: unknown key(s) ['inside']"),
    ({"acting": 1.5}, "compare.bar.acting: expected a share in [0, 1]"),
    ({"ahead_somewhere": ["ghost"]}, "compare.bar.ahead_somewhere: 'ghost' is not a rival role"),
    ({}, "compare.bar: name at least one clause"),
])
def test_bar_errors(tmp_path, bar, message):
    import yaml

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["compare"] = {"about": "x", "configs": ["dcmdp_r3"], "rivals": {"c": ["minirl"]}, "bar": bar}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(run.ExperimentError, match=re.escape(message)):
        run.load_experiment(path)


@pytest.mark.parametrize("block, message", [
    ({"about": "x", "configs": ["dcmdp_r3"], "rivals": {"c": ["ghost"]}}, "compare.rivals.c: unknown method(s) ['ghost']"),
    ({"about": "x", "configs": ["dcmdp_r3"], "rivals": {"c": {"int9": ["minirl"]}}}, "compare.rivals.c: unknown level(s)"),
    ({"about": "x", "configs": ["dcmdp_r3"], "rivals": {}}, "compare.rivals: name at least one rival role"),
    ({"about": "x", "configs": [], "rivals": {"c": ["minirl"]}}, "compare.configs: expected a non-empty list"),
    ({"configs": ["dcmdp_r3"], "rivals": {"c": ["minirl"]}}, "compare.about"),
])
def test_compare_block_errors(tmp_path, block, message):
    import yaml

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["compare"] = block
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(run.ExperimentError, match=re.escape(message)):
        run.load_experiment(path)


@pytest.mark.parametrize("smoke_run", ["stability"], indirect=True)
def test_pooled_profile_renders_its_parts_runs_with_shifted_seeds(smoke_run, tmp_path, capsys):
    """A pooled profile trains nothing and pages its parts' finished runs, each part's seeds shifted by its offset
    (here the smoke folder twice, as two cold starts would be), from their folders or their pages' records."""
    import csv
    import shutil

    import yaml

    run, exp, smoke_prefix, bench = smoke_run
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["profiles"]["both"] = {"about": "the smoke runs twice", "pool": [
        {"profile": "smoke", "bench_dir": str(bench), "seed_offset": 0},
        {"profile": "smoke", "bench_dir": str(bench), "seed_offset": 100}]}
    path = tmp_path / "pooled.yaml"
    path.write_text(yaml.safe_dump(raw))
    mtimes = {p: p.stat().st_mtime for p in bench.glob("*/summary.json")}
    prefix = tmp_path / "results" / "pooled_both"
    run.main([str(path), "--profile", "both", "--results", str(prefix)])
    rows = list(csv.DictReader(open(prefix.with_suffix(".csv"))))
    smoke = exp.cells("smoke")
    assert sorted((r["level"], r["method"], int(r["seed"])) for r in rows) == sorted(
        (lv, m, s + k) for lv, m, _, s in smoke for k in (0, 100))
    assert {p: p.stat().st_mtime for p in bench.glob("*/summary.json")} == mtimes  # nothing retrained
    md = prefix.with_suffix(".md").read_text()
    assert "pooled, no run trained here: profile smoke from" in md and "in progress" not in md

    # without the folders, from the part's page beside the pooled one
    shutil.copyfile(run.record_path(smoke_prefix), prefix.with_name("pooled_smoke.json.gz"))
    raw["profiles"]["both"]["pool"][1]["bench_dir"] = str(tmp_path / "gone")
    path.write_text(yaml.safe_dump(raw))
    run.main([str(path), "--profile", "both", "--results", str(prefix)])
    again = list(csv.DictReader(open(prefix.with_suffix(".csv"))))
    assert [(r["level"], r["method"], r["seed"], r["late"]) for r in again] == [
        (r["level"], r["method"], r["seed"], r["late"]) for r in rows]
    assert f"{len(smoke)} read from their pages' records" in capsys.readouterr().out


@pytest.mark.parametrize("pool, message", [
    ([{"profile": "smoke", "bench_dir": "a", "seed_offset": 0}, {"profile": "smoke", "bench_dir": "b", "seed_offset": 0}],
     "two parts give the same (level, method, N, seed)"),
    ([{"profile": "ghost", "bench_dir": "a", "seed_offset": 0}], "pool[0].profile: 'ghost' is not a profile with cells"),
    ([{"profile": "smoke", "bench_dir": "a"}], "pool[0]: expected exactly the keys profile, bench_dir, seed_offset"),
    ([], "pool: expected a list"),
])
def test_pooled_profile_errors(tmp_path, pool, message):
    import yaml

    run = _runner()
    raw = yaml.safe_load((run.EXPERIMENTS / "stability.yaml").read_text())
    raw["profiles"]["both"] = {"about": "pooled", "pool": pool}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(run.ExperimentError, match=re.escape(message)):
        run.load_experiment(path)


def test_paired_tests_by_seed_against_their_closed_forms():
    """Paired over the seeds both sides ran: t = mean(d) / (sd(d) / sqrt(n)) with n - 1 degrees of freedom; the exact
    Wilcoxon signed-rank p for three positive differences is 2 / 2^3 = 0.25; a seed one side lacks is left out."""
    from scipy.stats import t as student

    run = _runner()
    a, b = {0: 0.80, 1: 0.82, 2: 0.84}, {0: 0.70, 1: 0.71, 2: 0.69, 3: 0.50}
    d = [0.10, 0.11, 0.15]
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    out = run.paired(a, b)
    assert out["n"] == 3 and out["diff"] == pytest.approx(m, rel=1e-12)
    assert out["p_t"] == pytest.approx(2 * student.sf(m / (sd / math.sqrt(3)), 2), rel=1e-9)
    assert out["p_wilcoxon"] == pytest.approx(0.25, rel=1e-12)
    # one pair, or differences without spread: the t-test is undefined
    assert math.isnan(run.paired({0: 0.8}, {0: 0.7})["p_t"])
    assert math.isnan(run.paired({0: 0.8, 1: 0.9}, {0: 0.7, 1: 0.8})["p_t"])


def test_placebo_margin_counts_only_the_seeds_where_the_reach_exceeds_the_spread(tmp_path):
    """controller6's compare block: the config against its two placebo arms. Shares inside c by seed (10 steps each):
    config 0.9, 0.8, 0.5; lambda 0 placebo 0.7, 0.7, 0.6; lambda_max placebo 0.8, 0.8, 0.4. Reach > spread on seeds
    0 and 1 only: margins there (0.2 + 0.1) / 2 = 0.15 over lambda 0 (met, >= 0.10) and (0.1 + 0.0) / 2 = 0.05 over
    lambda_max (not met). With reach <= spread on every seed the clause does not apply (met: the accuracy clause alone
    is judged). The paired readings decide the accuracy role."""
    run = _runner()
    exp = run.load_experiment("controller6")
    assert exp.compare.placebos == {"dcmdp_authority": ("placebo_lambda0", "placebo_lambdamax")}
    assert exp.compare.bar.paired and exp.compare.bar.placebo_margin == 0.1
    weak = exp.profiles["confirm_weak"].bar
    assert weak.collapses_vs == "ESS rule alone" and weak.met_on == 4
    assert {s for _, _, _, s in exp.cells("confirm")} == set(range(10, 15))
    assert {s for _, _, _, s in exp.cells("confirm_weak")} == {3, 4, 5}

    def arm(method, shares, reach=(), late=0.6):
        out = []
        for seed, share in enumerate(shares):
            r = _fake_run(run, "program_trace", method, seed, late + 0.01 * seed)
            inside = round(10 * share)
            r = dataclasses.replace(r, measured=[1.0] * inside + [3.0] * (10 - inside), tolerance=[2.0] * 10,
                                    lambdas=[0.1] * 10, extra={"reach": reach[seed], "spread": 0.2} if reach else {})
            out.append(r)
        return out

    def cells(reach):
        runs = (arm("dcmdp_authority", [0.9, 0.8, 0.5], reach) + arm("placebo_lambda0", [0.7, 0.7, 0.6])
                + arm("placebo_lambdamax", [0.8, 0.8, 0.4]) + arm("lambda_0.1", [1, 1, 1], late=0.62)
                + arm("ess", [1, 1, 1], late=0.5))
        return run.aggregate(runs, [("program_trace", m, 4) for m in ("dcmdp_authority", "placebo_lambda0",
                                                                     "placebo_lambdamax", "lambda_0.1", "ess")],
                             caps={"dcmdp_authority": 0.3})

    here = cells((0.3, 0.25, 0.1))
    rows = {r["placebo"]: r for r in run.placebo_rows(exp.compare, here)}
    assert rows["placebo_lambda0"]["margin_authority"] == pytest.approx(0.15, abs=1e-12)
    assert rows["placebo_lambdamax"]["margin_authority"] == pytest.approx(0.05, abs=1e-12)
    assert rows["placebo_lambda0"]["margin"] == pytest.approx((0.2 + 0.1 - 0.1) / 3, abs=1e-12)  # every seed
    assert rows["placebo_lambda0"]["authority_seeds"] == 2 and rows["placebo_lambda0"]["measured_seeds"] == 3
    (bar,) = run.bar_rows(exp.compare, here, run.compare_rows(exp.compare, here), {})
    met = {c["clause"]: c for c in bar["clauses"]}
    assert met["inside c over placebo_lambda0 (>= 10 pts where reach > spread)"]["met"] is True
    assert met["inside c over placebo_lambdamax (>= 10 pts where reach > spread)"]["met"] is False
    # the accuracy role read paired: lambda 0.1 is 0.02 ahead on every seed, no spread in the differences: untested
    role = met["vs best of lambda 0.1 and ESS (level)"]
    assert "paired over 3 seeds" in role["value"] and role["met"] is None
    assert bar["verdict"].startswith("not decided")
    # no seed with authority: the placebo clauses do not apply
    none = cells((0.1, 0.1, 0.1))
    (bar,) = run.bar_rows(exp.compare, none, run.compare_rows(exp.compare, none), {})
    clause = {c["clause"]: c for c in bar["clauses"]}["inside c over placebo_lambda0 (>= 10 pts where reach > spread)"]
    assert clause["met"] is True and clause["value"] == "does not apply: reach <= spread on every seed (3)"
    table = "\n".join(run.placebo_table(run.placebo_rows(exp.compare, here)))
    assert "| placebo_lambda0 |" in table and "+15.0 pts" in table and "2 of 3" in table
    assert "late paired t p" in run.compare_table(run.compare_rows(exp.compare, here))[0]
    # met_on across levels: one cell not decided, so 4 of 5 is still open; a met cell counts
    line = run.met_on_line(weak, [{"config": "c", "verdict": v} for v in ("met", "met", "met", "not met: x", "not decided")])
    assert line == "The bar met on at least 4 cells: c: met on 3 of 5 (not decided)."
