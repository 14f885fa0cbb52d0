"""One builder of the policy for every command: tokenizer, task, model and rollout engine (``build_policy``).

``dcmdp train`` (``dcmdp.loop``), ``dcmdp calibrate`` and ``dcmdp eval`` build them alike, so an evaluation
or a calibration sees the same prompts, engine settings and sampling seeds as training. Also here: what
those commands share to sample the held-out set (prompt encoding, the length screen, response decoding,
``held_out_accuracy``) and the seeding of a run.
"""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from dcmdp import distributed
from dcmdp.config import RunConfig
from trainers.attention import GQA_ATTENTION
from trainers.batch import Rollout
from trainers.coldstart import cached_model_dir, cold_start
from trainers.engines import RolloutEngine, capabilities
from trainers.models import PRESETS, build_model, cast_model, check_context, save_model_dir
from trainers.routing import is_moe
from trainers.tasks import TASKS, Curriculum, Example, Task, score_completions
from trainers.tokenizer import build_char_tokenizer, load_tokenizer

log = logging.getLogger("dcmdp")


@dataclass
class Policy:
    """What ``build_policy`` builds."""

    tokenizer: Any
    task: Task
    # The training engine's model pi_theta (under torchrun the loop shards it in place).
    model: torch.nn.Module
    # Hugging Face directory of the model's starting weights (engines that load from disk read it).
    model_dir: str
    # The rollout engine mu, holding the model's starting weights.
    engine: RolloutEngine
    # The training prompts of each step under ``task.curriculum`` (None: ``task`` draws them).
    curriculum: Optional[Curriculum] = None

    @property
    def moe(self) -> bool:
        return is_moe(self.model)


def build_policy(cfg: RunConfig, out: Path, *, d: distributed.Dist = distributed.Dist(), progress: bool = False,
                 weights: Optional[dict[str, torch.Tensor]] = None, param_dtype: Optional[torch.dtype] = None
                 ) -> Policy:
    """Tokenizer, task, model (loaded from ``model.path``, or cold-started and cached) and rollout engine.

    ``weights``: a checkpoint's model state dict, loaded instead of the cold start (``dcmdp eval``). A model that
    is neither loaded from ``model.path`` nor cached by the cold start is saved to ``out/initial_model`` for the
    engines that load from disk. ``param_dtype``: the dtype the trainer's parameters train in (the optimiser's
    precision), cast to after the engine took its copy of the starting weights. ``progress``: the cold start's
    progress bar. Under torchrun (``d.sharded``) the model comes back FSDP2-sharded, built shard by shard
    (``_sharded_model``), and the engine is the scale-out's (``distributed.rollout_engine``), built after it.
    """
    preset = PRESETS[cfg.model.preset]
    task = TASKS[cfg.task.name](cfg.task, cfg.seed)
    random_init = cfg.model.init == "random"
    if cfg.model.path and not random_init:
        tokenizer = load_tokenizer(cfg.model.path)
    else:
        if preset.needs_path and not random_init:
            raise FileNotFoundError(f"model.preset={cfg.model.preset!r} loads real weights: set model.path to a "
                                    f"local directory with the weights and tokenizer, or model.init=random for a "
                                    f"speed or memory run without them")
        tokenizer = build_char_tokenizer()
    if random_init and d.main:
        log.warning("model.init=random: %s built with RANDOM weights%s and the character tokenizer as a stand-in "
                    "(%d tokens): a speed and memory run, not a model that can learn the task's language",
                    cfg.model.preset, f" at {cfg.model.num_layers} layers" if cfg.model.num_layers else "",
                    len(tokenizer))
    # a cold start from its own seed starts every run seed from one model
    init_seed = cfg.cold_start.seed if cfg.cold_start.seed is not None and not cfg.model.path else cfg.seed
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if d.sharded and weights is None:
        model, model_dir, engine = _sharded_model(cfg, out, d, tokenizer, task, seed=init_seed, dtype=param_dtype,
                                                  progress=progress)
        if cfg.model.gqa_attention:
            model.set_attn_implementation(GQA_ATTENTION)
        return Policy(tokenizer, task, model, model_dir, engine,
                      Curriculum(task, cfg.task) if cfg.task.curriculum else None)
    model = build_model(cfg.model, len(tokenizer), seed=init_seed, device=d.device)
    if weights is not None:
        model.load_state_dict(weights)
    if cfg.model.path and weights is None and not random_init:
        model_dir = cfg.model.path
    elif cfg.cold_start.steps > 0 and weights is None:
        with d.main_first():  # rank 0 fills the on-disk cache, the other ranks load from it
            model, info = cold_start(model, tokenizer, task, cfg.cold_start, cfg.model, seed=init_seed, eos_id=eos_id,
                                     progress=progress and d.main, fallback_dir=str(out / "initial_model"))
        model = model.to(d.device)  # a cached cold start loads on the CPU
        model_dir = str(info["model_dir"])
    else:
        model_dir = str(out / "initial_model")
        # only an engine that reads the weights from disk needs them there (a real preset is tens of GB)
        if d.main and capabilities(cfg.rollout.engine).loads_from_disk:
            save_model_dir(model, tokenizer, model_dir)
    engine = distributed.rollout_engine(cfg, model, model_dir, eos_id=eos_id, pad_id=pad_id, d=d)
    if param_dtype is not None:
        # the rotary buffers stay float32
        cast_model(model, param_dtype)
    if cfg.model.gqa_attention:
        # after the cold start (whose cached weights stay those of sdpa) and after the engine copied the model
        model.set_attn_implementation(GQA_ATTENTION)
    model = distributed.shard_model(model, cfg, d)
    return Policy(tokenizer, task, model, model_dir, engine,
                  Curriculum(task, cfg.task) if cfg.task.curriculum else None)


def _sharded_model(cfg: RunConfig, out: Path, d: distributed.Dist, tokenizer, task: Task, *, seed: int,
                   dtype: Optional[torch.dtype], progress: bool) -> tuple[torch.nn.Module, str, RolloutEngine]:
    """(sharded model, model_dir, engine) of a torchrun rank, no rank ever holding the whole trainer's model.

    The model is built on the meta device, sharded, and each rank fills its shards one full tensor at a time
    (``distributed.build_sharded_model``) from ``model.path``, from the cold-start cache entry (``model_dir``), or,
    at ``cold_start.steps=0`` without a path, by replaying the random init of ``seed`` (``trainers.weights``: the
    same weights as the single-process build). A cold start that is not cached yet is trained first by rank 0 on a
    whole model, as in a single process (the other ranks wait), and written to the cache (or ``out/initial_model``
    when the cache cannot be written); every rank then reads it. Without a cold start or a path, an engine that
    loads from disk gets the drawn weights written to ``out/initial_model`` by rank 0, one tensor at a time.

    The engine comes after the sharded model: rank 0's torch engine gets its own model, filled whole from the same
    source (it holds it and the engine's cast copy for a moment); a vLLM engine reads ``model_dir``."""
    from trainers.models import build_meta_model, init_device
    from trainers.weights import checkpoint_tensors, init_buffers, random_init_tensors, save_streamed

    meta, init_ops = build_meta_model(cfg.model, len(tokenizer))
    caps = capabilities(cfg.rollout.engine)
    if cfg.model.path and cfg.model.init != "random":
        model_dir = cfg.model.path
    elif cfg.cold_start.steps > 0:
        model_dir = cached_model_dir(meta, tokenizer, task, cfg.cold_start, cfg.model, seed=seed, device=d.device)
        if model_dir is None:
            trained = None
            if d.main:
                whole = build_model(cfg.model, len(tokenizer), seed=seed, device=d.device)
                whole, info = cold_start(whole, tokenizer, task, cfg.cold_start, cfg.model, seed=seed,
                                         eos_id=tokenizer.eos_token_id, progress=progress,
                                         fallback_dir=str(out / "initial_model"))
                trained = str(info["model_dir"])
                del whole
            model_dir = d.from_main(trained)
        elif d.main:
            log.info("cold start: loading cached model from %s, shard by shard", model_dir)
        init_ops = None
    else:
        model_dir = str(out / "initial_model")

    def source(model: torch.nn.Module):
        if init_ops is None:
            return checkpoint_tensors(model, model_dir)
        return random_init_tensors(init_ops, seed=seed, device=init_device(cfg.model, d.device))

    if init_ops is not None and d.main and caps.loads_from_disk:
        save_streamed(meta, source(meta), tokenizer, model_dir)

    engine_model = copy.deepcopy(meta) if d.main and caps.weight_sync == "rank0" else None
    model = distributed.build_sharded_model(meta, source(meta), cfg, d, dtype)
    if engine_model is not None:
        engine_model.to_empty(device=d.device)
        distributed.load_shards(engine_model, source(engine_model))
        init_buffers(engine_model)
    engine = distributed.rollout_engine(cfg, engine_model if engine_model is not None else model, model_dir,
                                        eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, d=d)
    return model, model_dir, engine


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, stream: int) -> int:
    """Independent seeds per (run seed, step, stream): a resumed run regenerates the same randomness."""
    return int(np.random.SeedSequence([seed, step, stream]).generate_state(1)[0])


# The sampling seed stream of the held-out evaluation (one fixed draw per run seed, whatever the step).
EVAL_SEED_STEP, EVAL_SEED_STREAM = 10**6, 3


def held_out_examples(policy: Policy) -> list[Example]:
    """The task's held-out examples that can fit the model's context (``screen_prompt_chars``)."""
    return screen_prompt_chars(policy.tokenizer, policy.model, policy.task.eval_set(), "held-out")


def screen_task_prompts(policy: Policy, max_new_tokens: int) -> None:
    """Drop, at load, every prompt of a file-based task (one with ``train_set``) that cannot fit the context with
    ``max_new_tokens`` response tokens: first by its length in characters (``screen_prompt_chars``, before
    tokenising), then by its token count. One warning per split names the count and the longest; a split left
    empty is a ValueError before the first step. Without this a single long training prompt ends a run at the
    step that happens to draw it."""
    task = policy.task
    if not hasattr(task, "train_set"):
        return
    limit = getattr(getattr(policy.model, "config", None), "max_position_embeddings", None)
    for what, examples, keep in (("training", task.train_set(), task.keep_train),
                                 ("held-out", task.eval_set(), task.keep_eval)):
        fit = screen_prompt_chars(policy.tokenizer, policy.model, examples, what)
        if limit:
            sizes = [len(encode_prompt(policy.tokenizer, ex.prompt)) for ex in fit]
            longer = [n for n in sizes if n + max_new_tokens > limit]
            if longer:
                log.warning("%d of %d %s prompts skipped: with rollout.max_new_tokens=%d they need more than the "
                            "model's context of %d positions (the longest has %d tokens)", len(longer), len(examples),
                            what, max_new_tokens, limit, max(longer))
                fit = [ex for ex, n in zip(fit, sizes) if n + max_new_tokens <= limit]
        if not fit:
            raise ValueError(f"every one of the {len(examples)} {what} prompts of task {task.name!r} is too long for "
                             f"the model's context of {limit} positions with rollout.max_new_tokens={max_new_tokens}: "
                             f"shorten the prompts or lower rollout.max_new_tokens")
        if len(fit) < len(examples):
            keep(fit)


def held_out_accuracy(policy: Policy, examples: list[Example], max_new_tokens: int, seed: int) -> float:
    """Mean reward of one sampled response (the rollout engine's settings) per held-out example."""
    if not examples:
        raise ValueError("every held-out prompt is too long for the model's context: nothing to evaluate")
    ids = encode_prompts(policy.tokenizer, policy.model, examples, max_new_tokens)
    rollout = policy.engine.generate(ids, seed=step_seed(seed, EVAL_SEED_STEP, EVAL_SEED_STREAM))
    completions = decode_responses(policy.tokenizer, rollout)
    return float(np.mean(score_completions(policy.task, completions, examples)[0]))


def screen_prompt_chars(tokenizer, model: torch.nn.Module, examples: list[Example], what: str) -> list[Example]:
    """Drop the prompts whose length in characters alone shows they cannot fit the context, before tokenising
    them (a 100 MB prompt would take gigabytes to tokenise): a prompt of more than context x (the longest
    vocabulary entry, in characters) characters has more tokens than the context has positions. Logs the count."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not context or not examples:
        return examples
    longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
    limit = context * max(longest_token, 1)
    kept = [ex for ex in examples if len(ex.prompt) <= limit]
    if len(kept) < len(examples):
        longest = max(len(ex.prompt) for ex in examples)
        log.warning("%d of %d %s prompts skipped: longer than %d characters (%d positions x %d characters in the "
                    "longest token), so they cannot fit the model's context; the longest has %d characters",
                    len(examples) - len(kept), len(examples), what, limit, context, longest_token, longest)
    return kept


def encode_prompt(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompts(tokenizer, model: torch.nn.Module, examples: list[Example], max_new_tokens: int
                   ) -> list[list[int]]:
    """Token ids of every prompt; a prompt that leaves no room for the response in the context is an error."""
    ids = [encode_prompt(tokenizer, ex.prompt) for ex in examples]
    check_context(ids, max_new_tokens, model, [ex.prompt for ex in examples])
    return ids


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    ids, mask = rollout.response_ids_BT.tolist(), rollout.response_mask_BT.tolist()
    return [tokenizer.decode([t for t, m in zip(row, mrow) if m], skip_special_tokens=True)
            for row, mrow in zip(ids, mask)]
