"""Small JSON files (a model's ``config.json``, a checkpoint's ``manifest.json``, a run's ``run.json``, a tracking
buffer's bookkeeping) read in time and memory bounded by their size: such a file is a few KiB nested a few levels,
and one larger, or nested deeper, is not one a model or a run wrote."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

MAX_SMALL_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
# a JSON string (to its closing quote, or to the end of the text if it has none) or a bracket: one linear pass
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.?)*(?:"|$)|[\[\]{}]', re.S)


def nesting_problem(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Optional[str]:
    """Why the JSON text ``raw`` is nested too deep to be read (brackets inside strings do not count), else None.
    Linear in its length and stops at the first bracket past ``max_depth``; most texts have too few brackets to
    look."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return None
    depth = 0
    for token in _JSON_TOKEN.finditer(raw):
        if token[0] in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return f"nested more than {max_depth} levels deep"
        elif token[0] in (b"]", b"}"):
            depth -= 1
    return None


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB" if limit >= 1 << 10 else f"{limit} bytes"


def read_small_json(path: str | Path, what: str = "a run writes a few KiB", limit: int = MAX_SMALL_JSON_BYTES) -> Any:
    """The JSON of ``path``, reading at most ``limit`` + 1 bytes: ValueError naming the file when it is larger
    (``what`` says why that is wrong) or nested more than ``MAX_JSON_DEPTH`` levels, or not JSON; OSError when it
    cannot be read."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{path.name} is larger than {_size(limit)} ({what})")
    if (why := nesting_problem(raw)) is not None:
        raise ValueError(f"{path.name} is {why}")
    return json.loads(raw)


def read_model_config(path: str | os.PathLike) -> dict:
    """The mapping in ``<path>/config.json``, read bounded (``read_small_json``) before transformers
    reads it whole and recursively: FileNotFoundError naming the directory when there is none, ValueError when it is
    larger than 1 MiB, nested too deep, not JSON or not a mapping."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no model at {os.fspath(path)!r} (expected a Hugging Face directory with config.json)")
    data = read_small_json(file, "a model's config.json is a few KiB")
    if not isinstance(data, dict):
        raise ValueError(f"config.json in {os.fspath(path)!r} holds a {type(data).__name__}, not a mapping")
    return data
