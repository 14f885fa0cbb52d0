"""The run folder: its lock (one run at a time, the holder named), what an earlier run left in it and what
``overwrite=true`` may clear, the run's identity file (run.json), the probe that finds a path the run cannot write
before it builds anything, and the run's config.yaml. The checkpoints inside it are dcmdp/checkpoint.py's."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from dcmdp.checkpoint_layout import (_OLD_PREFIX, _STEP_RE, _TMP_PREFIX, MANIFEST_FILE, CheckpointError,
                                     _complete_or_not)
from dcmdp.errors import InputError
from dcmdp.redact import public_command
from trainers.errors import not_a_regular_file
from trainers.jsonfile import MAX_SMALL_JSON_BYTES, read_small_json

# the log lines of the run folder keep the name they have always had
log = logging.getLogger("dcmdp.checkpoint")


class RunFolderError(CheckpointError):
    """The run folder is in use by another process, or already holds a run that this one must not touch."""


class RunFolderInputError(RunFolderError, InputError):
    """The ``output_dir`` the user chose holds what this run must not touch (an earlier run, a checkpoint copied in
    by hand): bad input, exit code 2. A folder held by a live run stays a plain ``RunFolderError`` (exit code 1)."""


LOCK_FILE = "run.lock"
# What a fresh run must not write over (``run_in_folder``), and where ``overwrite=true`` removes what the folder's
# earlier run wrote (``clear_run_folder``): its checkpoints, its end-of-run summary (the final evaluation) and plot.
RUN_OUTPUTS = ("checkpoints", "summary.json", "dual.png")


class RunFolderLock:
    """Exclusive ``flock`` on ``<folder>/run.lock``, held for the life of a run.

    The kernel releases a flock when its holder exits, however it exits (``kill -9`` included), so a lock file
    left by a dead process is no obstacle: the next run takes the lock and writes its own holder line. The file
    names the holder (PID, host, start time, and the command line with override keys but not their values, which
    may be credentials: ``public_command``), so a second run's error can say who holds it; when that PID has ended
    and the lock is still held, the error names the live processes that hold the file open instead. A child forked
    from the run closes its copy at once (``_close_locks_in_child``). The file itself is never deleted: unlinking a
    lock file lets two processes lock two different files.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fh: Optional[Any] = None

    def acquire(self) -> "RunFolderLock":
        """Take the lock or raise ``RunFolderError`` naming the holder; ``OSError`` if the folder is not writable."""
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = _holder(fh.read().strip(), self.path)
            fh.close()
            raise RunFolderError(f"output_dir {self.folder} is in use by another run ({holder}); wait until it "
                                 f"ends, or choose another output_dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: "
                 f"{public_command(sys.argv)}\n")
        fh.flush()
        self._fh = fh
        _HELD_LOCKS.add(fh)
        return self

    def release(self) -> None:
        if self._fh is not None:
            _HELD_LOCKS.discard(self._fh)
            self._fh.close()  # releases the flock
            self._fh = None

    @property
    def held(self) -> bool:
        return self._fh is not None


# Lock files this process holds. A child forked without exec (a reward's helper, a multiprocessing worker) would
# share each lock's open file description and keep the folder locked after the run ended; the child closes its
# copies at once (closing is not unlocking: the parent's lock stands). Descriptors are close-on-exec already.
_HELD_LOCKS: set[Any] = set()


def _close_locks_in_child() -> None:
    for fh in list(_HELD_LOCKS):
        try:
            fh.close()
        except OSError:
            pass
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_holders(path: Path) -> list[int]:
    """PIDs of the processes with ``path`` open (Linux ``/proc``; empty elsewhere or when none can be read)."""
    try:
        target = os.stat(path)
    except OSError:
        return []
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for fd in (proc / "fd").iterdir():
                st = os.stat(fd)
                if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                    found.append(int(proc.name))
                    break
        except OSError:  # another user's process, or one that just ended
            continue
    return sorted(p for p in found if p != os.getpid())


def _holder(line: str, path: Path) -> str:
    """Who holds the lock, in words: the holder line the locking run wrote, unless its PID is dead, in which case
    the live processes that still hold the file open (a child that outlived the run)."""
    m = re.match(r"pid (\d+)", line)
    if m and _alive(int(m.group(1))):
        return line
    holders = lock_holders(path)
    if holders:
        who = ", ".join(f"pid {p} ({_cmdline(p)})" for p in holders)
        dead = f"run pid {m.group(1)} has ended, but " if m else ""
        return f"{dead}{who} still holds {path} open (a process it started, left running); end it to free the folder"
    return line or "a process that has not written its PID yet"


def _cmdline(pid: int) -> str:
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        return public_command([a.decode(errors="replace") for a in argv if a])
    except OSError:
        return "command unknown"


def run_in_folder(folder: str | Path) -> Optional[str]:
    """What of an earlier run ``folder`` holds (complete checkpoints, summary.json), in words; None if nothing."""
    folder = Path(folder)
    found = []
    steps = [int(m.group(1)) for p in _complete_or_not(folder / "checkpoints")
             if (p / MANIFEST_FILE).is_file() and (m := _STEP_RE.match(p.name))]
    if steps:
        found.append(f"checkpoints up to step {max(steps)}")
    if (folder / "summary.json").is_file():
        found.append("summary.json")
    return " and ".join(found) or None


def unclaimed_outputs(folder: str | Path) -> Optional[str]:
    """Why ``overwrite=true`` may not clear ``folder``, whose files a run would write over (``run_in_folder``): no
    ``run.json`` names the run that wrote them (absent or unreadable), so nothing proves a dcmdp run did, and they
    may be the user's own. None when ``run.json`` names a run (``clear_run_folder`` may then remove what it wrote)."""
    folder = Path(folder)
    if read_run_file(folder).get("uid"):
        return None
    found = run_in_folder(folder) or ", ".join(name for name in RUN_OUTPUTS if os.path.lexists(folder / name))
    return (f"overwrite=true: output_dir {folder} holds {found} but no readable {RUN_FILE} naming a dcmdp run that "
            f"wrote them, so they may be your own files: overwrite=true removes only what a run's {RUN_FILE} proves "
            f"it wrote, and this run would write over them. Move them out of the folder (or delete them yourself), "
            f"or choose another output_dir; nothing was changed")


# Paths named in clear_run_folder's log line; the rest are counted.
_NAMED = 10


def clear_run_folder(folder: str | Path) -> list[Path]:
    """Remove what the earlier run of ``folder`` wrote (``overwrite=true``), so a new run cannot mix with it, and
    return the paths kept. Only a folder whose ``run.json`` names its run is cleared (else ``RunFolderInputError``,
    nothing removed: ``unclaimed_outputs``), and only what that run wrote: ``summary.json`` and ``dual.png`` (regular
    files), in ``checkpoints/`` the files each of its checkpoints' manifests lists (a checkpoint of this run, or one
    written before run identities) and its interrupted writes (``.tmp-*``, ``.old-*``), then the folders left
    empty. Anything else there (a note, another run's checkpoint copied in, a folder named ``summary.json``, a
    symbolic link) is kept, and named in the one log line that says what was removed. config.yaml and run.json are
    replaced by the new run; the MLflow store, unsent tracking buffers and everything else in the folder stay."""
    folder = Path(folder)
    uid = read_run_file(folder).get("uid")
    if not uid:
        raise RunFolderInputError(unclaimed_outputs(folder) or f"overwrite=true: {folder} names no run")
    removed: list[str] = []
    kept: list[Path] = []
    for name in RUN_OUTPUTS:
        path = folder / name
        if not os.path.lexists(path):
            continue
        if name == "checkpoints" and path.is_dir():
            removed += _clear_checkpoints(path, uid, kept)
        elif name != "checkpoints" and path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(name)
        else:  # a folder, a link or a special file under a name the run writes a regular file (or folder) by
            kept.append(path)
    shown = [str(p.relative_to(folder)) for p in kept[:_NAMED]] + ([f"and {len(kept) - _NAMED} more"]
                                                                  if len(kept) > _NAMED else [])
    log.warning("overwrite=true: removed %s of the earlier run %s from %s%s", ", ".join(removed) or "nothing", uid,
                folder, f"; kept what no run wrote: {', '.join(shown)}" if kept else "")
    return kept


def _clear_checkpoints(ckpt_dir: Path, uid: str, kept: list[Path]) -> list[str]:
    """``clear_run_folder`` in ``checkpoints/``: the run's checkpoints and interrupted writes removed, the rest added
    to ``kept``; what was removed, in words."""
    steps = []
    for path in sorted(ckpt_dir.iterdir()):
        if path.is_symlink() or not path.is_dir():
            kept.append(path)
        elif path.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
            shutil.rmtree(path)
        elif (m := _STEP_RE.match(path.name)) and (files := _own_files(path, uid)) is not None:
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    (path / name).unlink()
            steps.append(int(m.group(1)))
            kept += _remove_empty_folders(path)
        else:
            kept.append(path)
    plural = "s" if len(steps) > 1 else ""
    words = [f"checkpoint{plural} of step{plural} {', '.join(map(str, steps))}"] if steps else []
    if not ckpt_dir.is_symlink() and not any(ckpt_dir.iterdir()):
        ckpt_dir.rmdir()
        words.append("checkpoints/")
    return words


def _own_files(path: Path, uid: str) -> Optional[list[str]]:
    """The files (relative names) a checkpoint of run ``uid`` (or of a run before identities) wrote into ``path``, by
    its manifest, the manifest last; None when ``path`` is not such a checkpoint (no readable manifest, another run's,
    a manifest naming a file outside it or a link)."""
    try:
        manifest = read_small_json(path / MANIFEST_FILE)
        files = list(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if manifest.get("run_uid") not in (uid, None):
        return None
    for name in files:
        if (not isinstance(name, str) or name.startswith(("/", "\\")) or ".." in Path(name).parts
                or (path / name).is_symlink()):
            return None
    return [*files, MANIFEST_FILE]


def _remove_empty_folders(path: Path) -> list[Path]:
    """Remove ``path`` and the folders below it that are empty; return the files and links left in them."""
    left = []
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            left.append(Path(root) / name)
        with contextlib.suppress(OSError):  # not empty: something no run wrote is in it
            os.rmdir(root)
    return left


RUN_FILE = "run.json"


def new_run_uid() -> str:
    """A fresh run identity: kept in ``<output_dir>/run.json`` and in every checkpoint of the run."""
    return uuid.uuid4().hex


# A run's metadata files (run.json, manifest.json) are a few KiB; one larger, or nested deeper than Python's JSON
# decoder recurses, is not one a run wrote, and is read no further (``trainers.jsonfile.read_small_json``).
MAX_METADATA_BYTES = MAX_SMALL_JSON_BYTES


def read_run_file(folder: str | Path) -> dict[str, Any]:
    """``<folder>/run.json`` (``uid``, ``run_id`` of the run that owns the folder); {} when absent or unreadable."""
    try:
        data = read_small_json(Path(folder) / RUN_FILE)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_run_file(folder: str | Path, uid: str, run_id: Optional[str], parent: Optional[dict] = None,
                   tracking_uri: str = "") -> None:
    """Record which run owns ``folder`` and where its metrics are (its MLflow run id and the tracking URI, without
    credentials), atomically: a crash leaves the old file or the new one."""
    body = {"uid": uid, "run_id": run_id, **({"tracking_uri": tracking_uri} if tracking_uri else {}),
            **({"resumed_from": parent} if parent else {})}
    tmp = Path(folder) / f".{RUN_FILE}.tmp"
    try:
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, Path(folder) / RUN_FILE)
    except OSError as exc:  # a full disk fails on close, where Python's error names no file
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"cannot write {Path(folder) / RUN_FILE}: {exc.strerror or exc}") from exc


class RunPathInputError(CheckpointError, InputError):
    """A path the run will write cannot be written (a file where its folder goes, no permission, a read-only file
    system), found by ``unwritable_run_paths`` before the cold start: bad input, exit code 2."""


_PROBE_PREFIX = ".dcmdp-probe-"
# What a run writes in its folder as a single file: each must not be a folder, nor a file it cannot write.
RUN_FILES = (("summary.json", "the run's summary (its final evaluation)"), ("dual.png", "the dual plot"),
             (RUN_FILE, "the run's identity"))


def probe_folder(folder: str | Path) -> Optional[str]:
    """Why a run could not create, write, rename and remove a file in ``folder``, in words naming the path at fault,
    found by doing it: the folder (and its missing parents) made, a probe file created, written, renamed and
    removed; then the folders the probe made are removed again, so the disk is as it was. None when all succeed."""
    relative = not Path(folder).is_absolute()
    folder = Path(os.path.abspath(folder))  # ".." taken lexically, as the parents below are

    def shown(path: Path) -> str:  # a path as the user gave it: relative to the working directory when theirs was
        return os.path.relpath(path) if relative else str(path)

    missing, part = [], folder
    while True:
        try:
            if not stat.S_ISDIR(os.stat(part).st_mode):
                return f"{shown(part)} is a file, not a folder"
            break
        except (FileNotFoundError, NotADirectoryError):  # absent, or below a file: the parent says which
            if os.path.islink(part):
                return f"{shown(part)} is a symbolic link to a path that does not exist"
            if part.parent == part:
                break
            missing.append(part)
            part = part.parent
        except OSError as exc:
            return f"{shown(part)} cannot be reached: {_reason(exc)}"
    made: list[Path] = []
    probe = folder / f"{_PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    moved = probe.with_name(probe.name + "-renamed")
    doing = "create the folder"
    try:
        for part in reversed(missing):
            os.mkdir(part)
            made.append(part)
        doing = "create a file in"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            doing = "write a file in"
            os.write(fd, b"dcmdp probe\n")
        finally:
            os.close(fd)
        doing = "rename a file in"
        os.rename(probe, moved)
        doing = "remove a file from"
        os.unlink(moved)
    except OSError as exc:
        where = part if doing == "create the folder" else folder
        return f"cannot {doing} {shown(where)}: {_reason(exc)}"
    finally:
        for leftover in (probe, moved):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        for part in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(part)
    return None


def unwritable_run_paths(output_dir: str | Path, buffer_dir: Optional[str | Path] = None,
                         buffer_key: str = "output_dir") -> list[tuple[str, str]]:
    """(config key, what is wrong) for each path a run in ``output_dir`` writes that it could not, found before the
    run builds anything (``probe_folder``): ``output_dir`` itself, ``checkpoints/`` and the tracking buffer folder
    ``buffer_dir`` (None: tracking off; ``buffer_key`` names its key), and ``RUN_FILES`` (each not a folder, nor a
    file the user cannot write). [] when the run can write them all."""
    out = Path(output_dir)
    if why := probe_folder(out):
        return [("output_dir", f"cannot write the run folder {out}: {why}")]
    found = []
    folders = [("output_dir", "checkpoints", out / "checkpoints")]
    if buffer_dir is not None:
        folders.append((buffer_key, "the tracking buffer (metrics kept while the server cannot be reached)",
                        Path(buffer_dir)))
    for key, what, path in folders:
        if why := probe_folder(path):
            found.append((key, f"cannot write {what} to {path}: {why}; fix it, or choose another {key}"))
    for name, what in RUN_FILES:
        path = out / name
        if not os.path.lexists(path):
            continue
        why = not_a_regular_file(path)
        if why is None and not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
            why = "is not writable (permission denied)"
        if why is not None:
            found.append(("output_dir", f"cannot write {what} to {path}: {name} {why}; remove or rename it, or "
                                        f"choose another output_dir"))
    return found


def _reason(exc: OSError) -> str:
    """An OSError's cause without its file name (the caller names the path)."""
    name = errno.errorcode.get(exc.errno, exc.errno) if exc.errno is not None else type(exc).__name__
    return f"{exc.strerror or exc} [errno {name}]"


CONFIG_FILE, CONFIG_FALLBACK = "config.yaml", "config.resolved.yaml"
# First line of every config.yaml a run writes: how a later run knows the file is its to replace.
CONFIG_HEADER = "# dcmdp: the resolved config of the run in this folder (written by dcmdp train; replaced by the next run)"


def write_config_yaml(folder: str | Path, text: str, schema_keys: Iterable[str]) -> Path:
    """Write the run's resolved config to ``<folder>/config.yaml`` and return its path, unless a file there was not
    written by a run (no ``CONFIG_HEADER``, and not a full resolved config: some of ``schema_keys`` missing at top
    level), e.g. the user's own config kept in the output folder: that file is left as it is and the config goes
    to ``config.resolved.yaml``, with a warning."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if path.exists() and not _written_by_a_run(path, set(schema_keys)):
        log.warning("%s was not written by a run (your own config?): left as it is; this run's resolved config is "
                    "in %s", path, folder / CONFIG_FALLBACK)
        path = folder / CONFIG_FALLBACK
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(f"{CONFIG_HEADER}\n{text}")
    os.replace(tmp, path)
    return path


def _written_by_a_run(path: Path, schema_keys: set[str]) -> bool:
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_METADATA_BYTES + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if text.startswith(CONFIG_HEADER):
        return True
    if len(text) > MAX_METADATA_BYTES:
        return False  # a resolved config is a few KiB
    import yaml  # a config.yaml of an earlier dcmdp: the whole resolved config, without the header

    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return False
    return isinstance(data, dict) and schema_keys <= set(data)
