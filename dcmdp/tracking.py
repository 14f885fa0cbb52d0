"""MLflow tracking that never stops a run and never loses a metric.

``Tracker`` talks to MLflow through ``MlflowClient`` with explicit run ids (no global active run).
Every call turns into a few *records* (create run, params, tags, metric, artifact, end). While the
tracking store answers, records are sent directly. When a call fails, the record and every later one
are appended to a JSONL *segment* in the buffer directory (``tracking.buffer_dir``, default
``<output_dir>/tracking_buffer/``) and sent later, in order: on the next call after a back-off
interval, at ``finish``, or by ``sync_buffer`` (``dcmdp sync``). Training never sees an exception.

Buffer layout (one segment per outage of one tracker; removed once fully sent)::

    <buffer_dir>/<time_ns>-<hex>.jsonl   records, one JSON object per line, first line a header
                                          with the tracking URI
    <buffer_dir>/<time_ns>-<hex>.sent    {"offset": n}: bytes of the segment already sent,
                                          replaced atomically after each successful request
    <buffer_dir>/<time_ns>-<hex>.files/  copies of artifacts logged during the outage
    <buffer_dir>/runs.json               placeholder run id ("local-<hex>") -> MLflow run id

A live tracker holds an exclusive ``flock`` on its segment, so ``sync_buffer`` from another process
skips it instead of sending it twice.

Crash window: if the process dies after MLflow stored a request but before the ``.sent`` offset was
replaced, the next sync sends that one request again (at most 1000 metrics). Records keep their
original timestamps, so a SQL backend store (sqlite, the default, and the usual server backends)
drops the repeat: its metric primary key is (run, key, timestamp, step, value). A file store would
keep the duplicate. Runs are created with the tag ``dcmdp.local_id``; a sync looks that tag up
before creating a run, so a creation whose answer was lost is not repeated either.

Network: unless already set, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=1`` and
``MLFLOW_HTTP_REQUEST_TIMEOUT=10`` are put in the environment (they are read per request), so a dead
server costs milliseconds (connection refused) and a hung one at most ~20 s, once per back-off
interval (``retry_interval`` doubling up to ``max_retry_interval``).

Non-finite metric values are sent as they are: MLflow stores NaN as NaN and +-inf as +-1.797e308.

Asynchronous metrics (``tracking.async_log``, default on): ``log_metrics`` stamps its records and hands them to
one sender thread, which sends or buffers them exactly as above, in call order; the training step never waits
on the store. Every other call (``start``, ``log_artifact``, ``set_tags``, ``skip_logged``, ``finish``), ``flush``
and reading ``buffered`` first wait until the queue is empty, so the order of records and every guarantee above
are those of the synchronous path. The training loop flushes before it writes a checkpoint, so a run killed
after a checkpoint has every metric of the steps that checkpoint covers in the store or on disk; at most the
queued steps after it are lost, and the resumed run logs those steps again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Optional
from urllib.parse import quote, unquote, urlparse

from omegaconf import OmegaConf

from dcmdp.config import ConfigError, TrackingConfig
from dcmdp.redact import public_command, public_uri, redact, split_credentials, uri_problem, written_field
from trainers.errors import not_a_regular_file
from trainers.jsonfile import MAX_JSON_DEPTH, nesting_problem, read_small_json

logger = logging.getLogger(__name__)

# MLflow's log_batch limits (mlflow/utils/validation.py).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000

LOCAL_ID_PREFIX = "local-"
LOCAL_ID_TAG = "dcmdp.local_id"
# MLflow 3's UI files the runs of an experiment without a kind under "Evaluation runs" (its GenAI layout); this
# experiment tag, which the UI reads and sets itself, makes it show them as model training runs.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
# MLflow 3.17's UI takes the layout from its own workflow switch (default: GenAI), which this query parameter of a
# link sets, whatever the experiment's tag: the link the run prints opens the run's charts in the training layout.
UI_LAYOUT = "workflowType=machine_learning"
# The port of ``mlflow ui`` when none is given: the link of a run in a local store.
UI_DEFAULT = "http://127.0.0.1:5000"
# The UI makes one chart section per metric-key prefix, in key order; the dual's overview is logged a second time
# under this prefix, which sorts before every other ("0" < "a" byte-wise and in the UI's locale order), so that it
# is the first section: per constraint lambda, its cap, D-hat and c side by side.
OVERVIEW = "0_dual"
_OVERVIEW_OF = {"lambda": "lambda", "measured": "measured", "tolerance": "tolerance"}
PARENT_RUN_TAG = "mlflow.parentRunId"
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# MLflow error codes that mean "this record can never be stored", as opposed to "try later".
_REJECTED_CODES = {"INVALID_PARAMETER_VALUE", "INVALID_STATE"}


def dual_overview(metrics: dict[str, Any], caps: dict[str, float]) -> dict[str, Any]:
    """The overview keys of one step's metrics: ``dual/lambda/<c>``, ``dual/measured/<c>``, ``dual/tolerance/<c>``
    again as ``0_dual/<c>/lambda``, ``0_dual/<c>/measured``, ``0_dual/<c>/tolerance``, and ``0_dual/<c>/lambda_max``
    (``caps[c]``, when finite) wherever lambda is logged."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        group, kind, name = (key.split("/", 2) + ["", ""])[:3]
        if group == "dual" and kind in _OVERVIEW_OF and name:
            out[f"{OVERVIEW}/{name}/{_OVERVIEW_OF[kind]}"] = value
            if kind == "lambda" and math.isfinite(caps.get(name, math.inf)):
                out[f"{OVERVIEW}/{name}/lambda_max"] = caps[name]
    return out


def ui_base(tracking_uri: str, local: str = UI_DEFAULT) -> str:
    """Where MLflow's UI of a store is served: the server of an http(s) URI (without credentials), else ``local``
    (``mlflow ui`` on its default port)."""
    parsed = urlparse(tracking_uri)
    return (parsed._replace(netloc=parsed.hostname + (f":{parsed.port}" if parsed.port else ""), params="", query="",
                            fragment="").geturl().rstrip("/")
            if parsed.scheme in ("http", "https") and parsed.hostname else local)


def ui_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's charts in MLflow's UI, in its training layout (``ui_base``)."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?{UI_LAYOUT}"


# The experiment page's switch from the runs table to their charts (MLflow 3.17's UI reads it from the link).
UI_CHARTS = "compareRunsMode=CHART"


def experiment_link(base: str, experiment_id: str) -> str:
    """Every run of the experiment side by side as charts, in the training layout: the dual's section first, as on a
    run's own page (``OVERVIEW``)."""
    return f"{base}/#/experiments/{experiment_id}/runs?{UI_CHARTS}&{UI_LAYOUT}"


def resolve_tracking_uri(cfg: TrackingConfig, output_dir: str | Path) -> str:
    """cfg.uri, else $MLFLOW_TRACKING_URI, else the local store of ``output_dir`` (``local_store_uri``).

    MLflow 3 makes sqlite its default store (the file store is deprecated); it needs no server.
    Artifacts of the local store go to ``mlartifacts`` beside its database (see ``Tracker``).
    """
    if cfg.uri:
        return cfg.uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return local_store_uri(output_dir)


STORE_FILE = "mlflow.db"


def local_store_folder(output_dir: str | Path) -> Path:
    """Where the local store of a run in ``output_dir`` lives: the folder that holds the run folders
    (``outputs/default`` and ``outputs/pid`` share ``outputs/mlflow.db``), so that every run started beside another
    is in one store, and ``dcmdp report`` and ``mlflow ui`` show them side by side, experiments grouping them, as
    MLflow's own default store does for the runs of one working folder. A run folder that holds a store of its own
    keeps logging there (a folder given one on purpose, as ``benchmarks/run.py`` does per cell), so a resumed run
    always continues its MLflow run in the store that holds it. Depends on ``output_dir`` alone, not on the working
    directory: a run resumed from elsewhere finds its store."""
    out = Path(output_dir).resolve()
    try:
        own = (out / STORE_FILE).is_file()
    except OSError:  # a folder the user cannot read holds no store of its own to keep
        own = False
    return out if own else out.parent


def local_store_uri(output_dir: str | Path) -> str:
    """``sqlite:///<abs path>/mlflow.db`` in ``local_store_folder(output_dir)``, the path percent-encoded: SQLAlchemy
    decodes it, so a folder whose name holds ``?``, ``#``, ``%`` or spaces is the folder the database goes to."""
    return f"sqlite:///{quote(str(local_store_folder(output_dir) / STORE_FILE))}"


def sqlite_store_file(uri: str) -> Optional[Path]:
    """The database file of a ``sqlite:///`` URI (percent-decoded), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///"):])
    return Path(path) if path and path != ":memory:" else None


def check_sqlite_store(cfg: TrackingConfig, output_dir: str | Path) -> None:
    """ConfigError naming the key (``output_dir`` for the local store, whose file lies beside the run folders) and
    the path when the run's sqlite store cannot be written (``sqlite_store_problem``)."""
    why = sqlite_store_problem(resolve_tracking_uri(cfg, output_dir))
    if why is not None:
        source = tracking_uri_source(cfg)
        key = "output_dir" if source == "the local store" else source
        raise ConfigError(f"config error at '{key}': {why}; fix the path, or name another store with "
                          f"tracking.uri=sqlite:////path/to/mlflow.db")


def sqlite_store_problem(uri: str) -> Optional[str]:
    """Why the sqlite database of ``uri`` cannot be a store (a directory or a device where the file goes, a file or
    folder the user running dcmdp cannot write, a read-only file system), naming the path; None when it can, or when
    ``uri`` is not a sqlite one. SQLite writes a journal beside the file, so its folder must be writable too. Checked
    before a run starts: MLflow retries such a store for minutes (a 2-step run took 220 s) without naming it."""
    db = sqlite_store_file(uri)
    if db is None:
        return None
    db = db.absolute()
    effective = os.access in os.supports_effective_ids
    if db.exists() or db.is_symlink():
        why = not_a_regular_file(db)
        if why is not None:
            return f"the MLflow store {db} {why}; a sqlite store is a file"
        if not os.access(db, os.R_OK | os.W_OK, effective_ids=effective):
            return f"the MLflow store {db} cannot be written (permission denied or a read-only file system)"
    folder = next((p for p in db.parents if p.exists()), None)
    if folder is None or not folder.is_dir():
        return f"the folder of the MLflow store {db} is not a folder ({folder})"
    if not os.access(folder, os.W_OK | os.X_OK, effective_ids=effective):
        return (f"the folder {folder} of the MLflow store {db} cannot be written (permission denied or a read-only "
                f"file system): SQLite creates the file and its journal there")
    return None


# The schemes MLflow's own tracking stores serve (its documented backends): REST servers, Databricks, and the
# SQLAlchemy databases, whose URIs may name a driver (``postgresql+psycopg2://``). Plugins add schemes through the
# ``mlflow.tracking_store`` entry point group. The file store is left out on purpose: MLflow 3 keeps it behind
# MLFLOW_ALLOW_FILE_STORE. tests/test_tracking_inputs.py compares this list with the installed MLflow's.
MLFLOW_STORE_SCHEMES = ("databricks", "databricks-uc", "http", "https", "mssql", "mysql", "postgresql", "sqlite", "uc")
_DATABASE_SCHEMES = ("mssql", "mysql", "postgresql", "sqlite")
_BARE_SCHEMES = ("databricks", "databricks-uc", "uc")  # URIs that are the scheme's name alone
MAX_EXPERIMENT_NAME = 500  # MLflow stores experiment names of up to 500 characters
MAX_RUN_NAME = 250  # and run names of up to 250


def tracking_store_schemes() -> list[str]:
    """Every scheme a tracking URI may use here: MLflow's own stores and those of installed plugins."""
    from importlib.metadata import entry_points

    plugins = {ep.name for ep in entry_points(group="mlflow.tracking_store")}
    return sorted(set(MLFLOW_STORE_SCHEMES) | plugins)


def store_scheme(uri: str) -> str:
    """The store a tracking URI selects: ``databricks`` alone, a database without its driver suffix, else the
    URI's scheme (``""`` for a plain path)."""
    if uri in _BARE_SCHEMES:
        return uri
    scheme = urlparse(uri).scheme
    base = scheme.split("+", 1)[0]
    return base if base in _DATABASE_SCHEMES else scheme


def check_tracking_uri(uri: str, source: str) -> None:
    """Raise ConfigError naming ``source`` (the config key or variable the URI came from) when MLflow would not
    track to the URI: no store serves its scheme, or it is a file store (``file://`` or a plain path), which
    MLflow 3 refuses to open unless ``MLFLOW_ALLOW_FILE_STORE`` is set. Such a run would create no run, log no
    params, and buffer its metrics for a ``dcmdp sync`` that could never send them."""
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE  # MLflow's documented variables

    if why := uri_problem(uri):
        raise ConfigError(f"config error at '{source}': the tracking URI {public_uri(uri)!r} cannot be used: {why}")
    scheme = urlparse(uri).scheme
    file_store = uri not in _BARE_SCHEMES and scheme in ("", "file") or (len(scheme) == 1 and uri[1:3] in (":\\", ":/"))  # a Windows drive
    usable = tracking_store_schemes()
    hint = f"use one of the schemes {', '.join(repr(s) for s in usable)}, e.g. sqlite:///path/to/mlflow.db"
    if file_store and not MLFLOW_ALLOW_FILE_STORE.get():
        raise ConfigError(f"config error at '{source}': {public_uri(uri)!r} is a file store, which MLflow "
                          f"{_mlflow_version()} refuses to open (maintenance mode; MLFLOW_ALLOW_FILE_STORE=true "
                          f"overrides it); {hint}")
    if not file_store and store_scheme(uri) not in usable:
        raise ConfigError(f"config error at '{source}': MLflow cannot use the tracking URI {public_uri(uri)!r} (scheme "
                          f"{scheme!r}); {hint}")


def check_tracking_config(cfg: TrackingConfig, output_dir: str | Path) -> None:
    """What MLflow will refuse later, refused before the run starts (ConfigError naming the key): the tracking URI
    (``check_tracking_uri``), an experiment or run name MLflow rejects, and a parent run id that is not a run id.
    The rules are the project's own, after MLflow's documented limits, so a new MLflow release cannot change the
    message or skip a check."""
    check_tracking_uri(resolve_tracking_uri(cfg, output_dir), tracking_uri_source(cfg))
    if not cfg.experiment:
        raise ConfigError("config error at 'tracking.experiment': an empty name is no name")
    if not cfg.experiment.strip():
        raise ConfigError(f"config error at 'tracking.experiment': a blank name ({cfg.experiment!r}) is no name")
    if len(cfg.experiment) > MAX_EXPERIMENT_NAME:
        raise ConfigError(f"config error at 'tracking.experiment': {len(cfg.experiment)} characters; MLflow keeps at "
                          f"most {MAX_EXPERIMENT_NAME}")
    if cfg.run_name is not None and len(cfg.run_name) > MAX_RUN_NAME:
        raise ConfigError(f"config error at 'tracking.run_name': {len(cfg.run_name)} characters; MLflow keeps at "
                          f"most {MAX_RUN_NAME}")
    if cfg.parent_run_id is not None and not re.fullmatch(r"[0-9a-zA-Z_\-]{1,256}", cfg.parent_run_id):
        raise ConfigError(f"config error at 'tracking.parent_run_id': {cfg.parent_run_id!r} is not an MLflow run id")


def _mlflow_version() -> str:
    from importlib.metadata import version

    return version("mlflow")


def tracking_uri_source(cfg: TrackingConfig) -> str:
    """The config key or environment variable ``resolve_tracking_uri`` takes the URI from."""
    if cfg.uri:
        return "tracking.uri"
    return "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "the local store"


def provenance_tags() -> dict[str, str]:
    """Where a run came from, as MLflow tags: the command line, the dcmdp / torch / transformers / vllm versions
    (read from the installed packages' metadata: vllm is not imported), and the git commit of the dcmdp checkout
    (with ``dcmdp.git_dirty``) when the code runs from one."""
    from importlib.metadata import PackageNotFoundError, version

    tags = {"dcmdp.command": public_command(sys.argv)}  # an override's value may be a credential
    for package in ("dcmdp", "torch", "transformers", "vllm"):
        try:
            tags[f"dcmdp.version.{package}"] = version(package)
        except PackageNotFoundError:
            tags[f"dcmdp.version.{package}"] = "not installed"
    root = Path(__file__).resolve().parent.parent
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        if git("rev-parse", "--show-toplevel") == str(root):
            tags["mlflow.source.git.commit"] = git("rev-parse", "HEAD")
            tags["dcmdp.git_dirty"] = str(bool(git("status", "--porcelain", "--untracked-files=no"))).lower()
    except (OSError, subprocess.SubprocessError):
        pass  # not a checkout, or no git
    return tags


def resolve_buffer_dir(cfg: TrackingConfig, output_dir: str | Path) -> Path:
    return Path(cfg.buffer_dir) if cfg.buffer_dir else Path(output_dir) / "tracking_buffer"


def _set_http_defaults() -> None:
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _is_rejection(exc: BaseException) -> bool:
    """True when the store answered that the record itself is invalid (retrying cannot help)."""
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.error_code in _REJECTED_CODES


def _chunks(items: dict[str, str], size: int) -> list[dict[str, str]]:
    keys = list(items)
    return [{k: items[k] for k in keys[i:i + size]} for i in range(0, len(keys), size)]


def _clip(kind: str, values: dict[str, Any], limit: int) -> dict[str, str]:
    out = {}
    for k, v in values.items():
        s = str(v)
        if len(s) > limit:
            logger.warning("%s %r is %d characters long; MLflow keeps %d, the rest is cut", kind, k, len(s), limit)
            s = s[:limit]
        out[str(k)] = s
    return out


# --------------------------------------------------------------------------------------------------
# Segments: append-only JSONL files with a durable sent-offset.

# Bounds of one buffer line, so that reading a buffer takes time and memory linear in its size whatever its bytes.
# The longest record a tracker writes is a chunk of 100 params of at most 6,000 characters each (under 4 MiB even
# with every character escaped), nested 2 levels deep. A longer or deeper line was not written by a tracker: it is
# skipped like a line that is not JSON (``pending``), read in chunks, never whole, and never parsed recursively.
MAX_RECORD_BYTES = 16 << 20
MAX_RECORD_DEPTH = MAX_JSON_DEPTH


def _parse_record(line: bytes) -> tuple[Optional[dict], str]:
    """(the record of one complete buffer line, or None and why it is none): JSON nested at most
    ``MAX_RECORD_DEPTH`` levels, a mapping with a string ``t``. Never raises."""
    why = nesting_problem(line, MAX_RECORD_DEPTH)
    if why is not None:
        return None, f"{why} (a record is 2)"
    try:
        record = json.loads(line)  # bytes: a line that is not UTF-8 raises UnicodeDecodeError
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        return None, f"not JSON ({type(exc).__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("t"), str):
        return None, "not a record (a JSON object with a string 't')"
    return record, ""


def _read_line(f: IO[bytes]) -> tuple[Optional[bytes], int, bool]:
    """(the next line of ``f``, or None for one longer than ``MAX_RECORD_BYTES``; the bytes it spans; whether it
    ends with a newline). An over-long line is read on to its end in 1 MiB chunks, so memory stays bounded."""
    line = f.readline(MAX_RECORD_BYTES + 1)
    if len(line) <= MAX_RECORD_BYTES or line.endswith(b"\n"):
        return line, len(line), line.endswith(b"\n")
    size = len(line)
    while True:
        chunk = f.readline(1 << 20)
        size += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return None, size, bool(chunk)


class _Segment:
    """One buffer file, locked by its owner; ``offset`` is the number of bytes already sent."""

    def __init__(self, path: Path, fh: IO[bytes], offset: int):
        self.path, self.fh, self.offset = path, fh, offset
        self.sent_path = path.with_suffix(".sent")
        self.files_dir = path.with_suffix(".files")
        self._n_files = 0
        # complete lines that are not JSON (a damaged buffer): skipped when sending, counted; ``scanned`` is the end
        # of the last complete line ``pending`` read
        self.unreadable = 0
        self.scanned = offset

    @classmethod
    def create(cls, buffer_dir: Path, tracking_uri: str, as_written: Optional[str] = None) -> "_Segment":
        """A new segment whose header names the URI without its credentials (``public_uri``), whether it had some,
        and the config's interpolation of it (``as_written``, e.g. ``http://me:${oc.env:PW}@host``), from which
        ``sync_report`` reads the credentials again from the environment."""
        buffer_dir.mkdir(parents=True, exist_ok=True)
        path = buffer_dir / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.jsonl"
        fh = open(path, "ab")
        fcntl.flock(fh, fcntl.LOCK_EX)
        seg = cls(path, fh, 0)
        public, removed = split_credentials(tracking_uri)
        seg.append({"t": "header", "uri": public, "created": _now_ms(),
                    **({"credentials_removed": True} if removed else {}),
                    **({"uri_as_written": public_uri(as_written)} if as_written else {})})
        seg.mark_sent(seg.fh.tell())  # the header is never sent
        return seg

    @classmethod
    def open_existing(cls, path: Path) -> Optional["_Segment"]:
        """Lock a leftover segment; None when a live tracker holds it or it was just removed."""
        try:
            fh = open(path, "ab")
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return None
        try:
            # The owner may have drained and unlinked it between our open() and flock().
            if os.stat(path).st_ino != os.fstat(fh.fileno()).st_ino:
                raise FileNotFoundError
        except FileNotFoundError:
            fh.close()
            return None
        seg = cls(path, fh, 0)
        try:
            seg.offset = int(read_small_json(seg.sent_path, "a progress file holds one offset", 1 << 10)["offset"])
        except FileNotFoundError:
            seg.offset = 0
        except (ValueError, KeyError, TypeError) as exc:  # damaged: where sending stopped is unknown
            fh.close()
            raise _UnreadableProgress(f"{seg.sent_path} ({type(exc).__name__}: {exc})") from None
        if seg.files_dir.is_dir():
            seg._n_files = sum(1 for _ in seg.files_dir.iterdir())
        return seg

    def append(self, record: dict) -> None:
        if record["t"] == "artifact":
            record = dict(record, path=str(self._keep_copy(Path(record["path"]))))
        self.fh.write(json.dumps(record).encode() + b"\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def _keep_copy(self, src: Path) -> Path:
        """Artifacts are copied so that later edits or cleanup of the original change nothing."""
        dst = self.files_dir / str(self._n_files) / src.name
        self._n_files += 1
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
        return dst

    def header(self) -> dict:
        """The first line's record; {} when it is damaged (the segment then names no URI, and sync says so)."""
        with open(self.path, "rb") as f:
            line, _, complete = _read_line(f)
        header = _parse_record(line)[0] if line is not None and complete else None
        return header or {}

    def pending(self) -> Iterator[tuple[int, dict]]:
        """(end offset, record) of every complete unsent line, read one bounded line at a time; a torn last line is
        not a record. A line that is not a record (not JSON, longer than ``MAX_RECORD_BYTES``, nested deeper than
        ``MAX_RECORD_DEPTH``) is skipped with a warning naming its line and counted: one never blocks the rest."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            pos = self.offset
            line_no: Optional[int] = None  # counted only once a bad line needs naming
            while True:
                line, size, complete = _read_line(f)
                if not complete:
                    break
                start, pos = pos, pos + size
                if line_no is not None:
                    line_no += 1
                self.scanned = pos
                record, why = _parse_record(line) if line is not None else \
                    (None, f"longer than {MAX_RECORD_BYTES >> 20} MiB ({size} bytes)")
                if record is None:
                    if line_no is None:
                        line_no = _line_number(self.path, start)
                    logger.warning("skipping line %d of %s (byte %d): %s", line_no, self.path, start, why)
                    self.unreadable += 1
                    continue
                yield pos, record

    def mark_sent(self, offset: int) -> None:
        tmp = self.sent_path.with_suffix(".sent.tmp")
        with open(tmp, "w") as f:
            json.dump({"offset": offset}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.sent_path)
        self.offset = offset

    def drained(self) -> bool:
        return self.offset >= os.fstat(self.fh.fileno()).st_size

    def remove(self) -> None:
        """Unlink the records before the offset file: an orphan offset file is harmless."""
        self.path.unlink(missing_ok=True)
        self.sent_path.unlink(missing_ok=True)
        shutil.rmtree(self.files_dir, ignore_errors=True)
        self.close()

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.close()  # releases the lock


def _line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset`` of ``path``, counted in 1 MiB chunks."""
    count, left = 1, offset
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count


def _segments(buffer_dir: Path) -> list[Path]:
    return sorted(buffer_dir.glob("*.jsonl")) if buffer_dir.is_dir() else []


# --------------------------------------------------------------------------------------------------
# Sending records.


class _UnreadableProgress(Exception):
    """A segment's ``.sent`` file (how far it was sent) cannot be read."""


class _Blocked(Exception):
    """A record refers to a placeholder run that no earlier record creates yet."""


# sqlite store files a sender has seen; MLflow's db logger goes quiet about a store once its file is gone: a request
# already under way when the file goes makes MLflow log SQLAlchemy's traceback before it raises, and the failure
# is reported once, as a deleted store (``_Sender._check_store``). One filter for the process, however many senders.
_SEEN_STORES: set[Path] = set()


def _no_deleted_store(record: logging.LogRecord) -> bool:
    return all(path.exists() for path in list(_SEEN_STORES))


logging.getLogger("mlflow.store.db.utils").addFilter(_no_deleted_store)


@contextlib.contextmanager
def _store_creation_lock(db: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the folder of the sqlite store ``db`` while its tables are created or migrated.
    Two runs started at once beside each other share one new store; MLflow creates its tables without a lock, so
    one of them failed (``duplicate column name``, ``table already exists``) and logged nothing live. The second
    now waits for the first's creation and finds the tables made. The folder, not a file in it, is locked: no file
    is added beside the user's runs."""
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(db.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class _Sender:
    """Sends records in order through one MlflowClient; remembers placeholder -> MLflow run ids."""

    tracking_uri: str
    buffer_dir: Path
    client: Any = None
    run_map: dict[str, str] = field(default_factory=dict)
    _experiments: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_map.update(_read_run_map(self.buffer_dir))
        if public_uri(self.tracking_uri) != self.tracking_uri:
            # MLflow prints "View run ... at: <url>" with the URI's credentials: a secret must not reach the console
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        self._sqlite_file = sqlite_store_file(self.tracking_uri)
        self._sqlite_seen = False

    def _check_store(self) -> None:
        """A sqlite store file deleted under a live run fails like an unreachable server (so the records are
        buffered), instead of SQLAlchemy writing to the unlinked file and logging a traceback per call."""
        if self._sqlite_file is None:
            return
        if self._sqlite_file.exists():
            if not self._sqlite_seen:
                self._sqlite_seen = True
                _SEEN_STORES.add(self._sqlite_file)
        elif self._sqlite_seen:
            raise FileNotFoundError(errno.ENOENT, "the sqlite tracking store was deleted", str(self._sqlite_file))

    def _client(self) -> Any:
        if self.client is None:
            from mlflow.tracking import MlflowClient

            if self._sqlite_file is None:
                self.client = MlflowClient(tracking_uri=self.tracking_uri)
            else:
                with _store_creation_lock(self._sqlite_file):  # the client creates or migrates the store's tables
                    self.client = MlflowClient(tracking_uri=self.tracking_uri)
        return self.client

    def resolve(self, run: str) -> str:
        if not run.startswith(LOCAL_ID_PREFIX):
            return run
        if run not in self.run_map:
            self.run_map.update(_read_run_map(self.buffer_dir))
        if run not in self.run_map:
            raise _Blocked(run)
        return self.run_map[run]

    def send(self, records: Iterable[tuple[int, dict]]) -> Iterator[tuple[int, int]]:
        """Send in order; after each stored request yield (end offset of the last record it held,
        metrics in it). Consecutive metrics of one run share a log_batch request. Raises on
        failures worth retrying; drops (with a warning) only what the store rejects as invalid. Each request
        first checks that a sqlite store is still there (``_metrics``, ``_one``)."""
        group: list[dict] = []
        group_end = 0
        for end, rec in records:
            if group and (rec["t"] != "metric" or rec["run"] != group[0]["run"]
                          or len(group) == MAX_METRICS_PER_BATCH):
                yield group_end, self._metrics(group)
                group = []
            if rec["t"] == "metric":
                group.append(rec)
                group_end = end
                continue
            try:
                self._one(rec)
            except Exception as exc:
                if not _is_rejection(exc):
                    raise
                logger.warning("MLflow rejected a %r record of run %s: %s; dropped", rec["t"],
                               rec.get("run", rec.get("id")), exc)
            yield end, 0
        if group:
            yield group_end, self._metrics(group)

    def _metrics(self, recs: list[dict]) -> int:
        from mlflow.entities import Metric

        run_id = self.resolve(recs[0]["run"])
        metrics = [Metric(r["key"], float(r["value"]), int(r["ts"]), int(r["step"])) for r in recs]
        client = self._client()
        self._check_store()  # before every request: the file can go while a send is under way
        try:
            client.log_batch(run_id, metrics=metrics)
            return len(metrics)
        except Exception as exc:
            self._check_store()  # deleted during the request: report it as such
            if not _is_rejection(exc):
                raise
        sent = 0  # one bad metric must not drop the batch: send them one by one
        for m in metrics:
            try:
                client.log_batch(run_id, metrics=[m])
                sent += 1
            except Exception as exc:
                if not _is_rejection(exc):
                    raise
                logger.warning("MLflow rejected metric %s=%r at step %d of run %s: %s", m.key, m.value, m.step,
                               run_id, exc)
        return sent

    def _one(self, rec: dict) -> None:
        self._check_store()
        kind = rec["t"]
        if kind == "header":
            return
        if kind == "run":
            self._create_run(rec)
            return
        client = self._client()
        run_id = self.resolve(rec["run"])
        if kind == "params":
            self._params(run_id, rec["params"])
        elif kind == "tags":
            self._tags(run_id, rec["tags"])
        elif kind == "reopen":
            client.update_run(run_id, status="RUNNING")
        elif kind == "artifact":
            try:
                client.log_artifact(run_id, rec["path"], rec.get("artifact_path"))
            except FileNotFoundError:
                logger.warning("artifact %s of run %s no longer exists; not logged", rec["path"], run_id)
        elif kind == "end":
            client.set_terminated(run_id, status=rec["status"], end_time=rec["end_time"])
        else:
            logger.warning("unknown tracking record kind %r; skipped", kind)

    def _params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        client = self._client()
        try:
            client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
            return
        except Exception as exc:
            if not _is_rejection(exc):
                raise
        # MLflow params are immutable: on a resumed run, keep the stored values and log only new keys.
        stored = client.get_run(run_id).data.params
        changed = sorted(k for k, v in params.items() if k in stored and stored[k] != v)
        if changed:
            logger.warning("run %s already has different values for params %s; MLflow params cannot change, "
                           "the stored values are kept", run_id, changed)
        new = [Param(k, v) for k, v in params.items() if k not in stored]
        if new:
            client.log_batch(run_id, params=new)

    def _tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._client().log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def _experiment_id(self, name: str, artifact_location: Optional[str]) -> str:
        if name in self._experiments:
            return self._experiments[name]
        client = self._client()
        exp = client.get_experiment_by_name(name)
        if exp is None:
            try:
                exp_id = client.create_experiment(name, artifact_location=artifact_location, tags=EXPERIMENT_TAGS)
            except Exception:
                exp = client.get_experiment_by_name(name)  # created by someone else meanwhile
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
            for k, v in EXPERIMENT_TAGS.items():
                if k not in exp.tags:  # an experiment created before this tag, or by someone else
                    client.set_experiment_tag(exp_id, k, v)
        self._experiments[name] = exp_id
        return exp_id

    def _create_run(self, rec: dict) -> None:
        local_id = rec["id"]
        if local_id in self.run_map:
            return
        client = self._client()
        exp_id = self._experiment_id(rec["experiment"], rec.get("artifact_location"))
        # A creation whose answer was lost left a run carrying our tag: adopt it instead of a second run.
        found = client.search_runs([exp_id], filter_string=f"tags.`{LOCAL_ID_TAG}` = '{local_id}'", max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            tags = dict(rec.get("tags") or {}, **{LOCAL_ID_TAG: local_id})
            run_id = client.create_run(exp_id, start_time=rec["start_time"], tags=tags,
                                       run_name=rec.get("run_name")).info.run_id
        self.run_map[local_id] = run_id
        if self.buffer_dir.is_dir():  # a healthy run leaves no buffer directory behind
            _write_run_map(self.buffer_dir, {local_id: run_id})


def _read_run_map(buffer_dir: Path) -> dict[str, str]:
    try:
        found = read_small_json(buffer_dir / "runs.json", "a run map holds a few run ids", MAX_RECORD_BYTES)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # unreadable (a failing disk, damaged bytes): the tracker must still start
        logger.warning("cannot read %s (%s); buffered records that name a placeholder run id may not be sendable",
                       buffer_dir / "runs.json", exc)
        return {}
    return found if isinstance(found, dict) else {}


def _write_run_map(buffer_dir: Path, new: dict[str, str]) -> None:
    buffer_dir.mkdir(parents=True, exist_ok=True)
    merged = {**_read_run_map(buffer_dir), **new}
    tmp = buffer_dir / f"runs.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(merged, indent=1))
    os.replace(tmp, buffer_dir / "runs.json")


def _drain(segment: _Segment, sender: _Sender) -> int:
    """Send a segment's unsent records, advancing its offset after each stored request."""
    sent = 0
    for end, n in sender.send(segment.pending()):
        segment.mark_sent(end)
        sent += n
    return sent


UNREADABLE_SUFFIX = ".unreadable"


@dataclass
class SyncReport:
    """What ``sync_report`` sent, and one line per buffer file that still holds something it did not send."""

    sent: int = 0
    remaining: list[str] = field(default_factory=list)


def sync_buffer(buffer_dir: str | Path, tracking_uri: Optional[str] = None, known: tuple[str, ...] = ()) -> int:
    """``sync_report``'s count of metrics sent."""
    return sync_report(buffer_dir, tracking_uri, known).sent


def _segment_uri(header: dict, known: tuple[str, ...]) -> Optional[str]:
    """The URI to send a segment to: its header's, with the credentials the header leaves out read again from the
    config's interpolation (``uri_as_written``, resolved now), $MLFLOW_TRACKING_URI or a ``known`` URI whose
    ``public_uri`` is the header's."""
    uri = header.get("uri")
    if not isinstance(uri, str) or not uri or not header.get("credentials_removed"):
        return uri or None
    candidates = list(known)
    if isinstance(written := header.get("uri_as_written"), str):
        try:
            candidates.insert(0, OmegaConf.create({"uri": written}).uri)
        except Exception:  # a variable no longer set: the other candidates, or the URI without credentials
            pass
    candidates.append(os.environ.get("MLFLOW_TRACKING_URI") or "")
    return next((c for c in candidates if c and public_uri(c) == uri), uri)


def sync_report(buffer_dir: str | Path, tracking_uri: Optional[str] = None, known: tuple[str, ...] = ()) -> SyncReport:
    """Replay every leftover segment in ``buffer_dir`` (oldest first); report the metrics sent and what remains.

    ``tracking_uri`` overrides the URI recorded in each segment. Segments held by a live tracker are
    skipped. Fully sent segments are removed, so a second sync sends nothing. A segment with lines that are
    not JSON is sent without them and then kept as ``<segment>.unreadable`` for inspection; such files stay
    listed as remaining until removed by hand.
    """
    _set_http_defaults()
    buffer_dir = Path(buffer_dir)
    senders: dict[str, _Sender] = {}
    report = SyncReport()
    for path in _segments(buffer_dir):
        try:
            seg = _Segment.open_existing(path)
        except _UnreadableProgress as exc:
            logger.warning("segment %s: its progress file %s is unreadable; skipped", path, exc)
            report.remaining.append(f"{path}: its progress file {exc} is unreadable, so where sending stopped is "
                                    f"unknown; delete that file to send the whole segment again (records sent "
                                    f"before are then sent twice)")
            continue
        if seg is None:
            logger.info("segment %s is in use by a running tracker; skipped", path)
            report.remaining.append(f"{path}: in use by a running tracker (sent by it, or by a sync once it ends)")
            continue
        try:
            uri = tracking_uri or _segment_uri(seg.header(), known)
            if not uri:
                logger.warning("segment %s names no tracking URI; pass one", path)
                report.remaining.append(f"{path}: names no tracking URI; pass one with --tracking-uri")
                continue
            sender = senders.setdefault(uri, _Sender(uri, buffer_dir))
            report.sent += _drain(seg, sender)
            if seg.unreadable:
                kept = path.with_name(path.name + UNREADABLE_SUFFIX)
                shutil.copy2(path, kept)
                logger.warning("%d unreadable line(s) in %s could not be sent; the segment is kept as %s",
                               seg.unreadable, path, kept)
                seg.mark_sent(max(seg.offset, seg.scanned))  # every readable record up to there was sent
            if seg.drained():
                seg.remove()
            else:
                left = path.stat().st_size - seg.offset
                report.remaining.append(f"{path}: {left} bytes after byte {seg.offset} not sent (a record cut short "
                                        f"when its writer died)")
        except _Blocked as exc:
            logger.warning("segment %s refers to run %s, which no earlier segment creates; kept", path, exc)
            report.remaining.append(f"{path}: refers to run {exc}, which no earlier segment creates")
        except Exception as exc:
            logger.warning("sync of %s stopped at byte %d: %s; the rest stays buffered", path, seg.offset,
                           redact(str(exc)))
            report.remaining.append(f"{path}: stopped at byte {seg.offset} of {path.stat().st_size} "
                                    f"({type(exc).__name__}: {redact(str(exc))[:200]}); the rest stays buffered")
        finally:
            seg.close()
    if buffer_dir.is_dir():
        for kept in sorted(buffer_dir.glob(f"*.jsonl{UNREADABLE_SUFFIX}")):
            report.remaining.append(f"{kept}: a segment with unreadable lines, kept for inspection (its readable "
                                    f"records were sent); remove it once inspected")
    return report


# --------------------------------------------------------------------------------------------------
# The tracker.


class Tracker:
    """MLflow run of one training job; no method raises because of the tracking store.

    ``start`` returns the MLflow run id, or a placeholder ``local-<hex>`` while the store cannot be
    reached; ``run_id`` becomes the MLflow id once the run is created. ``buffered`` counts metrics
    waiting on local disk (after the queued ones were handled).
    """

    def __init__(self, cfg: TrackingConfig, output_dir: str | Path, *, retry_interval: float = 10.0,
                 max_retry_interval: float = 300.0, dual_caps: Optional[dict[str, float]] = None):
        _set_http_defaults()
        self.cfg = cfg
        if cfg.uri and split_credentials(written_field(cfg, "uri") or cfg.uri)[1]:
            logger.warning("tracking.uri holds a credential written into it (a password, a token as user name or a "
                           "credential parameter): no record of the run keeps it (%s), so a resume from config.yaml "
                           "or a `dcmdp sync` has to be given it again; read it from the environment instead: "
                           "http://user:${oc.env:NAME}@host", public_uri(cfg.uri))
        # lambda_max per constraint of the run's dual, whose overview section (``dual_overview``) is logged with it;
        # None: no overview (a tracker that logs no dual)
        self.dual_caps = None if dual_caps is None else dict(dual_caps)
        self.output_dir = Path(output_dir)
        self.tracking_uri = resolve_tracking_uri(cfg, output_dir)
        self.buffer_dir = resolve_buffer_dir(cfg, output_dir)
        # The default local store keeps its artifacts next to its database.
        self._artifact_location = ((local_store_folder(output_dir) / "mlartifacts").as_uri()
                                   if self.tracking_uri == local_store_uri(output_dir) else None)
        self._sender = _Sender(self.tracking_uri, self.buffer_dir)
        # MLflow makes the parent folder of the sqlite path before decoding it: with a ``%`` in the URI that is a
        # stray empty folder, removed after ``start`` (only when it did not exist before)
        db = sqlite_store_file(self.tracking_uri)
        encoded = Path(self.tracking_uri[len("sqlite:///"):]).parent if db is not None else None
        self._stray_dir = encoded if encoded is not None and encoded != db.parent and not encoded.exists() else None
        self._segment: Optional[_Segment] = None
        self._id: Optional[str] = None
        self._buffered = 0
        # tracking.async_log: metric records queued for the sender thread (started by the first log_metrics)
        self._queue: queue.Queue = queue.Queue()
        self._sender_thread: Optional[threading.Thread] = None
        self._retry_interval = self._interval = retry_interval
        self._max_interval = max_retry_interval
        self._retry_at = 0.0
        self._outage = False
        self._warned_values = False
        self._finished = False
        # records that could be neither sent nor buffered (the buffer's disk failed), and whether it fails now
        self._lost = 0
        self._buffer_failing = False
        # (key, step) pairs the store already holds for a resumed run (``skip_logged``): not logged again
        self._logged: set[tuple[str, int]] = set()

    @property
    def buffered(self) -> int:
        """Metrics waiting on local disk for the store, once every queued call was handled."""
        self.flush()
        return self._buffered

    def flush(self) -> None:
        """Wait until every queued ``log_metrics`` call is sent to the store or buffered on disk."""
        if self._sender_thread is not None:
            self._queue.join()

    @property
    def run_id(self) -> Optional[str]:
        if self._id is not None and self._id.startswith(LOCAL_ID_PREFIX):
            return self._sender.run_map.get(self._id, self._id)
        return self._id

    def start(self, params: dict[str, str], *, run_id: Optional[str] = None,
              tags: Optional[dict[str, str]] = None) -> str:
        """Create the run (or reopen ``run_id``), log params in batches of 100 and tags."""
        self.flush()
        self._sync_leftovers()
        tags = dict(tags or {})
        if self.cfg.parent_run_id:  # the tag MLflow itself uses to nest runs (start_run(nested=True))
            tags.setdefault(PARENT_RUN_TAG, self.cfg.parent_run_id)
        tags = _clip("tag", tags, MAX_TAG_VAL_LENGTH)
        records: list[dict] = []
        if run_id is None:
            self._id = LOCAL_ID_PREFIX + uuid.uuid4().hex
            records.append({"t": "run", "id": self._id, "experiment": self.cfg.experiment,
                            "artifact_location": self._artifact_location,
                            # a name read from the environment is recorded as written, like every such value
                            "run_name": written_field(self.cfg, "run_name") or self.cfg.run_name,
                            "tags": tags, "start_time": _now_ms()})
        else:
            self._id = run_id
            records.append({"t": "reopen", "run": run_id})
            records += [{"t": "tags", "run": run_id, "tags": c} for c in _chunks(tags, MAX_PARAMS_TAGS_PER_BATCH)]
        params = _clip("param", params, MAX_PARAM_VAL_LENGTH)
        records += [{"t": "params", "run": self._id, "params": c} for c in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH)]
        self._emit(records, force=True)
        if self._stray_dir is not None:
            try:
                self._stray_dir.rmdir()
            except OSError:
                pass  # not empty, or already gone: not ours to remove
        if (link := self.ui_link()) is not None:
            local = sqlite_store_file(self.tracking_uri) is not None
            logger.info("MLflow: lambda, D-hat and c first (section %s) at %s%s", OVERVIEW, link,
                        f" once `mlflow ui --backend-store-uri {self.tracking_uri}` runs" if local else "")
        return self.run_id  # type: ignore[return-value]

    def ui_link(self) -> Optional[str]:
        """``ui_link`` of this run; None while the store cannot be reached (the run is not created yet)."""
        run_id = self.run_id
        if run_id is None or run_id.startswith(LOCAL_ID_PREFIX):
            return None
        try:
            experiment_id = self._sender._client().get_run(run_id).info.experiment_id
        except Exception:  # an outage that began since: the link is a convenience, never a failure
            return None
        return ui_link(self.tracking_uri, experiment_id, run_id)

    def end_stale_run(self, run_id: str) -> None:
        """Mark ``run_id`` KILLED if the store still shows it RUNNING: the run this folder held before
        ``overwrite=true`` cleared it. Its process is gone (the folder's run lock is ours), so a RUNNING status only
        means it was killed (``kill -9``, power loss) before it could end the run. Never raises."""
        if not run_id or run_id.startswith(LOCAL_ID_PREFIX):
            return
        try:
            client = self._sender._client()
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, status="KILLED")
                logger.warning("MLflow run %s of the earlier run in %s was left RUNNING (its process was killed): "
                               "marked KILLED", run_id, self.output_dir)
        except Exception as exc:
            logger.warning("could not check the earlier MLflow run %s at %s: %s", run_id, public_uri(self.tracking_uri),
                           redact(str(exc))[:300])

    def skip_logged(self, after_step: int) -> int:
        """Read which metrics the store holds for this run at steps > ``after_step``; ``log_metrics`` leaves those
        (key, step) pairs out. A run resumed from the checkpoint of ``after_step`` repeats the steps that ran
        between that checkpoint and the crash (kill -9 during or before the next checkpoint write): each is then
        logged once. Call after ``start`` (which first sends what an earlier process left buffered). Returns the
        number of pairs found; when the store cannot be read, warns and returns 0 (the repeats are then logged).
        """
        self.flush()
        if self._id is None or self.run_id is None or self.run_id.startswith(LOCAL_ID_PREFIX):
            return 0
        try:
            client = self._sender._client()
            for key in client.get_run(self.run_id).data.metrics:
                self._logged.update((key, m.step) for m in client.get_metric_history(self.run_id, key)
                                    if m.step > after_step)
        except Exception as exc:
            logger.warning("could not read the metrics of run %s at %s (%s); steps after %d that ran before the "
                           "restart may appear twice", self.run_id, public_uri(self.tracking_uri),
                           redact(str(exc))[:300], after_step)
            return 0
        if self._logged:
            steps = sorted({step for _, step in self._logged})
            logger.info("run %s already holds metrics of steps %d..%d: those are not logged again", self.run_id,
                        steps[0], steps[-1])
        return len(self._logged)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._id is None:
            raise RuntimeError("Tracker.log_metrics before Tracker.start")
        ts, run = _now_ms(), self.run_id
        records = []
        overview = dual_overview(metrics, self.dual_caps) if self.dual_caps is not None else {}
        for key, value in {**metrics, **overview}.items():
            if (key, int(step)) in self._logged:
                continue
            try:
                value = float(value)
            except Exception:  # a string, a tensor of several elements, ...
                if not self._warned_values:
                    logger.warning("metric %s=%r is not a number; such metrics are not logged", key, value)
                    self._warned_values = True
                continue
            records.append({"t": "metric", "run": run, "key": key, "value": value, "step": int(step), "ts": ts})
        if not records:
            return
        if not self.cfg.async_log:
            self._emit(records)
            return
        if self._sender_thread is None:
            self._sender_thread = threading.Thread(target=self._send_queued, name="dcmdp-tracking", daemon=True)
            self._sender_thread.start()
        self._queue.put(records)

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None:
        if self._id is None:
            raise RuntimeError("Tracker.log_artifact before Tracker.start")
        self.flush()
        path = Path(path)
        if not path.exists():
            logger.warning("artifact %s does not exist; not logged", path)
            return
        self._emit([{"t": "artifact", "run": self.run_id, "path": str(path.resolve()), "artifact_path": artifact_path}])

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._id is None:
            raise RuntimeError("Tracker.set_tags before Tracker.start")
        self.flush()
        tags = _clip("tag", tags, MAX_TAG_VAL_LENGTH)
        self._emit([{"t": "tags", "run": self.run_id, "tags": c} for c in _chunks(tags, MAX_PARAMS_TAGS_PER_BATCH)])

    def finish(self, status: str = "FINISHED") -> None:
        """Send what is buffered (one try, whatever the back-off), end the run, release the buffer.

        A second call does nothing."""
        if self._id is None or self._finished:
            return
        self._finished = True
        if self._sender_thread is not None:
            self._queue.put(None)
            self._sender_thread.join()
            self._sender_thread = None
        self._emit([{"t": "end", "run": self.run_id, "status": status, "end_time": _now_ms()}], force=True)
        if self.dual_caps is not None and self._segment is None and (link := self.ui_link()) is not None:
            logger.info("MLflow: lambda, D-hat and c of run %s first (section %s) at %s", self.run_id, OVERVIEW, link)
        if self._segment is not None:
            logger.warning("MLflow at %s is unreachable: %d metrics of run %s stay buffered in %s; send them with "
                           "`dcmdp sync` (dcmdp.tracking.sync_buffer)", public_uri(self.tracking_uri), self._buffered,
                           self.run_id, self._segment.path)
            try:
                self._segment.close()
            except OSError as exc:  # a full disk: the last write's bytes, still in the file object, cannot go out
                logger.error("cannot write the end of the tracking buffer %s: %s; its last record may be torn (dcmdp "
                             "sync stops before a torn line)", self._segment.path, exc.strerror or exc)
            self._segment = None
        if self._lost:
            logger.error("%d tracking records of run %s were lost: the store did not answer and the buffer in %s "
                         "could not be written", self._lost, self.run_id, self.buffer_dir)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish("FAILED" if exc_type is not None else "FINISHED")

    # -- internals ---------------------------------------------------------------------------------

    def _send_queued(self) -> None:
        """The sender thread: queued metric records through ``_emit``, in order, until ``finish`` queues None."""
        while True:
            records = self._queue.get()
            try:
                if records is None:
                    return
                self._emit(records)
            except Exception as exc:  # _emit does not raise; should it, the thread must outlive it
                logger.error("tracking sender thread: %s: %s; %d records lost", type(exc).__name__, redact(str(exc)),
                             len(records))
            finally:
                self._queue.task_done()

    def _emit(self, records: list[dict], force: bool = False) -> None:
        """Send directly when nothing is buffered; otherwise append, then try to drain in order."""
        if not records:
            return
        if self._segment is None:
            if not (force or time.monotonic() >= self._retry_at):
                self._buffer(records)
                return
            done = 0
            try:
                for done, _ in self._sender.send(enumerate(records, start=1)):
                    pass
                self._recovered(0)
                return
            except Exception as exc:
                self._failed(exc)
                self._buffer(records[done:])
                return
        self._buffer(records)
        if force or time.monotonic() >= self._retry_at:
            self._try_drain()

    def _buffer(self, records: list[dict]) -> None:
        try:
            if self._segment is None:
                self._segment = _Segment.create(self.buffer_dir, self.tracking_uri, written_field(self.cfg, "uri"))
                if self._sender.run_map:  # buffered records may name the placeholder id
                    _write_run_map(self.buffer_dir, self._sender.run_map)
            for rec in records:
                self._segment.append(rec)
                self._buffered += rec["t"] == "metric"
        except OSError as exc:
            # The disk itself fails: nothing more can be done without stopping the run. One line, not one per step:
            # a full disk must not bury the error that matters (a checkpoint that cannot be written) in repeats
            self._lost += len(records)
            if not self._buffer_failing:
                logger.error("cannot write the tracking buffer in %s: %s; these metrics are lost until it can be "
                             "written again (the count is given at the end of the run)", self.buffer_dir, exc)
            self._buffer_failing = True
            return
        if self._buffer_failing:
            logger.warning("the tracking buffer in %s can be written again; %d records were lost meanwhile",
                           self.buffer_dir, self._lost)
        self._buffer_failing = False

    def _try_drain(self) -> None:
        seg = self._segment
        assert seg is not None
        sent = 0
        try:
            for end, n in self._sender.send(seg.pending()):
                seg.mark_sent(end)
                sent += n
                self._buffered -= n
        except Exception as exc:
            self._failed(exc)
            return
        # Metrics the store rejected were dropped: recount from what is left (nothing, if drained).
        if seg.drained():
            self._buffered = 0
            seg.remove()
            self._segment = None
        self._recovered(sent)

    def _failed(self, exc: BaseException) -> None:
        if not self._outage:
            logger.warning("MLflow tracking at %s failed (%s: %s); training goes on and metrics are buffered in %s "
                           "until the store answers (sent on a later call, at finish, or by `dcmdp sync`)",
                           public_uri(self.tracking_uri), type(exc).__name__, redact(str(exc))[:300], self.buffer_dir)
            self._outage = True
        self._retry_at = time.monotonic() + self._interval
        self._interval = min(2 * self._interval, self._max_interval)

    def _recovered(self, sent: int) -> None:
        if self._outage:
            logger.warning("MLflow tracking at %s answers again; %d buffered metrics sent",
                           public_uri(self.tracking_uri), sent)
        self._outage = False
        self._interval = self._retry_interval
        self._retry_at = 0.0

    def _sync_leftovers(self) -> None:
        """Segments left by earlier processes go first, so resumed runs keep their order."""
        if not _segments(self.buffer_dir):
            return
        try:
            n = sync_buffer(self.buffer_dir, known=(self.tracking_uri,))
            if n:
                logger.info("sent %d metrics left in %s by an earlier process", n, self.buffer_dir)
        except Exception as exc:
            logger.warning("could not sync leftover tracking buffer %s: %s", self.buffer_dir, redact(str(exc)))


class NoTracker:
    """The tracker of ranks other than 0 under torchrun (only rank 0 logs to MLflow): ``Tracker``'s calls, doing
    nothing."""

    run_id = None
    tracking_uri = ""
    buffered = 0
    dual_caps = None

    def start(self, *args, **kwargs) -> None:
        pass

    def ui_link(self) -> None:
        return None

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_metrics(self, *args, **kwargs) -> None:
        pass

    def log_artifact(self, *args, **kwargs) -> None:
        pass

    def skip_logged(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def end_stale_run(self, *args, **kwargs) -> None:
        pass

    def finish(self, *args, **kwargs) -> None:
        pass
