"""How a ``gpt-lightning`` process ends outside training (docs/resume.md): a rank Lightning's launcher
started dies with the process that started it (Linux's parent-death signal), a SIGTERM or Ctrl-C before
``Preemption`` listens ends it with one line and 143 / 130, and one path only says how it ends.
Light on purpose (no torch): the CLI calls it first."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

# Set by the CLI to its own pid; the ranks Lightning's launcher starts inherit it with their environment.
LAUNCHER_PID = "GPT_LIGHTNING_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long rank 0, its own work done, waits for the ranks it started before ending (which kills them).
FINISH_WAIT_S = 30.0

_claim_lock = threading.Lock()
_claimed_by: list[str] = []  # who says how this process ends: "run" (its own flow) or "watcher"
_launched: list[subprocess.Popen] = []  # the ranks this process's launcher started


def claim_the_end(by: str = "run") -> bool:
    """Whether ``by`` may say how this process ends: the run's own flow (a stop, a gone peer, its finish)
    and the launcher's watcher each say it only where the other has not already begun to."""
    with _claim_lock:
        _claimed_by[:] = _claimed_by or [by]
        return _claimed_by == [by]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_launcher() -> None:
    """In a rank Lightning's launcher started (``LOCAL_RANK`` > 0, not torchrun's, which ends its own): SIGKILL
    once the process that started it ends, whatever ended it; where it already has, exit at once."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    child = os.environ.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ
    os.environ[LAUNCHER_PID] = str(os.getpid())  # for the ranks this process may start
    if not (child and launcher.isdigit() and sys.platform.startswith("linux")):
        return
    if os.getppid() == int(launcher):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() == int(launcher):
            return  # set while the launcher still was this process's parent (or not settable: as before)
    elif _alive(int(launcher)):
        return  # started by another process the launcher started (not one of its ranks)
    print(
        f"gpt-lightning: the process that started this rank (pid {launcher}) has ended; so does this one.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def remember_launched(procs: list[subprocess.Popen]) -> None:
    _launched[:] = procs


def wait_for_launched_ranks(timeout: float = FINISH_WAIT_S) -> None:
    """Rank 0 done (finished or stopped): let the ranks it started finish too before it ends, which kills them."""
    claim_the_end()  # a rank's own end seen meanwhile is no failure to report
    for proc in _launched:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def _where() -> str:
    rank, world = os.environ.get("RANK") or os.environ.get("LOCAL_RANK"), os.environ.get("WORLD_SIZE", "1")
    return f" (rank {rank})" if rank is not None and world != "1" else ""


@contextmanager
def cli_run() -> Iterator[None]:
    """One run of the CLI, in its own process or in a caller's (a notebook's ``main()``, run again and again):
    it starts from no earlier run's state, and leaves the environment and the signal handlers as it found them."""
    previous = os.environ.get(LAUNCHER_PID)
    with _claim_lock:
        _claimed_by.clear()
    _launched.clear()
    die_with_launcher()
    try:
        with StopSignalsBeforeOurs():
            yield
    finally:
        claim_the_end()  # over: a launcher's watcher left behind must not end the caller's process
        if previous is None:
            os.environ.pop(LAUNCHER_PID, None)
        else:
            os.environ[LAUNCHER_PID] = previous


class StoppedOutsideTraining(SystemExit):
    """A SIGTERM or SIGINT with no handler of ``Preemption`` in place: exit code 128 + the signal's number."""


class StopSignalsBeforeOurs:
    """While the CLI runs: a SIGTERM or SIGINT that finds this handler in place (before ``Preemption``'s,
    or after it) prints one line and raises ``StoppedOutsideTraining``. A thread woken through
    ``signal.set_wakeup_fd`` ends the process where the main thread, blocked in C++ (a store at startup),
    has not run the handler ``GRACE_S`` later; never once the ``with`` is left (a caller goes on)."""

    GRACE_S = 3.0

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._writer: socket.socket | None = None
        self._stirred = threading.Event()  # the main thread ran the handler, or left the ``with``
        self._over = False
        self._lock = threading.Lock()  # the ``with`` left: ``_stirred`` stays set
        self._thread: threading.Thread | None = None
        self._said = False
        self._pid = os.getpid()

    def __enter__(self) -> StopSignalsBeforeOurs:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals cannot be handled here
        reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._thread = threading.Thread(
            target=self._watch, args=(reader,), name="gpt-lightning-stop-signals", daemon=True
        )
        self._thread.start()
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        try:
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        except StoppedOutsideTraining:  # a signal already: raised here, no ``__exit__`` follows
            self.__exit__(None)
            raise
        return self

    def _say(self, signum: int) -> bool:
        if self._said or self._over or not claim_the_end():
            return False  # said already, the CLI is over, or the launcher's watcher is ending this process
        self._said = True
        print(
            f"gpt-lightning: stopped by {signal.Signals(signum).name}{_where()} outside training (starting or "
            "finishing): nothing new to save. Run the same command again (with --ckpt_path last) to start or resume.",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a process forked meanwhile (a tokenizing pool's worker): as before
            previous = self._previous.get(signum, signal.SIG_DFL)
            if callable(previous):
                return previous(signum, frame)
            signal.signal(signum, previous)
            os.kill(os.getpid(), signum)
            return None
        self._stirred.set()  # the main thread runs Python: it unwinds by itself
        if self._say(signum):
            raise StoppedOutsideTraining(128 + signum)

    def _watch(self, reader: socket.socket) -> None:
        with reader:
            while data := reader.recv(64):  # a byte per signal; b"" once the CLI is over
                signum = next((s for s in data if s in STOP_SIGNALS and signal.getsignal(s) == self._handle), 0)
                if signum and not self._stirred.wait(self.GRACE_S) and not self._over and claim_the_end():
                    self._say(signum)
                    sys.stdout.flush()
                    os._exit(128 + signum)  # the ranks it started end with it
                with self._lock:
                    if not self._over:
                        self._stirred.clear()  # the next signal's handler run is the one that counts

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if self._writer is None:
            return
        with self._lock:
            self._over = True  # however it ends: an in-process caller goes on
            self._stirred.set()
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        signal.set_wakeup_fd(self._previous_fd)
        self._writer.close()  # the thread reads b"" and ends
        self._writer = None
        if self._thread is not None:
            self._thread.join(timeout=1)
