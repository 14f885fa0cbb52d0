"""Small JSON files (a model's ``config.json``, a checkpoint's ``manifest.json``, a run's ``run.json``) read in time
and memory bounded by their size: such a file is a few KiB, and one larger, or nested deeper than Python's JSON
decoder recurses, is not one a model or a run wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MAX_SMALL_JSON_BYTES = 1 << 20


def read_small_json(path: str | Path, what: str = "a run writes a few KiB") -> Any:
    """The JSON of ``path``, reading at most ``MAX_SMALL_JSON_BYTES`` + 1 bytes: ValueError naming the file when it is
    larger (``what`` says why that is wrong), nested too deep to decode, or not JSON; OSError when it cannot be
    read."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(MAX_SMALL_JSON_BYTES + 1)
    if len(raw) > MAX_SMALL_JSON_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_SMALL_JSON_BYTES >> 20} MiB ({what})")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError(f"{path.name} is nested too deep to be read") from None


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
