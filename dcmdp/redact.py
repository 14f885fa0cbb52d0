"""Secrets kept out of what a run writes: values a config read from the environment, and credentials in URIs.

A config may take a token or password from the environment (``tracking.uri: https://me:${oc.env:PW}@host``). The
resolved value must reach the MLflow client, but not the MLflow params, ``config.yaml`` (also an artifact), a
checkpoint's stored config or the console. Importing this module (``dcmdp.config`` does) wraps OmegaConf's
``oc.env`` resolver so that every value it resolves is remembered; ``redact`` then replaces each remembered value,
and the password of any ``scheme://user:password@host`` URI, with ``***``. Light: no torch, no mlflow.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import OmegaConf
from omegaconf.resolvers import oc

MASK = "***"
# values shorter than this are not masked: masking "1" or "on" would garble every number and flag in the config
MIN_SECRET_CHARS = 4

_from_env: set[str] = set()
# scheme://user:password@ (a password may hold any character but '@', '/' and whitespace)
_URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):(?P<password>[^@/\s]+)@")


def _env(key: str, default: Any = oc._DEFAULT_MARKER_) -> Any:
    value = oc.env(key, default)
    if isinstance(value, str) and len(value) >= MIN_SECRET_CHARS:
        _from_env.add(value)
    return value


# OmegaConf >= 2.4 names it register_resolver (register_new_resolver is deprecated there)
getattr(OmegaConf, "register_resolver", OmegaConf.register_new_resolver)("oc.env", _env, replace=True)


def remember(value: str) -> None:
    """Treat ``value`` as a secret from now on (for values that reach a config other than through ``oc.env``)."""
    if len(value) >= MIN_SECRET_CHARS:
        _from_env.add(value)


def redact(text: str) -> str:
    """``text`` with every value resolved from the environment and every URI password replaced by ``***``."""
    for secret in sorted(_from_env, key=len, reverse=True):  # longest first: one secret may contain another
        text = text.replace(secret, MASK)
    return _URI_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", text)


def redact_values(values: dict[str, Any]) -> dict[str, Any]:
    """``redact`` of every string value (flattened params, tags)."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in values.items()}
