"""``dcmdp check``: every class of problem (config, tolerance, task files, task split, tokenizer and model, device,
output folder) found in one call, each with its key and fix; ``train`` runs the same checks before anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcmdp import cli
from dcmdp.check import find_problems

TINY = ["model.preset=tiny-dense", "steps=1"]


def _keys(problems) -> list[str]:
    return [p.key for p in problems]


def _task_files(tmp_path: Path, lines: list[str]) -> tuple[Path, Path]:
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(prompt, completion, example):\n    return float(completion == example['answer'])\n")
    return data, reward


def _record(i: int) -> str:
    return json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "completion": str(i + 1)})


def test_the_default_config_has_no_problem(tmp_path, capsys):
    assert cli.main(["check", "configs/default.yaml", f"output_dir={tmp_path / 'out'}"]) == 0
    assert "configs/default.yaml: no problem found" in capsys.readouterr().out


def test_every_config_problem_of_the_overrides_at_once(tmp_path, capsys):
    rc = cli.main(["check", *TINY, f"output_dir={tmp_path / 'out'}", "algo.minibatchs=4", "optim.lr=nan",
                   "dual.constraints[0].lambda_init=-1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "dcmdp: 3 problems in the config" in err
    assert "unknown config key 'algo.minibatchs'; did you mean 'minibatches'?" in err
    assert "config error at 'optim.lr': must be a finite number, got nan" in err
    assert "config error at 'dual.constraints[0].lambda_init': -1.0 is outside [0.0, 10.0]" in err


def test_task_files_split_and_demonstrations_each_named(tmp_path):
    good = [_record(i) for i in range(20)]
    data, reward = _task_files(tmp_path, good[:5] + ["{not json", '{"answer": 3}', "[1, 2]", "{}"] + good[5:])
    base = [*TINY, "task.name=jsonl", f"task.reward={reward}:score", f"output_dir={tmp_path / 'out'}"]
    problems = find_problems(None, [*base, f"task.path={data}", f"task.eval_path={tmp_path / 'nowhere.jsonl'}"])
    assert sorted(_keys(problems)) == ["task.eval_path", "task.path"]
    by_key = {p.key: p.message for p in problems}
    bad_lines, missing = by_key["task.path"], by_key["task.eval_path"]
    # all four malformed lines counted, the first three named by line number
    assert bad_lines.startswith(f"{data}: 4 malformed jsonl line(s): line 6: ") and "line 7: " in bad_lines
    assert "line 8: " in bad_lines and "(and 1 more); fix or remove them" in bad_lines
    assert f"file not found: {tmp_path / 'nowhere.jsonl'}" in missing

    # a held-out file that repeats the training file leaves nothing to train on: said before any work, with the fix
    clean, _ = _task_files(tmp_path, good)
    (overlap,) = find_problems(None, [*base, f"task.path={clean}", f"task.eval_path={clean}"])
    assert overlap.key == "task.eval_path" and overlap.exit_code == 2 and overlap.file
    assert "every training problem also appears in the evaluation set; hold out other problems" in overlap.message

    # records without a completion, for a cold start that trains on them
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    (demo,) = find_problems(None, [*base, f"task.path={bare}", "task.eval_size=4", "cold_start.steps=10"])
    assert demo.key == "cold_start.steps" and "which 20 of 20 records lack" in demo.message


def test_tokenizer_model_directory_tolerance_and_device_together(tmp_path):
    weights_only = tmp_path / "model"
    weights_only.mkdir()
    (weights_only / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 10}))
    overrides = [*TINY, f"output_dir={tmp_path / 'out'}", f"model.path={weights_only}",
                 "dual.constraints=[{measure: abs_prob_diff, tolerance: 1.5}]", "device=cuda"]
    problems = find_problems(None, overrides)
    by_key = {p.key: p.message for p in problems}
    keys = _keys(problems)
    assert keys.count("model.path") == 3  # no tokenizer, another architecture, no weight files
    messages = [p.message for p in problems if p.key == "model.path"]
    assert messages[0].startswith(f"no tokenizer in '{weights_only}': expected one of tokenizer.json")
    assert "holds a 'qwen3_moe' model, preset 'tiny-dense' expects 'qwen3'" in messages[1]
    assert "no weight files (*.safetensors, *.bin)" in messages[2]
    assert "abs_prob_diff never exceeds 1, so c = 1.5 never binds" in by_key["dual.constraints[0].tolerance"]
    if not torch.cuda.is_available():
        assert "config error at 'device': device=cuda but this torch build has no CUDA" in by_key["device"] or \
               "config error at 'device': device=cuda but torch sees no CUDA device" in by_key["device"]
    # the checks read the folder and build nothing: it holds what it held, and no run folder was made
    assert list(weights_only.iterdir()) == [weights_only / "config.json"]
    assert list(tmp_path.iterdir()) == [weights_only]


def test_output_folder_holding_a_run_and_a_missing_resume_checkpoint(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert cli.main(["check", *TINY, f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "dcmdp: 1 problem in the config" in err
    assert f"output_dir: output_dir {out} already holds a run (summary.json): continue it with " \
           f"checkpoint.resume=auto, start afresh there with overwrite=true, or choose another output_dir" in err
    assert cli.main(["check", *TINY, f"output_dir={out}", "checkpoint.resume=auto"]) == 0
    assert cli.main(["check", *TINY, f"output_dir={tmp_path / 'new'}", f"checkpoint.resume={tmp_path / 'no'}"]) == 2
    assert f"checkpoint.resume='{tmp_path / 'no'}': no checkpoint there" in capsys.readouterr().err


def test_train_reports_every_problem_before_building_anything(tmp_path, capsys):
    good = [_record(i) for i in range(20)]
    data, reward = _task_files(tmp_path, good)
    out = tmp_path / "out"
    made = sorted(tmp_path.iterdir())
    rc = cli.main(["train", *TINY, "task.name=jsonl", f"task.path={data}", f"task.eval_path={data}",
                   f"task.reward={reward}:score", f"output_dir={out}", f"model.path={tmp_path / 'no_model'}",
                   f"cold_start.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert rc == 2  # input errors only (files): bad input, the code the run itself exits with for them
    assert "dcmdp: 2 problems in the config" in err
    assert "every training problem also appears in the evaluation set" in err
    assert f"model.path: tokenizer directory not found: '{tmp_path / 'no_model'}'" in err
    assert sorted(tmp_path.iterdir()) == made  # no run folder, cold-start cache or MLflow store was made

    # one config error among them makes it a config error (exit code 2), each line with its key
    rc = cli.main(["train", *TINY, "task.name=jsonl", f"task.path={data}", f"task.eval_path={data}",
                   f"task.reward={reward}:score", f"output_dir={out}", "optim.lr=-1"])
    err = capsys.readouterr().err
    assert rc == 2 and "optim.lr: config error at 'optim.lr'" in err and "task.eval_path: " in err
    assert not out.exists()


@pytest.mark.parametrize("override", ["task.path=", "task.reward="])
def test_a_jsonl_task_without_its_file_or_reward_is_named(override, tmp_path):
    data, reward = _task_files(tmp_path, [_record(i) for i in range(20)])
    overrides = [*TINY, "task.name=jsonl", f"task.path={data}", f"task.reward={reward}:score",
                 f"output_dir={tmp_path / 'out'}", override]
    keys = _keys(find_problems(None, overrides))
    assert override.rstrip("=") in keys


def _folder_of_a_run(out: Path, overrides: list[str], steps_done: int) -> None:
    """The files a run leaves in its folder that check reads: config.yaml as a run writes it, and summary.json."""
    from dcmdp.config import load_config, to_yaml

    out.mkdir(parents=True)
    (out / "config.yaml").write_text(to_yaml(load_config(None, overrides), public=True))
    (out / "summary.json").write_text(json.dumps({"steps": steps_done}))


def test_a_folder_holding_this_configs_own_run_passes_with_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    mine = [*TINY, f"output_dir={out}", "threads=1"]
    _folder_of_a_run(out, mine, steps_done=1)
    assert cli.main(["check", *mine]) == 0
    line = capsys.readouterr().out.splitlines()[-1]  # the summary line, after the memory plan's
    assert line.startswith("the config: no problem found") and \
        f"; {out} holds this config's own run, finished at step 1 (summary.json): train with " \
        f"checkpoint.resume=auto says so and trains nothing" in line
    # more steps than the run made: the run is continued, not finished
    assert cli.main(["check", *TINY[:1], "steps=3", f"output_dir={out}", "threads=1"]) == 0
    assert f"{out} holds this config's own run, resumable (summary.json): train with checkpoint.resume=auto " \
           f"continues it" in capsys.readouterr().out
    # another config's run in the folder stays a problem, and the difference is named
    assert cli.main(["check", *mine, "seed=7"]) == 2
    err = capsys.readouterr().err
    assert f"output_dir {out} already holds a run with another config (seed: '0' in the checkpoint, '7' now" in err


def test_a_vllm_config_without_vllm_is_a_config_error_naming_the_install(tmp_path, monkeypatch, capsys):
    """vLLM made unimportable (a None entry in sys.modules stops every import of it, as if it were absent):
    check and train both exit 2 before any work, naming vllm and the command that installs it."""
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    vllm = ["configs/default.yaml", "rollout.engine=vllm", "rollout.precision=bf16", f"output_dir={tmp_path / 'o'}"]
    for command in ("check", "train"):
        assert cli.main([command, *vllm]) == 2, command
        err = capsys.readouterr().err
        assert "config error at 'rollout.engine': rollout.engine=vllm needs vllm, which cannot be imported" in err
        assert "install it with make vllm (runs scripts/setup_vllm.sh .venv" in err
    assert not (tmp_path / "o").exists()  # train built nothing
    monkeypatch.delitem(sys.modules, "vllm")
    if __import__("importlib").util.find_spec("vllm") is not None:  # where vLLM is installed, the same config passes
        assert cli.main(["check", *vllm]) == 0


def test_no_load_average_line_before_a_command(tmp_path, monkeypatch, caplog):
    """On a busy machine the command sets OpenMP's passive wait policy, and says so only with -v: a mistyped key
    gets its error and nothing before it."""
    import logging
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(cli, "machine", lambda: (2, 5.0))
    caplog.set_level(logging.DEBUG)
    assert cli.main(["check", *TINY, "algo.minibatchs=2", f"output_dir={tmp_path}"]) == 2
    shown = [r for r in caplog.records if "load average" in r.getMessage()]
    assert shown and all(r.levelno == logging.DEBUG for r in shown)
