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

The arithmetic of a step runs in float32, chunk by chunk (a real-width embedding has 6e8 elements: a float32
temporary of the whole tensor would be 2.5 GB). The moments are stored with stochastic rounding in both
variants: with round-to-nearest, exp_avg_sq * beta2 rounds back to exp_avg_sq whenever 1 - beta2 is below
half a bfloat16 step (beta2 = 0.999), and the second moment would never decay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

# Elements per float32 working chunk of a step: 4 temporaries of 16 MiB each.
CHUNK = 1 << 22
# fp32 bits below the bfloat16 mantissa (bfloat16 is the upper half of a float32).
_LOW_BITS = 16
_HIGH_MASK = -(1 << _LOW_BITS)  # 0xFFFF0000 as a signed int32


def round_stochastic_bf16(x: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """``x`` (float32) rounded to bfloat16, up or down at random with E[result] = x.

    Adds a uniform random integer in [0, 2^16) to the float32 bit pattern and drops the low 16 bits: the
    magnitude rounds away from zero with probability (low 16 bits) / 2^16, i.e. the distance to the lower
    neighbour over the gap between the two (Gupta et al. 2015, §3). Sign, infinities and exact bfloat16 values
    are kept; NaN stays NaN.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_stochastic_bf16 takes float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << _LOW_BITS, x.shape, dtype=torch.int32, generator=generator, device=x.device)
    rounded = ((bits + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter, arXiv 1711.05101) on bfloat16 parameters with bfloat16 moments.

    Per step t, in float32: m <- beta1 m + (1 - beta1) g; v <- beta2 v + (1 - beta2) g^2;
    u = -lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) - lr * weight_decay * p, then p + u is
    written back to bfloat16 by ``rounding``: "stochastic" (``round_stochastic_bf16``) or "kahan" (p + c + u
    rounded to nearest, the remainder kept in the bfloat16 compensation buffer c). m and v are stored with
    stochastic rounding. ``seed`` seeds the rounding's generator, saved with the state dict, so a resumed run
    draws the same noise as an uninterrupted one.
    """

    ROUNDINGS = ("stochastic", "kahan")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, rounding: str = "stochastic", seed: int = 0):
        if rounding not in self.ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(self.ROUNDINGS)}, got {rounding!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.rounding, self.seed = rounding, int(seed)
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
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if self.rounding == "kahan":
                        state["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                t = int(state["step"].item())
                self._update(p, state, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                             1 - beta1 ** t, 1 - beta2 ** t)
        return loss

    def _update(self, p: Tensor, state: dict, lr: float, beta1: float, beta2: float, eps: float, wd: float,
                bias1: float, bias2: float) -> None:
        if p.grad.is_sparse:
            raise RuntimeError("BF16AdamW does not support sparse gradients")
        gen = self._generator(p.device)
        flat = {"p": p.view(-1), "g": p.grad.reshape(-1), "m": state["exp_avg"].view(-1),
                "v": state["exp_avg_sq"].view(-1)}
        if "compensation" in state:
            flat["c"] = state["compensation"].view(-1)
        step_size = lr / bias1
        for start in range(0, p.numel(), CHUNK):
            part = {k: t[start:start + CHUNK] for k, t in flat.items()}
            g = part["g"].to(torch.float32, copy=True)
            m = part["m"].float().lerp_(g, 1 - beta1)
            v = part["v"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            part["m"].copy_(round_stochastic_bf16(m, gen))
            part["v"].copy_(round_stochastic_bf16(v, gen))
            p32 = part["p"].float()
            # u = -lr * wd * p - step_size * m / (sqrt(v / bias2) + eps), built in g's storage
            u = v.div_(bias2).sqrt_().add_(eps)
            u = torch.div(m, u, out=g).mul_(-step_size)
            if wd:
                u.add_(p32, alpha=-lr * wd)
            if "c" in part:
                exact = p32.add_(part["c"].float()).add_(u)
                rounded = exact.to(torch.bfloat16)
                part["p"].copy_(rounded)
                part["c"].copy_(exact.sub_(rounded.float()))
            else:
                part["p"].copy_(round_stochastic_bf16(p32.add_(u), gen))

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
            for dev, rng in saved["generators"].items():
                self._generator(torch.device(dev)).set_state(rng)


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
