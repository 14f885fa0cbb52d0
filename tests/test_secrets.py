"""Secrets kept out of every artefact by construction: a value read from the environment is recorded as its
interpolation, a URI without its userinfo and credential parameters (dcmdp.redact). Property tests feed random
secret strings through the config records (many examples, no training) and through every artefact of two real
short runs (config.yaml, summary.json, checkpoints, run.lock, run.json, the tracking buffer, the MLflow store and
the console), grepping every byte for them."""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dcmdp import cli
from dcmdp.config import ConfigError, flatten, load_config, resume_conflicts, to_yaml
from dcmdp.redact import credential_param, public_uri, uri_problem

BASE = ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
        "algo.minibatches=1", "task.eval_size=2", "threads=1", "progress=false", "rollout.max_new_tokens=3", "steps=1"]

# unreserved URI characters: a secret made of them reads the same percent-encoded, JSON-escaped or in YAML
SECRET = st.text(alphabet=string.ascii_letters + string.digits + "-_.~", min_size=12, max_size=40).filter(
    lambda s: not s.isdigit() and s.strip("-_.~"))
# what may be given from the environment for a password, anything printable but a line break
RAW = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF, exclude_characters="\\'\"${}"),
              min_size=12, max_size=40)


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _forms(secret: str) -> list[bytes]:
    return sorted({secret.encode(), quote(secret, safe="").encode(), json.dumps(secret)[1:-1].encode()})


def _leaks(secret: str, blobs: dict[str, bytes]) -> list[str]:
    return [name for name, data in blobs.items() for form in _forms(secret) if form in data]


def _files(*roots: Path) -> dict[str, bytes]:
    out = {}
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                out[str(path)] = path.read_bytes()
    return out


# ----------------------------------------------------------------------------------- records of a config, no run

@settings(max_examples=10, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(password=RAW, token=SECRET, name=SECRET, literal=SECRET, key=SECRET)
def test_random_secrets_never_reach_a_record_and_config_yaml_reads_back(monkeypatch, tmp_path, password, token, name,
                                                                       literal, key):
    """Secrets from the environment (a URI password of any printable characters, a query token, a fragment's
    api_key, the run name) and a password written into a URI by hand: none is in config.yaml or the flattened
    params, config.yaml parses as YAML and loads back to the same resolved config, and a URI the run cannot use
    is refused by a message without the secret."""
    monkeypatch.setenv("DCMDP_PW", password)
    monkeypatch.setenv("DCMDP_TOK", token)
    monkeypatch.setenv("DCMDP_NAME", name)
    monkeypatch.setenv("DCMDP_KEY", key)
    # a database URI: an MLflow server's (http) takes no query or fragment
    uri = ("postgresql://me:${oc.env:DCMDP_PW}@127.0.0.1:5432/mlflow?token=${oc.env:DCMDP_TOK}&x=1"
           "#api_key=${oc.env:DCMDP_KEY}")
    overrides = [f"tracking.uri={uri}", "tracking.run_name=${oc.env:DCMDP_NAME}", "progress=${oc.env:DCMDP_PB,false}"]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as exc:  # a password with '/', '?', '#' or '@' breaks the URI: refused, the secret unsaid
        assert "tracking.uri" in str(exc) and not _leaks(password, {"error": str(exc).encode()})
        assert uri_problem(f"http://me:{password}@127.0.0.1:5000") is not None
        return
    records = {"config.yaml": to_yaml(cfg, public=True).encode(), "params": json.dumps(flatten(cfg)).encode()}
    for secret in (password, token, name, key):
        assert not _leaks(secret, records), secret
    assert "${oc.env:DCMDP_PW}" in records["config.yaml"].decode()
    path = tmp_path / "config.yaml"
    path.write_text(records["config.yaml"].decode())
    assert isinstance(yaml.safe_load(path.read_text()), dict)
    assert load_config(path) == cfg
    # a literal password written into the URI is left out with its userinfo
    literal_cfg = load_config(None, [f"tracking.uri=postgresql://bob:{literal}@db:5432/mlflow?sslmode=require"
                                     f"&api_key={key}"])
    assert flatten(literal_cfg)["tracking.uri"] == "postgresql://db:5432/mlflow?sslmode=require"
    assert not _leaks(literal, {"config.yaml": to_yaml(literal_cfg, public=True).encode()})


@pytest.mark.parametrize("uri, public", [
    ("http://127.0.0.1:5000/?token=abc123&x=1", "http://127.0.0.1:5000/?x=1"),
    ("https://h/p?X-Amz-Signature=zz&X-Amz-Credential=cc&X-Amz-Date=1", "https://h/p?X-Amz-Date=1"),
    ("https://h/p?sig=zz&access_token=t&password=p&auth=a&secret=s&key=k&page=2", "https://h/p?page=2"),
    ("https://ghp_tokenasuser@host/x", "https://host/x"),
    ("http://alice:QWxh/ZGRp+bg==@127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("http://host:5000/a@b", "http://host:5000/a@b"),
    ("http://me:${oc.env:PW}@host/?token=${oc.env:T}", "http://me:${oc.env:PW}@host/?token=${oc.env:T}"),
    ("http://${oc.env:TOKEN}@host", "http://${oc.env:TOKEN}@host"),
    ("http://me:literal@host?token=${oc.env:T}", "http://host?token=${oc.env:T}"),
    ("sqlite:////tmp/run/mlflow.db", "sqlite:////tmp/run/mlflow.db"),
    ("databricks", "databricks"),
])
def test_public_uri_removes_credentials_structurally(uri, public):
    assert public_uri(uri) == public


def test_credential_parameters_are_known_by_name_and_common_words_are_not_masked(monkeypatch):
    for name in ("token", "api_key", "apikey", "X-Amz-Signature", "sig", "access_token", "client_secret", "password",
                 "passwd", "auth", "Authorization", "session_id", "jwt"):
        assert credential_param(name), name
    for name in ("page", "x", "experiment", "design", "signal_rate"):
        assert not credential_param(name), name
    # values that are common words are never masked in a record: nothing is replaced as a substring
    monkeypatch.setenv("DCMDP_PB", "false")
    cfg = load_config(None, ["progress=${oc.env:DCMDP_PB}"])
    text = to_yaml(cfg, public=True)
    assert "progress: ${oc.env:DCMDP_PB}" in text and "overwrite: false" in text
    assert yaml.safe_load(text)["dual"]["average"] is False


def test_a_password_with_a_slash_is_refused_naming_the_key_not_the_password(monkeypatch, capsys):
    code = cli.main(["train", "tracking.uri=http://alice:QWxh/ZGRp+bg==@127.0.0.1:5000", "steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and "config error at 'tracking.uri': 'http://127.0.0.1:5000' cannot be used" in err
    assert "QWxh" not in err and "ZGRp" not in err


def test_a_resume_checked_key_from_the_environment_is_compared_on_its_value(monkeypatch):
    monkeypatch.setenv("DCMDP_PRESET", "tiny-dense")
    saved = flatten(load_config(None, ["model.preset=${oc.env:DCMDP_PRESET}"]))
    assert saved["model.preset"] == "tiny-dense"  # what a checkpoint records of it
    monkeypatch.setenv("DCMDP_PRESET", "tiny-moe")
    now = load_config(None, ["model.preset=${oc.env:DCMDP_PRESET}"])
    assert resume_conflicts(saved, now) == ["model.preset: 'tiny-dense' in the checkpoint, 'tiny-moe' now"]
    assert "preset: ${oc.env:DCMDP_PRESET}" in to_yaml(now, public=True)


# ---------------------------------------------------------------------------------------------- real short runs

def _secrets(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + "-_.~"
    return ["s" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(12, 30))) for _ in range(n)]


def _train(argv: list[str], capfd) -> tuple[int, str]:
    code = cli.main(["train", *argv])
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def test_random_secrets_reach_no_artefact_of_a_run_tracked_to_a_server(tmp_path, monkeypatch, capfd, caplog,
                                                                      mlflow_server):
    """A password and a run name from the environment; an output folder named from the environment too (its
    records hold the interpolation). After a run, a resume from the run's own config.yaml: every file of the
    output folder and of the MLflow server's store, and the console, are free of the secrets."""
    password, run_name = _secrets(46, 2)
    monkeypatch.setenv("DCMDP_T_PW", password)
    monkeypatch.setenv("DCMDP_T_NAME", run_name)
    out = tmp_path / "out"
    monkeypatch.setenv("DCMDP_T_OUT", str(out))
    host = mlflow_server.uri.split("://", 1)[1]
    argv = [*BASE, f"tracking.uri=http://dcmdp:${{oc.env:DCMDP_T_PW}}@{host}",
            "tracking.run_name=${oc.env:DCMDP_T_NAME}", "output_dir=${oc.env:DCMDP_T_OUT}", "checkpoint.every=1"]
    code, console = _train(argv, capfd)
    assert code == 0, console[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["output_dir"] == "${oc.env:DCMDP_T_OUT}"
    # the run resumes from its own config.yaml, which names the interpolations
    text = (out / "config.yaml").read_text()
    assert "uri: http://dcmdp:${oc.env:DCMDP_T_PW}@" in text and "run_name: ${oc.env:DCMDP_T_NAME}" in text
    code, console2 = _train([str(out / "config.yaml"), "steps=2", "checkpoint.resume=auto"], capfd)
    assert code == 0, console2[-3000:]
    from mlflow.tracking import MlflowClient

    run = MlflowClient(mlflow_server.uri).get_run(summary["run_id"])
    assert run.data.tags["dcmdp.output_dir"] == "${oc.env:DCMDP_T_OUT}"
    assert run.data.tags["mlflow.runName"] == "${oc.env:DCMDP_T_NAME}"
    state = torch.load(out / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)
    assert state["run"]["output_dir"] == "${oc.env:DCMDP_T_OUT}"
    blobs = {**_files(out, mlflow_server.root), "console": (console + console2).encode(), "log": caplog.text.encode()}
    for secret in (password, run_name):
        assert not _leaks(secret, blobs), (secret, _leaks(secret, blobs))


def test_random_secrets_reach_no_artefact_of_a_run_whose_tracking_is_buffered(tmp_path):
    """A tracking URI with a literal password beside a user name, a run name from the environment and an
    unreachable server: the metrics are buffered, and the buffer, run.lock, config.yaml, summary.json, the checkpoint,
    the console and the log (urllib3's retry warnings repeat the URL) hold none of the secrets; the buffer's header
    names the URI without them. (A query token is refused: test_secrets_every_command.py.)"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing answers there
    user, password, sig = _secrets(4646, 3)
    out = tmp_path / "out"
    uri = f"http://{user}:{password}@127.0.0.1:{port}/"
    # a process of its own: its command line (run.lock, the dcmdp.command tag) holds the literal secrets
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "OMP_NUM_THREADS": "1",
           "DCMDP_T_SIG": sig}
    done = subprocess.run([sys.executable, "-m", "dcmdp.cli", "train", *BASE, f"tracking.uri={uri}",
                           "tracking.run_name=${oc.env:DCMDP_T_SIG}", f"output_dir={out}"], capture_output=True,
                          text=True, env=env, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    [segment] = (out / "tracking_buffer").glob("*.jsonl")
    header = json.loads(segment.read_text().splitlines()[0])
    assert header["uri"] == f"http://127.0.0.1:{port}/" and header["credentials_removed"] is True
    assert "tracking.uri" in (out / "run.lock").read_text()  # the key, not its value
    assert "tracking.uri holds a credential written into it" in console  # and says how to keep it
    records = [json.loads(line) for line in segment.read_text().splitlines()[1:]]
    [command] = [r["tags"]["dcmdp.command"] for r in records if "dcmdp.command" in r.get("tags", {})]
    assert command.endswith("(overrides, values not recorded: " + ", ".join(
        o.split("=")[0] for o in [*BASE, "tracking.uri=", "tracking.run_name=", "output_dir="]) + ")")
    blobs = {**_files(out), "console": console.encode()}
    for secret in (password, sig):
        assert not _leaks(secret, blobs), (secret, _leaks(secret, blobs))
    # a user name beside a password is no secret (a library's message may repeat it); no record holds it
    assert not _leaks(user, _files(out)), _leaks(user, _files(out))


def test_a_tune_trial_config_keeps_interpolations_and_holds_no_uri_credential(monkeypatch, tmp_path):
    """A trial's run.yaml is a record too: the study's URI reaches the trial through the environment, and values the
    base config read from it stay interpolations."""
    from dcmdp.tune import TRIAL_URI_VARIABLE, apply_settings

    monkeypatch.setenv("DCMDP_NAME", "job-1234567")
    monkeypatch.setenv(TRIAL_URI_VARIABLE, "http://me:pw-4711@h:5000")
    base = load_config(None, ["tracking.run_name=${oc.env:DCMDP_NAME}", "dual.constraints[0].lr=${oc.env:DCMDP_LR,2}"])
    trial = apply_settings(base, {"tracking.uri": f"${{oc.env:{TRIAL_URI_VARIABLE}}}",
                                  "dual.constraints[0].lr": 0.5})
    text = to_yaml(trial, public=True)
    assert trial.tracking.uri == "http://me:pw-4711@h:5000" and "pw-4711" not in text
    assert "run_name: ${oc.env:DCMDP_NAME}" in text and f"uri: ${{oc.env:{TRIAL_URI_VARIABLE}}}" in text
    assert trial.dual.constraints[0].lr == 0.5 and "DCMDP_LR" not in text  # a setting replaces the interpolation
    (tmp_path / "run.yaml").write_text(text)
    assert load_config(tmp_path / "run.yaml") == trial


def test_a_tune_file_keeps_its_overrides_and_best_yaml_its_values_as_written(monkeypatch, tmp_path):
    """The tune file's overrides reach the study's attributes and the parent run's params as written (OmegaConf
    resolved them when the file was read), with a URI's literal password left out; best.yaml holds a constraint's
    value read from the environment as its interpolation."""
    from dcmdp.redact import public_overrides
    from dcmdp.tune import Trial, best_snippet, load_tune_config

    monkeypatch.setenv("DCMDP_T_PW", "pw-of-the-study-4711")
    monkeypatch.setenv("DCMDP_T_LR", "0.25")
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({
        "base": "run.yaml", "overrides": ["tracking.uri=http://me:${oc.env:DCMDP_T_PW}@h:5000", "steps=1"],
        "space": {"dual.constraints[0].tolerance": [0.01]}, "output_dir": str(tmp_path / "tune")}))
    (tmp_path / "run.yaml").write_text("model: {preset: tiny-dense}\n"
                                       "dual: {constraints: [{lr: '${oc.env:DCMDP_T_LR}'}]}\n")
    cfg = load_tune_config(tmp_path / "tune.yaml", ["tracking.uri=http://me:literal-pw-4711@h:5000"])
    assert cfg.overrides == ["tracking.uri=http://me:${oc.env:DCMDP_T_PW}@h:5000", "steps=1",
                             "tracking.uri=http://me:literal-pw-4711@h:5000"]
    assert public_overrides(cfg.overrides, ("tracking.uri",))[2] == "tracking.uri=http://h:5000"
    text = best_snippet(load_config(cfg.base, cfg.overrides), Trial("t000", {"dual.constraints[0].tolerance": 0.01}))
    assert "lr: ${oc.env:DCMDP_T_LR}" in text and "tolerance: 0.01" in text and "0.25" not in text


def test_metrics_buffered_during_an_outage_are_sent_with_the_password_read_again(tmp_path, monkeypatch,
                                                                                 mlflow_server):
    """The buffer's header holds the URI without its password and the config's interpolation of it: ``dcmdp sync``
    (here ``sync_report`` with no URI) resolves the interpolation from the environment and sends the run."""
    from mlflow.tracking import MlflowClient

    from dcmdp.tracking import Tracker, sync_report

    monkeypatch.setenv("DCMDP_T_PW", "pw-of-the-outage-4711")
    host = mlflow_server.uri.split("://", 1)[1]
    cfg = load_config(None, [f"tracking.uri=http://dcmdp:${{oc.env:DCMDP_T_PW}}@{host}",
                             f"tracking.buffer_dir={tmp_path / 'buffer'}", "tracking.async_log=false"])
    mlflow_server.stop()
    try:
        tracker = Tracker(cfg.tracking, tmp_path)
        local = tracker.start({"seed": "0"})
        for step in range(3):
            tracker.log_metrics({"reward/mean": 0.1 * step}, step=step)
        tracker.finish()
    finally:
        mlflow_server.start()
    [segment] = (tmp_path / "buffer").glob("*.jsonl")
    assert local.startswith("local-") and b"pw-of-the-outage" not in segment.read_bytes()
    header = json.loads(segment.read_text().splitlines()[0])
    assert header["uri"] == mlflow_server.uri and header["uri_as_written"].startswith("http://dcmdp:${oc.env:")
    from dcmdp import tracking

    used, post_init = [], tracking._Sender.__post_init__  # which URI the sender is built with (the server asks none)
    monkeypatch.setattr(tracking._Sender, "__post_init__", lambda self: (used.append(self.tracking_uri),
                                                                          post_init(self))[1])
    report = sync_report(tmp_path / "buffer")
    assert report.sent == 3 and report.remaining == []
    assert used == [f"http://dcmdp:pw-of-the-outage-4711@{host}"]
    runs = MlflowClient(mlflow_server.uri).search_runs(
        [e.experiment_id for e in MlflowClient(mlflow_server.uri).search_experiments()],
        filter_string="params.seed = '0'")
    assert any([m.value for m in MlflowClient(mlflow_server.uri).get_metric_history(r.info.run_id, "reward/mean")]
               == [0.0, 0.1, 0.2] for r in runs)


def test_the_default_run_name_of_an_output_folder_from_the_environment_holds_the_interpolation(monkeypatch):
    import argparse

    monkeypatch.setenv("DCMDP_T_OUT", "/tmp/folder-s3cr3t-name")
    cfg = cli._load(argparse.Namespace(args=["output_dir=${oc.env:DCMDP_T_OUT}"]))
    assert cfg.output_dir == "/tmp/folder-s3cr3t-name"
    text = to_yaml(cfg, public=True)
    assert "run_name: defaults/${oc.env:DCMDP_T_OUT}" in text
    assert "s3cr3t" not in text and "s3cr3t" not in json.dumps(flatten(cfg))
