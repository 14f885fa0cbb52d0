"""Where a run's metrics go: the tracking URI resolved (the config, the environment, or the local sqlite store
beside the run folder) and checked before the run starts, the run's provenance tags, links into MLflow's UI, and
MLflow's limits on what one request may hold. dcmdp/tracking.py's ``Tracker`` sends there."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import quote, unquote, urlparse

from dcmdp.config import ConfigError, TrackingConfig
from dcmdp.redact import public_command, public_uri, uri_problem
from trainers.errors import not_a_regular_file

# the log lines of tracking keep the name they have always had
logger = logging.getLogger("dcmdp.tracking")

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
