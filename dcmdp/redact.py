"""Secrets kept out of what a run writes, by construction: a config value is recorded as it was written, and a URI
without its credentials.

Two kinds of value may carry a secret:

- a value a config reads from the environment (``tracking.uri: https://me:${oc.env:PW}@host``,
  ``tracking.run_name: ${oc.env:JOB}``): every record of the config (``config.yaml``, the MLflow params, a
  checkpoint's config) holds the interpolation as written, ``${oc.env:PW}``, never its value. ``load_config``
  finds the interpolations before it resolves them and ``attach_written`` keeps them beside the resolved config;
  ``public_container`` builds the record from both.
- the credential parts of a URI: its userinfo (``user:password@``, or a token as user name) and the query or
  fragment parameters named like a credential (``token``, ``key``, ``secret``, ``password``, ``auth``,
  ``signature``, ``sig``, ``access_token``, ...). ``public_uri`` removes them structurally (``urllib.parse``), so
  no value is compared or replaced as a substring; an interpolation in their place (``${oc.env:PW}``) is kept,
  being no secret.

``redact`` is for free text the run does not compose itself (a third-party exception's message, which may repeat a
URI): it replaces the exact values known to be secret (values read from the environment, credentials of a URI
given to ``public_uri``) of at least ``MIN_SECRET_CHARS`` characters. Records of the config never go through it.
Light: no torch, no mlflow.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Iterator, Optional, Sequence
from urllib.parse import unquote, urlsplit

from omegaconf import OmegaConf
from omegaconf.resolvers import oc

MASK = "***"
# free-text scrubbing skips shorter values: masking "1" or "on" in an exception message would garble it
MIN_SECRET_CHARS = 4

_known: set[str] = set()


def _env(key: str, default: Any = oc._DEFAULT_MARKER_) -> Any:
    value = oc.env(key, default)
    if isinstance(value, str):
        remember(value)
    return value


# OmegaConf >= 2.4 names it register_resolver (register_new_resolver is deprecated there)
getattr(OmegaConf, "register_resolver", OmegaConf.register_new_resolver)("oc.env", _env, replace=True)


def remember(value: str) -> None:
    """Scrub ``value`` from free text from now on (``redact``)."""
    if len(value) >= MIN_SECRET_CHARS:
        _known.add(value)
        if (decoded := unquote(value)) != value and len(decoded) >= MIN_SECRET_CHARS:
            _known.add(decoded)


class ThirdPartyLogFilter(logging.Filter):
    """``redact`` of every log record of a library (urllib3, mlflow, ...), which may repeat a URI with its query or
    userinfo; the project's own messages name URIs through ``public_uri`` and pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("dcmdp", "trainers", "constraints")) and _known:
            try:
                record.msg, record.args = redact(record.getMessage()), None
            except Exception:  # a record whose arguments do not format: logging reports it as it would have
                pass
        return True


def filter_log_handlers() -> None:
    """Put ``ThirdPartyLogFilter`` on every handler of the root logger (once)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ThirdPartyLogFilter) for f in handler.filters):
            handler.addFilter(ThirdPartyLogFilter())


def redact(text: str) -> str:
    """Free text with every known secret value replaced by ``***`` (see the module docstring: never for records)."""
    for secret in sorted(_known, key=len, reverse=True):  # longest first: one secret may contain another
        text = text.replace(secret, MASK)
    return text


# ------------------------------------------------------------------------------------------------------------- URIs

# a whole interpolation: a reference to a value, not the value
_REF = re.compile(r"^\$\{[^{}]*\}$")
# a query or fragment parameter that holds a credential, by its name: a word of it (split at anything but letters and
# digits) is one of these, or contains one of the stems
_CREDENTIAL_WORDS = frozenset({"key", "sig", "signature", "auth", "authorization", "pass", "pwd", "session",
                               "sessionid", "cookie", "jwt", "bearer", "otp", "code", "private", "nonce", "sas"})
_CREDENTIAL_STEMS = ("token", "secret", "passw", "apikey", "credential", "privatekey", "accesskey")


def is_ref(text: str) -> bool:
    """``text`` is one interpolation (``${oc.env:NAME}``)."""
    return bool(_REF.match(text))


def credential_param(name: str) -> bool:
    """A query parameter named ``name`` holds a credential (``token``, ``api_key``, ``X-Amz-Signature``, ...)."""
    words = re.split(r"[^a-z0-9]+", unquote(name).lower())
    return any(w in _CREDENTIAL_WORDS or any(stem in w for stem in _CREDENTIAL_STEMS) for w in words)


def _authority_end(rest: str) -> int:
    """End of the authority in ``rest`` (the URI after ``scheme://``), reading a password that holds an unencoded
    '/', '?' or '#' (``alice:QWxh/ZGRp+bg==@host``) as part of the userinfo: an '@' after such a character ends the
    userinfo when the text before the first '/' is not ``host:port``."""
    end = next((i for i, ch in enumerate(rest) if ch in "/?#"), len(rest))
    at = rest.rfind("@")
    if at >= end:
        head = rest[:end]
        port = head.rpartition(":")[2] if ":" in head and "@" not in head else ""
        if port and not port.isdigit() and not head.startswith("["):
            return next((i for i, ch in enumerate(rest[at:], at) if ch in "/?#"), len(rest))
    return end


def _public_params(text: str, sep: str = "&") -> tuple[str, bool]:
    """``text`` (a query or fragment) without its credential parameters, and whether any was removed."""
    kept, removed = [], False
    for piece in text.split(sep):
        name, eq, value = piece.partition("=")
        if credential_param(name) and not (eq and is_ref(unquote(value))):
            removed = True
            if value:
                remember(unquote(value))
            continue
        kept.append(piece)
    return sep.join(kept), removed


def _split_outside_refs(text: str, sep: str) -> tuple[str, str, str]:
    """``text.partition(sep)`` at the first ``sep`` outside an interpolation (``${oc.env:PW}`` holds a ':')."""
    depth = 0
    for i, ch in enumerate(text):
        if text.startswith("${", i):
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
        elif ch == sep and not depth:
            return text[:i], sep, text[i + 1:]
    return text, "", ""


def split_credentials(uri: str) -> tuple[str, bool]:
    """(``uri`` without its credentials, whether it held any): see ``public_uri``."""
    if is_ref(uri.strip()) or "://" not in uri:
        return uri, False
    scheme, _, rest = uri.partition("://")
    end = _authority_end(rest)
    authority, tail = rest[:end], rest[end:]
    removed = False
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")
        user, colon, password = _split_outside_refs(userinfo, ":")
        keep = (is_ref(password) if colon else is_ref(user)) and (not user or is_ref(user) or colon)
        if not keep:
            removed = True
            # the secret is the password, or a lone user name (a token); a user name beside a password is not
            secret = password if colon else user
            if secret and not is_ref(secret):
                remember(secret)
            authority = host
    try:
        parts = urlsplit("x://h" + tail)
    except ValueError:
        return f"{scheme}://{authority}", True  # what follows cannot be read: keep none of it
    path, query, fragment = parts.path, parts.query, parts.fragment
    if query:
        query, gone = _public_params(query)
        removed |= gone
    if fragment and "=" in fragment:
        fragment, gone = _public_params(fragment)
        removed |= gone
    out = f"{scheme}://{authority}{path}"
    if query:
        out += f"?{query}"
    if fragment:
        out += f"#{fragment}"
    return out, removed


def public_uri(uri: Optional[str]) -> Optional[str]:
    """``uri`` without its credentials: no userinfo (``user:password@``, or a token as user name) unless the
    password (or the lone user) is an interpolation, and no query or fragment parameter named like a credential
    (``credential_param``) unless its value is an interpolation. Structural (``urllib.parse``), never a substring
    replacement; the parts removed are remembered for ``redact``."""
    return uri if uri is None else split_credentials(uri)[0]


def uri_problem(uri: str) -> Optional[str]:
    """Why a URI cannot be used as written (a password with an unencoded '/', '?', '#' or '@' makes its host
    unreadable; an http(s) URI with a query or fragment, which MLflow would send inside the request's path), in words,
    or None."""
    if "://" not in uri or is_ref(uri.strip()):
        return None
    rest = uri.partition("://")[2]
    plain_end = next((i for i, ch in enumerate(rest) if ch in "/?#"), len(rest))
    if _authority_end(rest) != plain_end:
        return ("its userinfo holds an unencoded '/', '?' or '#', so the host cannot be read: percent-encode them in "
                "the user name and password (%2F, %3F, %23), or better, read the password from the environment")
    authority = rest[:plain_end]
    if authority.count("@") > 1:
        return ("its userinfo holds an unencoded '@': percent-encode it (%40) in the user name and password")
    try:
        parts = urlsplit(uri)
        parts.port
    except ValueError as exc:
        return f"its port cannot be read ({exc})"
    if parts.scheme.lower() in ("http", "https") and (parts.query or parts.fragment or "?" in uri or "#" in uri):
        return ("an MLflow server's URI takes no query or fragment: MLflow appends its API path to the URI as "
                "written (GET /?token=.../api/2.0/mlflow/...), so neither would reach the server as one. Give a token "
                "through the environment variable MLFLOW_TRACKING_TOKEN (sent as a bearer header), a user and password "
                "through MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD or the URI's userinfo read from the "
                "environment (http://user:${oc.env:NAME}@host)")
    return None


def public_command(argv: list[str]) -> str:
    """The command line as a record may hold it: the program and its plain arguments, and of each ``key=value``
    override or ``--option=value`` only the key (a value may be a URI with a password, or a token)."""
    words = [os.path.basename(argv[0]) if argv else "python"]
    elided, after_option = [], False
    for arg in argv[1:]:
        if after_option:
            after_option = False
            continue
        if "=" in arg:
            elided.append(arg.split("=", 1)[0])
        elif arg.startswith("--") and arg not in ("--",):
            words.append(arg)
            after_option = True  # its value follows as the next word
            words.append("…")
        else:
            words.append(arg)
    return " ".join(words) + (f" (overrides, values not recorded: {', '.join(elided)})" if elided else "")


def public_overrides(overrides: Sequence[str], uri_keys: Sequence[str]) -> list[str]:
    """``key=value`` overrides as a record may hold them: as written (an interpolation stays ``${oc.env:PW}``, never
    its value), the value of each key of ``uri_keys`` (dotted, ``[i]`` read as ``.i``) by its ``public_uri``."""
    out = []
    for text in overrides:
        key, eq, value = str(text).partition("=")
        if eq and re.sub(r"\[(\d+)\]", r".\1", key.strip().lstrip("+~")) in uri_keys:
            text = f"{key}={public_uri(value)}"
        out.append(text)
    return out


# ------------------------------------------------------------------------------------------ values as written

_WRITTEN = "_dcmdp_written"


def interpolations(container: Any, prefix: str = "") -> dict[str, str]:
    """Every string leaf of ``container`` (``OmegaConf.to_container(node, resolve=False)``) that holds an
    interpolation, as ``{dotted key: text}`` (list elements by index: ``dual.constraints.0.tolerance``)."""
    out: dict[str, str] = {}
    if isinstance(container, dict):
        for k, v in container.items():
            out.update(interpolations(v, f"{prefix}{k}."))
    elif isinstance(container, list):
        for i, v in enumerate(container):
            out.update(interpolations(v, f"{prefix}{i}."))
    elif isinstance(container, str) and "${" in container:
        out[prefix[:-1]] = container
    return out


def attach_written(cfg: Any, written: dict[str, str]) -> None:
    """Keep ``written`` (``interpolations``) with the dataclass config ``cfg``: each entry on the innermost dataclass
    that holds its key, so a component's config (``cfg.tracking``) carries its own."""
    for key, text in written.items():
        obj, parts = cfg, key.split(".")
        i = 0
        while i < len(parts) - 1:
            child = _child(obj, parts[i])
            if not is_dataclass(child) and not (isinstance(child, list) and i + 1 < len(parts) - 1
                                                and is_dataclass(_child(child, parts[i + 1]))):
                break
            obj, i = child, i + 1
            if isinstance(obj, list):
                obj, i = _child(obj, parts[i]), i + 1
        if is_dataclass(obj):
            obj.__dict__.setdefault(_WRITTEN, {})[".".join(parts[i:])] = text


def _child(obj: Any, part: str) -> Any:
    if isinstance(obj, list):
        return obj[int(part)] if part.isdigit() and int(part) < len(obj) else None
    return getattr(obj, part, None)


def written(cfg: Any) -> dict[str, str]:
    """The interpolations kept with ``cfg`` and every dataclass inside it, by dotted key from ``cfg``."""
    out: dict[str, str] = {}
    for prefix, obj in _dataclasses(cfg, ""):
        out.update({f"{prefix}{k}": v for k, v in obj.__dict__.get(_WRITTEN, {}).items()})
    return out


def written_field(obj: Any, name: str) -> Optional[str]:
    """The interpolation field ``name`` of the dataclass ``obj`` was written as, or None."""
    return obj.__dict__.get(_WRITTEN, {}).get(name)


def _dataclasses(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if is_dataclass(obj):
        yield prefix, obj
        for f in fields(obj):
            yield from _dataclasses(getattr(obj, f.name), f"{prefix}{f.name}.")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from _dataclasses(item, f"{prefix}{i}.")


def public_container(cfg: Any, resolved: dict, uri_keys: tuple[str, ...] = (),
                     keep: Optional[Callable[[str], bool]] = None) -> dict:
    """``resolved`` (the plain nested container of ``cfg``'s values) as a record may hold it: each value written as
    an interpolation replaced by that interpolation (except the dotted keys ``keep`` accepts), and each key of
    ``uri_keys`` by its ``public_uri``. Nothing is compared or replaced as a substring."""
    for key, text in written(cfg).items():
        if keep is None or not keep(key):
            _set(resolved, key, text)
    for key in uri_keys:
        value = _get(resolved, key)
        if isinstance(value, str):
            _set(resolved, key, public_uri(value))
    return resolved


def _get(node: Any, key: str) -> Any:
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _set(node: Any, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    parent = _get(node, ".".join(path)) if path else node
    if isinstance(parent, dict) and leaf in parent:
        parent[leaf] = value
    elif isinstance(parent, list) and leaf.isdigit() and int(leaf) < len(parent):
        parent[int(leaf)] = value
