"""What a tracker could not send, kept and sent later: the buffer's segments (append-only JSONL files with a durable
sent-offset), the sender that replays their records into MLflow in order, and ``sync_buffer`` / ``sync_report``
(``dcmdp sync``). The layout and the guarantees are described in dcmdp/tracking.py."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Optional

from omegaconf import OmegaConf

from dcmdp.redact import public_uri, redact, split_credentials
from dcmdp.tracking_store import (EXPERIMENT_TAGS, LOCAL_ID_PREFIX, LOCAL_ID_TAG, MAX_METRICS_PER_BATCH, _is_rejection,
                                  _now_ms, _set_http_defaults, sqlite_store_file)
from trainers.jsonfile import MAX_JSON_DEPTH, nesting_problem, read_small_json

# the log lines of tracking keep the name they have always had
logger = logging.getLogger("dcmdp.tracking")

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
