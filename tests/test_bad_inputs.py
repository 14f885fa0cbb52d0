"""The bad-input catalogue (docs/bad_inputs.md): every bad input gets a clear, specific error naming what is
wrong and where, or a logged skip, and nothing already written (checkpoints, MLflow runs) is lost.

Cases already tested elsewhere are listed in docs/bad_inputs.md with the test that covers them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dcmdp import cli
from dcmdp.checkpoint import CheckpointError
from dcmdp.config import ConfigError, load_config
from dcmdp.loop import train
from dcmdp.tracking import local_store_uri
from trainers import guards, learner
from trainers.batch import Rollout
from trainers.config import AlgoConfig, ModelConfig, RolloutConfig, TaskConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model, save_model_dir
from trainers import tasks
from trainers.tasks import TASKS
from trainers.tokenizer import build_char_tokenizer, load_tokenizer
from cli_process import run_dcmdp
from fsutil import unprivileged

torch.set_num_threads(1)


def _overrides(out, *extra: str) -> list[str]:
    return ["model.preset=tiny-dense", "cold_start.steps=0", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
            "algo.minibatches=1", "task.eval_size=4", "steps=2", "threads=1", "progress=false",
            "rollout.max_new_tokens=4", f"output_dir={out}", *extra]


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("override, needle", [
    ("algo.std_normalize=maybe", r"'algo.std_normalize': Value 'maybe' is not a valid bool"),
    ("algo.minibatches=2.5", r"'algo.minibatches': Value '2.5' of type 'float' could not be converted to Integer"),
    ("optim.betas=0.9", r"'optim.betas': expected a list$"),
    ("dual.constraints=5", r"'dual.constraints': expected a list$"),
])
def test_wrong_types_name_the_key_in_one_line(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


@pytest.mark.parametrize("override, needle", [
    ("checkpoint.every=-1", r"'checkpoint.every': must be >= 0, got -1"),
    ("eval_every=-5", r"'eval_every': must be >= 0, got -5"),
    ("rollout.temperature=0", r"'rollout.temperature': must be > 0, got 0"),
    ("rollout.top_p=1.5", r"'rollout.top_p': must be in \(0, 1\], got 1.5"),
    ("task.name=additon", r"'task.name': unknown 'additon'; did you mean 'addition'"),
])
def test_out_of_range_and_misspelled_values(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_r2_on_a_dense_model_is_rejected():
    with pytest.raises(ConfigError, match=r"'algo.routing_replay': r2 replays MoE routes, but "
                                          r"model.preset='tiny-dense' is a dense model"):
        load_config(None, ["model.preset=tiny-dense", "algo.routing_replay=r2"])


# ------------------------------------------------------------------------------------------ model and tokenizer


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory) -> Path:
    """A tiny-dense model with only 50 embedding rows (the character tokenizer has 101), plus its tokenizer."""
    path = tmp_path_factory.mktemp("small") / "model"
    save_model_dir(build_model(ModelConfig(preset="tiny-dense"), 50, seed=0), build_char_tokenizer(), path)
    return path


def test_missing_model_directory_names_the_path(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    rc = cli.main(["train", *_overrides(tmp_path / "out", f"model.path={missing}")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"tokenizer directory not found: '{missing}' (model.path must be a local directory" in err


def test_model_directory_without_tokenizer(small_model_dir, tmp_path):
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(small_model_dir / f, weights_only / f)
    with pytest.raises(FileNotFoundError, match=rf"no tokenizer in '{weights_only}': expected one of tokenizer.json"):
        load_tokenizer(weights_only)


def test_tokenizer_larger_than_the_model_vocabulary(small_model_dir):
    with pytest.raises(ValueError, match=rf"tokenizer has 101 tokens but the model in '{small_model_dir}' has only 50 "
                                         r"embedding rows"):
        build_model(ModelConfig(preset="tiny-dense", path=str(small_model_dir)), 101, seed=0)


def test_model_directory_of_the_wrong_architecture(small_model_dir):
    with pytest.raises(ValueError, match=r"holds a 'qwen3' model, preset 'tiny-moe' expects 'qwen3_moe'"):
        build_model(ModelConfig(preset="tiny-moe", path=str(small_model_dir)), 50, seed=0)


# ------------------------------------------------------------------------------------------ data


def test_math_task_without_a_file():
    with pytest.raises(ValueError, match=r"'task.path': task 'math' needs a JSONL file"):
        TASKS["math"](TaskConfig(name="math"), 0)


def test_prompt_longer_than_the_context_is_a_clear_error(tmp_path):
    # 40-digit operands: prompts of up to 82 characters (= tokens) + 50 new tokens > 128 positions. The config is
    # refused at load (the longest of the task's draws); the engine's own check, for every batch, still stands
    # behind it: here it meets a config changed after it was checked
    with pytest.raises(ConfigError, match=r"config error at 'task.digits': prompts of 40 digits run to \d+ characters"):
        load_config(None, _overrides(tmp_path / "out", "task.digits=40", "rollout.max_new_tokens=50"))
    cfg = load_config(None, _overrides(tmp_path / "out", "rollout.max_new_tokens=50"))
    cfg.task.digits = 40
    with pytest.raises(ValueError, match=r"tokens; with rollout.max_new_tokens=50 that is \d+ positions, beyond the "
                                         r"model's context of 128 \(max_position_embeddings\)"):
        train(cfg)


def test_empty_prompt_is_rejected_by_the_engine():
    engine = TorchEngine(RolloutConfig(), build_model(ModelConfig(preset="tiny-dense"), 101, seed=0), eos_id=1,
                         pad_id=0)
    with pytest.raises(ValueError, match="no empty prompt"):
        engine.generate([[5, 6], []], seed=0)


# ------------------------------------------------------------------------------------------ rollouts


def _rollout():
    model = build_model(ModelConfig(preset="tiny-dense"), 101, seed=0)
    engine = TorchEngine(RolloutConfig(max_new_tokens=3), model, eos_id=1, pad_id=0)
    return model, engine.generate([[10, 11], [12, 13, 14], [15], [16, 17]], seed=0)


def test_engine_returning_fewer_logprobs_than_tokens_names_the_shapes():
    _, rollout = _rollout()
    B, T = rollout.response_ids_BT.shape
    with pytest.raises(ValueError, match=rf"response_ids_BT \({B}, {T}\), response_mask_BT \({B}, {T}\), "
                                         rf"rollout_logp_BT \({B}, {T - 1}\) \(every response token needs exactly "
                                         r"one rollout log-prob\)"):
        rollout.with_(rollout_logp_BT=rollout.rollout_logp_BT[:, :-1])
    with pytest.raises(ValueError, match=rf"rollout_logp_BT \({B - 1}, {T}\)"):
        rollout.with_(rollout_logp_BT=rollout.rollout_logp_BT[1:])
    with pytest.raises(ValueError, match=rf"version_B has shape \(3,\), expected \({B},\)"):
        rollout.with_(version_B=torch.zeros(3, dtype=torch.long))


def test_all_masked_responses_give_a_finite_zero_update():
    model, rollout = _rollout()
    empty = rollout.with_(response_mask_BT=torch.zeros_like(rollout.response_mask_BT))
    keep_B, m = guards.screen_rows(empty.rollout_logp_BT, empty.response_mask_BT, torch.zeros(4))
    assert keep_B.all() and m["guard/empty_response_samples"] == 4.0
    cfg = AlgoConfig(prompts_per_step=2, samples_per_prompt=2, minibatches=2)
    batch = learner.score_old(model, empty, torch.tensor([1.0, -1.0, 0.5, -0.5]), cfg, learner.ScoringSpec())
    before = [p.detach().clone() for p in model.parameters()]
    result = learner.update(model, learner.OptimStep(torch.optim.SGD(model.parameters(), lr=0.1), grad_clip=1.0), batch,
                            scoring=learner.ScoringSpec(), penalty=learner.PenaltySpec(), cfg=cfg,
                            generator=torch.Generator())
    assert result.skipped == 0
    assert all(m["loss/total"] == 0.0 and m["optim/grad_norm"] == 0.0 for m in result.steps)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ------------------------------------------------------------------------------------------ outputs and resume


def test_output_directory_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    for out in (blocker / "run", blocker):
        rc = cli.main(["train", *_overrides(out)])
        err = capsys.readouterr().err
        assert rc == 2 and f"config error at 'output_dir': '{blocker}' is a file, not a folder" in err
        assert blocker.read_text() == "keep me" and list(tmp_path.iterdir()) == [blocker]  # no MLflow store beside


def test_read_only_output_directory(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        with unprivileged():
            with pytest.raises(OSError, match=rf"output_dir='{out}' is not a writable directory: Permission denied"):
                train(load_config(None, _overrides(out)))
    finally:
        out.chmod(0o755)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A completed 2-step run with its final checkpoint and MLflow run."""
    old = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        out = tmp_path_factory.mktemp("finished") / "out"
        train(load_config(None, _overrides(out)))
    finally:
        if old is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return out


def _runs(out: Path) -> list[tuple[str, str]]:
    client = MlflowClient(local_store_uri(out))
    exp = client.get_experiment_by_name("dcmdp")
    return sorted((r.info.run_id, r.info.status) for r in client.search_runs(exp.experiment_id))


def test_resume_from_a_missing_checkpoint_keeps_everything(finished_run, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ckpts, runs = _snapshot(finished_run / "checkpoints"), _runs(finished_run)
    missing = finished_run / "checkpoints" / "step_00000099"
    with pytest.raises(CheckpointError, match=f"resume checkpoint {missing} does not exist"):
        train(load_config(None, _overrides(finished_run, f"checkpoint.resume={missing}")))
    assert _snapshot(finished_run / "checkpoints") == ckpts and _runs(finished_run) == runs
    assert runs[0][1] == "FINISHED"


def test_resume_from_a_corrupt_checkpoint_keeps_everything(finished_run, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ckpts, runs = _snapshot(finished_run / "checkpoints"), _runs(finished_run)
    corrupt = tmp_path / "step_00000002"
    shutil.copytree(finished_run / "checkpoints" / "step_00000002", corrupt)
    data = bytearray((corrupt / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupt / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError,
                       match=f"resume checkpoint {corrupt} is not valid: state.pt sha256 mismatch \\(corrupted\\)"):
        train(load_config(None, _overrides(finished_run, f"checkpoint.resume={corrupt}")))
    assert (corrupt / "state.pt").read_bytes() == bytes(data)  # left for inspection, not deleted
    assert _snapshot(finished_run / "checkpoints") == ckpts and _runs(finished_run) == runs


# ------------------------------------------------------------------------------------------ nonsense values


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=inf", "'optim.lr': must be a finite number, got inf (inf is allowed only in "),
    ("optim.lr=nan", "'optim.lr': must be a finite number, got nan"),
    ("optim.weight_decay=-0.1", "'optim.weight_decay': must be >= 0, got -0.1"),
    ("seed=-1", "'seed': must be >= 0, got -1"),
    ("dual.constraints[0].tolerance=inf", "'dual.constraints[0].tolerance': must be a finite number, got inf"),
    ("algo.entropy_coef=nan", "'algo.entropy_coef': must be a finite number, got nan"),
    ("dual.constraints[0].lambda_max=-inf", "'dual.constraints[0].lambda_max': must be a finite number, got -inf"),
    ("cold_start.lr=inf", "'cold_start.lr': must be a finite number, got inf"),
    ("dual.coupling.b=[nan]", "'dual.coupling.b[0]': must be a finite number, got nan"),
])
def test_non_finite_and_negative_values_exit_2_before_anything_is_built(override, needle, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["train", *_overrides(out, override)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()  # rejected before the output folder, the model or the tracker


def test_inf_is_accepted_where_it_means_no_bound():
    cfg = load_config(None, ["dual.constraints[0].lambda_max=inf"])
    assert cfg.dual.constraints[0].lambda_max == float("inf")


def test_routing_mismatch_under_r3_is_refused():
    with pytest.raises(ConfigError, match=r"'dual.constraints\[1\].measure': routing_mismatch .* measures exactly 0"):
        load_config(None, ["model.preset=tiny-moe", "algo.routing_replay=r3",
                           "dual.constraints=[{measure: kl_k3, tolerance: 0.01}, {measure: routing_mismatch}]"])
    # under r2 the two engines' routes do differ: the constraint stays allowed
    load_config(None, ["model.preset=tiny-moe", "algo.routing_replay=r2", "dual.constraints=[{measure: routing_mismatch}]"])


def test_an_error_mid_run_ends_the_mlflow_run_failed(tmp_path, monkeypatch):
    # a learning rate beyond float32's range: AdamW's first step raises inside torch
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="overflow"):
        train(load_config(None, _overrides(out, "optim.lr=1e38")))
    assert [status for _, status in _runs(out)] == ["FAILED"]


# ------------------------------------------------------------------------------------------ inputs


def _math_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": p, "answer": f"#### {i}"}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_huge_held_out_prompt_is_skipped_by_length_before_tokenising(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    train_file = _math_file(tmp_path / "train.jsonl", [f"{a}+{a}=" for a in range(6)])
    huge = "7" * 2_000_000
    eval_file = _math_file(tmp_path / "eval.jsonl", ["1+2=", huge, "2+2=", "3+1="])
    cfg = load_config(None, _overrides(tmp_path / "out", "task.name=math", f"task.path={train_file}",
                                       f"task.eval_path={eval_file}", "steps=1"))
    summary = train(cfg)
    assert "1 of 4 held-out prompts skipped: longer than " in caplog.text
    assert "the longest has 2000000 characters" in caplog.text
    assert 0.0 <= summary.accuracy_after <= 1.0


def test_report_out_pointing_at_a_file_and_a_missing_store_are_clear_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    a_file = tmp_path / "report.txt"
    a_file.write_text("keep me")
    assert cli.main(["report", "dcmdp", "--out", str(a_file), "--tracking-uri", f"sqlite:///{tmp_path}/x.db"]) == 2
    assert f"--out {a_file} is a file: the report is a folder" in capsys.readouterr().err
    assert a_file.read_text() == "keep me"
    missing = tmp_path / "no" / "such" / "mlflow.db"
    rc = cli.main(["report", "dcmdp", "--out", str(tmp_path / "rep"), "--tracking-uri", f"sqlite:///{missing}"])
    assert rc == 2 and f"no MLflow store at {missing} (--tracking-uri: sqlite:///{missing})" in capsys.readouterr().err
    assert not (tmp_path / "no").exists() and not (tmp_path / "rep").exists()  # nothing created


def test_sigint_during_the_cold_start_is_one_line(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    # PYTHONFAULTHANDLER: should the process not stop, SIGABRT below prints every thread's stack into the failure
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dcmdp.cli", "train", *_overrides(out, "cold_start.steps=100000",
                             f"cold_start.cache_dir={cache}")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # as from a terminal: a SIGINT disposition of "ignore" inherited from the test process
                            # (seen in full suites) would keep the child from ever seeing the Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:  # wait until the cold start trains
        lines.append(line)
        if "cold start: training 100000 steps" in line:
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        # ~5 s on a quiet machine; generous for a loaded one (two full suites side by side exceeded 120 s)
        _, rest = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, rest = proc.communicate(timeout=60)
        pytest.fail("dcmdp train did not stop within 300 s of SIGINT; its stacks:\n" + rest[-6000:])
    err = "".join(lines) + rest
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("dcmdp: interrupted (SIGINT) during dcmdp train: stopped; finished "
                                           "checkpoints and cold-start cache entries are kept")
    assert not any(cache.glob("*/model.safetensors"))  # no half-trained entry


def test_a_config_typo_is_reported_before_torch_is_imported():
    # torch's import alone takes seconds: a mistyped key or a bad value must not wait for it
    code = ("import json, sys; from dcmdp import cli; "
            "rcs = [cli.main(['train', 'algo.minibatchs=4']), cli.main(['train', 'optim.lr=inf'])]; "
            "print(json.dumps({'rcs': rcs, 'torch': 'torch' in sys.modules}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert json.loads(done.stdout) == {"rcs": [2, 2], "torch": False}, done.stdout + done.stderr
    assert "unknown config key 'algo.minibatchs'; did you mean 'minibatches'?" in done.stderr
    assert "config error at 'optim.lr': must be a finite number, got inf" in done.stderr


# ------------------------------------------------------------------------------- config, caught before anything runs


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_an_empty_config_file_is_an_error_not_the_default_run(tmp_path, capsys, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert cli.main(["train", str(path), f"output_dir={tmp_path / 'out'}"]) == 2
    assert f"config file {path} holds no setting (it is empty or only comments)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_config_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes("steps: 2\nrun_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"cannot parse config file {path}: line 2 is not UTF-8"):
        load_config(path)


@pytest.mark.parametrize("override, needle", [
    ("seed=4294967296", "config error at 'seed': must be <= 4294967295 (2^32 - 1), got 4294967296"),
    ("cold_start.seed=4294967296", "config error at 'cold_start.seed': must be in [0, 4294967295]"),
    ("output_dir=''", "config error at 'output_dir': empty; name a folder for the run"),
    ("output_dir='  '", "config error at 'output_dir': empty"),
    ("rollout.max_new_tokens=100000", "config error at 'rollout.max_new_tokens': 100000 new tokens leave no room for "
                                      "a prompt in the context of model.preset='tiny-dense' (128 positions)"),
    ("task.reward_timeout=0", "config error at 'task.reward_timeout': must be a finite number of seconds > 0"),
])
def test_out_of_range_run_values_exit_2_naming_the_key_before_anything_is_built(override, needle, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["train", "model.preset=tiny-dense", f"output_dir={out}",
                   f"cold_start.cache_dir={tmp_path / 'cache'}", override])
    assert rc == 2 and needle in capsys.readouterr().err
    # a run makes its folder before it builds a model: none, and no cold-start cache or MLflow store either
    assert list(tmp_path.iterdir()) == []


def test_an_infeasible_dual_coupling_names_the_row_before_anything_is_built(tmp_path, capsys):
    rc = cli.main(["train", f"output_dir={tmp_path / 'out'}", "dual.coupling.A=[[1.0]]", "dual.coupling.b=[-1.0]"])
    err = capsys.readouterr().err
    assert rc == 2 and "config error at 'dual.coupling.b[0]': the coupled limit row 0 (A[0] lambda <= b[0] = -1) " \
                       "fails at lambda_init [0.1]" in err
    assert not (tmp_path / "out").exists()


def test_eval_of_a_moe_checkpoint_with_a_dense_preset_names_the_preset(tmp_path, capsys):
    from dcmdp.checkpoint import save_checkpoint
    from dcmdp.config import flatten

    saved = flatten(load_config(None, ["model.preset=tiny-moe"]))
    path = save_checkpoint(tmp_path / "ckpt", 3, {"step": 3, "model": {}, "config": saved, "engine_version": 3}, keep=1)
    rc = cli.main(["eval", "model.preset=tiny-dense", "cold_start.steps=0", f"output_dir={tmp_path}",
                   "--checkpoint", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"checkpoint {path} holds weights of another model than the config's: model.preset: " \
                       f"'tiny-moe' in the checkpoint, 'tiny-dense' now" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------- data files


def test_a_latin1_jsonl_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": 2}\n' + '{"prompt": "caf\xe9", "answer": 1}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path}:2: malformed jsonl example: not UTF-8 \(invalid continuation byte: "
                                         rf"byte b'\\xe9' at column 16\); save the file as UTF-8"):
        tasks._load_jsonl(path, tasks.parse_jsonl_record, "jsonl")
    # with on_error=skip the line is dropped with a warning and the rest is read
    assert len(tasks._load_jsonl(path, tasks.parse_jsonl_record, "jsonl", on_error="skip")) == 1


def test_a_compressed_jsonl_file_says_so(tmp_path):
    import gzip

    path = tmp_path / "data.jsonl"
    path.write_bytes(gzip.compress(b'{"prompt": "1+1="}\n'))
    with pytest.raises(ValueError, match=rf"{path}: a compressed file .*decompress it"):
        tasks._load_jsonl(path, tasks.parse_jsonl_record, "jsonl")


@pytest.mark.parametrize("kind", ["directory", "device"])
def test_a_task_path_that_is_not_a_regular_file_is_a_config_error(tmp_path, kind):
    path = tmp_path if kind == "directory" else Path("/dev/zero")  # reading /dev/zero would never end
    what = "a directory" if kind == "directory" else "not a regular file"
    with pytest.raises(ConfigError, match=f"config error at 'task.path': {path} is {what}"):
        load_config(None, ["task.name=jsonl", f"task.path={path}", "task.reward=x.py:score"])


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--batches", "0"], "argument --batches: must be >= 1, got 0"),
    (["calibrate", "--batches", "two"], "argument --batches: must be an integer >= 1, got 'two'"),
    (["calibrate", "--slack", "-1"], "argument --slack: must be a finite number >= 0, got -1"),
    (["calibrate", "--slack", "nan"], "argument --slack: must be a finite number >= 0, got nan"),
    (["tune", "tune.yaml", "--workers", "0"], "argument --workers: must be >= 1, got 0"),
    (["report", "dcmdp", "--out", ""], "argument --out: empty; give a value"),
    (["eval", "--checkpoint", " "], "argument --checkpoint: empty; give a value"),
    (["calibrate", "--out", ""], "argument --out: empty; give a value"),
    (["report", "dcmdp", "--tracking-uri", ""], "argument --tracking-uri: empty; give a value"),
    (["sync", ".", "--tracking-uri", " "], "argument --tracking-uri: empty; give a value"),
])
def test_bad_command_options_exit_2_naming_the_option_before_torch_loads(argv, needle, tmp_path):
    # a subprocess: the exit code and the imports are the process's own; PYTHONPATH makes it import this tree's code
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc, modules = run_dcmdp([*argv, f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "torch" not in modules and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, needle", [
    (["--measures", "kl_k33"], "config error at '--measures': unknown 'kl_k33'; did you mean 'kl_k3'?"),
    (["--measures", "ess"], "config error at '--measures': 'ess' cannot be a constraint"),
    (["--out", "{tmp}"], "config error at '--out': {tmp} is a folder, or its folder does not exist"),
    (["--out", "{tmp}/no_dir/c.yaml"], "config error at '--out': {tmp}/no_dir/c.yaml is a folder"),
])
def test_calibrate_checks_measures_and_out_before_measuring(option, needle, tmp_path, capsys):
    out = tmp_path / "run"
    option = [o.format(tmp=tmp_path) for o in option]
    rc = cli.main(["calibrate", "model.preset=tiny-dense", f"output_dir={out}", *option])
    assert rc == 2 and needle.format(tmp=tmp_path) in capsys.readouterr().err
    assert not out.exists()  # nothing was measured: no MLflow store in the folder
