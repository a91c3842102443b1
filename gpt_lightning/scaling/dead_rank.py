"""A rank that went away (killed, out of memory, lost, hung): the CLI ends each survivor with one line
naming a file with the full error and how to resume, whether a collective or Lightning's launcher notices
first, and sets ``PROCESS_GROUP_TIMEOUT`` (docs/multi-gpu.md)."""

from __future__ import annotations

import faulthandler
import inspect
import os
import signal
import sys
import tempfile
import time
import traceback
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import StrategyRegistry

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import watch_launched_ranks
from gpt_lightning.scaling.launched_ranks import claim_the_end, remember_launched

# How long a rank waits at a collective for the others before it gives up (what a rank that hangs,
# or a dead one under NCCL, costs the survivors). Where healthy ranks wait for each other: a first
# step's compile that takes longer on one rank (GPT-2 XL: minutes), and rank 0 writing a whole DDP
# checkpoint while the others wait at the barrier after it (GPT-2 large, 9 GB: 1.5 min at 100 MB/s).
# (A text's tokenizing in ``prepare_data`` is waited for at Lightning's own gloo barrier, not under it.)
# 10 minutes is torch's own default for NCCL; Lightning's is 30.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)

# What gloo's transport raises (a plain RuntimeError) when the other end of a pair is gone: killed
# ("Connection closed by peer", as seen with a SIGKILLed rank), or hung past the timeout.
GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")
# NCCL's error for a peer that exited (ncclRemoteError), raised as a DistBackendError. Verified by reading.
NCCL_PEER_GONE = ("ncclRemoteError", "remote process exited")
# Set on an exception by ``PeerGoneReport``: the file its traceback goes to.
ERROR_FILE_ATTRIBUTE = "gpt_lightning_error_file"
_error_dir = [Path()]  # where error-rank<N>.txt goes: the run's log directory once training started


def peer_went_away(err: BaseException) -> bool:
    """Whether ``err`` is what a collective raises when another rank is gone (whenever it happened)."""
    if not isinstance(err, RuntimeError) or (
        isinstance(err, dist.DistError) and not isinstance(err, dist.DistBackendError)
    ):
        return False  # the store's and the launch's own errors (DistStoreError, DistNetworkError) included
    text = str(err)
    gloo = "gloo/transport" in text and any(words in text for words in GLOO_PEER_GONE)
    return gloo or (isinstance(err, dist.DistBackendError) and any(words in text for words in NCCL_PEER_GONE))


class PeerGoneReport(Callback):
    """Marks a gone peer's error (after the first optimizer step) with its traceback file,
    ``error-rank<N>.txt`` in the log directory, for ``exit_if_peer_went_away``. Attached by the CLI."""

    def __init__(self) -> None:
        self._error_file: Path | None = None  # set once this fit completed an optimizer step
        self._log_dir, self._start_step = Path(), 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._error_file = None
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # every rank is here: a collective is safe
        _error_dir[0] = self._log_dir
        self._start_step = trainer.global_step  # a resumed run's too

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if self._error_file is None and trainer.global_step > self._start_step:
            self._error_file = self._log_dir / f"error-rank{trainer.global_rank}.txt"

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._error_file is not None and peer_went_away(exception):
            setattr(exception, ERROR_FILE_ATTRIBUTE, self._error_file)


def exit_if_peer_went_away(err: BaseException) -> None:
    """For an error ``PeerGoneReport`` marked: write its traceback to the file, print the one line
    and exit 1. Returns for any other error, which the caller re-raises with its traceback."""
    error_file = getattr(err, ERROR_FILE_ATTRIBUTE, None)
    if error_file is None:
        return
    if not claim_the_end():  # Lightning's launcher saw the rank end first and is saying so
        time.sleep(60)
        os._exit(1)
    try:
        atomic_write_bytes(Path(error_file), "".join(traceback.format_exception(err)).encode())
    except (OSError, UserError) as write_err:  # a full or read-only disk must not hide the line
        error_file = f"nowhere ({write_err})"
    first_line = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    print(
        f"gpt-lightning: error: {went_away_message(f'{type(err).__name__}: {first_line}', error_file)}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    # Not SystemExit: at exit the process groups' destructors join threads still waiting on the rank
    # that went away (a gloo group's for up to its timeout). Lightning's teardown has run already.
    os._exit(1)


def went_away_message(what: str, error_file: object) -> str:
    """The survivor's one line: which rank says it, what it saw, where the rest is, and how to resume."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
    world = os.environ.get("WORLD_SIZE")
    return (
        f"another rank of this run went away, and this one (rank {rank}{f' of {world}' if world else ''}) "
        f"stopped ({what}; the whole error is in {error_file}): the log of "
        "the rank that failed says why (killed, out of memory, a lost node, hung). Run the same "
        "command with --ckpt_path last to resume from the last checkpoint (under torchrun, --max-restarts does "
        "this by itself; see docs/resume.md)."
    )


def shorten_strategy_timeouts(timeout: timedelta = PROCESS_GROUP_TIMEOUT) -> None:
    """Give every strategy Lightning builds from a name (``ddp``, or ``auto`` on several devices)
    ``timeout`` as its process group's timeout. A strategy given as a class keeps its own. Called by the CLI only.

    Args:
        timeout: how long a rank waits at a collective for the others.
    """
    for name, entry in list(StrategyRegistry.items()):
        strategy, init_params = entry["strategy"], entry["init_params"]
        if "timeout" in inspect.signature(strategy).parameters and "timeout" not in init_params:
            StrategyRegistry.register(
                name, strategy, entry.get("description"), override=True, timeout=timeout, **init_params
            )


def report_launched_rank_ends() -> AbstractContextManager[None]:
    """Where Lightning's launcher, not a collective, notices first that a rank it started ended, rank 0
    says so in our line too (``_launched_rank_ended``), in the ``with``. Called by the CLI only."""
    return watch_launched_ranks(remember_launched, _launched_rank_ended)


def _launched_rank_ended(procs: list) -> bool:
    """In the launcher's watcher thread, a rank having ended non-zero: the line, then the end of every
    rank (exit 1; 143 / 130 where that rank was stopped by a signal). False: this process is ending already."""
    if not claim_the_end("watcher"):
        return False  # its own flow is ending it (finished, stopped, or a gone peer said)
    rank, proc = next((i + 1, p) for i, p in enumerate(procs) if p.returncode)
    code = proc.returncode
    how = f"exit code {code}"
    if code < 0 and -code in signal.valid_signals():
        how = f"killed by {signal.Signals(-code).name}"
    for other in procs:
        if other.poll() is None:
            other.kill()
    if code in (128 + signal.SIGTERM, 128 + signal.SIGINT):  # its line says so: stopped outside training
        print(
            f"gpt-lightning: rank {rank} was stopped by {signal.Signals(code - 128).name} before the ranks could "
            "agree, and so is this one: nothing new to save. Run the same command again (with --ckpt_path last) "
            "to start or resume.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(code)
    error_file = _error_dir[0].absolute() / f"error-rank{os.environ.get('RANK') or '0'}.txt"
    with tempfile.TemporaryFile() as stacks:
        faulthandler.dump_traceback(stacks, all_threads=True)
        stacks.seek(0)
        report = (
            f"Lightning's launcher saw rank {rank} (pid {proc.pid}) end: {how}.\nWhere this rank's threads were:\n"
        ).encode() + stacks.read()
    try:
        atomic_write_bytes(error_file, report)
    except (OSError, UserError) as write_err:
        error_file = f"nowhere ({write_err})"
    what = f"Lightning's launcher saw rank {rank} (pid {proc.pid}) end: {how}"
    print(f"gpt-lightning: error: {went_away_message(what, error_file)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
