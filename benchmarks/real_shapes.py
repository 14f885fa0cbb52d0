"""The Qwen3-8B and Qwen3-30B-A3B recipes at their real widths, one decoder layer deep, on CPU.

One-layer models with the presets' shapes (``trainers.models`` ``qwen3-8b`` / ``qwen3-30b-a3b``), random bf16
weights and a character tokenizer padded to the full vocabulary (``build_tokenizer``), run two RL steps of each
recipe through ``dcmdp train`` with the torch and the vLLM engine, one process at a time; per run: the step times
(``time/*``), the peak RSS of the child (``os.wait4``) and that it trained and synced. Departures from the recipe
(``overrides``): one layer, ``max_position_embeddings = --context``, 2 prompts x 2 samples, 16 new tokens,
``algo.entropy_coef=0.01`` and ``optim.lr=1e-3`` so that step 1 moves the weights; ``--precision`` sets
``optim.precision`` (bytes per parameter tabulated by ``optimizer_bytes_per_param``).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/real_shapes.py [--recipes qwen3-8b,qwen3-30b-a3b]
        [--engines torch,vllm] [--precision fp32|bf16_stochastic|bf16_kahan] [--workdir /tmp/dcmdp_real_shapes]
        [--out benchmarks/results/real_shapes/real_shapes]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._page import environment, machine_kind, md_table  # noqa: E402
from benchmarks._page import fmt as _fmt  # noqa: E402

from trainers.models import get_preset, param_counts, save_model_dir  # noqa: E402

RECIPES = ("qwen3-8b", "qwen3-30b-a3b")
ENGINES = ("torch", "vllm")
VOCAB = 151936
DATA = "tests/data/math_sample.jsonl"  # repository-relative: runs start in the repository root
GIB = 1 << 30
# Beyond the recipe: see the module docstring ("A gradient that is not zero").
SYNC_PROBE = ("algo.entropy_coef=0.01", "optim.lr=1e-3")


def one_layer_config(recipe: str, context: int = 1024):
    """The recipe preset's transformers config with one decoder layer and ``context`` positions."""
    config = get_preset(recipe).make_config(VOCAB)
    config.num_hidden_layers = 1
    config.max_position_embeddings = context
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:1]
    return config


def build_tokenizer(vocab_size: int = VOCAB):
    """The character tokenizer's ids 0..100 (``trainers.tokenizer``) plus filler tokens up to ``vocab_size``.

    Fillers are whole-word vocabulary entries (``<|f101|>`` ...): the per-character pre-tokenizer never
    produces them on encode, and each decodes to its own text, so any id a 151936-way sampler draws decodes.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trainers.tokenizer import (CHARACTERS, EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, PAD_TOKEN,
                                    SPECIAL_TOKENS, UNK_TOKEN)

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    vocab.update({f"<|f{i}|>": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=UNK_TOKEN, additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
                                   clean_up_tokenization_spaces=False, padding_side="left", model_max_length=1 << 20)


def _bf16_model(config):
    """The Qwen3 (MoE or dense) model of ``config``, built directly in bfloat16 from the global generator."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return _model_class(config)(config)
    finally:
        torch.set_default_dtype(default)


def _model_class(config):
    from transformers import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM


def build_model_dir(recipe: str, path: Path, *, context: int = 1024, seed: int = 0) -> dict:
    """Random bfloat16 one-layer model of ``recipe`` + tokenizer saved to ``path``; returns its parameter counts.

    Built directly in bfloat16 (the recipe's ``model.dtype``): a float32 build of ~1.4e9 parameters would
    need 5.7 GB more for a moment.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _bf16_model(one_layer_config(recipe, context))
    total, active = param_counts(model)
    save_model_dir(model, build_tokenizer(), path)
    del model
    return {"params": total, "active_params": active}


def memory_estimate(recipe: str, engine: str, context: int = 1024, precision: str = "fp32") -> dict[str, float]:
    """GB the ``dcmdp train`` process needs at its peak, term by term (decimal GB).

    fp32 (the recipes'): float32 master weights and gradients, two AdamW moments, AdamW's foreach temporary and
    autocast's bf16 weight copies; ``bf16_*`` (``trainers.optim``): all of those bfloat16 (``bf16_kahan`` adds a
    compensation buffer) plus the fp32 LM head's float32 weight + gradient. Plus the engine's bf16 copy, vLLM's KV
    cache (2 layers kv_heads head_dim 2 B per token, 256 sequences of ``context``, capped at 4 GiB) and ``base``.
    """
    config = one_layer_config(recipe, context)
    with torch.device("meta"):
        total, _ = param_counts(_model_class(config)(config))
    w16, w32 = total * 2 / 1e9, total * 4 / 1e9
    head = config.vocab_size * config.hidden_size * 8 / 1e9
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    kv = min(max(kv_token * context, kv_token * context * 256), 4 * GIB) / 1e9
    if precision == "fp32":
        terms = {"weights": w32, "grads": w32, "adamw_state": 2 * w32,
                 "transient": w32 + w16}  # AdamW's foreach temporary + autocast's bfloat16 weight copies
    else:
        terms = {"weights": w16, "grads": w16, "adamw_state": 2 * w16 + (w16 if precision == "bf16_kahan" else 0.0),
                 "transient": head}
    terms |= {"engine_weights": w16, "kv_cache": kv if engine == "vllm" else 0.0,
              "base": 2.5 if engine == "vllm" else 1.0}
    terms["total"] = sum(terms.values())
    return terms


def saved_bytes_per_token(recipe: str, tokens: tuple[int, int] = (256, 512), seed: int = 0) -> dict[str, float]:
    """Bytes autograd saves per token for the backward (``saved_tensors_hooks``): one real-width decoder layer
    and the fp32 LM-head chain at the real vocabulary, the difference between two sequence lengths over their
    token difference (per-call terms cancel); the head chain at hidden size 64, its H-sized input added back.
    """
    from trainers.models import _set_kernels
    from trainers.scoring import lm_head_logits, tempered_logp

    def saved(fn) -> int:
        total = 0
        seen: set[int] = set()

        def pack(t):
            nonlocal total
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        del out
        return total

    config = one_layer_config(recipe, max(tokens) + 1)
    config.vocab_size = 1024
    torch.manual_seed(seed)
    model = _set_kernels(_bf16_model(config))
    model.train()
    layer = {}
    for n in tokens:
        ids = torch.randint(0, config.vocab_size, (1, n))
        layer[n] = saved(lambda: model.model(input_ids=ids, use_cache=False).last_hidden_state)
    del model
    V, H_real = VOCAB, one_layer_config(recipe).hidden_size
    head = torch.nn.Linear(64, V, bias=False, dtype=torch.bfloat16)
    head_bytes = {}
    for n in tokens:
        hidden = torch.randn(1, n, 64, dtype=torch.bfloat16, requires_grad=True)

        def chain():
            logp_BTV = tempered_logp(lm_head_logits(_Head(head), hidden,
                                                    fp32_lm_head=True), 1.0)
            ids = torch.randint(0, V, (1, n, 1))
            return logp_BTV.gather(-1, ids).sum() + (-(logp_BTV.exp() * logp_BTV).sum())

        head_bytes[n] = saved(chain)
    a, b = tokens
    per_layer = (layer[b] - layer[a]) / (b - a)
    per_head = (head_bytes[b] - head_bytes[a]) / (b - a) + (H_real - 64) * 4
    return {"layer_bytes_per_token": per_layer, "head_bytes_per_token": per_head,
            "layer_input_bytes_per_token": H_real * 2}


class _Head(torch.nn.Module):
    """A stand-in with ``get_output_embeddings`` for ``trainers.scoring.lm_head_logits``."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.head


def optimizer_bytes_per_param(seed: int = 0) -> dict[str, dict[str, float]]:
    """Per ``optim.precision``: bytes per parameter of the parameters, their gradients and the optimiser state
    (``trainers.optim.state_bytes_per_param``: tensor storage sizes) after one step on the tiny-moe preset with
    random gradients."""
    from trainers.config import OptimConfig
    from trainers.models import model_from_config
    from trainers.optim import PRECISIONS, build_optimizer, precision_param_dtype, state_bytes_per_param

    out = {}
    for name in PRECISIONS:
        model = model_from_config(get_preset("tiny-moe").make_config(128), seed=seed, dtype="float32")
        if (dtype := precision_param_dtype(name)) is not None:
            model.to(dtype)
        optimizer = build_optimizer(model.parameters(), OptimConfig(precision=name), seed=seed)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        out[name] = state_bytes_per_param(optimizer)
    return out


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def overrides(recipe: str, model_dir: Path, out: Path, engine: str, *, threads: int = 2,
              extra: tuple[str, ...] = ()) -> list[str]:
    """The dotlist that turns the recipe into two small real-shape steps (module docstring)."""
    return [f"model.path={model_dir}", f"task.path={DATA}", "task.eval_path=null", "task.eval_size=2",
            f"rollout.engine={engine}", "rollout.max_new_tokens=16", "rollout.vllm.tensor_parallel_size=1",
            "algo.prompts_per_step=2", "algo.samples_per_prompt=2", *SYNC_PROBE, "steps=2", "eval_every=0",
            "checkpoint.every=0", "checkpoint.keep=1", "progress=false", f"threads={threads}",
            f"output_dir={out}", "overwrite=true", *extra]


@dataclass
class RunResult:
    recipe: str
    engine: str
    command: str
    returncode: int
    wall_s: float
    peak_rss_gb: float
    estimate_gb: float
    available_before_gb: float
    steps: list[dict] = field(default_factory=list)
    changed_fraction: Optional[float] = None
    compared_elements: int = 0
    error: str = ""
    extra: list[str] = field(default_factory=list)


def _history_and_changes(out: Path, model_dir: Path) -> tuple[list[dict], Optional[float], int]:
    """The run's per-step metrics and the share of weights that differ from the initial ones (final checkpoint;
    memory-mapped, so the comparison holds one tensor at a time)."""
    from safetensors import safe_open

    from dcmdp.checkpoint import STATE_FILE

    ckpts = sorted((out / "checkpoints").glob("step_*"))
    if not ckpts:
        return [], None, 0
    state = torch.load(ckpts[-1] / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    history = list(state["history"])
    changed = compared = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name in state["model"]:
                    a, b = f.get_tensor(name), state["model"][name]
                    if a.shape == b.shape:
                        changed += int((a != b).sum())
                        compared += a.numel()
    return history, (changed / compared if compared else None), compared


def run_recipe(recipe: str, engine: str, model_dir: Path, out: Path, *, context: int = 1024,
               threads: int = 2, extra: tuple[str, ...] = ()) -> RunResult:
    """``dcmdp train configs/<recipe>.yaml <overrides>`` in a child process; its peak RSS from ``os.wait4``."""
    args = [str(ROOT / ".venv" / "bin" / "dcmdp"), "train", f"configs/{recipe}.yaml",
            *overrides(recipe, model_dir, out, engine, threads=threads, extra=extra)]
    # PYTHONPATH: the child runs this checkout's dcmdp, not the one the console script was installed from
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CACHE_ROOT": str(out.parent / "vllm_cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    shown = [".venv/bin/dcmdp", *args[1:]]
    command = f"OMP_NUM_THREADS={threads} " + " ".join(shlex.quote(a) for a in shown)
    estimate = memory_estimate(recipe, engine, context, precision_of(extra))["total"]
    available = mem_available_gb()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{recipe}_{engine}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    result = RunResult(recipe, engine, command, proc.returncode, wall, usage.ru_maxrss * 1024 / 1e9, estimate,
                       available, extra=list(extra))
    if proc.returncode != 0:
        result.error = error_from_log(log_path, proc.returncode)
        return result
    result.steps, result.changed_fraction, result.compared_elements = _history_and_changes(out, model_dir)
    return result


def precision_of(extra: tuple[str, ...] | list[str]) -> str:
    """The ``optim.precision`` an override list selects (the recipes' ``fp32`` when none does)."""
    found = [o.split("=", 1)[1] for o in extra if o.startswith("optim.precision=")]
    return found[-1] if found else "fp32"


def error_from_log(log_path: Path, returncode: int) -> str:
    """The line that says why a run failed: the last exception line of its log (vLLM prefixes its workers' lines
    with ``[rank0]:``), a ``dcmdp:`` error, or the signal that killed it (SIGKILL with no traceback: usually the
    kernel's out-of-memory killer)."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name} (no traceback)"
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln) for ln in log_path.read_text(errors="replace").splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", ln) or ln.startswith("dcmdp:")]
    return (errors[-1] if errors else (lines[-1] if lines else f"exit {returncode}"))[:600]


STEP_KEYS = ("time/step", "time/rollout", "time/old_logp", "time/update", "time/sync", "discrepancy/abs_prob_diff",
             "discrepancy/kl_k3", "discrepancy/abs_log_ratio", "dual/lambda/abs_prob_diff", "loss/total",
             "policy/approx_kl", "optim/grad_norm", "routing/mismatch")


def table(results: list[RunResult], counts: dict[str, dict]) -> str:
    rows = ["| recipe (1 layer) | engine | extra overrides | params | peak RSS GB (est.) | step 1 s | step 2 s | rollout / pi_old+fwd / "
            "update / sync s (step 2) | abs_prob_diff 1, 2 | kl_k3 1, 2 | lambda 2 | loss 1, 2 | routing mismatch | "
            "weights changed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        n = counts.get(r.recipe, {}).get("params")
        params = f"{n / 1e9:.3f} B" if n else "-"
        if r.returncode != 0 or len(r.steps) < 2:
            rows.append(f"| {r.recipe} | {r.engine} | {' '.join(r.extra) or '-'} | {params} | {r.peak_rss_gb:.1f} ({r.estimate_gb:.1f}) | failed "
                        f"(exit {r.returncode}): {r.error.replace('|', '/')} |||||||||")
            continue
        s1, s2 = r.steps[0], r.steps[1]
        g = lambda s, k: s.get(k)  # noqa: E731
        phases = " / ".join(_fmt(g(s2, k), ".1f") for k in ("time/rollout", "time/old_logp", "time/update",
                                                               "time/sync"))
        lam = g(s2, "dual/lambda/abs_prob_diff")
        mism = g(s2, "routing/mismatch")
        rows.append(
            f"| {r.recipe} | {r.engine} | {' '.join(r.extra) or '-'} | {params} | {r.peak_rss_gb:.1f} ({r.estimate_gb:.1f}) | "
            f"{_fmt(g(s1, 'time/step'), '.1f')} | {_fmt(g(s2, 'time/step'), '.1f')} | {phases} | "
            f"{_fmt(g(s1, 'discrepancy/abs_prob_diff'), '.2e')}, {_fmt(g(s2, 'discrepancy/abs_prob_diff'), '.2e')} | "
            f"{_fmt(g(s1, 'discrepancy/kl_k3'), '.2e')}, {_fmt(g(s2, 'discrepancy/kl_k3'), '.2e')} | "
            f"{_fmt(lam, '.4g')} | {_fmt(g(s1, 'loss/total'), '.3g')}, {_fmt(g(s2, 'loss/total'), '.3g')} | "
            f"{_fmt(mism, '.3g') if mism is not None else 'n/a (dense)'} | {_fmt(r.changed_fraction, '.3f')} |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--workdir", default="/tmp/dcmdp_real_shapes", help="models, run folders and logs")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "real_shapes" / "real_shapes"),
                   help="results prefix: writes <out>.md and <out>.json")
    p.add_argument("--context", type=int, default=1024, help="max_position_embeddings of the one-layer models")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep-runs", action="store_true", help="keep the run folders (checkpoints are ~9 GB each)")
    p.add_argument("--extra", default="", help="space-separated overrides appended to every run "
                   "(e.g. model.gradient_checkpointing=false)")
    p.add_argument("--precision", default=None, help="optim.precision of every run (fp32, bf16_stochastic, "
                   "bf16_kahan; trainers.optim): appended to --extra")
    p.add_argument("--activations", action="store_true", help="also measure the bytes autograd saves per token for "
                   "one real-width layer and the fp32 LM-head chain (saved_bytes_per_token)")
    p.add_argument("--merge", action="store_true", help="keep the runs already in <out>.json that this invocation "
                   "does not repeat (to run one recipe and engine at a time)")
    ns = p.parse_args(argv)
    work = Path(ns.workdir)
    work.mkdir(parents=True, exist_ok=True)
    recipes = [r for r in ns.recipes.split(",") if r]
    engines = [e for e in ns.engines.split(",") if e]
    extra = tuple(ns.extra.split()) + ((f"optim.precision={ns.precision}",) if ns.precision else ())
    torch.set_num_threads(ns.threads)
    counts: dict[str, dict] = {}
    for recipe in recipes:
        model_dir = work / f"{recipe}-1layer"
        meta = model_dir / "real_shapes.json"
        if meta.is_file() and json.loads(meta.read_text()).get("context") == ns.context:
            counts[recipe] = json.loads(meta.read_text())
        else:
            t0 = time.perf_counter()
            counts[recipe] = {**build_model_dir(recipe, model_dir, context=ns.context), "context": ns.context}
            counts[recipe]["build_s"] = time.perf_counter() - t0
            meta.write_text(json.dumps(counts[recipe]))
        print(f"{recipe}: one layer, {counts[recipe]['params']:,} parameters "
              f"({counts[recipe]['active_params']:,} active) in {model_dir}", flush=True)
    acts = {}
    if ns.activations:
        for recipe in recipes:
            acts[recipe] = saved_bytes_per_token(recipe)
            print(f"{recipe}: saved for backward per token: " + ", ".join(f"{k} {v:,.0f}" for k, v in
                                                                        acts[recipe].items()), flush=True)
    results: list[RunResult] = []
    for recipe in recipes:
        for engine in engines:
            est = memory_estimate(recipe, engine, ns.context, precision_of(extra))
            print(f"\n{recipe} / {engine}: estimated peak {est['total']:.1f} GB ("
                  + ", ".join(f"{k} {v:.2f}" for k, v in est.items() if k != "total")
                  + f"); available now {mem_available_gb():.1f} GB", flush=True)
            out = work / f"run_{recipe}_{engine}"
            r = run_recipe(recipe, engine, work / f"{recipe}-1layer", out, context=ns.context, threads=ns.threads,
                           extra=extra)
            results.append(r)
            print(f"  exit {r.returncode}, wall {r.wall_s:.0f} s, peak RSS {r.peak_rss_gb:.2f} GB"
                  + (f", error: {r.error}" if r.error else ""), flush=True)
            if not ns.keep_runs:
                shutil.rmtree(out, ignore_errors=True)
    earlier_invocations: list[dict] = []
    if ns.merge and Path(ns.out).with_suffix(".json").is_file():
        earlier = json.loads(Path(ns.out).with_suffix(".json").read_text())
        earlier_invocations = earlier.get("invocations") or [{"date": earlier["date"], "command": earlier["command"]}]
        done = {(r.recipe, r.engine, tuple(r.extra)) for r in results}
        kept = [RunResult(**r) for r in earlier["runs"]
                if (r["recipe"], r["engine"], tuple(r.get("extra", []))) not in done]
        counts = {**earlier["models"], **counts}
        acts = {**earlier.get("saved_bytes_per_token", {}), **acts}
        order = {(rc, e): i for i, (rc, e) in enumerate((rc, e) for rc in RECIPES for e in ENGINES)}
        results = sorted(kept + results, key=lambda r: (order.get((r.recipe, r.engine), 99), r.extra))
    text = table(results, counts)
    print("\n" + text)
    write_results(Path(ns.out), results, counts, ns, text, acts, earlier_invocations, optimizer_bytes_per_param())
    return 0 if all(r.returncode == 0 for r in results) else 1


def write_results(prefix: Path, results: list[RunResult], counts: dict, ns, text: str, acts: dict,
                  earlier_invocations: tuple[dict, ...] | list[dict] = (),
                  optim_bytes: Optional[dict[str, dict[str, float]]] = None) -> None:
    """<prefix>.json and <prefix>.md; ``earlier_invocations`` (date, command) are the --merge'd runs' own."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = (f"OMP_NUM_THREADS={ns.threads} .venv/bin/python benchmarks/real_shapes.py --recipes {ns.recipes} "
               f"--engines '{ns.engines}' --context {ns.context} --threads {ns.threads}"
               + (f" --extra '{ns.extra}'" if ns.extra else "")
               + (f" --precision {ns.precision}" if getattr(ns, "precision", None) else "")
               + (" --merge" if ns.merge else "")
               + (" --activations" if ns.activations else ""))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = environment()
    info = {"date": date, "machine": f"{machine_kind()}, {os.cpu_count()} cores, {mem_available_gb():.1f} GB available",
            "versions": {k: env[k] for k in ("python", "torch", "transformers", "vllm")}, "command": command,
            "invocations": [*earlier_invocations, {"date": date, "command": command}],
            "context": ns.context, "models": counts, "saved_bytes_per_token": acts,
            "estimates_gb": {f"{r.recipe}/{r.engine}/{precision_of(r.extra)}":
                             memory_estimate(r.recipe, r.engine, ns.context, precision_of(r.extra)) for r in results},
            "optimizer_bytes_per_param": optim_bytes or {},
            "runs": [{**asdict(r), "steps": [{k: s.get(k) for k in STEP_KEYS if k in s} for s in r.steps]}
                     for r in results]}
    prefix.with_suffix(".json").write_text(json.dumps(info, indent=2))
    lines = [f"# Real recipes at real shapes, one decoder layer, CPU", "",
             f"- date: {info['date']}", f"- machine: {info['machine']}",
             f"- versions: {', '.join(f'{k} {v}' for k, v in info['versions'].items())}",
             "- commands (in order; `--merge` keeps the earlier invocations' results):"]
    lines += [f"  - {i['date']}: `{i['command']}`" for i in info["invocations"]]
    lines += ["", "Per run (each a `dcmdp train` child process):", ""]
    lines += [f"- `{r.command}`" for r in results]
    lines += ["", text, ""]
    if acts:
        lines += ["Bytes autograd saves per token (no activation checkpointing; `saved_bytes_per_token`):", "",
                  *md_table(("recipe", "one decoder layer (bf16)", "fp32 LM-head chain (logits, log-softmax, entropy)",
                             "checkpointed layer input (bf16)"),
                            [(r, f"{a['layer_bytes_per_token']:,.0f}", f"{a['head_bytes_per_token']:,.0f}",
                              f"{a['layer_input_bytes_per_token']:,.0f}") for r, a in acts.items()]), ""]
    if optim_bytes:
        from trainers.optim import PRECISIONS

        lines += ["Bytes per parameter by `optim.precision` (`trainers.optim`; storage sizes of the tensors after "
                  "one AdamW step on the tiny-moe preset, `optimizer_bytes_per_param`):", "",
                  *md_table(("optim.precision", "parameter", "gradient", "optimiser state", "parameter + state",
                             "total", "what"),
                            [(k, *(f"{b[x]:.2f}" for x in ("param", "grad", "state", "param+state", "total")),
                              PRECISIONS[k].about) for k, b in optim_bytes.items()]), ""]
    prefix.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
