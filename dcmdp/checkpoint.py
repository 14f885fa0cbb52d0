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

The run folder around the checkpoints (its lock, run.json, what ``overwrite=true`` clears) is in
dcmdp/run_folder.py, the names both share and the checkpoint errors in dcmdp/checkpoint_layout.py; both are
importable from here as before.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from types import FrameType
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch

# the parts, importable from here as before
from dcmdp.checkpoint_layout import (_OLD_PREFIX, _STEP_RE, _TMP_PREFIX, FORMAT_VERSION, MANIFEST_FILE,  # noqa: F401
                                     STATE_FILE, CheckpointError, CheckpointInputError, _complete_or_not,
                                     checkpoint_run_uid, manifest_run_uid)
from dcmdp.run_folder import (CONFIG_FALLBACK, CONFIG_FILE, CONFIG_HEADER, LOCK_FILE, MAX_METADATA_BYTES,  # noqa: F401
                              RUN_FILE, RUN_FILES, RUN_OUTPUTS, RunFolderError, RunFolderInputError, RunFolderLock,
                              RunPathInputError, clear_run_folder, lock_holders, new_run_uid, probe_folder,
                              read_run_file, run_in_folder, unclaimed_outputs, unwritable_run_paths,
                              write_config_yaml, write_run_file)
from dcmdp.redact import public_command  # noqa: F401
from trainers.jsonfile import read_small_json

log = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 20

# Exactly these types (not subclasses: np.float64 subclasses float but unpickles through numpy).
_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


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
