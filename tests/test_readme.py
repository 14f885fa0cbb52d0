"""The README is executable: every command of every ```bash block of README.md and docs/custom_tasks.md runs, in
order, as written, with shortened settings appended (``SHORT``), so that a command that fails after the one before it
fails here. The README's commands run where a user types them: in a fresh clone's folder after ``make demo`` (its run,
shortened, in the demo's folder), so the first command meets the demo's finished run.

What does not run here is listed in ``NOT_RUN`` with the reason, and only that; a command that serves forever (``dcmdp
ui``) is started, asked for a page on 127.0.0.1 and stopped. The default test run runs the demo and README section 1
(check, the default run again, a second run beside it); the whole of both files is ``slow`` (minutes).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"

# Appended to each command, by subcommand: a run of two RL steps after a 30-step cold start, on a few prompts.
RUN = ["steps=2", "cold_start.steps=30", "cold_start.batch_size=16", "cold_start.target_accuracy=null",
       "algo.prompts_per_step=4", "algo.samples_per_prompt=4", "task.eval_size=16", "threads=1", "progress=false"]
SHORT = {"train": RUN, "check": RUN, "eval": RUN, "calibrate": ["--batches", "1", *RUN],
         "tune": ["steps=2", "eval_every=0", "task.eval_size=8", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
                  "cold_start.steps=20", "progress=false"]}

# Commands that do not run here, each with the reason (matched as a prefix of the command as written).
NOT_RUN = {
    "make demo": "creates .venv and trains the 650-step default: its command, shortened, runs first instead "
                 "(demo_command; test_make_demo_is_the_readme_default_run)",
    "make test": "the test suite itself",
    "make vllm": "installs vLLM (minutes); the environment the tests run in has it (`make test` installs it first)",
    ".venv/bin/torchrun --standalone --nproc_per_node 8": "needs eight CUDA GPUs and the Qwen3-8B weights",
}
# Commands that end otherwise here, and how: the recipe's check names the absent weights, and only them; the tune
# study's 2-step trials end inside its 18-step warm-up (the anchor's first window), so none can be selected (exit code
# 3, its table written).
EXPECTED = {".venv/bin/dcmdp check configs/qwen3-8b.yaml model.path=/models/Qwen3-8B --gpus 8 --gpu-memory 79":
            (2, {"model.path"}),
            ".venv/bin/dcmdp tune configs/tune/default.yaml --workers 2": (3, None)}


def bash_commands(path: Path) -> list[str]:
    """The commands of the file's ```bash blocks, in order, without their trailing comments."""
    text = path.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # the environment the docs ask to activate (custom_tasks.md types `dcmdp` and `python`)
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent),
               OMP_NUM_THREADS="1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subcommand(command: str) -> str:
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word.endswith("dcmdp") and i + 1 < len(words):
            return words[i + 1]
    return ""


def _serve_and_ask(command: str, folder: Path) -> str:
    """Start a command that serves forever on its port (given here, free), ask it for its page, stop it; the first
    line it printed (``dcmdp ui``: the link to open)."""
    port = _free_port()
    out = folder / f"serve-{port}.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen(["bash", "-c", f"exec {command} --host 127.0.0.1 --port {port}"], cwd=folder,
                                env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"{command} exited with {proc.returncode}: {out.read_text()[-3000:]!r}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as page:
                    assert page.status == 200 and b"<html" in page.read().lower()
                    return out.read_text().splitlines()[0]
            except OSError:
                assert time.monotonic() < deadline, f"{command}: no answer on 127.0.0.1:{port} within 180 s"
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def run_command(command: str, folder: Path) -> subprocess.CompletedProcess | None:
    """Run one documented command in ``folder`` with its shortened settings; None when it is in ``NOT_RUN``."""
    if any(command.startswith(prefix) for prefix in NOT_RUN):
        return None
    if _subcommand(command) == "ui":
        line = _serve_and_ask(command, folder)
        # the link opens every run of the experiment as charts, in the training layout
        assert re.search(r"at http://127\.0\.0\.1:\d+/#/experiments/\d+/runs\?compareRunsMode=CHART&"
                         r"workflowType=machine_learning$", line), line
        return None
    extra = " ".join(shlex.quote(a) for a in SHORT.get(_subcommand(command), []))
    done = subprocess.run(["bash", "-c", f"{command} {extra}"], cwd=folder, env=_env(), capture_output=True,
                          text=True, timeout=900)
    code, keys = EXPECTED.get(command, (0, None))
    where = f"`{command}` in {folder}: exit code {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == code, where
    if keys is not None:
        listed = {line.split(":", 1)[0].strip() for line in done.stderr.splitlines() if line.startswith("  ")}
        assert listed == keys, where
    return done


def _readme_folder(tmp_path: Path) -> Path:
    """A fresh folder with what the README's commands name: the configs, the scripts, the environment, and tiny
    stand-ins for the local GSM8K files the recipe's data command converts."""
    folder = tmp_path / "clone"
    folder.mkdir()
    for name in ("configs", "scripts", ".venv"):
        (folder / name).symlink_to(ROOT / name)
    (folder / "gsm8k").mkdir()
    for name, numbers in (("train", range(0, 40)), ("test", range(40, 50))):
        (folder / "gsm8k" / f"{name}.jsonl").write_text("".join(
            json.dumps({"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
            for i in numbers))
    return folder


def demo_command() -> str:
    """``make demo``'s command, as the README writes the commands (``.venv/bin/...``)."""
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    return recipe.replace("$(VENV)", ".venv")


def _after_the_demo(tmp_path: Path) -> Path:
    """A fresh clone's folder after ``make demo``: its run, shortened, finished in the demo's folder."""
    folder = _readme_folder(tmp_path)
    run_command(demo_command(), folder)
    assert (folder / "outputs" / "default" / "summary.json").is_file()
    return folder


def _section(commands: list[str], first: str, last: str) -> list[str]:
    i = next(n for n, c in enumerate(commands) if c.startswith(first))
    j = next(n for n, c in enumerate(commands) if c.startswith(last))
    return commands[i:j + 1]


def test_every_command_is_run_or_listed_with_a_reason():
    readme, custom = bash_commands(ROOT / "README.md"), bash_commands(ROOT / "docs" / "custom_tasks.md")
    assert readme[:2] == ["make demo", "make test"]  # the README opens with exactly these two
    assert len(readme) >= 10 and len(custom) >= 4
    for prefix in NOT_RUN:  # no stale entry: each names a command the docs show
        assert any(c.startswith(prefix) for c in readme + custom), prefix
    for command in EXPECTED:
        assert command in readme, command
    # every dcmdp subcommand the docs show gets shortened settings (none would run its full length here)
    for command in readme + custom:
        sub = _subcommand(command)
        assert not sub or sub in SHORT or sub in ("report", "ui"), command


def test_make_demo_is_the_readme_default_run():
    assert demo_command() in bash_commands(ROOT / "README.md")


def test_readme_section_1_runs_in_order_after_the_demo(tmp_path):
    commands = _section(bash_commands(ROOT / "README.md"), ".venv/bin/dcmdp check configs/default.yaml",
                        ".venv/bin/dcmdp train configs/default.yaml output_dir=outputs/pid")
    assert len(commands) == 3
    folder = _after_the_demo(tmp_path)
    check, again, _ = (run_command(command, folder) for command in commands)
    # the first command meets the demo's finished run: no problem, and its summary line says what train will do
    line = check.stdout.splitlines()[-1]
    assert "configs/default.yaml: no problem found" in line and \
        "; outputs/default holds this config's own run, finished at step 2 (checkpoints up to step 2 and " \
        "summary.json): train with checkpoint.resume=auto says so and trains nothing" in line
    assert "holds this run, finished at step 2 (summary.json): nothing to train" in again.stdout
    pid = yaml.safe_load((folder / "outputs" / "pid" / "config.yaml").read_text())["dual"]
    assert pid["rule"] == "pid" and pid["pid"]["kp"] == 0.1 and pid["pid"]["kd"] == 0.1  # a PID, not the I term alone
    # one store beside the two run folders, each folder naming its MLflow run in it
    runs = {name: json.loads((folder / "outputs" / name / "run.json").read_text()) for name in ("default", "pid")}
    assert runs["default"]["tracking_uri"] == runs["pid"]["tracking_uri"] == \
        f"sqlite:///{(folder / 'outputs' / 'mlflow.db').resolve()}"
    assert not any((folder / "outputs" / name / "mlflow.db").exists() for name in runs)


@pytest.mark.slow
def test_every_readme_command_runs_in_order(tmp_path):
    folder = _after_the_demo(tmp_path)
    commands = bash_commands(ROOT / "README.md")
    for command in commands:
        run_command(command, folder)
    report = (folder / "report" / "report.md").read_text()
    assert (folder / "data" / "math_train.jsonl").is_file() and (folder / "report" / "mismatch.png").is_file()
    # the default and the PID run side by side; calibrate's and tune's runs counted, not listed
    assert "| default/outputs-default |" in report and "| default/outputs-pid |" in report
    assert re.search(r"Left out: 1 calibrate run, \d+ tune runs", report), report[:600]
    assert re.search(r"6 trials in study 'default' \(6 run now, \d+ pruned, 0 failed\)",
                     (folder / "outputs" / "tune-default" / "table.txt").read_text())


@pytest.mark.slow
def test_the_custom_task_example_runs_in_an_empty_folder(tmp_path):
    doc = (ROOT / "docs" / "custom_tasks.md").read_text()
    folder = tmp_path / "mine"
    folder.mkdir()
    # the files the example asks to save: the python and yaml blocks that open with their file name
    for body in re.findall(r"```(?:python|yaml)\n(# (\S+?)(?::|\s).*?)```", doc, flags=re.S):
        text, name = body
        if name.endswith((".py", ".yaml")):
            (folder / name).write_text(text)
    assert {p.name for p in folder.iterdir()} == {"make_data.py", "my_reward.py", "sums.yaml"}
    for command in bash_commands(ROOT / "docs" / "custom_tasks.md"):
        run_command(command, folder)
    assert (folder / "outputs" / "sums" / "summary.json").is_file()


# Markdown files the docs name that a command writes, not files of the repository.
WRITTEN_PAGES = {"report.md"}


def test_the_docs_name_no_page_outside_the_repository():
    """Every NAME.md the README and docs/ mention, linked or not, is a page of the repository (or one a command
    writes): a design note the docs lean on must be in them, not in a file a clone does not have."""
    pages = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in set(re.findall(r"(?<![\w/.-])([\w.-]+\.md)\b", page.read_text())):
            if name not in pages | WRITTEN_PAGES:
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, missing
