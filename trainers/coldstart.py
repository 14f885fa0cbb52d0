"""Supervised cold start: a short fine-tune on task demonstrations so that RL starts with signal.

A randomly initialised tiny model answers nothing correctly, and group-relative advantages are zero
when every sample of a group fails. A few hundred AdamW steps of teacher forcing on
``task.demonstration(example)`` take it to a modest accuracy, leaving room for RL to improve: on
2-digit addition the tiny MoE reached ~18% (T=1 samples) / ~25% (greedy) after 500 steps x 64 at
lr 6e-3 (~20 s on one core), but only ~2% / ~4% after 150 steps at lr 3e-3. The result is cached on disk by a content hash, so runs that share the
model, task, cold-start config and seed (a tolerance sweep, a rerun) train it once.

Each cache entry carries ``cache_manifest.json`` (size and sha256 of every file, written last); an entry without
it, with a file that does not match, or whose weights do not load is trained again, with a warning. A cache
directory that cannot be written on a miss: the cold start trains without caching (warning) and saves the
model to ``fallback_dir`` (or a temporary directory) for the engines that load from disk.

Loss: mean over all response tokens of the batch of ``-log pi(y_t)`` at temperature 1, with the
response = demonstration + EOS, computed by ``trainers.scoring.response_logprobs`` on the same
left-padded prompt + right-padded response layout the RL learner uses. Learning rate: ``cfg.lr`` after
a linear warm-up over the first 10% of the steps, cosine-decayed to ``cfg.lr / 10`` at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import tempfile
import time
from typing import Any, Protocol, Sequence

import torch
import transformers
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from trainers import routing
from trainers.config import ColdStartConfig, ModelConfig, RolloutConfig
from trainers.models import load_model_dir, param_dtype, save_model_dir, set_compute_dtype
from trainers.scoring import response_logprobs
from trainers.tasks import score_completions

log = logging.getLogger(__name__)

# Number of eval-set examples whose sampled accuracy is reported after the cold start.
_EVAL_EXAMPLES = 256
CACHE_MANIFEST = "cache_manifest.json"
# How the cold start of a cache entry ended: steps run, whether the stop rule reached its target, the last check.
STOP_RESULT = "cold_start_result.json"


class _Example(Protocol):
    prompt: str


class _Task(Protocol):
    """The part of ``trainers.tasks.Task`` the cold start uses."""

    def sample(self, rng: random.Random, n: int) -> list: ...

    def demonstration(self, example) -> str: ...

    def eval_set(self) -> list: ...

    def reward(self, completion: str, example) -> float: ...


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def _without(x: Any, key: str) -> Any:
    return {k: v for k, v in x.items() if k != key} if isinstance(x, dict) else x


def cache_key(model: PreTrainedModel, tokenizer, task: _Task, cfg: ColdStartConfig, model_cfg: ModelConfig,
              *, seed: int, device: torch.device | str | None = None) -> str:
    """Hex digest over everything that determines the cold-started weights.

    Covers the model's architecture config, the model config (preset, dtype, path), the tokenizer's
    vocabulary, the task's name and config (and its ``data_digest``, a hash of its files, when it has one), the
    cold-start hyper-parameters (not the cache directory), the seed, the torch / transformers versions (kernels
    and init code change across versions), and, when the cold start trains on the CPU, torch's intra-op thread
    count: CPU reductions split across threads sum in another order, and over ~1000 steps at a high learning rate
    the rounding differences grow into a different model (measured on the default config: 1150 steps give 91.8%
    held-out accuracy with 1 thread, ~32% with 2). On a GPU every floating-point operation of the cold start runs
    in CUDA kernels, which do not use that pool (the CPU only draws examples and encodes integer token ids), so the
    count is left out there and one entry serves every thread count. ``device``: where the cold start trains
    (default: the model's device; a model on the meta device counts as the CPU unless ``device`` says otherwise).
    """
    trains_on = torch.device(device) if device is not None else next(model.parameters()).device
    arch = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"):
        arch.pop(k, None)
    payload = {
        "arch": arch,
        # fp32_router=False (the default) leaves every weight as it was before the field existed: left out of the
        # key so that the caches written then stay valid
        # gqa_attention applies after the cold start (dcmdp.policy.build_policy)
        "model": {k: v for k, v in dataclasses.asdict(model_cfg).items()
                  if not (k == "fp32_router" and not v) and k != "gqa_attention"},
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "task": {"name": getattr(task, "name", type(task).__qualname__),
                 # the curriculum draws RL's training prompts only: the cold start never reads it
                 "cfg": _without(_jsonable(getattr(task, "cfg", None)), "curriculum"),
                 # a task read from files names their content (the same path may hold other data later)
                 **({"data": task.data_digest} if getattr(task, "data_digest", None) else {})},
        "cold_start": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "cache_dir"},
        "seed": seed,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        **({"threads": torch.get_num_threads()} if trains_on.type in ("cpu", "meta") else {}),
    }
    blob = json.dumps(payload, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def encode_batch(tokenizer, examples: Sequence[_Example], completions: Sequence[str], *, eos_id: int,
                 pad_id: int) -> tuple[Tensor, Tensor, int]:
    """(ids_BS, mask_BS, P): left-padded prompts then right-padded ``completion + EOS`` responses."""
    prompts = [tokenizer.encode(ex.prompt, add_special_tokens=False) for ex in examples]
    responses = [tokenizer.encode(c, add_special_tokens=False) + [eos_id] for c in completions]
    B, P, T = len(prompts), max(map(len, prompts)), max(map(len, responses))
    ids_BS = torch.full((B, P + T), pad_id, dtype=torch.long)
    mask_BS = torch.zeros((B, P + T), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids_BS[b, P - len(p):P] = torch.tensor(p)
        ids_BS[b, P:P + len(r)] = torch.tensor(r)
        mask_BS[b, P - len(p):P + len(r)] = True
    return ids_BS, mask_BS, P


def _lr_factor(step: int, steps: int) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


# Seconds between two cold-start progress lines (plus the first and the last step), terminal or not.
LOG_EVERY_S = 30.0


class _ProgressLog:
    """Progress lines of the cold start at a steady cadence: the first step, then every ``every_s`` seconds, and the
    last step; each with the loss, the last sampled accuracy on training prompts (the stop rule's), s/step and ETA."""

    def __init__(self, steps: int, every_s: float):
        self.steps, self.every_s = steps, every_s
        self.t0 = self.last = time.perf_counter()
        self.accuracy: tuple[int, float] | None = None  # (step, sampled accuracy on the training prompts)

    def step(self, step: int, loss: float, final: bool = False) -> None:
        now = time.perf_counter()
        if not (step == 1 or final or now - self.last >= self.every_s):
            return
        self.last = now
        per_step = (now - self.t0) / step
        acc = (f", sampled accuracy on training prompts {100 * self.accuracy[1]:.1f}% (step {self.accuracy[0]})"
               if self.accuracy else "")
        eta = "done" if final else f"ETA <= {_duration(per_step * (self.steps - step))}"
        log.info("cold start: step %d/%d, loss %.3f%s, %.2f s/step, %s", step, self.steps, loss, acc, per_step, eta)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def supervised_finetune(model: PreTrainedModel, tokenizer, task: _Task, cfg: ColdStartConfig, *, seed: int,
                        eos_id: int, progress: bool = True, log_every_s: float = LOG_EVERY_S) -> list[float]:
    """Train ``model`` in place for ``cfg.steps`` steps, or until the sampled accuracy on fixed training-
    distribution prompts reaches ``cfg.target_accuracy`` (checked every ``cfg.check_every`` steps); returns the
    per-step losses (their count is the number of steps run). Logs a progress line at the first step, every
    ``log_every_s`` seconds and at the last step, whether or not a bar is shown, and a warning when the target was
    set and never reached."""
    return _finetune(model, tokenizer, task, cfg, seed=seed, eos_id=eos_id, progress=progress,
                     log_every_s=log_every_s)[0]


def _finetune(model: PreTrainedModel, tokenizer, task: _Task, cfg: ColdStartConfig, *, seed: int, eos_id: int,
              progress: bool = True, log_every_s: float = LOG_EVERY_S) -> tuple[list[float], tuple[int, float] | None]:
    """``supervised_finetune``, also returning the last (step, sampled accuracy on training prompts) checked."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    # probe prompts from the training distribution (never the held-out eval set), fixed by the seed
    probes = task.sample(random.Random(f"cold-start-probe-{seed}"), _EVAL_EXAMPLES) if cfg.target_accuracy else []
    probe_tokens = max((len(tokenizer.encode(task.demonstration(ex), add_special_tokens=False)) for ex in probes),
                       default=0) + 2
    rng = random.Random(seed)
    device = next(model.parameters()).device
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: _lr_factor(i, cfg.steps))
    losses = []
    report = _ProgressLog(cfg.steps, log_every_s)
    bar = tqdm(range(cfg.steps), desc="cold start", disable=not progress, leave=False)
    for _ in bar:
        examples = task.sample(rng, cfg.batch_size)
        ids_BS, mask_BS, P = encode_batch(tokenizer, examples, [task.demonstration(ex) for ex in examples],
                                          eos_id=eos_id, pad_id=pad_id)
        ids_BS, mask_BS = ids_BS.to(device), mask_BS.to(device)
        logp_BT, _ = response_logprobs(model, ids_BS, mask_BS, P, temperature=1.0)
        response_mask_BT = mask_BS[:, P:]
        loss = -(logp_BT * response_mask_BT).sum() / response_mask_BT.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        report.step(len(losses), losses[-1], final=len(losses) == cfg.steps)
        if probes and len(losses) % cfg.check_every == 0 and len(losses) < cfg.steps:
            model.eval()
            accuracy = sampled_accuracy(model, tokenizer, task, probes, eos_id=eos_id, seed=seed,
                                        max_new_tokens=probe_tokens)
            model.train()
            report.accuracy = (len(losses), accuracy)
            if accuracy >= cfg.target_accuracy:
                report.step(len(losses), losses[-1], final=True)
                log.info("cold start: sampled accuracy on %d training prompts %.1f%% >= target %.1f%% after %d steps: "
                         "stopping", len(probes), 100 * accuracy, 100 * cfg.target_accuracy, len(losses))
                break
    else:
        if probes:
            log.warning("%s", below_target_warning(cfg, report.accuracy, f"after {cfg.steps} of {cfg.steps} steps"))
    model.eval()
    return losses, report.accuracy


def below_target_warning(cfg: ColdStartConfig, last: tuple[int, float] | None, when: str) -> str:
    """The warning of a cold start whose stop rule never fired: the sampled accuracy on training prompts (the
    measure ``target_accuracy`` is compared with) stayed below the target; ``last`` is its (step, value)."""
    seen = (f"sampled accuracy on training prompts {100 * last[1]:.1f}% at step {last[0]}" if last else
            "sampled accuracy on training prompts never checked")
    return (f"cold start ended below its target: {seen} < cold_start.target_accuracy {100 * cfg.target_accuracy:.1f}% "
            f"({when}); RL may find little reward signal: raise cold_start.steps or cold_start.lr, or make the task "
            f"easier")


@torch.no_grad()
def sampled_accuracy(model: PreTrainedModel, tokenizer, task: _Task, examples: Sequence[_Example], *, eos_id: int,
                     temperature: float = 1.0, max_new_tokens: int = 8, seed: int = 0) -> float:
    """Mean ``task.reward > 0.5`` of one response per example sampled at ``temperature`` (fp32 engine)."""
    from trainers.engines.torch_engine import TorchEngine

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    engine = TorchEngine(RolloutConfig(temperature=temperature, max_new_tokens=max_new_tokens), model,
                         eos_id=eos_id, pad_id=pad_id)
    rollout = engine.generate([tokenizer.encode(ex.prompt, add_special_tokens=False) for ex in examples], seed=seed)
    completions = [tokenizer.decode(rollout.response_ids_BT[b][rollout.response_mask_BT[b]].tolist(),
                                    skip_special_tokens=True) for b in range(len(examples))]
    rewards, _ = score_completions(task, completions, list(examples))
    engine.close()
    return sum(r > 0.5 for r in rewards) / len(examples)


def _file_digests(directory: str) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file under ``directory`` but the manifest."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if rel == CACHE_MANIFEST:
                continue
            sha = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    sha.update(chunk)
            out[rel] = {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}
    return out


def write_cache_manifest(model_dir: str) -> None:
    """Checksum every file of a saved cache entry; the manifest is written last and renamed into place."""
    files = _file_digests(model_dir)
    tmp = os.path.join(model_dir, f".{CACHE_MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(model_dir, CACHE_MANIFEST))


def write_stop_result(model_dir: str, cfg: ColdStartConfig, steps: int, last: tuple[int, float] | None) -> None:
    """Record in a cache entry how its cold start ended (``STOP_RESULT``), so that loading the entry warns as
    training it did when the target was not reached. Written before the manifest, which then covers it."""
    result = {"steps": steps, "target_accuracy": cfg.target_accuracy,
              "reached": cfg.target_accuracy is None or steps < cfg.steps,  # the rule stops early only at the target
              "step": last[0] if last else None, "accuracy": last[1] if last else None}
    with open(os.path.join(model_dir, STOP_RESULT), "w") as f:
        json.dump(result, f)


def read_stop_result(model_dir: str) -> dict | None:
    """The entry's ``STOP_RESULT``; None for an entry written without one."""
    try:
        with open(os.path.join(model_dir, STOP_RESULT)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def verify_cache_entry(model_dir: str) -> tuple[bool, str]:
    """(ok, why not): the entry has its manifest and every listed file has its size and sha256."""
    try:
        with open(os.path.join(model_dir, CACHE_MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return False, f"no {CACHE_MANIFEST} (written by an interrupted or older cold start)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"unreadable {CACHE_MANIFEST}: {exc}"
    found = _file_digests(model_dir)
    for name, meta in files.items():
        if name not in found:
            return False, f"{name} is missing"
        if found[name] != meta:
            return False, f"{name} does not match its checksum (truncated or corrupted)"
    return True, "checksums ok"


def _writable(directory: str) -> str:
    """'' when a cache entry can be written under ``directory``, else why not."""
    try:
        os.makedirs(directory, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=directory))
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)


def _load_cached(model_dir: str, dtype: str) -> tuple[PreTrainedModel | None, str]:
    """The cached model, or (None, why it cannot be used) for an entry that exists but fails its checks."""
    ok, why = verify_cache_entry(model_dir)
    if not ok:
        return None, why
    try:
        return load_model_dir(model_dir, dtype), ""
    except Exception as exc:  # a verified entry that still fails to load was written by another version
        return None, f"its weights do not load: {type(exc).__name__}: {str(exc)[:200]}"


def cached_model_dir(model: PreTrainedModel, tokenizer, task: _Task, cfg: ColdStartConfig, model_cfg: ModelConfig, *,
                     seed: int, device: torch.device | str | None = None) -> str | None:
    """The cache entry ``cold_start`` would load for this model (``cache_key``; the model may be on the meta device,
    ``device`` then names where a cold start would train it) when it exists and passes its checksums, else None.
    Loads no weights."""
    key = cache_key(model, tokenizer, task, cfg, model_cfg, seed=seed, device=device)
    model_dir = os.path.abspath(os.path.join(cfg.cache_dir, key))
    return model_dir if os.path.exists(model_dir) and verify_cache_entry(model_dir)[0] else None


def cold_start(model: PreTrainedModel, tokenizer, task: _Task, cfg: ColdStartConfig, model_cfg: ModelConfig, *,
               seed: int, eos_id: int, progress: bool = True,
               fallback_dir: str | None = None) -> tuple[PreTrainedModel, dict]:
    """Cold-start ``model`` on ``task`` demonstrations, or load the cached result.

    Returns ``(model, info)``. ``info`` holds numeric metrics ``coldstart/loss`` (mean of the last 10
    steps; NaN when loaded from cache or ``cfg.steps == 0``), ``coldstart/loss_first``,
    ``coldstart/cached`` (1.0 if loaded), ``coldstart/accuracy`` (T=1 sampled accuracy on the first
    256 eval examples, one sample each), ``coldstart/seconds``, and ``model_dir``: the directory (str)
    holding the model and tokenizer in Hugging Face format, for engines that load weights from disk
    (vLLM). Pop ``model_dir`` before logging the rest as metrics. With ``cfg.steps == 0`` the
    untouched model is saved, so ``model_dir`` always exists: in the cache, or in ``fallback_dir`` (default: a
    new temporary directory) when the cache directory cannot be written.
    """
    t0 = time.perf_counter()
    check = getattr(task, "check_demonstrations", None)
    if check is not None:  # a task whose examples may lack a demonstration says so before any work
        check()
    key = cache_key(model, tokenizer, task, cfg, model_cfg, seed=seed)
    model_dir = os.path.abspath(os.path.join(cfg.cache_dir, key))
    losses: list[float] = []
    cached = False
    if os.path.exists(model_dir):
        loaded, why = _load_cached(model_dir, param_dtype(model_cfg.dtype))
        if loaded is not None:
            log.info("cold start: loading cached model from %s", model_dir)
            model, cached = loaded, True
            model.config.use_cache = False
            routing.set_fp32_router(model, model_cfg.fp32_router)
            set_compute_dtype(model, model_cfg.dtype)
        else:
            log.warning("cold start: cached model %s is not usable (%s); training it again", model_dir, why)
    if not cached:
        unwritable = _writable(cfg.cache_dir)
        if unwritable:
            target = fallback_dir or tempfile.mkdtemp(prefix="dcmdp_coldstart_")
            log.warning("cold start: the cache directory %s cannot be written (%s): training %d steps without "
                        "caching; the model is saved to %s", os.path.abspath(cfg.cache_dir), unwritable, cfg.steps,
                        target)
            model_dir = os.path.abspath(target)
        else:
            log.info("cold start: training %d steps x %d sequences, caching in %s", cfg.steps, cfg.batch_size,
                     model_dir)
        losses, last = _finetune(model, tokenizer, task, cfg, seed=seed, eos_id=eos_id, progress=progress)
        if unwritable:
            save_model_dir(model, tokenizer, model_dir)
        elif _load_cached(model_dir, param_dtype(model_cfg.dtype))[0] is not None:  # a concurrent run (a tune
            # worker) cached the same entry while this one trained
            log.info("cold start: %s was cached by another run meanwhile; keeping it", model_dir)
        else:
            def finalize(directory: str) -> None:
                write_stop_result(directory, cfg, len(losses), last)
                write_cache_manifest(directory)

            save_model_dir(model, tokenizer, model_dir, finalize=finalize)
    model.eval()
    nan = float("nan")
    examples = list(task.eval_set())[:_EVAL_EXAMPLES]
    accuracy = nan
    if examples:
        # Room for the longest demonstration, its EOS and one token more.
        longest = max(len(tokenizer.encode(task.demonstration(ex), add_special_tokens=False)) for ex in examples)
        accuracy = sampled_accuracy(model, tokenizer, task, examples, eos_id=eos_id, seed=seed,
                                    max_new_tokens=longest + 2)
    if examples:
        # not on the console: a run prints one held-out figure before RL, its rollout engine's (dcmdp.loop)
        log.debug("cold start: held-out sampled accuracy %.1f%% on %d eval prompts (fp32 engine)", 100 * accuracy,
                  len(examples))
    if cached and cfg.target_accuracy is not None:
        result = read_stop_result(model_dir)
        if result is not None and not result["reached"]:
            last = (result["step"], result["accuracy"]) if result.get("step") else None
            log.warning("%s", below_target_warning(cfg, last, f"cached model {model_dir}, trained {result['steps']} "
                                                              f"of {cfg.steps} steps"))
    info = {
        "coldstart/loss": sum(losses[-10:]) / len(losses[-10:]) if losses else nan,
        "coldstart/loss_first": losses[0] if losses else nan,
        "coldstart/steps": float(len(losses)) if losses else nan,
        "coldstart/cached": float(cached),
        "coldstart/accuracy": accuracy,
        "coldstart/seconds": time.perf_counter() - t0,
        "model_dir": model_dir,
    }
    return model, info


def cold_start_for_run(seed: int, cfg) -> str:
    """Train (or find cached) the cold start of a run config (``dcmdp.config.RunConfig``) at RL seed ``seed`` on one
    torch thread, as the run's own setup would; its cache directory. A module-level function so that a process pool
    (the benchmark runner's, which trains the distinct cold starts of an experiment side by side) can call it."""
    import logging

    from trainers.models import build_model
    from trainers.tasks import TASKS
    from trainers.tokenizer import build_char_tokenizer

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(processName)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # the runs' threads=1: the cold start (and its cache key) depend on the thread count
    cs_seed = seed if cfg.cold_start.seed is None else cfg.cold_start.seed  # as dcmdp.loop.setup does
    tok = build_char_tokenizer()
    model = build_model(cfg.model, len(tok), seed=cs_seed)
    _, info = cold_start(model, tok, TASKS[cfg.task.name](cfg.task, seed), cfg.cold_start, cfg.model, seed=cs_seed,
                         eos_id=tok.eos_token_id, progress=False)
    return str(info["model_dir"])
