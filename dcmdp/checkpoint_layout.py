"""Where a checkpoint's files are, what marks one complete, and the checkpoint errors: the names every reader and
writer of ``<ckpt_dir>/step_<step:08d>/`` shares (dcmdp/checkpoint.py writes and reads checkpoints, dcmdp/run_folder.py
clears a run's), and the run identity a checkpoint carries."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from dcmdp.errors import InputError
from trainers.jsonfile import read_small_json

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, verified or loaded; the message names the path and why."""


class CheckpointInputError(CheckpointError, InputError):
    """A checkpoint the user named (``checkpoint.resume=<path>``) is missing or not valid: bad input, exit code 2."""


def checkpoint_run_uid(payload: dict[str, Any]) -> Optional[str]:
    """The run identity a checkpoint payload carries (None for checkpoints written before identities)."""
    run = payload.get("run")
    return run.get("uid") if isinstance(run, dict) else None


def manifest_run_uid(path: str | Path) -> Optional[str]:
    """The run identity in a checkpoint's manifest, read without loading ``state.pt`` (None when absent)."""
    try:
        return read_small_json(Path(path) / MANIFEST_FILE).get("run_uid")
    except (OSError, ValueError, AttributeError):
        return None


def _complete_or_not(ckpt_dir: Path) -> list[Path]:
    """``step_*`` directories of ``ckpt_dir``, highest step first (temporary directories excluded)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]
