"""A real training job (tiny-moe, one constraint) logging to a real MLflow server, read back step by step.

Every step's λ and discrepancy values in MLflow must be exactly the values the loop recorded in its
history (kept in the final checkpoint), one value per step for steps 1..N, and agree with the summary.
"""

import math

import pytest
import torch

from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint
from dcmdp.config import load_config
from dcmdp.loop import train

STEPS = 4


def test_every_step_of_lambda_and_discrepancy_reaches_the_server(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "model.preset=tiny-moe", "rollout.precision=int8", "cold_start.steps=5",
        f"cold_start.cache_dir={tmp_path / 'cache'}", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
        "algo.minibatches=2", "task.eval_size=8", f"steps={STEPS}", "threads=1", "progress=false",
        f"output_dir={tmp_path / 'run'}", f"tracking.uri={mlflow_server.uri}", "tracking.experiment=tracking-train",
        # one constraint with a tolerance below the int8 floor, so lambda moves on every step
        "dual.constraints=[{measure: kl_k3, tolerance: 1e-12, lambda_init: 0.5, lr: 100.0}]"])
    summary = train(cfg)
    assert summary.tracking_uri == mlflow_server.uri
    history = load_checkpoint(find_resume_checkpoint(tmp_path / "run" / "checkpoints", "auto"))["history"]
    assert len(history) == STEPS

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED"
    keys = [k for k in run.data.metrics if k.startswith(("dual/lambda/", "dual/measured/", "discrepancy/"))]
    assert "dual/lambda/kl_k3" in keys and "dual/measured/kl_k3" in keys and "discrepancy/kl_k3" in keys
    assert {k for k in history[0] if k.startswith(("dual/lambda/", "dual/measured/", "discrepancy/"))} == set(keys)
    for key in keys:
        logged = client.get_metric_history(summary.run_id, key)
        assert sorted(m.step for m in logged) == list(range(1, STEPS + 1)), key
        by_step = {m.step: m.value for m in logged}
        for step in range(1, STEPS + 1):
            want = history[step - 1][key]
            assert by_step[step] == want or (math.isnan(want) and math.isnan(by_step[step])), (key, step)

    lam = [m.value for m in sorted(client.get_metric_history(summary.run_id, "dual/lambda/kl_k3"), key=lambda m: m.step)]
    assert lam[-1] == summary.final_lambda["kl_k3"]
    # D-hat > c on every step: projected ascent raises lambda each time (lambda_max = 10 is not reached).
    assert all(b > a for a, b in zip([0.5] + lam[:-1], lam))
    for name, mean in summary.mean_discrepancy.items():
        values = [m.value for m in client.get_metric_history(summary.run_id, f"discrepancy/{name}")]
        assert mean == pytest.approx(sum(values) / len(values), rel=1e-12, abs=1e-300)
    # the experiment shows its runs as model training in MLflow 3's UI; the summary's constraint figures are the
    # dual/ metrics as constrained
    from dcmdp.tracking import EXPERIMENT_TAGS

    exp = client.get_experiment(run.info.experiment_id)
    assert {k: exp.tags.get(k) for k in EXPERIMENT_TAGS} == EXPERIMENT_TAGS
    measured = [m.value for m in client.get_metric_history(summary.run_id, "dual/measured/kl_k3")]
    assert summary.constraints["kl_k3"].measured_mean == pytest.approx(sum(measured) / len(measured), rel=1e-12)
    assert summary.constraints["kl_k3"].inside_frac == 0.0 and summary.constraints["kl_k3"].lambda_final == lam[-1]
    # the loop gives the tracker its constraints' caps: lambda's overview section holds lambda and the cap
    # (lambda_max: the default 10), and dual.png (lambda from lambda_init, D-hat against c) is one of the run's files
    assert run.data.metrics["0_dual/kl_k3/lambda"] == lam[-1] and run.data.metrics["0_dual/kl_k3/lambda_max"] == 10.0
    assert "dual.png" in {a.path for a in client.list_artifacts(summary.run_id)}


def test_the_command_names_its_run_after_the_config_and_the_output_folder(tmp_path, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    from dcmdp.cli import main

    (tmp_path / "tiny.yaml").write_text("model:\n  preset: tiny-dense\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny.yaml", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
                 "algo.minibatches=1", "task.eval_size=4", "threads=1", "rollout.max_new_tokens=4", "steps=1",
                 "progress=false", "output_dir=outputs/tiny", f"tracking.uri={mlflow_server.uri}",
                 "tracking.experiment=run-names"]) == 0
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("run-names").experiment_id])
    assert run.info.run_name == "tiny/outputs-tiny"
