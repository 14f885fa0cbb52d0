"""What the console says: a line per log_every steps when there is no terminal, a warning when RL has no signal
or the cold start ends below its target, and the same step numbers in MLflow, the report and the summary."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.config import load_config
from dcmdp.loop import NO_SIGNAL_STEPS, train
from dcmdp.report import write_report
from dcmdp.tracking import local_store_uri
from test_coldstart import SingleDigitSum
from trainers.coldstart import cold_start
from trainers.config import ColdStartConfig, ModelConfig
from trainers.models import build_model
from trainers.tokenizer import build_char_tokenizer

torch.set_num_threads(1)

BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=4", "threads=1", "rollout.max_new_tokens=4"]


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.slow
def test_without_a_terminal_a_line_every_log_every_steps_and_no_bar(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "dcmdp.cli", "train", *BASE, f"output_dir={tmp_path / 'out'}",
                           "steps=5", "log_every=2", "dual.constraints=[{measure: abs_prob_diff}, {measure: kl_k3}]"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "it/s" not in done.stderr and "dcmdp train:" not in done.stderr  # progress unset, no terminal: no bar
    lines = re.findall(r"dcmdp: (step \d+/5: .*)", done.stderr)
    assert [line.split(":")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert re.fullmatch(r"step 2/5: reward [\d.]+, rollout accuracy [\d.]+%, lambda abs_prob_diff=[\d.e-]+ "
                        r"kl_k3=[\d.e-]+, D-hat abs_prob_diff=[\d.e-]+ kl_k3=[\d.e-]+, [\d.]+ s/step "
                        r"\(mean of steps 1-2\), ETA \d+m\d\ds", lines[0]), lines[0]
    assert "(mean of steps 3-4)" in lines[1] and "(mean of steps 5-5)" in lines[2]
    assert re.search(r"held-out accuracy before RL: [\d.]+% \(4 eval prompts", done.stderr)
    assert done.stderr.index("held-out accuracy before RL") < done.stderr.index("step 2/5")


def test_zero_reward_variance_for_many_steps_warns_once(tmp_path, caplog):
    # a random model never answers right: every group's rewards are all 0
    train(load_config(None, [*BASE, f"output_dir={tmp_path / 'out'}", f"steps={NO_SIGNAL_STEPS + 3}",
                             "progress=false"]))
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RL has no signal")]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"RL has no signal: for {NO_SIGNAL_STEPS} steps in a row (up to step "
                                  f"{NO_SIGNAL_STEPS}) at least 95% of the groups gave the same reward")


def test_cold_start_below_its_target_warns_with_the_accuracy_and_steps(tmp_path, caplog):
    tok = build_char_tokenizer()
    model_cfg = ModelConfig(preset="tiny-dense")
    cfg = ColdStartConfig(steps=4, batch_size=8, cache_dir=str(tmp_path), target_accuracy=0.99, check_every=2)
    model = build_model(model_cfg, len(tok), seed=0)
    cold_start(model, tok, SingleDigitSum(), cfg, model_cfg, seed=0, eos_id=tok.eos_token_id, progress=False)
    # the stop rule checks at step 2 (step 4 is the last: no check), so the warning names step 2's accuracy
    checked = re.findall(r"cold start ended below its target: sampled accuracy on training prompts ([\d.]+)% at "
                         r"step 2 < cold_start.target_accuracy 99.0% \(after 4 of 4 steps\); RL may find little "
                         r"reward signal", caplog.text)
    assert len(checked) == 1 and float(checked[0]) < 99.0
    assert "held-out sampled accuracy" not in caplog.text  # the run prints one held-out figure: its own, before RL
    caplog.clear()
    # the cached entry remembers that its target was missed, and says so when it is loaded
    _, info = cold_start(build_model(model_cfg, len(tok), seed=0), tok, SingleDigitSum(), cfg, model_cfg, seed=0,
                         eos_id=tok.eos_token_id, progress=False)
    assert info["coldstart/cached"] == 1.0
    assert (f"cold start ended below its target: sampled accuracy on training prompts {checked[0]}% at step 2 < "
            f"cold_start.target_accuracy 99.0% (cached model ") in caplog.text
    assert "trained 4 of 4 steps)" in caplog.text


def test_cold_start_that_reaches_its_target_does_not_warn_when_trained_or_loaded(tmp_path, caplog):
    tok = build_char_tokenizer()
    model_cfg = ModelConfig(preset="tiny-dense")
    # single-digit sums pass 30% within 100 steps at this rate (test_coldstart): the rule stops before the last step
    cfg = ColdStartConfig(steps=100, batch_size=32, lr=6e-3, cache_dir=str(tmp_path), target_accuracy=0.2,
                          check_every=10)
    _, info = cold_start(build_model(model_cfg, len(tok), seed=0), tok, SingleDigitSum(), cfg, model_cfg, seed=0,
                         eos_id=tok.eos_token_id, progress=False)
    assert info["coldstart/steps"] < 100
    _, info = cold_start(build_model(model_cfg, len(tok), seed=0), tok, SingleDigitSum(), cfg, model_cfg, seed=0,
                         eos_id=tok.eos_token_id, progress=False)
    assert info["coldstart/cached"] == 1.0
    assert "cold start ended below its target" not in caplog.text


def test_step_numbers_agree_in_mlflow_report_and_summary_after_a_resume(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=2", "progress=false"]) == 0
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=5", "progress=false",
                     "checkpoint.resume=auto"]) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"after 5 steps \(3 in \d+ s after resuming at step 2\)", stdout), stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["resumed_at"] == 2
    client = MlflowClient(local_store_uri(out))
    run = client.search_runs([client.get_experiment_by_name("dcmdp").experiment_id])[0]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")) == [1, 2, 3, 4, 5]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")) == [0, 2, 5]
    md = write_report([run.info.run_id], tmp_path / "rep", tracking_uri=local_store_uri(out)).read_text()
    assert f"| `{run.info.run_id}` | FINISHED | 5 |" in md


def test_the_step_line_gives_the_mean_time_per_step_since_the_previous_line():
    """Ten steps in 56 s since the previous line: 5.60 s/step whatever the last step took, ETA from that mean."""
    import time
    from types import SimpleNamespace

    from dcmdp.loop import step_line

    state = SimpleNamespace(dual=SimpleNamespace(lambda_C=torch.tensor([0.5])), line_mark=(10, time.perf_counter() - 56.0))
    s = SimpleNamespace(names=["abs_prob_diff"], cfg=SimpleNamespace(steps=30), state=state)
    line = step_line(s, 20, {"time/step": 0.91, "reward/mean": 0.5, "reward/accuracy": 0.25,
                             "dual/measured/abs_prob_diff": 0.002})
    assert re.search(r", 5\.6\d s/step \(mean of steps 11-20\), ETA 0m5[6-7]s$", line), line


def test_summary_gives_each_constraint_as_constrained_and_warns_when_it_was_slack_throughout(tmp_path, capsys):
    """c = 0.5 is far above any D-hat: lambda falls to its floor 0 at the first step and stays, so the constraint is
    slack on every step; the random model ends at chance level. Both warnings reach the console and summary.json,
    and the per-constraint figures equal the MLflow history of the dual/ metrics."""
    out = tmp_path / "out"
    assert cli.main(["train", *BASE, f"output_dir={out}", "steps=4", "progress=false",
                     "dual.constraints=[{measure: abs_prob_diff, tolerance: 0.5, lambda_init: 0.1}]"]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    c = summary["constraints"]["abs_prob_diff"]
    client = MlflowClient(local_store_uri(out))
    run_id = summary["run_id"]

    def series(key):
        return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    measured = series("dual/measured/abs_prob_diff")
    assert len(measured) == 4 and c["measured_mean"] == pytest.approx(sum(measured) / 4, rel=1e-12)
    assert c["tolerance_start"] == c["tolerance_end"] == 0.5 and c["inside_frac"] == 1.0 and c["slack_frac"] == 1.0
    assert c["lambda_final"] == 0.0 and c["lambda_mean"] == 0.0  # 0.1 + 1 x (D - 0.5) < 0 from the first step
    assert re.search(r"constraint abs_prob_diff: mean D-hat [\d.e-]+ \(as constrained\), c 0.5 -> 0.5, inside on 100% of "
                     r"steps, lambda mean 0, final 0", stdout), stdout
    # dcmdp report shows the same mean D-hat as the summary
    (row,) = [r for r in csv.DictReader(open(write_report([run_id], tmp_path / "rep", tracking_uri=local_store_uri(out))
                                              .with_suffix(".csv")))]
    assert float(row["measured_mean"]) == pytest.approx(c["measured_mean"], rel=1e-12)
    assert [w.split(" (")[0].split(":")[0] for w in summary["warnings"]] == [
        "constraint abs_prob_diff was slack on 100% of the steps", "held-out accuracy ended at chance level"]
    assert stdout.count("warning: ") == 2


def test_a_demo_run_again_resumes_and_once_finished_says_so_and_exits_0(tmp_path, capsys):
    """``make demo`` trains with checkpoint.resume=auto: the first call trains, a second one on the finished run
    trains nothing (no new MLflow run, checkpoints untouched) and prints the summary; more steps continue it."""
    out = tmp_path / "out"
    argv = ["train", *BASE, f"output_dir={out}", "steps=2", "progress=false", "checkpoint.resume=auto"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    stamps = {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    assert cli.main(argv) == 0
    again = capsys.readouterr().out
    assert f"{out} holds this run, finished at step 2 (summary.json): nothing to train" in again
    assert first.splitlines()[0] in again  # the held-out accuracy line of the summary
    assert {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == stamps
    client = MlflowClient(local_store_uri(out))
    runs = client.search_runs([client.get_experiment_by_name("dcmdp").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == f"defaults/{str(out).strip('/').replace('/', '-')}"
    assert cli.main([*argv[:-2], "steps=3", "progress=false", "checkpoint.resume=auto"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_at"] == 2
