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

Where the parts live: the tracking URI, its checks, provenance tags, UI links and MLflow's limits in
dcmdp/tracking_store.py; the buffer's segments, the sender and ``sync_buffer`` in dcmdp/tracking_buffer.py; the
``Tracker`` here, where every name is importable as before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from dcmdp.config import TrackingConfig
from dcmdp.redact import public_uri, redact, split_credentials, written_field

# the parts, importable from here as before
from dcmdp.tracking_buffer import (MAX_RECORD_BYTES, MAX_RECORD_DEPTH, SyncReport, UNREADABLE_SUFFIX,  # noqa: F401
                                   _Segment, _Sender, _read_line, _segment_uri, _segments, _write_run_map, sync_buffer,
                                   sync_report)
from dcmdp.tracking_store import (EXPERIMENT_TAGS, HTTP_DEFAULTS, LOCAL_ID_PREFIX, LOCAL_ID_TAG,  # noqa: F401
                                  MAX_EXPERIMENT_NAME, MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH,
                                  MAX_PARAM_VAL_LENGTH, MAX_RUN_NAME, MAX_TAG_VAL_LENGTH, MLFLOW_STORE_SCHEMES,
                                  OVERVIEW, PARENT_RUN_TAG, STORE_FILE, UI_CHARTS, UI_DEFAULT, UI_LAYOUT, _chunks,
                                  _clip, _now_ms, _set_http_defaults, check_sqlite_store, check_tracking_config,
                                  check_tracking_uri, dual_overview, experiment_link, local_store_folder,
                                  local_store_uri, provenance_tags, resolve_buffer_dir, resolve_tracking_uri,
                                  sqlite_store_file, sqlite_store_problem, store_scheme, tracking_store_schemes,
                                  tracking_uri_source, ui_base, ui_link)

logger = logging.getLogger(__name__)

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
