"""A user's reward function run in a worker process the trainer can always stop.

A reward runs arbitrary code: a loop whose bare ``except:`` swallows every exception (the timeout's and a
KeyboardInterrupt included), a call blocked in C code, a helper process it forks. In the trainer's own process
nothing can stop such code but ``kill -9``, which loses the run's last checkpoint and leaves its MLflow run RUNNING.
So each ``JsonlTask`` calls its reward in one persistent worker process (``RewardWorker``), started with the
trainer's interpreter and working directory, in a session of its own:

- the trainer waits at most ``task.reward_timeout`` seconds per call (``multiprocessing.connection.wait``) and
  ``task.reward_load_timeout`` for the worker to start and import the reward; past it, the worker's whole process
  group gets SIGKILL (a reward's forked helpers with it) and the call counts as a timeout (``RewardTimeout``); the
  next call starts a fresh worker;
- the worker's resident memory, with every process below it, is read from ``/proc`` every ``MEMORY_POLL`` seconds
  while the trainer waits and after each call; past ``task.reward_memory_mib`` the worker is killed the same way and
  the call fails with ``RewardMemoryExceeded`` (a leaking reward would otherwise grow until the machine runs out,
  taking other users' processes with it). Linux only; a reward that allocates faster than the poll overshoots by
  what it allocates in ``MEMORY_POLL`` seconds;
- the trainer's signal handlers run while it waits, so a second SIGINT (or a SIGQUIT) stops the run at once: the
  worker is killed on the way out, the run checkpoints and ends its MLflow run;
- a terminal's Ctrl-C reaches only the trainer (the worker is in another session), and the worker ends with the
  trainer (``PR_SET_PDEATHSIG`` on Linux, and it exits when its pipe closes);
- the worker inherits no descriptor but its two pipes: not the run folder's lock, which a reward's helper process
  could otherwise hold after the run;
- the reward gets a copy of its record (pickled), so it cannot change the data set, and changing the worker's
  working directory or signal handlers changes nothing in the trainer.

Protocol (pickled tuples over two pipes): the trainer sends ``(prompt, completion, record)``; the worker answers
``("ready",)`` once after importing the reward, then per call ``("value", float)``, ``("bad", why)`` (not a finite
real number), ``("raised", type name, message, traceback)`` or ``("exited", code)`` (``sys.exit``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Optional

# how long a worker may take to start and import the reward module when no load timeout is given
START_TIMEOUT = 60.0
# seconds between two reads of the worker's memory while the trainer waits for it
MEMORY_POLL = 0.05
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RewardTimeout(BaseException):
    """A reward call (or the worker's start and the reward's import) ran past its limit and the worker was killed:
    ``args`` = (the limit in seconds, the setting that holds it)."""


class RewardRaised(Exception):
    """The reward raised in the worker: its exception's type name, message and formatted traceback."""

    def __init__(self, type_name: str, message: str, tb: str):
        super().__init__(message)
        self.type_name, self.message, self.traceback = type_name, message, tb


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in the worker, as the cause of the ``RewardRaised`` that reports it (a
    logged traceback then shows the reward's own frames)."""

    def __str__(self) -> str:
        return f"\n\n{self.args[0].rstrip()}\n(in the reward's worker process)"


def _raised(reply: tuple) -> RewardRaised:
    err = RewardRaised(*reply[1:])
    err.__cause__ = _RemoteTraceback(reply[3])
    return err


class RewardExited(Exception):
    """The reward called ``sys.exit`` (its code), or its worker process died (code None, ``signal`` set)."""

    def __init__(self, code: Any, died: Optional[str] = None):
        super().__init__(code)
        self.code, self.died = code, died


class RewardNotNumber(Exception):
    """The reward returned something that is not a finite real number (``why`` says what)."""


class RewardMemoryExceeded(Exception):
    """The worker (with the processes below it) held more than its limit: ``limit_mib``, ``used_mib``. It was
    killed; the next call starts a new one."""

    def __init__(self, limit_mib: float, used_mib: float):
        super().__init__(f"{used_mib:.0f} MiB > {limit_mib:g} MiB")
        self.limit_mib, self.used_mib = limit_mib, used_mib


def resident_mib(pid: int) -> float:
    """Resident memory of process ``pid`` and of every process below it, in MiB (Linux ``/proc``; 0.0 where it is
    not readable)."""
    pages, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/statm") as f:
                pages += int(f.read().split()[1])
            for thread in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{thread}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue  # it ended while being read
    return pages * _PAGE / 2**20


class RewardWorker:
    """The worker process of one reward function (``spec``: ``module:function`` or ``file.py:function``): each call
    may take ``timeout`` seconds, the start (the reward's import) ``load_timeout``; the worker may hold
    ``memory_limit_mib`` MiB (None: no limit)."""

    def __init__(self, spec: str, timeout: float, *, load_timeout: float = START_TIMEOUT,
                 memory_limit_mib: Optional[float] = None):
        self.spec, self.timeout, self.load_timeout = spec, timeout, load_timeout
        self.memory_limit_mib = memory_limit_mib
        self._proc: Optional[subprocess.Popen] = None
        self._send: Optional[Connection] = None
        self._recv: Optional[Connection] = None
        self._lock = threading.Lock()
        self.starts = 0

    def call(self, prompt: str, completion: str, record: dict) -> float:
        """The reward of one completion, or an exception: ``RewardTimeout``, ``RewardRaised``, ``RewardExited``,
        ``RewardNotNumber``, ``RewardMemoryExceeded`` (also when the worker is past its limit after the call).
        Whatever interrupts the wait (a signal's exception) kills the worker first."""
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                self._send.send((prompt, completion, record))
                reply = self._reply(self.timeout)
                self._check_memory()  # a call that returns within one poll is still measured
            except BaseException:
                self.close()
                raise
        kind = reply[0]
        if kind == "value":
            return reply[1]
        if kind == "bad":
            raise RewardNotNumber(reply[1])
        if kind == "raised":
            raise _raised(reply)
        raise RewardExited(reply[1])

    def start(self) -> None:
        """Start the worker and import the reward now (a later call would): RewardTimeout past ``load_timeout``,
        RewardRaised when the import or the function fails (a ``RewardSpecError`` names what), RewardExited when the
        import ends the process, RewardMemoryExceeded."""
        with self._lock:
            try:
                self._start()
            except BaseException:
                self.close()
                raise

    def _check_memory(self) -> None:
        if self.memory_limit_mib is not None and (used := resident_mib(self._proc.pid)) > self.memory_limit_mib:
            self.close()
            raise RewardMemoryExceeded(self.memory_limit_mib, used)

    def _reply(self, seconds: float, setting: str = "task.reward_timeout") -> tuple:
        """The worker's next message within ``seconds``; RewardTimeout (the worker killed) past it, RewardExited
        when it died, RewardMemoryExceeded when it held more than its limit meanwhile."""
        deadline = time.monotonic() + seconds
        # short slices: a worker that died while a helper it forked keeps the pipe open never sends EOF
        poll = MEMORY_POLL if self.memory_limit_mib is not None else 0.5
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RewardTimeout(seconds, setting)
            if wait([self._recv], min(left, poll)):
                try:
                    return self._recv.recv()
                except (EOFError, OSError):
                    break
            if self._proc.poll() is not None:
                break
            self._check_memory()
        code = self._proc.wait()
        self.close()
        died = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise RewardExited(None, died)

    def _start(self) -> None:
        self.close()
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            # close_fds (the default) with only the two pipes passed: no lock or other descriptor of the trainer
            self._proc = subprocess.Popen(
                # -P: the working directory is not put first on the path (as in the trainer, load_reward appends it
                # last, so a local file never shadows an installed module, this one included)
                [sys.executable, "-P", "-m", "trainers.reward_worker", str(to_worker_r), str(from_worker_w),
                 self.spec],
                pass_fds=(to_worker_r, from_worker_w), start_new_session=True, env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self._send = Connection(to_worker_w, readable=False)
        self._recv = Connection(from_worker_r, writable=False)
        self.starts += 1
        reply = self._reply(self.load_timeout, "task.reward_load_timeout")
        if reply[0] != "ready":
            self.close()
            raise _raised(reply) if reply[0] == "raised" else RewardExited(reply[1])

    def close(self) -> None:
        """Kill the worker (and every process of its session's group) and close the pipes."""
        if self._proc is not None:
            try:  # the group outlives a dead worker while a helper it started runs
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._proc.wait()
            self._proc = None
        for conn in (self._send, self._recv):
            if conn is not None:
                conn.close()
        self._send = self._recv = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the trainer dies (a hung reward must not outlive it)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _serve(recv: Connection, send: Connection, spec: str) -> None:
    from trainers.reward_fn import as_number, load_reward

    try:
        fn = load_reward(spec)
    except BaseException as exc:
        send.send(("raised", type(exc).__name__, str(exc), traceback.format_exc()))
        return
    send.send(("ready",))
    cwd = os.getcwd()
    while True:
        try:
            prompt, completion, record = recv.recv()
        except (EOFError, OSError):
            return  # the trainer is gone
        try:
            value, why = as_number(fn(prompt, completion, record))
            reply = ("value", value) if why is None else ("bad", why)
        except SystemExit as exc:
            reply = ("exited", exc.code if isinstance(exc.code, (int, str, type(None))) else repr(exc.code))
        except BaseException as exc:
            reply = ("raised", type(exc).__name__, str(exc), traceback.format_exc())
        if os.getcwd() != cwd:
            os.chdir(cwd)  # each call starts where the trainer is
        send.send(reply)


def main(argv: list[str]) -> None:
    recv_fd, send_fd, spec = int(argv[0]), int(argv[1]), argv[2]
    _die_with_parent()
    # the reward's prints go to the trainer's stderr; stdout is left to nobody (the protocol has its own pipes)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when this process ends
    _serve(Connection(recv_fd, writable=False), Connection(send_fd, readable=False), spec)


if __name__ == "__main__":
    main(sys.argv[1:])
