"""The optimiser and the precision of its parameters and state (``optim.precision``).

``fp32`` is ``torch.optim.AdamW`` on the model's parameters as built (float32 master weights, also under
``model.dtype: bfloat16``, whose forwards run in bfloat16 autocast). The ``bf16_*`` precisions train bfloat16
parameters with bfloat16 AdamW moments, which cuts parameter + state from 12 to 6 bytes per parameter
(8 with the Kahan buffer; gradients follow the parameters: 4 -> 2). Plain bfloat16 AdamW loses every update
smaller than half a bfloat16 step of the weight (2^-9 of it: at lr 1e-6 every update is lost), so the
parameter update is applied either

- with **stochastic rounding** (``bf16_stochastic``): the float32 result is rounded up or down to its two
  bfloat16 neighbours with probabilities that make the rounded value unbiased (E[round(x)] = x), so updates
  below the bfloat16 step survive in expectation; Gupta et al., "Deep Learning with Limited Numerical
  Precision", ICML 2015, §3; Zamirai et al., "Revisiting BFloat16 Training", arXiv 2010.06192, §3;
- or with **Kahan-compensated summation** (``bf16_kahan``): a bfloat16 buffer c keeps the part of each update
  that the bfloat16 parameter could not hold and adds it back at the next step, so p + c follows the exact
  sum to within the rounding of c (Kahan, "Further remarks on reducing truncation errors", CACM 1965;
  Zamirai et al. §3).

The arithmetic of a step runs in float32 over buckets of parameter pieces (``BF16AdamW``: a real-width embedding has
6e8 elements, a float32 temporary of the whole tensor would be 2.5 GB): one random draw per bucket, then either one
compiled kernel per piece (CUDA by default) or eager slices that stay in cache. The moments are stored with
stochastic rounding in both variants: with round-to-nearest, exp_avg_sq * beta2 rounds back to exp_avg_sq whenever
1 - beta2 is below half a bfloat16 step (beta2 = 0.999), and the second moment would never decay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# Elements per bucket of a step: the parameters are cut into flat pieces grouped into buckets of at most this many
# elements, each with one random draw (int64: 128 MiB) and one pass of float32 arithmetic (64 MiB per temporary).
# A real-width embedding (6e8 elements) is cut into pieces, so no temporary spans a whole tensor.
BUCKET = 1 << 24
# Elements per slice of the eager (uncompiled) arithmetic: its float32 temporaries (1 MiB) stay in the CPU's caches
# and allocator, where whole-bucket temporaries cost a page fault per 4 KiB (measured 10x slower on the CPU).
EAGER_SLICE = 1 << 18
# fp32 bits below the bfloat16 mantissa (bfloat16 is the upper half of a float32).
_LOW_BITS = 16
_HIGH_MASK = -(1 << _LOW_BITS)  # 0xFFFF0000 as a signed int32
_FIELD = (1 << _LOW_BITS) - 1


def _round_with(x: Tensor, noise: Tensor) -> Tensor:
    """``x`` (float32) rounded to bfloat16 with ``noise`` (int32 in [0, 2^16), one per element): the noise is added
    to the float32 bit pattern and the low 16 bits dropped (``round_stochastic_bf16``). Infinities have zero low
    bits and come back unchanged; a NaN is kept as it is (its low bits could carry it to an infinity)."""
    rounded = ((x.view(torch.int32) + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), rounded)


def _noise_field(draws: Tensor, field: int) -> Tensor:
    """Bits 16 field ... 16 field + 15 of the int64 ``draws`` (uniform on [0, 2^63)) as int32 in [0, 2^16): the
    fields 0, 1, 2 of one draw are independent uniform 16-bit integers. Eager: read as the field-th uint16 of each
    draw (little-endian, as CPUs and CUDA GPUs are), 4x faster on the CPU than the shift a compiled kernel fuses."""
    if torch.compiler.is_compiling():
        return ((draws >> (_LOW_BITS * field)) & _FIELD).to(torch.int32)
    return draws.view(torch.uint16).view(-1, 4)[:, field].to(torch.int32)


def round_stochastic_bf16(x: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """``x`` (float32) rounded to bfloat16, up or down at random with E[result] = x.

    Adds a uniform random integer in [0, 2^16) to the float32 bit pattern and drops the low 16 bits: the
    magnitude rounds away from zero with probability (low 16 bits) / 2^16, i.e. the distance to the lower
    neighbour over the gap between the two (Gupta et al. 2015, §3). Sign, infinities and exact bfloat16 values
    are kept; NaN stays NaN.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_stochastic_bf16 takes float32, got {x.dtype}")
    noise = torch.randint(0, 1 << _LOW_BITS, x.shape, dtype=torch.int32, generator=generator, device=x.device)
    return _round_with(x.contiguous(), noise)


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> tuple:
    """The scalars of ``adamw_bf16_update`` at step ``step`` (1-based), computed in float64:
    (beta1, 1 - beta1, beta2, 1 - beta2, eps, 1 - beta2^t, lr / (1 - beta1^t), lr weight_decay)."""
    return (beta1, 1 - beta1, beta2, 1 - beta2, eps, 1 - beta2 ** step, lr / (1 - beta1 ** step), lr * weight_decay)


def adamw_bf16_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, c: Optional[Tensor], draws: Tensor, beta1, w1, beta2,
                      w2, eps, bias2, step_size, decay) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """One AdamW step of flat bfloat16 tensors (N,) in float32 arithmetic; returns the new (p, m, v, c) in bfloat16.

    m32 = beta1 m + w1 g; v32 = beta2 v + w2 g^2; m and v are stored stochastically rounded with the noise fields
    0 and 1 of ``draws`` (int64, (N,)); u = -step_size m32 / (sqrt(v32 / bias2) + eps) - decay p. ``c`` None: p + u
    stochastically rounded with field 2. Else Kahan: e = (p + c) + u, p = e rounded to nearest, c = e - p rounded to
    nearest. The scalars (``adamw_scalars``) are Python floats, or 0-d float32 tensors in the compiled step; both are
    the float64 values rounded to float32 once.
    """
    g32 = g.float()
    m32 = m.float() * beta1 + w1 * g32
    v32 = v.float() * beta2 + w2 * g32 * g32
    m_new, v_new = _round_with(m32, _noise_field(draws, 0)), _round_with(v32, _noise_field(draws, 1))
    u = m32 / ((v32 / bias2).sqrt() + eps) * -step_size
    p32 = p.float()
    if isinstance(decay, Tensor) or decay:
        u = u - decay * p32
    if c is None:
        return _round_with(p32 + u, _noise_field(draws, 2)), m_new, v_new, None
    exact = p32 + c.float() + u
    p_new = exact.to(torch.bfloat16)
    return p_new, m_new, v_new, (exact - p_new.float()).to(torch.bfloat16)


def _update_in_place(p: Tensor, g: Tensor, m: Tensor, v: Tensor, c: Optional[Tensor], draws: Tensor,
                     hyper: Tensor) -> None:
    """``adamw_bf16_update`` written back into p, m, v (and c); ``hyper``: ``adamw_scalars`` as a float32 tensor, so
    that a compiled step does not recompile when the learning rate or the step changes."""
    out = adamw_bf16_update(p, g, m, v, c, draws, *hyper.unbind())
    for dst, src in zip((p, m, v, c), out):
        if dst is not None:
            dst.copy_(src)


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (an FSDP2 parameter, its gradient or state), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


_COMPILED: dict[str, Callable] = {}


def _compiled_update() -> Callable:
    """``_update_in_place`` compiled once (shapes dynamic): one fused kernel per piece, reading p, g, m, v (and c)
    and the draws once and writing p, m, v (and c) once."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_update_in_place, dynamic=True, fullgraph=True,
                                       options={"emulate_precision_casts": True})
    return _COMPILED["fn"]


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter, arXiv 1711.05101) on bfloat16 parameters with bfloat16 moments.

    Per step t, in float32: m <- beta1 m + (1 - beta1) g; v <- beta2 v + (1 - beta2) g^2;
    u = -lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) - lr * weight_decay * p, then p + u is
    written back to bfloat16 by ``rounding``: "stochastic" (``round_stochastic_bf16``) or "kahan" (p + c + u
    rounded to nearest, the remainder kept in the bfloat16 compensation buffer c). m and v are stored with
    stochastic rounding. ``seed`` seeds the rounding's generator, saved with the state dict, so a resumed run
    draws the same noise as an uninterrupted one.

    A step is multi-tensor (``adamw_bf16_update``): the parameters of a group, cut into pieces of at most
    ``BUCKET`` elements, are taken a bucket at a time; each bucket draws one int64 per element from the generator
    (its 16-bit fields round m, v and p) and runs the float32 arithmetic once over the bucket's concatenated
    pieces (``compile=False``) or as one compiled kernel per piece (``compile=True``: ``torch.compile``; the default
    None compiles on CUDA only). The two execute the same operations on the same draws.
    """

    ROUNDINGS = ("stochastic", "kahan")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, rounding: str = "stochastic", seed: int = 0,
                 compile: Optional[bool] = None):
        if rounding not in self.ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(self.ROUNDINGS)}, got {rounding!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.rounding, self.seed, self.compile = rounding, int(seed), compile
        self._generators: dict[torch.device, torch.Generator] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"BF16AdamW needs bfloat16 parameters, got {p.dtype} (shape {tuple(p.shape)})")

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # (device, step) -> pieces (p, g, m, v, c) as flat views, in parameter order
            pieces: dict[tuple[torch.device, int], list[tuple]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BF16AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if self.rounding == "kahan":
                        state["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                # an FSDP2 parameter (DTensor) is stepped through its local shard: the update is elementwise
                flat = tuple(None if x is None else _local(x).reshape(-1) if x is p.grad else _local(x).view(-1)
                             for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state.get("compensation")))
                parts = pieces.setdefault((p.device, int(state["step"].item())), [])
                for start in range(0, flat[0].numel(), BUCKET):
                    parts.append(tuple(None if x is None else x[start:start + BUCKET] for x in flat))
            for (device, t), parts in pieces.items():
                self._step_pieces(parts, device, group, t)
        return loss

    def _step_pieces(self, parts: list[tuple], device: torch.device, group: dict, t: int) -> None:
        scalars = adamw_scalars(group["lr"], *group["betas"], group["eps"], group["weight_decay"], t)
        compiled = device.type == "cuda" if self.compile is None else self.compile
        hyper = torch.tensor(scalars, dtype=torch.float32, device=device) if compiled else None
        gen = self._generator(device)
        bucket: list[tuple] = []
        size = 0
        for i, part in enumerate(parts):
            bucket.append(part)
            size += part[0].numel()
            if i + 1 < len(parts) and size + parts[i + 1][0].numel() <= BUCKET:
                continue
            draws = torch.empty(size, dtype=torch.int64, device=device).random_(generator=gen)
            if compiled:
                fn = _compiled_update()
                for part_, d in zip(bucket, draws.split([x[0].numel() for x in bucket])):
                    fn(*part_, d, hyper)
            else:
                self._eager_bucket(bucket, draws, scalars)
            bucket, size = [], 0

    @staticmethod
    def _eager_bucket(bucket: list[tuple], draws: Tensor, scalars: tuple) -> None:
        """The bucket's pieces concatenated (a single piece is used in place), updated ``EAGER_SLICE`` elements at a
        time, and copied back into the pieces (multi-tensor copies)."""
        kahan = bucket[0][4] is not None
        columns = (0, 1, 2, 3, 4) if kahan else (0, 1, 2, 3)
        single = len(bucket) == 1
        flat = [bucket[0][k] if single else torch.cat([x[k] for x in bucket]) for k in columns]
        if not kahan:
            flat.append(None)
        for start in range(0, len(draws), EAGER_SLICE):
            part = [None if x is None else x[start:start + EAGER_SLICE] for x in flat]
            out = adamw_bf16_update(*part, draws[start:start + EAGER_SLICE], *scalars)
            for column, new in zip((0, 2, 3, 4), out):  # out is (p, m, v, c): every column but g's
                if new is not None:
                    part[column].copy_(new)
        if not single:
            sizes = [x[0].numel() for x in bucket]
            for column in columns:
                if column != 1:
                    torch._foreach_copy_([x[column] for x in bucket], list(flat[column].split(sizes)))

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["rounding"] = {"kind": self.rounding, "seed": self.seed,
                          "generators": {str(dev): g.get_state() for dev, g in self._generators.items()}}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("rounding", None)
        if saved is not None and saved["kind"] != self.rounding:
            raise ValueError(f"optimizer state was saved with {saved['kind']!r} rounding, this optimizer uses "
                             f"{self.rounding!r}")
        super().load_state_dict(state_dict)
        if saved is not None:
            self.seed = int(saved["seed"])
            self._generators = {}
            here = {p.device for group in self.param_groups for p in group["params"]}
            for dev, rng in saved["generators"].items():
                if torch.device(dev) in here:
                    self._generator(torch.device(dev)).set_state(rng)
            moved = here - set(self._generators)
            if moved and saved["generators"]:
                # a checkpoint written on another device (CPU <-> CUDA): that device's generator state means nothing
                # here, and replaying the seed's first draws would repeat step 1's noise
                steps = max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)
                for dev in moved:
                    self._generators[dev] = torch.Generator(device=dev).manual_seed(
                        (self.seed * 1_000_003 + steps) % 2**63)
                log.warning("BF16AdamW: the rounding noise's generator was saved on %s and the parameters are on %s: "
                            "its stream restarts from the seed and step %d (the resumed run rounds with other draws "
                            "than an uninterrupted one would)", ", ".join(saved["generators"]),
                            ", ".join(str(d) for d in sorted(moved, key=str)), steps)


class Float32Grads:
    """Gradient accumulation in float32 for the parameters of a lower precision (bfloat16, float16), as a context:
    inside it, each backward's gradient of such a parameter is added into a float32 sum (a post-accumulate-grad hook;
    FSDP2 runs it on the sharded gradient after its reduce-scatter) and ``p.grad`` is freed; on leaving, ``p.grad``
    is the sum rounded to the parameter's dtype once.

    Summing M micro-batches in bfloat16 rounds M times: the relative error of the sum grows to ~1e-2 at M = 128, where
    one rounding is 2^-9 ~ 2e-3 (tests/test_optim.py). Memory: 4 bytes per such parameter for the sum, in place of
    the 2 of the bfloat16 gradient, while the micro-batches run; float32 parameters are left alone."""

    def __init__(self, params: Iterable[Tensor]):
        self.params = [p for p in params if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
        self.sums: dict[Tensor, Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> "Float32Grads":
        for p in self.params:
            if p.grad is not None:  # a gradient from before: part of the sum
                self._add(p)
            self.handles.append(p.register_post_accumulate_grad_hook(self._add))
        return self

    def _add(self, p: Tensor) -> None:
        grad, p.grad = p.grad, None
        if p in self.sums:
            self.sums[p].add_(grad)
        else:
            self.sums[p] = grad.to(torch.float32)

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for p in self.params:
            total = self.sums.pop(p, None)
            if total is not None:  # one parameter at a time: a single extra gradient is alive while rounding
                p.grad = total.to(p.dtype)
                del total


@dataclass(frozen=True)
class Precision:
    """One ``optim.precision``: the parameters' dtype it trains (None: as built) and its optimiser factory."""

    param_dtype: Optional[torch.dtype]
    make: Callable[..., torch.optim.Optimizer]
    about: str


def _adamw(params, *, lr, betas, eps, weight_decay, seed):  # noqa: ARG001 (torch's AdamW draws no noise)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _bf16(rounding: str):
    def make(params, *, lr, betas, eps, weight_decay, seed):
        return BF16AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rounding=rounding,
                         seed=seed)
    return make


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(None, _adamw, "torch AdamW on the parameters as built (float32 master weights): 16 B "
                                    "per parameter with its gradient"),
    "bf16_stochastic": Precision(torch.bfloat16, _bf16("stochastic"),
                                 "bfloat16 parameters and moments, the update stochastically rounded: 8 B per "
                                 "parameter with its gradient"),
    "bf16_kahan": Precision(torch.bfloat16, _bf16("kahan"),
                            "bfloat16 parameters and moments, the update Kahan-compensated by a bfloat16 buffer: "
                            "10 B per parameter with its gradient"),
}


def precision_param_dtype(name: str) -> Optional[torch.dtype]:
    """The dtype ``optim.precision=name`` trains the parameters in (None: leave them as built)."""
    return PRECISIONS[name].param_dtype


def build_optimizer(params: Iterable[Tensor], cfg, *, seed: int) -> torch.optim.Optimizer:
    """The optimiser of ``cfg`` (an ``OptimConfig``) over ``params``, already in ``precision_param_dtype``."""
    return PRECISIONS[cfg.precision].make(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8,
                                          weight_decay=cfg.weight_decay, seed=seed)


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes per parameter of the parameters, their gradients and the optimiser state (tensor storage sizes;
    scalar step counters included), measured after at least one step."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    n = sum(p.numel() for p in params)
    size = lambda t: t.untyped_storage().nbytes()  # noqa: E731
    out = {"param": sum(size(p) for p in params) / n,
           "grad": sum(size(p.grad) for p in params if p.grad is not None) / n,
           "state": sum(size(v) for p in params for v in optimizer.state[p].values()
                        if isinstance(v, Tensor)) / n}
    out["param+state"] = out["param"] + out["state"]
    out["total"] = out["param+state"] + out["grad"]
    return out
