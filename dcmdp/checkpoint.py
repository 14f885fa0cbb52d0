"""Checkpoints: atomic, checksummed, keep-last-N, and a signal flag for a clean stop on pre-emption.

Layout: ``<ckpt_dir>/step_<step:08d>/`` holds ``state.pt`` (the payload, one ``torch.save``) and
``manifest.json`` (format version, step, and the size and sha256 of every other file).

Writing is atomic: the files go into a temporary directory ``.tmp-step_<step:08d>-*`` inside ``ckpt_dir``
(same filesystem), each is fsynced, the manifest is written last, the temporary directory is fsynced and
renamed to its final name, and ``ckpt_dir`` is fsynced. A ``step_*`` directory therefore exists only once
it is complete; a crash mid-write leaves only a ``.tmp-*`` directory, which readers ignore and the next
``save_checkpoint`` removes. Re-saving an existing step swaps the old directory out (``.old-*``) and
the new one in, then deletes the old one; a crash between those two renames (microseconds) leaves the
step missing and its previous copy under ``.old-*``, which the next save puts back.

Loading uses ``torch.load(weights_only=True)``: no arbitrary unpickling, so a checkpoint cannot run code.
That works because a payload may hold only tensors and plain python values (dict, list, tuple, set, str,
bytes, int, float, complex, bool, None, torch.Size/dtype/device), which ``save_checkpoint`` checks before
it writes anything: pass ``optimizer.state_dict()``, ``dual.state_dict()``, ``capture_rng()``, never the
objects themselves (a numpy scalar is refused too: convert it with ``float``). Loaded tensors are on the CPU.

One writer per ``ckpt_dir`` (rank 0): a second writer's temporary directory would be cleaned as a leftover.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from types import FrameType
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch

from dcmdp.errors import InputError
from dcmdp.redact import public_command
from trainers.errors import not_a_regular_file
from trainers.jsonfile import MAX_SMALL_JSON_BYTES, read_small_json

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_HASH_CHUNK = 1 << 20

# Exactly these types (not subclasses: np.float64 subclasses float but unpickles through numpy).
_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, verified or loaded; the message names the path and why."""


class RunFolderError(CheckpointError):
    """The run folder is in use by another process, or already holds a run that this one must not touch."""


class CheckpointInputError(CheckpointError, InputError):
    """A checkpoint the user named (``checkpoint.resume=<path>``) is missing or not valid: bad input, exit code 2."""


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


def capture_rng() -> dict[str, Any]:
    """RNG states of python ``random``, the numpy global generator, torch CPU and (if available) every CUDA device.

    Plain values and tensors only, so it can go into a payload as is.
    """
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": tuple(internal), "gauss_next": gauss_next},
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``: the next draws equal those that followed the capture."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state({"bit_generator": npy["bit_generator"],
                         "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": int(npy["pos"])},
                         "has_gauss": int(npy["has_gauss"]), "gauss": float(npy["gauss"])})
    torch.set_rng_state(state["torch_cpu"])
    cuda = state.get("torch_cuda")
    if cuda:
        if not torch.cuda.is_available():
            log.warning("checkpoint holds CUDA RNG states for %d devices but CUDA is not available: not restored",
                        len(cuda))
            return
        n = torch.cuda.device_count()
        if n != len(cuda):
            log.warning("checkpoint holds CUDA RNG states for %d devices, this process sees %d: restoring the "
                        "first %d", len(cuda), n, min(n, len(cuda)))
        for i in range(min(n, len(cuda))):
            torch.cuda.set_rng_state(cuda[i], device=i)


def save_checkpoint(ckpt_dir: str | Path, step: int, payload: dict[str, Any], *, keep: int) -> Path:
    """Write ``payload`` atomically to ``<ckpt_dir>/step_<step:08d>/`` and keep the newest ``keep`` checkpoints.

    Pruning keeps the ``keep`` highest steps among complete checkpoints (those with a manifest) and never
    deletes the one just written; ``step_*`` directories without a manifest were not written here and are
    left alone. Raises ``CheckpointError`` when writing fails (disk full, permission,
    not a directory): the temporary directory is removed and existing checkpoints are left untouched.
    Raises ``TypeError`` (before touching the disk) when the payload holds a non-plain value.
    """
    _check_publishable(payload, keep)  # before any directory is made
    return _write_and_publish(prepare_checkpoint_dir(ckpt_dir, step), ckpt_dir, step, payload, keep=keep)


def _check_publishable(payload: dict[str, Any], keep: int) -> None:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    _check_plain(payload, "payload")


def prepare_checkpoint_dir(ckpt_dir: str | Path, step: int) -> Path:
    """The temporary directory a checkpoint of ``step`` is written into (first half of ``save_checkpoint``).

    Other writers (``torch.distributed.checkpoint`` shards) may add files to it before
    ``publish_checkpoint``, which lists every file in the manifest.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    ckpt_dir = Path(ckpt_dir)
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {ckpt_dir}: {_why(exc)}") from exc
    _clean_leftovers(ckpt_dir)
    try:
        return Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{_dir_name(step)}-", dir=ckpt_dir))
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {ckpt_dir} is not writable: {_why(exc)}") from exc


def publish_checkpoint(tmp: Path, ckpt_dir: str | Path, step: int, payload: dict[str, Any], *, keep: int) -> Path:
    """Write ``payload`` into ``tmp`` as ``state.pt``, checksum every file there, rename ``tmp`` into place and
    prune (second half of ``save_checkpoint``). On failure ``tmp`` is removed and ``CheckpointError`` raised."""
    _check_publishable(payload, keep)
    return _write_and_publish(tmp, ckpt_dir, step, payload, keep=keep)


def _write_and_publish(tmp: Path, ckpt_dir: str | Path, step: int, payload: dict[str, Any], *, keep: int) -> Path:
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / _dir_name(step)
    t0 = time.perf_counter()
    try:
        files = {STATE_FILE: _write_state(tmp / STATE_FILE, payload)}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name = f.relative_to(tmp).as_posix()
            if name != STATE_FILE:
                files[name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        manifest = {"format_version": FORMAT_VERSION, "step": int(step), "files": files,
                    "payload_keys": sorted(map(str, payload)), "run_uid": checkpoint_run_uid(payload),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write_file(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
        _fsync_dir(tmp)
        _publish(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, _WriteFailed)):
            raise CheckpointError(f"could not write checkpoint step {step} to {ckpt_dir}: {_why(exc)}; "
                                  f"existing checkpoints were left as they were") from exc
        raise
    size = sum(meta["bytes"] for meta in files.values())
    log.info("saved checkpoint %s (%.1f MB in %.2f s)", final, size / 1e6, time.perf_counter() - t0)
    _prune(ckpt_dir, keep, final)
    return final


def verify_checkpoint(path: str | Path, *, by_name: bool = True) -> tuple[bool, str]:
    """(ok, reason): the manifest exists and parses, its format and step match (``by_name``: the step of the
    directory's name too), every file has its size and sha256."""
    path = Path(path)
    if not path.is_dir():
        return False, "not a directory" if path.exists() else "does not exist"
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return False, f"no {MANIFEST_FILE} (incomplete checkpoint)"
    try:
        manifest = read_small_json(manifest_path)
        version, step, files = manifest["format_version"], int(manifest["step"]), manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"unreadable {MANIFEST_FILE}: {exc}"
    if version != FORMAT_VERSION:
        return False, f"format version {version} (this code reads {FORMAT_VERSION})"
    m = _STEP_RE.match(path.name)
    if by_name and m and int(m.group(1)) != step:
        return False, f"manifest step {step} does not match the directory name"
    if not isinstance(files, dict) or STATE_FILE not in files:
        return False, f"{MANIFEST_FILE} lists no {STATE_FILE}"
    total = 0
    for name, meta in files.items():
        # a manifest names files inside its checkpoint only: an edited one must not make us read elsewhere
        if not isinstance(name, str) or name.startswith(("/", "\\")) or ".." in Path(name).parts:
            return False, f"{MANIFEST_FILE} names a file outside the checkpoint: {name!r}"
        try:
            expected_bytes, expected_sha = int(meta["bytes"]), str(meta["sha256"])
        except (KeyError, TypeError, ValueError):
            return False, f"{MANIFEST_FILE} entry of {name} is malformed: {meta!r}"
        f = path / name
        if not f.is_file():
            return False, f"{name} is missing"
        size = f.stat().st_size
        if size != expected_bytes:
            return False, f"{name} has {size} bytes, the manifest says {expected_bytes} (truncated or rewritten)"
        try:
            digest = _sha256(f)
        except OSError as exc:
            return False, f"cannot read {name}: {_why(exc)}"
        if digest != expected_sha:
            return False, f"{name} sha256 mismatch (corrupted): {digest[:12]}... vs {expected_sha[:12]}..."
        total += size
    return True, f"step {step}, {len(files)} file(s), {total} bytes, checksums ok"


def find_resume_checkpoint(ckpt_dir: str | Path, resume: Optional[str], *, purpose: str = "resuming from"
                           ) -> Optional[Path]:
    """The checkpoint to resume from, or None for a fresh run; ``purpose`` starts the log line naming it.

    ``resume`` empty/None: None. ``"auto"``: the highest-step checkpoint in ``ckpt_dir`` that verifies;
    the ones skipped on the way (corrupt, partial) are logged as warnings with the reason; None when there
    is none. Otherwise ``resume`` is a checkpoint directory: returned if it verifies, else ``CheckpointError``.
    """
    if not resume:
        return None
    if resume == "auto":
        for path in _complete_or_not(Path(ckpt_dir)):
            ok, why = _verify_own(path)
            if ok:
                log.info("%s %s (%s)", purpose, path, why)
                return path
            log.warning("skipping checkpoint %s: %s", path, why)
        return None
    path = Path(resume)
    if not path.exists():
        raise CheckpointInputError(f"resume checkpoint {path} does not exist")
    if path.is_file() and path.name in (STATE_FILE, MANIFEST_FILE):
        raise CheckpointInputError(f"resume checkpoint {path} is a file of a checkpoint: name its folder, "
                                   f"checkpoint.resume={path.parent}")
    if path.is_dir() and not (path / MANIFEST_FILE).exists() and (steps := _complete_or_not(path)):
        raise CheckpointInputError(f"resume checkpoint {path} is a folder of checkpoints, not one checkpoint: name one "
                                   f"(newest: {steps[0]}), or use checkpoint.resume=auto for an output_dir's own")
    ok, why = verify_checkpoint(path)
    if not ok:
        raise CheckpointInputError(f"resume checkpoint {path} is not valid: {why}")
    return path


def _verify_own(path: Path) -> tuple[bool, str]:
    """``verify_checkpoint`` for ``checkpoint.resume=auto``, which continues a folder's own checkpoints: a damaged one
    is skipped (the caller warns and tries the next older one), but one whose files all verify under a directory
    name of another step was renamed or copied in by hand (a run writes each under its own step's name, atomically),
    and is refused: ``RunFolderInputError`` naming it, nothing changed. Resuming past it would silently continue from an
    older step, or from another run's weights."""
    ok, why = verify_checkpoint(path)
    if ok or not why.endswith("does not match the directory name") or not verify_checkpoint(path, by_name=False)[0]:
        return ok, why
    step = read_small_json(path / MANIFEST_FILE)["step"]
    raise RunFolderInputError(f"checkpoint {path} holds step {step} (its manifest; every file verifies) under the "
                              f"name {path.name}: it was renamed or copied into {path.parent} by hand, and "
                              f"checkpoint.resume=auto continues a folder's own checkpoints only. To start from it, "
                              f"move it out of {path.parent} and name it: checkpoint.resume=<its path> (its config is "
                              f"compared with this one); else delete it. Nothing was changed")


def load_resume_checkpoint(ckpt_dir: str | Path, resume: Optional[str]) -> Optional[tuple[Path, dict[str, Any]]]:
    """(path, payload) of the checkpoint to resume from, or None for a fresh run (see ``find_resume_checkpoint``).

    With ``"auto"``, a checkpoint whose files verify but whose payload does not load (a ``state.pt`` truncated
    before its manifest was written) is skipped with a warning like a corrupt one, and the next older one tried.
    """
    if resume != "auto":
        path = find_resume_checkpoint(ckpt_dir, resume)
        return None if path is None else (path, load_checkpoint(path))
    for path in _complete_or_not(Path(ckpt_dir)):
        ok, why = _verify_own(path)
        if not ok:
            log.warning("skipping checkpoint %s: %s", path, why)
            continue
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
            continue
        log.info("resuming from %s (%s)", path, why)
        return path, state
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify the checksums, then the payload as saved (``torch.load(weights_only=True)``, tensors on the CPU)."""
    path = Path(path)
    ok, why = verify_checkpoint(path)
    if not ok:
        raise CheckpointError(f"checkpoint {path} is not valid: {why}")
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # a verified file that still fails is a version or format problem: say where
        raise CheckpointError(f"checkpoint {path} verified but could not be loaded: {exc}") from exc


class ForcedStop(KeyboardInterrupt):
    """A second SIGINT/SIGTERM/SIGHUP, or a SIGQUIT, inside the training loop: stop now, not at the end of the step."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalCheckpointer:
    """Context manager that turns SIGINT/SIGTERM/SIGHUP into a flag the training loop polls, and a repeated one (or
    a SIGQUIT) into an immediate stop.

    SIGHUP (the terminal that started the run was closed, the SSH session dropped) is a stop request like SIGTERM,
    not the default death that would lose the run's steps since its last checkpoint and leave its MLflow run
    RUNNING. A SIGHUP the process inherited as ignored (``nohup``) stays ignored: that run was asked to outlive its
    terminal.

    Inside the ``with`` block a first SIGINT/SIGTERM/SIGHUP only sets ``requested`` (and records ``signum``,
    ``count``): the handler does no I/O and takes no lock. The loop checks ``requested`` after each step, saves a
    checkpoint and leaves the block (the run exits 128 + the signal's number: 129 for SIGHUP, 143 for SIGTERM); on
    exit the previous handlers are restored.

    A second stop signal, or a SIGQUIT (Ctrl-\\), raises ``ForcedStop`` (a KeyboardInterrupt) where the loop
    is: a step that never ends (a hung reward, a stuck engine) cannot make the run deaf, and the caller ends the
    MLflow run KILLED and checkpoints the last completed step. While ``hold()`` is active (a checkpoint being
    written) signals are only counted, so a save is never interrupted half-way; a forced stop requested then is
    raised when the save is done. Must be entered from the main thread (a python rule for handlers).
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
                 force: Iterable[int] = (signal.SIGQUIT,)):
        self.signals = tuple(signals)
        self.force = tuple(force)
        self.requested = False
        self.signum: Optional[int] = None
        self.count = 0
        self._holding = 0
        self._forced: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        first = not self.requested
        if first:
            self.signum = signum
        self.requested = True
        self.count += 1
        if signum in self.force or not first:
            if self._holding:
                self._forced = signum
            else:
                raise ForcedStop(signum)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Signals only counted inside: a checkpoint being written is never cut short."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if not self._holding and self._forced is not None:
            signum, self._forced = self._forced, None
            raise ForcedStop(signum)

    @property
    def signal_name(self) -> Optional[str]:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def __enter__(self) -> "SignalCheckpointer":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalCheckpointer must be entered from the main thread")
        for s in self.signals + self.force:
            if s == signal.SIGHUP and signal.getsignal(s) is signal.SIG_IGN:
                continue  # nohup's choice: the run outlives its terminal
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for s, handler in self._previous.items():
            # None means a handler installed outside python: the closest we can restore is the default.
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()


class _WriteFailed(Exception):
    """torch.save failed after our file object raised; carries that OSError."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _HashingWriter:
    """File object for torch.save that hashes and counts the bytes as they are written (no second read)."""

    def __init__(self, f: Any):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as exc:
            # torch catches this inside its C++ writer and raises its own error; keep the real cause.
            self.error = self.error or exc
            raise
        self.sha.update(data)
        self.bytes += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self.f.flush()


def _write_state(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(payload, writer)
            f.flush()
            os.fsync(f.fileno())
        except Exception as exc:
            if writer.error is not None and writer.error is not exc:
                raise _WriteFailed(writer.error) from exc
            raise
    size = path.stat().st_size
    if size != writer.bytes:
        raise OSError(errno.EIO, f"{path.name}: wrote {writer.bytes} bytes but the file has {size}")
    return {"bytes": size, "sha256": writer.sha.hexdigest()}


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # filesystems without directory fsync
            raise
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the complete temporary directory to its final name, swapping out an existing one of the same step."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f"{_OLD_PREFIX}{final.name}-", dir=final.parent))
        os.rmdir(old)
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if old is not None:
            os.rename(old, final)
        raise
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(ckpt_dir: Path, keep: int, written: Path) -> None:
    """Delete complete checkpoints beyond the ``keep`` highest steps (never ``written``).

    Failures only warn: the new checkpoint is already durable.
    """
    # another run's checkpoint copied in is neither counted nor deleted: keep applies to this run's own
    own = manifest_run_uid(written)
    complete = [p for p in _complete_or_not(ckpt_dir) if (p / MANIFEST_FILE).is_file()
                and (own is None or manifest_run_uid(p) in (own, None))]
    for path in complete[keep:]:
        if path == written:
            continue
        try:
            shutil.rmtree(path)
            log.info("pruned checkpoint %s (keep=%d)", path, keep)
        except OSError as exc:
            log.warning("could not prune checkpoint %s: %s", path, _why(exc))


def _clean_leftovers(ckpt_dir: Path) -> None:
    """Remove ``.tmp-*`` directories of interrupted writes; put back an ``.old-*`` whose swap was interrupted."""
    for path in sorted(ckpt_dir.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith(_TMP_PREFIX):
            log.warning("removing %s, left by an interrupted checkpoint write", path)
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(_OLD_PREFIX):
            final = ckpt_dir / path.name[len(_OLD_PREFIX):].rsplit("-", 1)[0]
            if _STEP_RE.match(final.name) and not final.exists():
                log.warning("restoring %s from %s, left by an interrupted re-save", final, path)
                try:
                    os.rename(path, final)
                except OSError as exc:
                    log.warning("could not restore %s: %s", final, _why(exc))
            else:
                shutil.rmtree(path, ignore_errors=True)


def _complete_or_not(ckpt_dir: Path) -> list[Path]:
    """``step_*`` directories of ``ckpt_dir``, highest step first (temporary directories excluded)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def _dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def _why(exc: BaseException) -> str:
    if isinstance(exc, _WriteFailed):
        exc = exc.error
    if isinstance(exc, OSError) and exc.errno is not None:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or os.strerror(exc.errno)} [errno {errno.errorcode.get(exc.errno, exc.errno)}]{where}"
    return str(exc)


def _check_plain(obj: Any, where: str) -> None:
    """Raise TypeError naming the first value a weights_only load could not read back."""
    kind = type(obj)
    if kind in _TENSORS or kind in _SCALARS:
        return
    if kind in (dict, OrderedDict):
        for k, v in obj.items():
            _check_plain(k, f"{where} key {k!r}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if kind in (list, tuple, set):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {kind.__module__}.{kind.__qualname__}; checkpoints hold only tensors and plain "
                    f"python values (loaded with weights_only=True): pass a state_dict() or convert it")
