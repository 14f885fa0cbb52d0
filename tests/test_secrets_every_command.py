"""No secret at rest anywhere a command writes. A secret reaches dcmdp four ways: read from the environment by a
config (``${oc.env:PW}`` in a YAML file), written into a URI's userinfo by hand (``http://user:PW@host``), as a query
token (``?token=...``: refused, MLflow would send it inside the request's path) and through an environment variable
MLflow reads itself (``MLFLOW_TRACKING_TOKEN``, a bearer header). Each command that writes files (check, train, eval,
calibrate, report, tune, sync) runs on tiny configs, and every byte of every file under its output folders, of the
MLflow server's store and of the console is searched for each secret, plain, percent-encoded and JSON-escaped."""

from __future__ import annotations

import json
import random
import socket
import string
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from dcmdp import cli

TINY = {"model": {"preset": "tiny-dense"}, "cold_start": {"steps": 0}, "steps": 1, "threads": 1, "progress": False,
        "algo": {"prompts_per_step": 2, "samples_per_prompt": 2, "minibatches": 1},
        "task": {"eval_size": 2}, "rollout": {"max_new_tokens": 3}}


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _secrets(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + "-_.~"
    return ["s" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(16, 30))) for _ in range(n)]


def _leaks(secrets: dict[str, str], blobs: dict[str, bytes]) -> list[str]:
    """``how the secret came: where it was found`` for each secret in any of its written forms in any blob."""
    found = []
    for how, secret in secrets.items():
        forms = {secret.encode(), quote(secret, safe="").encode(), json.dumps(secret)[1:-1].encode()}
        found += [f"{how}: {name}" for name, data in blobs.items() if any(form in data for form in forms)]
    return found


def _files(*roots: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for root in roots for p in root.rglob("*") if p.is_file()}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the block ends: nothing answers there


def _run(capfd, console: list[str], *argv: str) -> int:
    code = cli.main(list(argv))
    captured = capfd.readouterr()
    console.append(captured.out + captured.err)
    return code


def _setup(tmp_path: Path, monkeypatch, mlflow_server):
    """(secrets by how they came, the server's host:port, run.yaml reading the password from the environment)."""
    secrets = dict(zip(("environment", "userinfo", "query token", "MLFLOW_TRACKING_TOKEN"), _secrets(7575, 4)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DCMDP_S_PW", secrets["environment"])
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", secrets["MLFLOW_TRACKING_TOKEN"])
    host = mlflow_server.uri.split("://", 1)[1]
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({**TINY, "tracking": {"uri": f"http://dcmdp:${{oc.env:DCMDP_S_PW}}@{host}",
                                                             "experiment": "secrets-at-rest"}}))
    return secrets, host, run_yaml


def _tune_file(tmp_path: Path, run_yaml: Path, uri: str) -> Path:
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({"base": str(run_yaml), "overrides": [f"tracking.uri={uri}", "steps=1"],
                                    "space": {"dual.constraints[0].tolerance": [0.01]},
                                    "select": {"max_slack_frac": 1.0}, "prime_cold_start": False,
                                    "output_dir": str(tmp_path / "tune")}))
    return path


def test_no_command_writes_a_secret_given_by_the_environment_a_uri_a_query_token_or_a_header(
        tmp_path, monkeypatch, capfd, mlflow_server):
    """check, train, eval, calibrate and report against a live server whose password the config reads from the
    environment, with MLFLOW_TRACKING_TOKEN set; report and sync with a password written into --tracking-uri; tune
    with both, its server down, then sync. A query token is refused by check, train and tune (exit 2) with a line
    naming tracking.uri and not the token. No file under any output folder (study.db: the study's attributes, the
    trials' params and records; the buffers; best.yaml), nothing in the server's store and nothing on the console
    holds any of the four secrets; the study records the overrides as written (the interpolation, the URI without
    its userinfo). About 30 s on 2 cores."""
    import optuna

    secrets, host, run_yaml = _setup(tmp_path, monkeypatch, mlflow_server)
    console: list[str] = []
    train_dir = tmp_path / "train"
    literal_uri = f"http://dcmdp:{secrets['userinfo']}@{host}"
    assert _run(capfd, console, "check", str(run_yaml), f"output_dir={train_dir}") == 0, console[-1][-3000:]
    assert _run(capfd, console, "train", str(run_yaml), f"output_dir={train_dir}") == 0, console[-1][-3000:]
    run_id = json.loads((train_dir / "summary.json").read_text())["run_id"]
    assert _run(capfd, console, "eval", str(run_yaml), f"output_dir={train_dir}", "--checkpoint", "auto") == 0, \
        console[-1][-3000:]
    (tmp_path / "calibrate").mkdir()
    assert _run(capfd, console, "calibrate", str(run_yaml), f"output_dir={tmp_path / 'calibrate'}", "--batches", "1",
                "--out", str(tmp_path / "calibrate" / "snippet.yaml")) == 0, console[-1][-3000:]
    assert _run(capfd, console, "report", run_id, "--tracking-uri", literal_uri, "--out",
                str(tmp_path / "report")) == 0, console[-1][-3000:]
    # a query token: refused before anything is written, naming the key and not the token
    query = f"tracking.uri=http://{host}/?token={secrets['query token']}"
    for argv in (("check", str(run_yaml), query, f"output_dir={tmp_path / 'q'}"),
                 ("train", str(run_yaml), query, f"output_dir={tmp_path / 'q'}"),
                 ("tune", str(_tune_file(tmp_path, run_yaml, f"http://{host}")), query)):
        assert _run(capfd, console, *argv) == 2, console[-1][-3000:]
        assert "config error at 'tracking.uri'" in console[-1] and "MLFLOW_TRACKING_TOKEN" in console[-1], console[-1]
    assert not (tmp_path / "q").exists()
    port = _closed_port()
    tune_file = _tune_file(tmp_path, run_yaml, f"http://dcmdp:${{oc.env:DCMDP_S_PW}}@127.0.0.1:{port}")
    assert _run(capfd, console, "tune", str(tune_file), f"tracking.uri=http://dcmdp:{secrets['userinfo']}@127.0.0.1:"
                                                        f"{port}") == 0, console[-1][-3000:]
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{tmp_path / 'tune' / 'study.db'}")
    assert json.loads(study.user_attrs["dcmdp.spec"])["overrides"] == [
        f"tracking.uri=http://dcmdp:${{oc.env:DCMDP_S_PW}}@127.0.0.1:{port}", "steps=1",
        f"tracking.uri=http://127.0.0.1:{port}"]
    [segment] = (tmp_path / "tune" / "tracking_buffer").glob("*.jsonl")
    assert "${oc.env:DCMDP_S_PW}" in segment.read_text()  # the parent run's tune.overrides param, as written
    for buffer in (tmp_path / "tune").rglob("tracking_buffer"):
        assert _run(capfd, console, "sync", str(buffer), "--tracking-uri", literal_uri) == 0, console[-1][-3000:]
    written = _files(tmp_path, mlflow_server.root)
    assert {Path(p).name for p in written} >= {"summary.json", "config.yaml", "state.pt", "study.db", "best.yaml",
                                               "snippet.yaml", "run.yaml"}
    blobs = {**written, "console": "".join(console).encode()}
    assert not _leaks(secrets, blobs), _leaks(secrets, blobs)
