"""The config as its records hold it (config.yaml, MLflow params, a checkpoint's config), and what a resume compares
with a checkpoint's: the keys it must share (``RESUME_KEYS``) and those it cannot change (``NOT_ON_RESUME``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from omegaconf import OmegaConf

from dcmdp import redact
from dcmdp.config.schema import RunConfig


# Config keys that hold a URI: records hold them without credentials (``redact.public_uri``).
URI_KEYS = ("tracking.uri",)


def _is_resume_key(key: str) -> bool:
    """A key a resume compares (``RESUME_KEYS``, ``NOT_ON_RESUME``): its records hold the resolved value."""
    generic = _generic(key)
    return generic in RESUME_KEYS or _not_on_resume(generic) is not None


def public_config(cfg: RunConfig, *, resume_keys_resolved: bool = False) -> dict:
    """The config as every record of it holds it (config.yaml, MLflow params, a checkpoint's config): a value
    written as an interpolation (``${oc.env:PW}``) stays that interpolation, URIs (``URI_KEYS``) lose their
    credentials, the rest is resolved. ``resume_keys_resolved``: the ``RESUME_KEYS`` resolved even when written as an
    interpolation (registry names, a dtype, a model folder: what a resume compares, never a secret)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return redact.public_container(cfg, data, URI_KEYS, keep=_is_resume_key if resume_keys_resolved else None)


def to_yaml(cfg: RunConfig, *, public: bool = False) -> str:
    """The resolved config as YAML; ``public``: as ``public_config`` has it (what a run writes to its folder and to
    MLflow), which ``load_config`` reads back to the same config in the same environment."""
    if public:
        return OmegaConf.to_yaml(OmegaConf.create(public_config(cfg)))
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Flattened ``public_config`` (dotted keys, the ``RESUME_KEYS`` resolved) for MLflow params and checkpoints."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list) and node and isinstance(node[0], dict):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")
        else:
            out[prefix[:-1]] = str(node)

    walk(public_config(cfg, resume_keys_resolved=True), "")
    return out


# Keys a resumed run must share with its checkpoint: the model's shape and weights, and the dual state's layout
# and meaning (number, order and measures of the constraints, the dual rule). Others (lr, steps, tolerances, ...)
# may change on resume. ``*`` stands for a constraint's index.
RESUME_KEYS = ("model.preset", "model.path", "model.dtype", "task.name", "dual.rule", "dual.constraints.*.measure",
               "dual.constraints.*.tau")


# The anchored tolerance's gap g, floor at anchoring and probe window live in the dual state: c = F + g stays the
# checkpoint's until the next anchoring, whatever the config now says.
_ANCHOR_STATE = "the anchored tolerance c = F + g continues from the checkpoint's dual state (its gap and probe window)"


# Keys whose value a resumed run takes from the checkpoint's state, not from the config: a change is refused (exit 2,
# naming the key) instead of being recorded in config.yaml while the old value trains. A key ending in "." is a
# block (every key under it but ``RESUMABLE_IN_BLOCKS``).
NOT_ON_RESUME = {
    "seed": "the random generators continue from the checkpoint's states",
    "optim.lr": "the optimiser and its schedule continue from the checkpoint's state",
    "optim.betas": "the optimiser continues from the checkpoint's state",
    "optim.weight_decay": "the optimiser continues from the checkpoint's state",
    "optim.warmup_steps": "the schedule continues from the checkpoint's state",
    "optim.precision": "the parameters and optimiser state continue in the checkpoint's precision",
    "dual.constraints.*.lambda_init": "the multipliers continue from the checkpoint's",
    "dual.constraints.*.anchor": _ANCHOR_STATE,
    "dual.constraints.*.anchor_start": _ANCHOR_STATE,
    "dual.constraints.*.anchor_batches": _ANCHOR_STATE,
    "dual.constraints.*.anchor_every": _ANCHOR_STATE,
    "dual.constraints.*.anchor_ratio": _ANCHOR_STATE,
    "dual.constraints.*.authority": "whether the dual acts or stands down was decided at the checkpoint's anchor "
                                    "windows with its authority, and lambda was set from that decision",
    "dual.constraints.*.miss_rate": "the anchored gap g was set at the checkpoint's miss rate and the chance rule's "
                                    "multipliers were reached under it",
    "dual.measure_at": "the floor, the anchored gap and the multipliers in the checkpoint's dual state were measured "
                       "at its measurement point",
    "dual.penalty": "the multipliers in the checkpoint's dual state were reached under its penalty form",
    "model.init": "the weights come from the checkpoint",
    "model.num_layers": "the weights come from the checkpoint",
    "cold_start.": "the weights come from the checkpoint, not from a cold start",
}


# Keys inside a ``NOT_ON_RESUME`` block that a resume does honour.
RESUMABLE_IN_BLOCKS = frozenset({"cold_start.cache_dir"})


def _rule_of_old_keys(saved: dict[str, str]) -> dict[str, str]:
    """A flattened config saved before ``dual.rule`` named off and fixed: its ``dual.enabled=False`` is rule off and
    its ``dual.fixed=True`` rule fixed (see ``RENAMED_KEYS``)."""
    if saved.get("dual.enabled") == "False":
        return {**saved, "dual.rule": "off"}
    if saved.get("dual.fixed") == "True":
        return {**saved, "dual.rule": "fixed"}
    return saved


def resume_conflicts(saved: dict[str, str], cfg: RunConfig) -> list[str]:
    """One line per ``RESUME_KEYS`` or ``NOT_ON_RESUME`` key where ``cfg`` differs from the flattened config ``saved``
    with a checkpoint (``flatten``: these keys resolved, so a value read from the environment is compared as the
    value it is), the number of constraints first; empty when the run can continue from it."""
    saved = _rule_of_old_keys(saved)
    now = flatten(cfg)

    def count(flat: dict[str, str]) -> int:
        return len({k.split(".")[2] for k in flat if k.startswith("dual.constraints.")})

    out = []
    if count(saved) != count(now):
        out.append(f"dual.constraints: {count(saved)} constraint(s) in the checkpoint, {count(now)} now")
    for key in sorted(set(saved) | set(now)):
        generic = _generic(key)
        if key not in saved or key not in now or saved[key] == now[key]:
            continue
        if generic in RESUME_KEYS:
            out.append(f"{key}: {saved[key]!r} in the checkpoint, {now[key]!r} now")
        elif (why := _not_on_resume(generic)) is not None:
            out.append(f"{key}: {saved[key]!r} in the checkpoint, {now[key]!r} now ({why}: the new value would be "
                       f"ignored)")
    return out


def _generic(key: str) -> str:
    return re.sub(r"^dual\.constraints\.\d+\.", "dual.constraints.*.", key)


def _not_on_resume(generic: str) -> Optional[str]:
    """Why a resumed run cannot honour a new value of the key (``NOT_ON_RESUME``), or None."""
    for pattern, why in NOT_ON_RESUME.items():
        if generic == pattern or (pattern.endswith(".") and generic.startswith(pattern)
                                  and generic not in RESUMABLE_IN_BLOCKS):
            return why
    return None

