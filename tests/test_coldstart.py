"""Supervised cold start: the loss falls, accuracy rises above a random model's, the result is cached."""

import dataclasses
import math
import os
import random

import torch

from trainers.coldstart import cache_key, cold_start, encode_batch, sampled_accuracy
from trainers.config import ColdStartConfig, ModelConfig
from trainers.models import build_model
from trainers.tokenizer import build_char_tokenizer

torch.set_num_threads(1)


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


@dataclasses.dataclass(frozen=True)
class SumConfig:
    digits: int = 1


class SingleDigitSum:
    """Stand-in task with the trainers.tasks interface: "3+4=" -> "7" (learnable in seconds)."""

    name = "single_digit_sum"

    def __init__(self, cfg: SumConfig = SumConfig()):
        self.cfg = cfg

    def _example(self, rng: random.Random) -> Example:
        a, b = rng.randrange(10), rng.randrange(10)
        return Example(f"{a}+{b}=", str(a + b))

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        return [self._example(rng) for _ in range(n)]

    def demonstration(self, ex: Example) -> str:
        return ex.answer

    def eval_set(self) -> list[Example]:
        return self.sample(random.Random(1234), 64)

    def reward(self, completion: str, ex: Example) -> float:
        return float(completion.strip() == ex.answer)


def test_encode_batch_layout():
    tok = build_char_tokenizer()
    ids, mask, P = encode_batch(tok, [Example("1+2=", "3"), Example("10+20=", "30")], ["3", "30"], eos_id=1, pad_id=0)
    assert P == 6
    assert ids[0].tolist() == [0, 0] + tok.encode("1+2=") + tok.encode("3") + [1, 0]
    assert ids[1].tolist() == tok.encode("10+20=") + tok.encode("30") + [1]
    assert mask[0].tolist() == [False, False] + [True] * 6 + [False]


def test_cold_start_learns_and_is_cached(tmp_path):
    tok, task = build_char_tokenizer(), SingleDigitSum()
    model_cfg = ModelConfig(preset="tiny-dense")
    cfg = ColdStartConfig(steps=100, batch_size=32, lr=6e-3, cache_dir=str(tmp_path / "cache"))
    random_model = build_model(model_cfg, len(tok), seed=0)
    random_acc = sampled_accuracy(random_model, tok, task, task.eval_set(), eos_id=tok.eos_token_id)

    model, info = cold_start(random_model, tok, task, cfg, model_cfg, seed=0, eos_id=tok.eos_token_id, progress=False)
    assert info["coldstart/cached"] == 0.0
    # Uniform over 101 tokens costs log(101) = 4.6 nats; the trained model is far below.
    assert info["coldstart/loss_first"] > 4.0 and info["coldstart/loss"] < 0.5 * info["coldstart/loss_first"]
    assert random_acc <= 0.05 and info["coldstart/accuracy"] >= random_acc + 0.3
    assert os.path.isfile(os.path.join(info["model_dir"], "config.json"))
    assert os.path.isfile(os.path.join(info["model_dir"], "tokenizer.json"))
    assert os.path.dirname(info["model_dir"]) == os.path.abspath(cfg.cache_dir)

    fresh = build_model(model_cfg, len(tok), seed=0)
    again, info2 = cold_start(fresh, tok, task, cfg, model_cfg, seed=0, eos_id=tok.eos_token_id, progress=False)
    assert info2["coldstart/cached"] == 1.0 and math.isnan(info2["coldstart/loss"])
    assert info2["model_dir"] == info["model_dir"] and info2["coldstart/accuracy"] == info["coldstart/accuracy"]
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name
    assert len(os.listdir(cfg.cache_dir)) == 1


def test_cache_key_covers_what_determines_the_weights():
    tok, task = build_char_tokenizer(), SingleDigitSum()
    model_cfg = ModelConfig(preset="tiny-dense")
    model = build_model(model_cfg, len(tok), seed=0)
    cfg = ColdStartConfig(steps=10)
    base = cache_key(model, tok, task, cfg, model_cfg, seed=0)
    assert base == cache_key(model, tok, task, dataclasses.replace(cfg, cache_dir="elsewhere"), model_cfg, seed=0)
    moe_cfg = ModelConfig(preset="tiny-moe")
    variants = [
        cache_key(model, tok, task, cfg, model_cfg, seed=1),
        cache_key(model, tok, task, dataclasses.replace(cfg, lr=1e-3), model_cfg, seed=0),
        cache_key(model, tok, task, dataclasses.replace(cfg, steps=11), model_cfg, seed=0),
        cache_key(model, tok, SingleDigitSum(SumConfig(digits=2)), cfg, model_cfg, seed=0),
        cache_key(build_model(moe_cfg, len(tok), seed=0), tok, task, cfg, moe_cfg, seed=0),
        cache_key(model, tok, task, cfg, dataclasses.replace(model_cfg, dtype="bfloat16"), seed=0),
    ]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count sums in another order: another model
        variants.append(cache_key(model, tok, task, cfg, model_cfg, seed=0))
    finally:
        torch.set_num_threads(threads)
    assert len(set(variants + [base])) == len(variants) + 1


def test_the_thread_count_keys_a_cpu_cold_start_only():
    """CPU reductions split across threads sum in another order, so a CPU cold start's entry is keyed by the count;
    a GPU cold start runs its floating-point work in CUDA kernels, which the count does not touch: one entry serves
    every count there. A meta-device model (the sharded build) gets the key of the device it would train on."""
    from trainers.models import build_meta_model

    tok, task = build_char_tokenizer(), SingleDigitSum()
    model_cfg, cfg = ModelConfig(preset="tiny-dense"), ColdStartConfig(steps=10)
    model = build_model(model_cfg, len(tok), seed=0)
    meta, _ = build_meta_model(model_cfg, len(tok))
    threads = torch.get_num_threads()
    keys = {}
    try:
        for n in (threads, threads + 1):
            torch.set_num_threads(n)
            keys[n] = {where: cache_key(model, tok, task, cfg, model_cfg, seed=0, device=where)
                       for where in (None, "cpu", "cuda", "cuda:1")}
            keys[n]["meta"] = cache_key(meta, tok, task, cfg, model_cfg, seed=0)
            keys[n]["meta-on-cuda"] = cache_key(meta, tok, task, cfg, model_cfg, seed=0, device=torch.device("cuda"))
    finally:
        torch.set_num_threads(threads)
    one, other = keys[threads], keys[threads + 1]
    assert one[None] == one["cpu"] == one["meta"] != other["cpu"]
    assert one["cuda"] == one["cuda:1"] == one["meta-on-cuda"] == other["cuda"] != one["cpu"]


def test_zero_steps_saves_the_untouched_model(tmp_path):
    tok, task = build_char_tokenizer(), SingleDigitSum()
    model_cfg = ModelConfig(preset="tiny-moe")
    model = build_model(model_cfg, len(tok), seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = ColdStartConfig(steps=0, cache_dir=str(tmp_path))
    out, info = cold_start(model, tok, task, cfg, model_cfg, seed=2, eos_id=tok.eos_token_id, progress=False)
    assert math.isnan(info["coldstart/loss"]) and info["coldstart/cached"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in out.state_dict().items())
    assert os.path.isfile(os.path.join(info["model_dir"], "model.safetensors"))


def test_cold_start_seed_gives_run_seeds_one_starting_model(tmp_path):
    """cold_start.seed fixed: runs with different seeds start RL from the same weights (bitwise); unset, the
    run seed drives the cold start and the starting models differ."""
    from dcmdp.config import load_config
    from dcmdp.loop import setup

    def start(seed: int, *extra: str) -> dict:
        cfg = load_config(None, ["model.preset=tiny-dense", "cold_start.steps=3", f"cold_start.cache_dir={tmp_path}/c",
                                 f"seed={seed}", "threads=1", "progress=false", f"output_dir={tmp_path}/run{seed}",
                                 *extra])
        s = setup(cfg)
        try:
            return {k: v.clone() for k, v in s.policy.model.state_dict().items()}
        finally:
            s.tracker.finish()
            s.policy.engine.close()
            s.lock.release()  # the run folder's lock: each start() is a run of its own in the same folder

    a, b = start(1, "cold_start.seed=7"), start(2, "cold_start.seed=7")
    assert all(torch.equal(a[k], b[k]) for k in a)
    c, d = start(1), start(2)
    assert not all(torch.equal(c[k], d[k]) for k in c)


def test_target_accuracy_stops_at_the_first_check_that_reaches_it(tmp_path):
    """SingleDigitSum on tiny-dense reaches >= 30% sampled accuracy well within 100 steps (see the test above):
    with a 20% target checked every 10 steps the cold start stops at a multiple of 10 below 100, and the probe
    accuracy of the model it returns (same probes, same seed) is >= the target. An unreachable target runs every
    step."""
    from trainers.coldstart import _EVAL_EXAMPLES, supervised_finetune

    tok, task = build_char_tokenizer(), SingleDigitSum()
    model_cfg = ModelConfig(preset="tiny-dense")
    cfg = ColdStartConfig(steps=100, batch_size=32, lr=6e-3, target_accuracy=0.2, check_every=10)
    probes = task.sample(random.Random("cold-start-probe-0"), _EVAL_EXAMPLES)
    probe_tokens = max(len(tok.encode(task.demonstration(ex), add_special_tokens=False)) for ex in probes) + 2

    def probe(m):
        return sampled_accuracy(m, tok, task, probes, eos_id=tok.eos_token_id, seed=0, max_new_tokens=probe_tokens)

    model = build_model(model_cfg, len(tok), seed=0)
    losses = supervised_finetune(model, tok, task, cfg, seed=0, eos_id=tok.eos_token_id, progress=False)
    assert len(losses) % 10 == 0 and len(losses) < 100
    assert probe(model) >= 0.2
    unreachable = build_model(model_cfg, len(tok), seed=0)
    assert len(supervised_finetune(unreachable, tok, task, dataclasses.replace(cfg, steps=30, target_accuracy=1.0),
                                   seed=0, eos_id=tok.eos_token_id, progress=False)) == 30


def test_progress_lines_at_the_first_and_last_step_and_every_interval_without_a_terminal(caplog):
    """progress=False (no terminal): a line at step 1 and at the last step when the interval is never reached, a line
    every step with a zero interval; the stop line says the accuracy is the training prompts'."""
    import logging
    import re

    from trainers.coldstart import supervised_finetune

    tok, task = build_char_tokenizer(), SingleDigitSum()
    model_cfg = ModelConfig(preset="tiny-dense")
    cfg = ColdStartConfig(steps=6, batch_size=8, lr=6e-3, target_accuracy=1.0, check_every=2)
    caplog.set_level(logging.INFO, logger="trainers.coldstart")
    supervised_finetune(build_model(model_cfg, len(tok), seed=0), tok, task, cfg, seed=0, eos_id=tok.eos_token_id,
                        progress=False, log_every_s=1e9)
    lines = [r.getMessage() for r in caplog.records if re.match(r"cold start: step \d", r.getMessage())]
    assert [line.split(",")[0] for line in lines] == ["cold start: step 1/6", "cold start: step 6/6"]
    assert re.fullmatch(r"cold start: step 1/6, loss [\d.]+, [\d.]+ s/step, ETA <= \dm\d\ds", lines[0]), lines[0]
    # the last line carries the accuracy of the check at step 4 (step 6 is the end: no check there)
    assert re.fullmatch(r"cold start: step 6/6, loss [\d.]+, sampled accuracy on training prompts [\d.]+% \(step 4\), "
                        r"[\d.]+ s/step, done", lines[1]), lines[1]
    caplog.clear()
    supervised_finetune(build_model(model_cfg, len(tok), seed=0), tok, task, dataclasses.replace(cfg, steps=3),
                        seed=0, eos_id=tok.eos_token_id, progress=False, log_every_s=0.0)
    assert len([r for r in caplog.records if r.getMessage().startswith("cold start: step ")]) == 3
