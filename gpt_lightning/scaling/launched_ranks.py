"""How a ``gpt-lightning`` process ends outside training (docs/resume.md): a rank Lightning's launcher
started dies with the process that started it (Linux's parent-death signal), and one path only says how
it ends. Light on purpose (no torch): the CLI calls it first."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Set by the CLI to its own pid; the ranks Lightning's launcher starts inherit it with their environment.
LAUNCHER_PID = "GPT_LIGHTNING_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
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


@contextmanager
def cli_run() -> Iterator[None]:
    """One run of the CLI, in its own process or in a caller's (a notebook's ``main()``, run again and again):
    it starts from no earlier run's state, and leaves the environment as it found it."""
    previous = os.environ.get(LAUNCHER_PID)
    with _claim_lock:
        _claimed_by.clear()
    _launched.clear()
    die_with_launcher()
    try:
        yield
    finally:
        claim_the_end()  # over: a launcher's watcher left behind must not end the caller's process
        if previous is None:
            os.environ.pop(LAUNCHER_PID, None)
        else:
            os.environ[LAUNCHER_PID] = previous
