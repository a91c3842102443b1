"""The ranks Lightning's launcher starts (``--trainer.devices N`` without torchrun), and how they end: each dies
with the process that started it (Linux's parent-death signal); that process, rank 0, says in one line which
rank ended where Lightning's watcher sees it first, and at its own end waits for them, 30 s in all
(docs/resume.md, "How a run stops"). Light on purpose (no torch): the CLI calls ``die_with_launcher`` first."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

# Set by the CLI to its own pid; the ranks Lightning's launcher starts inherit it with their environment.
LAUNCHER_PID = "GPT_LIGHTNING_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How long rank 0, its own work done, waits in all for the ranks it started before it kills them.
FINISH_WAIT_S = 30.0


def die_with_launcher() -> None:
    """In a rank Lightning's launcher started (``LOCAL_RANK`` > 0, not torchrun's, which ends its own): SIGKILL
    once the process that started it ends, whatever ended it; where it already has, exit at once."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    os.environ[LAUNCHER_PID] = str(os.getpid())  # for the ranks this process may start
    child = os.environ.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ
    if not (child and launcher.isdigit() and sys.platform.startswith("linux")):
        return
    if os.getppid() == int(launcher):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher) and not _alive(int(launcher)):  # else started by a process in between
        print(
            f"gpt-lightning: the process that started this rank (pid {launcher}) has ended; so does this one.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _killed_by(code: int) -> str | None:
    """The name of the signal a process that exited with ``code`` died of; None where it exited."""
    return signal.Signals(-code).name if -code in signal.valid_signals() else None


def _stop_signal(code: int) -> signal.Signals | None:
    """SIGTERM or SIGINT, where a process that exited with ``code`` was stopped by one (died of it, or exited 143 / 130)."""
    return next((s for s in (signal.SIGTERM, signal.SIGINT) if code in (-s, 128 + s)), None)


def _how(code: int) -> str:
    return f"killed by {_killed_by(code)}" if _killed_by(code) else f"exit code {code}"


# Where a rank was killed by a signal, its log has nothing of it: said in place of pointing at that log.
_SILENT = (
    "a signal from outside the run (a scheduler, a user, the out-of-memory killer), which leaves nothing in its log"
)


def went_away_message(what: str, error_file: object = None, killed_by: str | None = None) -> str:
    """The survivor's one line: which rank says it, what it saw, where the rest is, and how to resume."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
    world = os.environ.get("WORLD_SIZE")
    why = (
        f"{killed_by} is {_SILENT}"
        if killed_by
        else "the log of the rank that failed says why (killed, out of memory, a lost node, hung)"
    )
    return (
        f"another rank of this run went away, and this one (rank {rank}{f' of {world}' if world else ''}) "
        f"stopped ({what}{f'; the whole error is in {error_file}' if error_file else ''}): {why}. Run the same "
        "command with --ckpt_path last to resume from the last checkpoint (under torchrun, --max-restarts does "
        "this by itself; see docs/resume.md)."
    )


class LaunchedRanks:
    """The ranks Lightning's launcher started in one run of the CLI, seen from rank 0. ``ending``: this run ends
    by its own flow (stopped, finished, failed), so a rank's end is no news for the launcher's watcher."""

    current: LaunchedRanks | None = None  # the newest run's: what ``run_ends`` marks

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.ending = False
        LaunchedRanks.current = self

    def started(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs

    def ended(self, procs: list[subprocess.Popen]) -> None:
        """In Lightning's watcher (it polls every 5 s), a rank seen ended non-zero: ``end_because`` it, where
        Lightning's own SIGKILL gave 137. Nothing once this run ends by its own flow: no news."""
        if not self.ending:
            rank, proc = next((i, p) for i, p in enumerate(procs, 1) if p.returncode)
            self.end_because(
                proc, f"Lightning's launcher saw rank {rank} (pid {proc.pid}) end: {_how(proc.returncode)}"
            )

    def end_because(self, proc: subprocess.Popen, what: str) -> None:
        """One line, the other ranks killed, and the exit: 143 / 130 where a SIGTERM or Ctrl-C ended rank ``proc``
        (before its fit set up: a group signal at startup reaches every rank), else 1."""
        stop = _stop_signal(proc.returncode)
        line = (
            f"stopped by {stop.name} ({what}) before training: nothing new to save. Run the same command with "
            "--ckpt_path last to start (or resume) from where it was."
            if stop
            else f"error: {went_away_message(what, killed_by=_killed_by(proc.returncode))}"
        )
        print(f"gpt-lightning: {line}", file=sys.stderr, flush=True)
        for other in self.procs:
            other.kill()
        sys.stdout.flush()
        os._exit(128 + stop if stop else 1)

    def finish(self, code: int) -> bool:
        """Rank 0's own work done (exit ``code``): waits up to ``FINISH_WAIT_S`` in all for the ranks it started
        and kills those still running then. Where one ended otherwise than ``code``, says so in one line: True."""
        self.ending = True
        deadline, failed = time.monotonic() + FINISH_WAIT_S, []
        for rank, proc in enumerate(self.procs, 1):
            try:
                proc.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                failed.append(f"rank {rank} (pid {proc.pid}) still ran {FINISH_WAIT_S:.0f} s later and was killed")
                continue
            if proc.returncode != code:
                silent = f" ({_SILENT})" if _killed_by(proc.returncode) else ""
                failed.append(f"rank {rank} (pid {proc.pid}) ended with {_how(proc.returncode)}{silent}")
        if failed:
            done = "finished" if code == 0 else f"stopped ({_how(code)})"
            logged = ": its log says why" if any(not entry.endswith(f"{_SILENT})") for entry in failed) else ""
            print(
                f"gpt-lightning: error: this rank {done}, but {'; '.join(failed)}{logged}.",
                file=sys.stderr,
                flush=True,
            )
        return bool(failed)


def signal_that_ended_a_rank(within: float = 2.0) -> str | None:
    """On rank 0, told by a collective that a peer is gone: waits up to ``within`` s for a rank it started to end.
    One a SIGTERM or Ctrl-C ended stops the run (``LaunchedRanks.end_because``); else the name of the signal that
    killed it, or None. The launcher's watcher stays quiet from here: this rank says the line."""
    run_ends()
    ranks, deadline = LaunchedRanks.current, time.monotonic() + within
    while ranks is not None and ranks.procs and time.monotonic() < deadline:
        if ended := [(i, p) for i, p in enumerate(ranks.procs, 1) if p.poll() is not None]:
            rank, proc = max(ended, key=lambda item: item[1].returncode != 0)  # one that failed, if any
            if _stop_signal(proc.returncode):
                ranks.end_because(proc, f"rank {rank} (pid {proc.pid}) ended: {_how(proc.returncode)}")
            return _killed_by(proc.returncode)
        time.sleep(0.05)
    return None


def run_ends() -> None:
    """This process's run ends by its own flow now: the launcher's watcher stays quiet from here."""
    if LaunchedRanks.current is not None:
        LaunchedRanks.current.ending = True
