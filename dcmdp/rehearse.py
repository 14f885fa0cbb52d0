"""``dcmdp check CONFIG --gpus N --gpu-memory GiB --rehearse``: one training step of the run at its real shapes, on
fake tensors, its memory traced against the plan (``dcmdp.memplan``) before a GPU is rented.

The model is built from the preset's real dimensions (vocabulary from ``model.path``'s config.json when readable) on
the meta device and materialised under ``FakeTensorMode`` (shapes and dtypes, no storage); at ``--gpus N > 1`` it is
sharded by ``dcmdp.distributed.shard_model`` over a fake process group of world N (``FakeStore``: collectives return
at once, this process is rank 0). Then the loop's phases run as ``dcmdp.loop._train_step`` runs them:

- rollout: the engine's outputs at the config's shapes (every row at its full P + max_new_tokens, the worst case):
  token ids, masks, log mu, and the MoE routes for an engine that reports them; under torchrun a vLLM engine goes
  through ``SpmdEngine.generate`` (its cross-rank digest). The torch engine is not rehearsed (its decode ends on data
  the fake tensors do not hold); the plan's kv_cache term stands for it;
- screen (``loop.screen_phase``), pi_old (``learner.old_pass``), measures (``loop.measure_phase``) and the dual step;
- update (``learner.update``: micro-batches, activation checkpointing, gradient accumulation), with its optimiser
  steps traced as their own phase;
- sync (``engine.load_weights(model.state_dict())``: ``GatheredStateDict`` under FSDP2).

Rewards are drawn, not computed (decoding and scoring run on the host). Tensors that only the batch's data made (ids,
masks, log mu, rewards) are real CPU tensors, so the micro-batches, screens and buckets see real lengths; a value the
model computed is fake, and a read of one (a loss for a metric, a finiteness check, a digest comparison) gets a
nominal answer (True, 0), each site listed in the output.

Memory: ``torch.distributed._tools.mem_tracker.MemTracker`` (categories: parameters, gradients, optimiser state,
activations = made in a forward or its recomputation, temporaries = made in a backward or outside a module, batch =
made in the rollout phase), with the peak per phase and the five largest tensors at the peak with the project line
that made them. Time: ``RuntimeEstimator``'s roofline cost model with the named GPU's datasheet FLOP/s and bandwidth,
by phase (an estimate; communication not counted).

Depth: a full-depth fake step takes too long on two cores, so the step runs at three depths (``DEPTHS``); every phase's
peak and time is affine in the depth (each decoder layer adds the same tensors), which the third depth checks to
``LINEAR_TOL``; the full depth is then the affine extrapolation, printed as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

GIB = 1024 ** 3

PHASES = ("rollout", "old_logp", "measures", "update", "optimiser", "sync")
# The update and optimiser phases after the first optimiser step (the state held) are traced apart from the first
# ones: which of the two holds a phase's peak can change with the depth, and each is affine in it where their maximum
# is not; they are fitted apart and the larger taken.
LATER = ":later"
TRACED = PHASES + ("update" + LATER, "optimiser" + LATER)
CATEGORIES = ("parameters", "gradients", "optimiser state", "activations", "temporaries", "batch")
# MemTracker's reference types -> the categories printed.
_REFTYPE_CATEGORY = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
                     "Optstate": "optimiser state", "Activation": "activations", "Temp": "temporaries",
                     "Other": "batch"}
# Depths the step runs at: the first two fix the affine fit, the third checks it.
DEPTHS = (2, 3, 4)
# Rows per rank in each mini-batch of the reduced runs (two points of the fit in the batch's rows; at least two, so
# a mini-batch accumulates over micro-batches as the config's do), and their number of mini-batches (the first
# makes the optimiser state, the second runs with it: the steady state of every later one).
ROWS = (2, 3)
REDUCED_MINIBATCHES = 2
# Relative gap allowed between the third depth's traced figure and the fit's prediction.
LINEAR_TOL = 1e-3
# A tensor of at least this many bytes records the project line that made it (for the top five at the peak); a model
# whose parameters are smaller than 1024 x this records from 1/1024 of them.
BIG_BYTES = 16 * 1024 ** 2
# Real tensors whose elements exceed this stay fake even when made from real ones.
REAL_NUMEL = 1 << 24
_PROJECT = ("dcmdp", "trainers", "constraints")


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one GPU for the roofline (dense bf16 tensor-core FLOP/s, float32 FLOP/s, HBM bytes/s)."""

    name: str
    gib: float
    bf16_flops: float
    fp32_flops: float
    bytes_per_s: float


GPUS = (GPUSpec("NVIDIA H100 SXM 80GB", 80, 989e12, 67e12, 3.35e12),
        GPUSpec("NVIDIA H200 141GB", 141, 989e12, 67e12, 4.8e12))


def gpu_for(gib: float) -> GPUSpec:
    """The listed GPU whose memory is closest to ``gib``."""
    return min(GPUS, key=lambda g: abs(g.gib - gib))


# ------------------------------------------------------------------------------------------ fake and real tensors


def _fake_class():
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor


# The rehearsal's own dispatch hooks, skipped when naming the line that made a tensor.
_HOOKS = ("__torch_dispatch__", "_track", "_update_peak_stats", "_roofline_estimate", "call", "real", "bf16")


_FILES: dict[str, Optional[str]] = {}


def _project_file(filename: str) -> Optional[str]:
    """``package/module.py`` for a file of the project's own packages, else None (memoised: called per tensor)."""
    if filename not in _FILES:
        parts = Path(filename).parts
        _FILES[filename] = f"{parts[-2]}/{parts[-1]}" if len(parts) >= 2 and parts[-2] in _PROJECT else None
    return _FILES[filename]


def _project_line() -> str:
    """The innermost frame of the project's own code on the stack, as ``path:line in function``."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        name = _project_file(code.co_filename)
        if name is not None and not (name == "dcmdp/rehearse.py" and code.co_name in _HOOKS):
            return f"{name}:{f.f_lineno} in {code.co_name}"
        f = f.f_back
    return "?"


def _zeros_for(fake_cls):
    """A map from a fake (or meta) tensor to real values of its shape and dtype: True for a mask (every element
    selected, the nominal answer of a data-dependent read), zeros otherwise; anything else as it is."""
    def real(x):
        if not (isinstance(x, Tensor) and (isinstance(x, fake_cls) or x.is_meta)):
            return x
        return torch.ones(x.shape, dtype=x.dtype) if x.dtype == torch.bool else torch.zeros(x.shape, dtype=x.dtype)
    return real


def _writes_real(func, args, kwargs, fake_cls) -> bool:
    """Whether ``func`` writes into one of its arguments that is a real tensor."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            x = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(x, Tensor) and not isinstance(x, fake_cls):
                return True
    return False


def _uninitialised_ops() -> tuple:
    aten = torch.ops.aten
    return (aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
            aten.new_empty_strided.default, aten.empty_like.default)


# Ops whose output holds no values until written: always fake, so a buffer a collective of the fake process group
# fills (FSDP2's all-gathered weights, its reduce-scattered gradients) is not real memory holding garbage.
_UNINITIALISED = _uninitialised_ops()


class _MixedMode:
    """A dispatch mode above ``FakeTensorMode``: an op none of whose inputs is fake and whose outputs are small runs
    for real (the batch's data: its values decide the micro-batches and screens); a data-dependent read of a fake
    tensor (``.item()``, ``torch.equal``, a whole-tensor ``any`` / ``all``) gets a nominal value, its project line
    counted in ``nominal``."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            nominal: dict[str, int] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.utils._python_dispatch import _disable_current_modes
                from torch.utils._pytree import tree_leaves

                kwargs = kwargs or {}
                fake_cls = _fake_class()
                leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, Tensor)]
                # a meta tensor (the model before ``to_empty``) counts as fake: what is made from it has no values
                fake = any(isinstance(x, fake_cls) or x.is_meta for x in leaves)
                aten = torch.ops.aten
                if fake and func in (aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default):
                    site = _project_line()
                    self.nominal[site] = self.nominal.get(site, 0) + 1
                    if func is aten._local_scalar_dense.default:
                        t = args[0]
                        return True if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0
                    return True
                if fake and func in (aten.any.default, aten.all.default):
                    # a whole-tensor test of fake values (a check that no route or log-prob is bad, that every one is
                    # valid): the nominal answer is the passing one, any -> False, all -> True
                    site = _project_line()
                    self.nominal[site] = self.nominal.get(site, 0) + 1
                    with _disable_current_modes():
                        return torch.tensor(func is aten.all.default)
                if fake and _writes_real(func, args, kwargs, fake_cls):
                    # a fake value written into a real tensor (a model's log-probs into the batch's buffer): the
                    # real tensor keeps real storage, the value written is 0
                    def real(x):
                        return torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, fake_cls) else x

                    from torch.utils._pytree import tree_map

                    with _disable_current_modes():
                        return func(*tree_map(real, args), **tree_map(real, kwargs))
                from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

                if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                    # the meta kernel of grouped_mm accepts only bfloat16 (CUDA's); the CPU runs it in float32: the
                    # shape from bfloat16 stand-ins (made below the trackers, so not counted), the output in its dtype
                    # (fake even from real inputs: under FSDP2 on the fake process group the gathered weights are
                    # real tensors that hold no values)
                    from torch.utils._pytree import tree_map

                    def bf16(x):
                        return x.to(torch.bfloat16) if isinstance(x, Tensor) and x.is_floating_point() else x

                    out = func(*tree_map(bf16, args), **tree_map(bf16, kwargs))
                    return torch.empty(out.shape, dtype=args[0].dtype)
                if fake:
                    try:
                        return func(*args, **kwargs)
                    except DynamicOutputShapeException:
                        # a shape set by the batch's real data (values[mask]): the fake values read as 0
                        if sum(x.numel() for x in leaves) > REAL_NUMEL:
                            raise
                        from torch.utils._pytree import tree_map

                        with _disable_current_modes():
                            return func(*tree_map(_zeros_for(fake_cls), args), **tree_map(_zeros_for(fake_cls), kwargs))

                try:  # the shapes first: an output too large to hold for real stays fake
                    out = func(*args, **kwargs)
                except (DataDependentOutputException, DynamicOutputShapeException):
                    with _disable_current_modes():
                        return func(*args, **kwargs)
                outs = [x for x in tree_leaves(out) if isinstance(x, Tensor)]
                if not outs or sum(x.numel() for x in outs) > REAL_NUMEL or func in _UNINITIALISED:
                    return out
                with _disable_current_modes():
                    return func(*args, **kwargs)

        return Mode()


@contextlib.contextmanager
def _host_object_collectives():
    """The pickled-object collectives (``broadcast_object_list``, ``gather_object``) run below the fake modes: they
    pickle host objects into byte tensors, which FakeTensorMode refuses to build from real storage."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    def outside(fn):
        def call(*args, **kwargs):
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return call

    saved = dist.broadcast_object_list, dist.gather_object
    dist.broadcast_object_list, dist.gather_object = outside(saved[0]), outside(saved[1])
    try:
        yield
    finally:
        dist.broadcast_object_list, dist.gather_object = saved


# ------------------------------------------------------------------------------------------ tracing


@contextlib.contextmanager
def _no_module_grad_hooks():
    """ModTracker (under MemTracker and RuntimeEstimator) registers a multi-grad hook on each module call's inputs
    and outputs that need a gradient, to keep its module stack in the backward. The hook's closure holds the
    tensors' autograd nodes, which hold the tensors: a cycle through C++ that the garbage collector does not see,
    so every micro-batch's layer inputs would stay alive to the end (~one hidden state per row at the real width).
    The trackers here read only whether a backward is running (the autograd graph task), not that stack: the hooks
    are not registered."""
    from torch.distributed._tools import mod_tracker

    saved = mod_tracker.register_multi_grad_hook
    mod_tracker.register_multi_grad_hook = lambda *args, **kwargs: None
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = saved


def _tracker_class():
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class PhaseTracker(MemTracker):
        """MemTracker with the peak per phase (its category snapshot) and the largest tensors at the global peak."""

        def __init__(self, big_bytes: int = BIG_BYTES) -> None:
            super().__init__()
            self.big_bytes = big_bytes
            self.phase = "build"
            self.phase_peak: dict[str, int] = {}
            self.phase_snap: dict[str, dict[str, int]] = {}
            self.big: dict[int, tuple[int, str, str]] = {}  # id(storage) -> (bytes, category, line)
            self.top: list[tuple[int, str, str]] = []
            self._top_at = 0
            self._seen: weakref.WeakSet = weakref.WeakSet()

        # MemTracker's module hooks keep a snapshot per module call and refuse a module called twice (every
        # micro-batch calls each layer again): only what the categories need is kept, params and AC regions
        def _pre_fw_hook(self, module, inputs) -> None:
            if module not in self._seen:
                self._seen.add(module)
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
            elif self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True

        def _post_fw_hook(self, module, inputs, outputs) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def _pre_bw_hook(self, module, args) -> None:
            pass

        def _post_bw_hook(self, module, args) -> None:
            pass

        def _track(self, reftype, t: Tensor) -> None:
            if self.phase == "rollout" and reftype == _MemRefType.ACT:
                reftype = _MemRefType.OTH
            from torch.distributed._tools.common_utils import get_untyped_storages

            for st in get_untyped_storages(t):
                n = st.nbytes()
                if n >= self.big_bytes and id(st) not in self.big and st not in self._WINFO:
                    self.big[id(st)] = (n, _REFTYPE_CATEGORY.get(str(reftype.value), "?"), _project_line())
                    weakref.finalize(st, self.big.pop, id(st), None)
            super()._track(reftype, t)

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            total = sum(s.get(_TOTAL_KEY, 0) for s in self._curr_mem_snap.values())
            if total > self.phase_peak.get(self.phase, -1):
                self.phase_peak[self.phase] = total
                snap: dict[str, int] = {}
                for dev_snap in self._curr_mem_snap.values():
                    for k, v in dev_snap.items():
                        if k != _TOTAL_KEY:
                            cat = _REFTYPE_CATEGORY.get(str(k.value), "temporaries")
                            snap[cat] = snap.get(cat, 0) + v
                self.phase_snap[self.phase] = snap
                if total > self._top_at + self.big_bytes:
                    self._top_at = total
                    self.top = sorted(self.big.values(), reverse=True)[:5]

    return PhaseTracker


def _estimator_class(gpu: GPUSpec):
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    class Roofline(RuntimeEstimator):
        """RuntimeEstimator's roofline cost model with ``gpu``'s datasheet figures instead of a CUDA device's."""

        phase_ms: dict[str, float]

        @classmethod
        def _roofline_estimate(cls, func, args, kwargs):
            import torch.utils._runtime_estimation as est

            saved = est.get_device_tflops, est.get_gpu_dram_gbps
            est.get_device_tflops = lambda dtype: (gpu.fp32_flops if dtype == torch.float32 else gpu.bf16_flops) / 1e12
            est.get_gpu_dram_gbps = lambda: gpu.bytes_per_s / 1e9
            try:
                available = torch.cuda.is_available
                torch.cuda.is_available = lambda: True
                try:
                    return super()._roofline_estimate.__func__(cls, func, args, kwargs)
                finally:
                    torch.cuda.is_available = available
            finally:
                est.get_device_tflops, est.get_gpu_dram_gbps = saved

        def __exit__(self, *args: Any) -> None:  # RuntimeEstimator prints its total; the caller prints by phase
            from torch.utils._python_dispatch import TorchDispatchMode

            TorchDispatchMode.__exit__(self, *args)
            self._mod_tracker.clear_user_hooks()
            self._mod_tracker.__exit__(*args)

    return Roofline


# ------------------------------------------------------------------------------------------ the step


class SyntheticEngine:
    """The rollout engine's outputs at the config's shapes (every row at full length) in place of vLLM's, which
    cannot run on fake tensors: ``generate`` returns the Rollout an engine with these capabilities would, and
    ``load_weights`` reads every tensor of the state dict in order, as vLLM's loader does (each then copied into
    the engine's own weights, which its reservation holds)."""

    def __init__(self, B: int, P: int, T: int, vocab: int, routes: Optional[tuple[int, int, int]]):
        self.B, self.P, self.T, self.vocab, self.routes = B, P, T, vocab, routes
        self.version = 0

    def generate(self, prompts, seed: int):
        from trainers.batch import Rollout

        g = torch.Generator().manual_seed(seed)
        B, P, T = self.B, self.P, self.T
        experts = None
        if self.routes is not None:
            L, K, E = self.routes
            from trainers.routing import route_dtype

            # (B, S, L, K) routes in the engine's dtype; fake (no values): they only flow to the learner and measures
            experts = torch.empty(B, P + T, L, K, dtype=route_dtype(E))
        return Rollout(prompt_ids_BP=torch.randint(3, self.vocab, (B, P), generator=g),
                       prompt_mask_BP=torch.ones(B, P, dtype=torch.bool),
                       response_ids_BT=torch.randint(3, self.vocab, (B, T), generator=g),
                       response_mask_BT=torch.ones(B, T, dtype=torch.bool),
                       rollout_logp_BT=-torch.rand(B, T, generator=g), rollout_experts_BSLK=experts)

    def load_weights(self, state_dict, version: int) -> None:
        for name in state_dict:
            state_dict[name].detach()
        self.version = int(version)

    def close(self) -> None:
        pass


@dataclass
class Trace:
    """What one rehearsed step traced, at one depth."""

    layers: int
    peak: int
    phase_peak: dict[str, int]
    phase_snap: dict[str, dict[str, int]]
    phase_ms: dict[str, float]
    top: list[tuple[int, str, str]]
    nominal: dict[str, int]
    seconds: float
    # Wall seconds per phase here.
    phase_s: dict[str, float] = field(default_factory=dict)


def reduced_rows(cfg, gpus: int, rows: int, minibatches: int):
    """``cfg`` with ``minibatches`` mini-batches of ``rows`` rows per rank (the rollout batch ``minibatches x gpus x
    rows``; a prompt's samples cut to divide it when they do not)."""
    algo = cfg.algo
    batch = minibatches * gpus * rows
    samples = math.gcd(algo.samples_per_prompt, batch)
    return dataclasses.replace(cfg, algo=dataclasses.replace(algo, prompts_per_step=batch // samples,
                                                             samples_per_prompt=samples, minibatches=minibatches))


def rows_per_rank(cfg, gpus: int) -> float:
    """Rows per rank in one mini-batch of ``cfg``'s rollout batch."""
    return cfg.algo.prompts_per_step * cfg.algo.samples_per_prompt / (cfg.algo.minibatches * gpus)


@contextlib.contextmanager
def _optimiser_as_on_gpu(optimizer):
    """A ``BF16AdamW`` step as a CUDA device runs it: one fused kernel per piece (``compile`` None compiles on CUDA
    only). The compiled kernel cannot run on fake tensors (inductor generates code for real storage): its eager
    function ``_update_in_place`` stands for it, the same operations on each piece, whose float32 temporaries the
    fused kernel keeps in registers (an upper bound of the step's memory by a few pieces)."""
    from trainers import optim

    if not isinstance(optimizer, optim.BF16AdamW) or optimizer.compile is not None:
        yield
        return
    saved = optim._COMPILED.get("fn")
    optimizer.compile = True
    optim._COMPILED["fn"] = optim._update_in_place
    try:
        yield
    finally:
        optimizer.compile = None
        if saved is None:
            optim._COMPILED.pop("fn", None)
        else:
            optim._COMPILED["fn"] = saved


def rehearse_step(cfg, gpus: int, gpu: GPUSpec, layers: int, *, prompt_tokens: int) -> Trace:
    """One training step of ``cfg`` at ``layers`` decoder layers on rank 0 of ``gpus``, traced (module docstring)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dcmdp import distributed, loop
    from dcmdp.dual import dual_step, init_state, penalty_spec
    from dcmdp.memplan import model_shapes
    from dcmdp.policy import step_seed
    from trainers import learner
    from trainers.engines import capabilities
    from trainers.models import build_meta_model, cast_model
    from trainers.optim import build_optimizer, precision_param_dtype
    from trainers.weights import init_buffers

    t0 = time.perf_counter()
    shapes = model_shapes(cfg)
    model_cfg = dataclasses.replace(cfg.model, init="random", num_layers=layers)
    sharded = gpus > 1
    if sharded:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)
    d = (distributed.Dist(rank=0, world=gpus, backend="fake", shard=learner.DataShard(0, gpus), sharded=True)
         if sharded else distributed.Dist())
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    mixed = _MixedMode()
    tracker = _tracker_class()(min(BIG_BYTES, max(shapes.params * 4 // 1024, 4096)))
    roof = _estimator_class(gpu)()("operator-level-cost-model")
    roof._estimate = type(roof)._roofline_estimate
    phase_ms: dict[str, float] = {}
    phase_s: dict[str, float] = {}
    mark = [0.0, time.perf_counter()]

    def enter(phase: str) -> None:
        now, wall = roof.total_runtime, time.perf_counter()
        phase_ms[tracker.phase] = phase_ms.get(tracker.phase, 0.0) + now - mark[0]
        phase_s[tracker.phase] = phase_s.get(tracker.phase, 0.0) + wall - mark[1]
        mark[0], mark[1] = now, wall
        tracker.phase = phase

    try:
        # built and cast on the meta device (no storage), as build_sharded_model does; materialised fake below
        model, _ = build_meta_model(model_cfg, shapes.vocab)
        dtype = precision_param_dtype(cfg.optim.precision)
        if dtype is not None:
            cast_model(model, dtype)
        with fake, mixed, _host_object_collectives(), _no_module_grad_hooks(), contextlib.ExitStack() as stack:
            with tracker, roof:
                distributed.shard_model(model, cfg, d)
                model.to_empty(device="cpu")
                init_buffers(model)
                optimizer = build_optimizer(model.parameters(), cfg.optim, seed=cfg.seed)
                stack.enter_context(_optimiser_as_on_gpu(optimizer))
                steps = [0]

                def stepped(*a) -> None:
                    steps[0] += 1
                    enter("update" + LATER)

                optimizer.register_step_pre_hook(lambda *a: enter("optimiser" + (LATER if steps[0] else "")))
                optimizer.register_step_post_hook(stepped)
                moe = bool(shapes.experts)
                scoring = learner.ScoringSpec(temperature=cfg.rollout.temperature,
                                              fp32_lm_head=cfg.model.fp32_lm_head,
                                              lm_head_kernel=cfg.model.lm_head_kernel, moe=moe, shard=d.shard,
                                              micro_batch_tokens=cfg.algo.micro_batch_tokens)
                optim = learner.OptimStep(optimizer, None, None, cfg.optim.grad_clip)
                algo = cfg.algo
                B = algo.prompts_per_step * algo.samples_per_prompt
                caps = capabilities(cfg.rollout.engine)
                routes = (layers, shapes.top_k, shapes.experts) if moe else None
                inner = SyntheticEngine(B, prompt_tokens, cfg.rollout.max_new_tokens, shapes.vocab, routes)
                engine = (distributed.SpmdEngine(inner, d, distributed.sync_dtype(cfg.rollout))
                          if sharded and caps.weight_sync == "every_rank" else
                          distributed.RankZeroEngine(inner, d, distributed.sync_dtype(cfg.rollout))
                          if sharded else inner)
                dual = init_state(cfg.dual)

                enter("rollout")
                rollout = engine.generate([], seed=step_seed(cfg.seed, 0, 1))
                # 0 and 1 in turn: every group has a spread, so the screen keeps every row (the longest step)
                rewards_B = (torch.arange(B) % 2).float()
                rollout, advantages_B, keep_B, _ = loop.screen_phase(algo, rollout, rewards_B)
                rollout, advantages_B, keep_B = learner.place(model, rollout, advantages_B, keep_B)
                enter("old_logp")
                old = learner.old_pass(model, rollout, advantages_B, keep_B, algo, scoring)
                batch, train_logp_BT = old.batch, old.train_logp_BT
                enter("measures")
                measured_C, _ = loop.measure_phase(cfg.dual.constraints, batch, train_logp_BT)
                enter("update")
                learner.update(model, optim, batch, scoring=scoring, penalty=penalty_spec(dual, cfg.dual),
                               cfg=algo, generator=torch.Generator().manual_seed(step_seed(cfg.seed, 0, 2)),
                               forward=old.forward)
                del old
                enter("measures")
                dual, _ = dual_step(dual, measured_C, cfg.dual, floor_C=measured_C)
                enter("sync")
                engine.load_weights(model.state_dict(), version=1)
                enter("done")
    finally:
        if sharded and dist.is_initialized():
            dist.destroy_process_group()
    peak = max(tracker.phase_peak.get(p, 0) for p in TRACED)
    return Trace(layers, peak, {p: tracker.phase_peak.get(p, 0) for p in TRACED},
                 {p: tracker.phase_snap.get(p, {}) for p in TRACED}, {p: phase_ms.get(p, 0.0) for p in TRACED},
                 list(tracker.top), dict(mixed.nominal), time.perf_counter() - t0,
                 {p: phase_s.get(p, 0.0) for p in TRACED})


# ------------------------------------------------------------------------------------------ the report

NOT_TRACED = (
    "rollout engine: vLLM's CUDA kernels and the torch engine's decode (its loop ends on sampled tokens, which fake "
    "tensors do not hold) do not run on fake tensors: the engine's outputs at the config's shapes stand for them, so "
    "the plan's rollout_engine and kv_cache terms are not traced",
    "CUDA context, NCCL buffers and allocator slack (the plan's overhead): no CUDA here",
)
NOT_TRACED_WORLD = (
    "collectives run on a fake process group: they move no data, and what a gather returns holds no values (a "
    "read of one gets the nominal answer below); communication time is not in the estimate",
)


@dataclass
class Rehearsal:
    """The rehearsed step at the config's depth and batch: traced (or extrapolated) figures, bytes and ms."""

    layers: int
    traces: list[Trace]
    phase_peak: dict[str, float]
    phase_snap: dict[str, dict[str, float]]
    phase_ms: dict[str, float]
    extrapolated: bool
    # Largest relative gap between the check depth's figures and the fit's prediction (0 when not fitted in depth).
    fit_gap: float = 0.0
    # Rows per rank in the batch (the whole step's) and in its reduced runs (empty when not reduced).
    rows: float = 0.0
    reduced_rows: tuple[int, ...] = ()
    minibatches: int = 1
    reduced_minibatches: int = 1

    @property
    def peak(self) -> float:
        return max(self.phase_peak.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phase_peak, key=self.phase_peak.get)


def _fold(peak: dict, snap: dict, ms: dict) -> tuple[dict, dict, dict]:
    """``TRACED`` figures as ``PHASES``: a phase's peak (and its categories) the larger of its first and later
    parts', its time their sum."""
    peak, snap, ms = dict(peak), dict(snap), dict(ms)
    for p in ("update", "optimiser"):
        q = p + LATER
        if peak.get(q, 0) > peak.get(p, 0):
            peak[p], snap[p] = peak[q], snap[q]
        ms[p] = ms.get(p, 0.0) + ms.get(q, 0.0)
    return ({p: peak[p] for p in PHASES}, {p: snap.get(p, {}) for p in PHASES}, {p: ms.get(p, 0.0) for p in PHASES})


def _affine(xs: tuple[int, int], ys: tuple[float, float], x: float) -> float:
    return ys[0] + (ys[1] - ys[0]) * (x - xs[0]) / (xs[1] - xs[0])


def _bilinear(xs: tuple, ys: tuple, f: dict, x: float, y: float) -> float:
    """The function affine in x and in y (a + b x + c y + d x y) through ``f[(xi, yj)]`` at x, y; an axis with one
    point is constant along it."""
    if len(xs) == 1 and len(ys) == 1:
        return f[(xs[0], ys[0])]
    if len(ys) == 1:
        return _affine(xs, (f[(xs[0], ys[0])], f[(xs[1], ys[0])]), x)
    if len(xs) == 1:
        return _affine(ys, (f[(xs[0], ys[0])], f[(xs[0], ys[1])]), y)
    return _affine(ys, (_affine(xs, (f[(xs[0], ys[0])], f[(xs[1], ys[0])]), x),
                        _affine(xs, (f[(xs[0], ys[1])], f[(xs[1], ys[1])]), x)), y)


def _isolated(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a child process forked from this one (so it sees this process's modules as they
    are), its result sent back. Steps run one after another in one process do not trace alike under FSDP2 on the
    fake process group (the second step's update peak 14% lower, its optimiser state half): each starts afresh."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(fn, args, kwargs)


def rehearse(cfg, gpus: int, gpu: GPUSpec, *, prompt_tokens: int) -> Rehearsal:
    """The step at the config's depth and batch. Run as is when it has at most ``max(DEPTHS)`` layers and at most
    ``REDUCED_MINIBATCHES`` mini-batches of at most ``max(ROWS)`` rows per rank; else on a grid of depths
    (``DEPTHS[:2]``) and rows per rank per mini-batch (``ROWS``, in ``REDUCED_MINIBATCHES`` mini-batches), every
    figure affine in each (``_bilinear``: the routes are rows x layers) and extrapolated to the config's depth and
    rows per rank; the depth fit checked at ``DEPTHS[2]``. The optimiser phase's time is per optimiser step: scaled
    from the reduced mini-batches to the config's."""
    from dcmdp.memplan import model_shapes

    layers = model_shapes(cfg).layers
    minibatches = cfg.algo.minibatches
    per_minibatch = rows_per_rank(cfg, gpus)
    rows = per_minibatch * minibatches  # rows per rank in the step
    cut_depth = layers > max(DEPTHS)
    cut_rows = minibatches > REDUCED_MINIBATCHES or per_minibatch > max(ROWS)
    if not cut_depth and not cut_rows:
        t = rehearse_step(cfg, gpus, gpu, layers, prompt_tokens=prompt_tokens)
        peak, snap, ms = _fold(t.phase_peak, t.phase_snap, t.phase_ms)
        return Rehearsal(layers, [t], {p: float(v) for p, v in peak.items()},
                         {p: {k: float(v) for k, v in c.items()} for p, c in snap.items()},
                         ms, False, rows=rows, minibatches=minibatches, reduced_minibatches=minibatches)
    reduced_mb = min(minibatches, REDUCED_MINIBATCHES)
    xs = DEPTHS[:2] if cut_depth else (layers,)
    ys = ROWS if cut_rows else (per_minibatch,)

    def step_cfg(r):
        return reduced_rows(cfg, gpus, r, reduced_mb) if cut_rows else cfg

    traces = {}
    for r in ys:
        for x in xs:
            traces[(x, r)] = _isolated(rehearse_step, step_cfg(r), gpus, gpu, x, prompt_tokens=prompt_tokens)
    check = (_isolated(rehearse_step, step_cfg(ys[0]), gpus, gpu, DEPTHS[2], prompt_tokens=prompt_tokens)
             if cut_depth else None)
    # the fit's second axis: rows per rank in the whole reduced step (its mini-batches x rows per mini-batch)
    ns = tuple(reduced_mb * r for r in ys) if cut_rows else (rows,)
    gap = 0.0

    def fit(get, scale: float = 1.0, per_minibatch_axis: bool = False) -> float:
        # the update's and the optimiser's peaks are those of one mini-batch: fitted along its rows per rank; the
        # other phases hold or walk the whole step's rows: fitted along those
        nonlocal gap
        axis, target = ((tuple(ys), per_minibatch) if per_minibatch_axis and cut_rows else (ns, rows))
        f = {(x, n): float(get(traces[(x, r)])) for x in xs for n, r in zip(axis, ys)}
        if check is not None:
            want = _bilinear(xs, axis, f, DEPTHS[2], axis[0])
            gap = max(gap, abs(float(get(check)) - want) / max(abs(float(get(check))), 1.0))
        return max(_bilinear(xs, axis, f, layers, target), 0.0) * scale

    def one_minibatch(p: str) -> bool:
        return p.startswith(("update", "optimiser"))

    peak = {p: fit(lambda t, p=p: t.phase_peak[p], per_minibatch_axis=one_minibatch(p)) for p in TRACED}
    snap = {p: {c: fit(lambda t, p=p, c=c: t.phase_snap[p].get(c, 0), per_minibatch_axis=one_minibatch(p))
                for c in CATEGORIES} for p in TRACED}
    # the time: each phase's parts summed in every run, then fitted
    # (the update's and the optimiser's per mini-batch, along its rows, times the config's mini-batches)
    ms = {p: fit(lambda t, p=p: t.phase_ms[p] + t.phase_ms.get(p + LATER, 0.0),
                 minibatches / reduced_mb if one_minibatch(p) else 1.0, per_minibatch_axis=p == "update")
          for p in PHASES}
    peak, snap, _ = _fold(peak, snap, {})
    runs = list(traces.values()) + ([check] if check is not None else [])
    return Rehearsal(layers, runs, peak, snap, ms, True, gap, rows=rows, reduced_rows=ys if cut_rows else (),
                     minibatches=minibatches, reduced_minibatches=reduced_mb)


def _plan_by_phase(plan) -> tuple[dict[str, float], dict[str, float]]:
    """The plan's figures (bytes, the terms a CPU trace can hold: no engine, KV cache or overhead) by phase and by
    category, in the rehearsal's names."""
    def term(name: str) -> float:
        return next((t.bytes for t in plan.terms if t.name == name), 0.0)

    base = term("weights") + term("optimiser") + term("routes")
    forward = term("activations") + term("logits")
    train = plan.train_bytes
    by_phase = {"rollout": base, "old_logp": base + forward, "measures": base, "update": base + train,
                "optimiser": base + train, "sync": base + term("transients")}
    by_cat = {"parameters": term("weights"), "gradients": term("gradients"), "optimiser state": term("optimiser"),
              "activations": forward, "temporaries": term("transients"), "batch": term("routes")}
    return by_phase, by_cat


def _duration(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"


def rehearsal_lines(cfg, gpus: int, gpu_gib: float) -> list[str]:
    """``dcmdp check --rehearse``'s report: the rehearsed step's peak by phase and category beside the plan's, the
    five largest tensors at the peak, the roofline time by phase, and what could not be traced and why."""
    from dcmdp.memplan import PROMPT_TOKENS, plan_memory

    gpu = gpu_for(gpu_gib)
    t0 = time.perf_counter()
    r = rehearse(cfg, gpus, gpu, prompt_tokens=PROMPT_TOKENS)
    plan = plan_memory(cfg, gpus, gpu_gib, prompt_tokens=PROMPT_TOKENS, overhead_gib=0.0)
    plan_phase, plan_cat = _plan_by_phase(plan)
    how = (f"extrapolated from depths {', '.join(map(str, DEPTHS))} to {r.layers} layers (fit checked at depth "
           f"{DEPTHS[2]}: {r.fit_gap:.1e} relative)" if r.extrapolated and r.traces[-1].layers != r.layers else
           f"traced at its {r.layers} layers")
    if r.reduced_rows:
        how += (f"; and from {' and '.join(map(str, r.reduced_rows))} rows per rank in each of "
                f"{r.reduced_minibatches} mini-batches to its {r.rows:g} rows per rank in {r.minibatches} "
                f"(affine in the rows, each figure a bilinear fit in depth x rows; the optimiser's time per step "
                f"x {r.minibatches} steps)")
    last = r.traces[-1]
    opt_state = max(r.phase_snap["optimiser"].get("optimiser state", 0.0),
                    r.phase_snap["update"].get("optimiser state", 0.0))
    lines = [f"rehearsal: one training step on rank 0 of {gpus} on fake tensors, {how}, rows of {PROMPT_TOKENS} + "
             f"{cfg.rollout.max_new_tokens} tokens; in {time.perf_counter() - t0:.0f} s here",
             f"  {'phase':<11} {'traced':>10} {'+opt state':>11} {'plan':>10}   (GiB per GPU; plan without its "
             f"rollout_engine, kv_cache and overhead terms, which are not traced)"]
    later = 0.0
    for p in PHASES:
        held = r.phase_snap[p].get("optimiser state", 0.0)
        steady = r.phase_peak[p] + max(opt_state - held, 0.0)  # a later step holds the state from its start
        later = max(later, steady)
        lines.append(f"  {p:<11} {r.phase_peak[p] / GIB:10.3f} {steady / GIB:11.3f} {plan_phase[p] / GIB:10.3f}")
    lines.append(f"  (+opt state: the phase at a later step, which holds the optimiser state made at step 1's "
                 f"first optimiser step: {opt_state / GIB:.3f} GiB)")
    peak_phase = r.peak_phase
    lines.append(f"  by category at the peak ({peak_phase}):")
    for c in CATEGORIES:
        lines.append(f"  {c:<16} {r.phase_snap[peak_phase].get(c, 0.0) / GIB:10.3f} {plan_cat[c] / GIB:10.3f}")
    lines.append(f"  {'total (peak)':<16} {r.peak / GIB:10.3f} {max(plan_phase.values()) / GIB:10.3f}   "
                 f"(the full plan, with its untraced terms: {plan.total_gib:.2f} GiB of {gpu_gib:g})")
    planned = max(plan_phase.values())
    lines.append(f"  {'later steps':<16} {later / GIB:10.3f} {planned / GIB:10.3f}   (the peak of a step that holds the "
                 f"optimiser state from its start; the plan {(planned - later) / max(later, 1.0):+.1%} of it)")
    depth = f" at depth {last.layers}" if r.extrapolated else ""
    lines.append(f"  largest tensors at the peak{depth}:")
    lines += [f"    {n / 2 ** 20:10.1f} MiB  {cat:<16} {line}" for n, cat, line in last.top] or ["    (none recorded)"]
    total_ms = sum(r.phase_ms.values())
    lines.append(f"  roofline time (an estimate: RuntimeEstimator's per-op cost model with {gpu.name}'s datasheet "
                 f"FLOP/s and bandwidth, no communication): {_duration(total_ms)} for the step")
    lines.append("    " + ", ".join(f"{p} {_duration(r.phase_ms[p])}" for p in PHASES))
    lines.append("  not traced, and why:")
    lines += [f"    - {why}" for why in NOT_TRACED + (NOT_TRACED_WORLD if gpus > 1 else ())]
    if last.nominal:
        sites = ", ".join(f"{site} (x{n})" for site, n in sorted(last.nominal.items()))
        lines.append(f"    - values the model computed are fake: these reads got a nominal answer (True, 0): {sites}")
    return lines
