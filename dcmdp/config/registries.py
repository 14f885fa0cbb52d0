"""The registries a config names, asked through one function (``registry``), and the modes that own knobs.

A mode (policy loss, IS mode, sequence mask, rejection measure, dual rule, ...) owns its knobs: a knob of a mode that
is not selected is an error naming both (``MODE_SELECTORS``, ``check_modes``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from dcmdp.config.schema import RunConfig, _get, nearest
from trainers.errors import config_error, require


def registry(key: str) -> Mapping[str, Any] | tuple[str, ...]:
    """The registry whose names the config key ``key`` takes (``model.preset``: ``trainers.models.PRESETS``; a
    constraint's measure: ``dual.constraints[*].measure``): the one place the config asks for a registry. Imported on
    the first ask, as the registries import torch and a bound's error is reported before that. KeyError for a key that
    takes no registry's names."""
    if key == "model.preset":
        from trainers.models import PRESETS
        return PRESETS
    if key == "rollout.engine":
        from trainers.engines import ENGINES
        return ENGINES
    if key == "task.name":
        from trainers.tasks import TASKS
        return TASKS
    if key == "optim.precision":
        from trainers.optim import PRECISIONS
        return PRECISIONS
    if key == "algo.loss":
        from trainers.losses import POLICY_LOSSES
        return POLICY_LOSSES
    if key == "algo.is_mode":
        from trainers.losses import IS_MODES
        return IS_MODES
    if key == "algo.seq_mask.mode":
        from trainers.config import SEQ_MASK_MODES
        return SEQ_MASK_MODES
    if key == "algo.advantage":
        from trainers.advantages import ADVANTAGES
        return ADVANTAGES
    if key == "dual.rule":
        from dcmdp.dual import DUAL_RULES
        return DUAL_RULES
    if key == "dual.penalty":
        from constraints.penalties import PENALTIES
        return PENALTIES
    if key == "dual.constraints[*].measure":
        from constraints.measures import MEASURES
        return MEASURES
    raise KeyError(f"no registry for the config key {key!r}")


def one_of(value: str, key: str, registry_key: Optional[str] = None) -> None:
    """``value`` of ``key`` must be a name of its registry (``registry(registry_key or key)``); the error names the
    nearest spelling, or the registry's names."""
    names = registry(registry_key or key)
    require(value in names, key, f"unknown {value!r}{nearest(value, list(names))}")


def _no_shared(names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return {}


@dataclass(frozen=True)
class ModeSelector:
    """A config key that picks one mode from a registry, and the knobs each mode owns.

    Mode ``m`` owns the block named after it beside the key (``algo.is_mode=tis`` reads ``algo.tis``, ``dual.rule=pid``
    reads ``dual.pid``; the one-config-class-per-mode convention) and the ``shared`` knobs that name it among their
    readers (``algo.clip_ratio_c``: ppo_clip and minirl). A knob is foreign when no selected mode reads it.
    """

    # Dotted path of the selecting field.
    key: str
    # Knobs (a dotted leaf or block) outside the mode-named blocks -> the modes that read them, given the names.
    shared: Callable[[tuple[str, ...]], dict[str, tuple[str, ...]]] = _no_shared
    # The modes' names when they are not those of the key's registry (``registry``), else None.
    choices: Optional[Callable[[], tuple[str, ...]]] = None

    def names(self) -> tuple[str, ...]:
        """The modes' names (asked at validation: the registries import torch, the dataclasses do not)."""
        return self.choices() if self.choices is not None else tuple(registry(self.key))

    @property
    def kind(self) -> str:
        """How messages call a mode of this key: ``is_mode``, ``loss``, ``seq_mask.mode``, ``rule``, ..."""
        return self.key.split(".", 1)[1]


def _reject_names() -> tuple[str, ...]:
    measures = registry("dual.constraints[*].measure")
    return ("none", *(n for n, m in measures.items() if m.kind == "token"))


def _rule_shared(names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    rules = registry("dual.rule")
    # the coupling limits are part of the projection set, which only rules that project lambda read
    return {"dual.coupling": tuple(n for n in names if rules[n].projects)}


# Every key that picks a mode with knobs of its own. rollout.engine is not one: an engine's block holds a deployment's
# settings, and a recipe keeps its vllm block when a CPU run or a test switches it to rollout.engine=torch.
MODE_SELECTORS: tuple[ModeSelector, ...] = (
    ModeSelector("algo.loss", lambda names: {"algo.clip_ratio_c": ("ppo_clip", "minirl")}),
    ModeSelector("algo.is_mode"),
    ModeSelector("algo.seq_mask.mode"),
    ModeSelector("algo.reject.measure", lambda names: {"algo.reject.bound": tuple(n for n in names if n != "none")},
                 choices=_reject_names),
    ModeSelector("algo.advantage"),
    ModeSelector("dual.rule", _rule_shared),
    ModeSelector("dual.penalty"),
)


def _leaves(node: Any, prefix: str) -> list[str]:
    if isinstance(node, DictConfig):
        return [leaf for k in node.keys() for leaf in _leaves(node._get_node(k), f"{prefix}.{k}")]
    return [prefix]


@functools.lru_cache(maxsize=None)
def mode_knobs(selector: ModeSelector, mode: str) -> tuple[str, ...]:
    """The dotted leaf keys mode ``mode`` of ``selector`` owns (``ModeSelector``)."""
    schema = OmegaConf.structured(RunConfig)
    parent = selector.key.rsplit(".", 1)[0]
    owned = []
    block = OmegaConf.select(schema, f"{parent}.{mode}", default=None)
    if isinstance(block, DictConfig):
        owned += _leaves(block, f"{parent}.{mode}")
    for knob, readers in selector.shared(selector.names()).items():
        if mode in readers:
            owned += _leaves(OmegaConf.select(schema, knob), knob)
    return tuple(owned)


def check_modes(cfg: RunConfig) -> None:
    """A knob of a mode that is not selected is an error naming the knob, its mode and the selected one.

    "Set" means: its value differs from the dataclass default. Whether a key was written in a file or an override
    cannot tell a choice apart: every run folder's config.yaml and every tune trial's run.yaml list all knobs of all
    modes at their resolved values, and must load again. A knob at its default does nothing under any mode, so an
    unselected mode's knob left at (or written at) its default is accepted; any other value would be silently
    ignored, which is what this check refuses. The same rule holds for a config built in python (``validate``).
    """
    default = RunConfig()
    for sel in MODE_SELECTORS:
        names = sel.names()
        selected = _get(cfg, sel.key)
        if selected not in names:  # validate's name checks name the bad value first
            continue
        read = set(mode_knobs(sel, selected))
        owners: dict[str, list[str]] = {}
        for mode in names:
            for knob in mode_knobs(sel, mode):
                owners.setdefault(knob, []).append(mode)
        for knob, modes in owners.items():
            if knob in read or _get(cfg, knob) == _get(default, knob):
                continue
            quoted = [f"'{m}'" for m in modes]
            who = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
            fix = f"{sel.key}={modes[0]}" if len(modes) == 1 else f"{sel.key} to one of them"
            raise config_error(knob, f"{knob} belongs to {sel.kind} {who}; the selected {sel.kind} is '{selected}' "
                                     f"({sel.key}), which does not read it; drop the key or set {fix}")

