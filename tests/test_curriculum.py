"""task.curriculum: the training prompts' digit counts follow the schedule, the held-out set never leaks into
training, and bad schedules are config errors naming the key."""

from __future__ import annotations

import random

import pytest

from dcmdp.config import ConfigError, load_config
from dcmdp.loop import rollout_phase
from dcmdp.policy import build_policy
from trainers.config import CurriculumPhase, TaskConfig
from trainers.tasks import TASKS, Curriculum
from runs import metric_history

SCHEDULE = [CurriculumPhase(until_step=3, digits=2, min_digits=1),
            CurriculumPhase(until_step=6, digits=4, min_digits=3), CurriculumPhase(digits=8, min_digits=7)]


def _lengths(examples) -> set[int]:
    return {len(op) for ex in examples for op in ex.prompt.rstrip("=").split("+")}


def test_long_addition_operand_lengths_follow_the_schedule():
    cfg = TaskConfig(name="long_addition", digits=8, min_digits=1, eval_size=64, curriculum=SCHEDULE)
    cfg.check()
    base = TASKS[cfg.name](cfg, 0)
    curriculum = Curriculum(base, cfg)
    expected = {0: {1, 2}, 2: {1, 2}, 3: {3, 4}, 5: {3, 4}, 6: {7, 8}, 100: {7, 8}}
    for step, lengths in expected.items():
        examples = curriculum.task_at(step).sample(random.Random(step), 200)
        assert _lengths(examples) == lengths, step
        # the task's own reward and demonstration still apply
        assert all(base.reward(base.demonstration(ex), ex) == 1.0 for ex in examples[:20])


def test_curriculum_never_draws_a_held_out_prompt():
    # phase digits=1..2 against a base whose held-out set holds many 1-2 digit sums
    cfg = TaskConfig(name="long_addition", digits=2, min_digits=1, eval_size=2000,
                     curriculum=[CurriculumPhase(until_step=5, digits=2), CurriculumPhase(digits=2)])
    base = TASKS[cfg.name](cfg, 0)
    held_out = {ex.prompt for ex in base.eval_set()}
    drawn = Curriculum(base, cfg).task_at(0).sample(random.Random(1), 3000)
    assert not held_out & {ex.prompt for ex in drawn}


def test_addition_digits_grow_through_the_loop_rollout_phase(tmp_path):
    cfg = load_config(None, [
        "model.preset=tiny-dense", "task.name=addition", "task.digits=3", "cold_start.steps=0", "task.eval_size=8",
        "algo.prompts_per_step=16", "algo.samples_per_prompt=2", "rollout.max_new_tokens=2", "threads=1",
        f"output_dir={tmp_path}", "task.curriculum=[{until_step: 2, digits: 1}, {digits: 3}]"])
    policy = build_policy(cfg, tmp_path)
    maxima = []
    for step in range(4):
        examples, rollout = rollout_phase(policy, cfg, step)
        assert len(rollout) == 32
        maxima.append(max(int(x) for ex in examples for x in ex.prompt.rstrip("=").split("+")))
    assert maxima[0] < 10 and maxima[1] < 10 and maxima[2] >= 10 and maxima[3] >= 10


@pytest.mark.parametrize("override,key", [
    ("task.curriculum=[{until_step: 2, digits: 1}]", "task.curriculum[0].until_step"),
    ("task.curriculum=[{until_step: 4, digits: 1}, {until_step: 3, digits: 2}, {digits: 2}]",
     "task.curriculum[1].until_step"),
    ("task.curriculum=[{until_step: 4, digits: 0}, {digits: 2}]", "task.curriculum[0].digits"),
    ("task.curriculum=[{until_step: 4, digits: 2, min_digits: 3}, {digits: 3}]", "task.curriculum[0].min_digits"),
])
def test_bad_curricula_are_config_errors(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, ["task.name=long_addition", "task.digits=3", f"output_dir={tmp_path}", override])


def test_curriculum_needs_a_generated_task(tmp_path):
    with pytest.raises(ConfigError, match="task.curriculum"):
        load_config(None, ["task.name=math", f"task.path={tmp_path / 'x.jsonl'}", f"output_dir={tmp_path}",
                           "task.curriculum=[{until_step: 2, digits: 1}, {digits: 2}]"])


def test_run_logs_the_curriculum_phase_digits(tmp_path):
    """A run with a curriculum logs task/digits every step (the phase's digits), so lambda can be read against it."""
    from dcmdp.loop import train

    summary = train(load_config(None, [
        "model.preset=tiny-dense", "task.name=addition", "task.digits=3", "cold_start.steps=0", "task.eval_size=8",
        "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "rollout.max_new_tokens=2", "threads=1", "steps=3",
        "progress=false", f"output_dir={tmp_path / 'run'}", "task.curriculum=[{until_step: 2, digits: 1}, {digits: 3}]"]))
    assert metric_history(summary, "task/digits") == [1.0, 1.0, 3.0]
