"""A rank that went away (killed, out of memory, lost, hung), noticed by a collective: the CLI ends each
survivor with one line naming a file with the full error and how to resume (where Lightning's launcher
notices first: launched_ranks.py), and gives each strategy ``PROCESS_GROUP_TIMEOUT`` (docs/multi-gpu.md)."""

from __future__ import annotations

import inspect
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import StrategyRegistry

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.errors import UserError
from gpt_lightning.stopping.launched_ranks import signal_that_ended_a_rank, went_away_message

# How long a rank waits at a collective for the others (what a hung rank, or a dead one under NCCL, costs
# the survivors); long enough for one rank's slower first compile or rank 0 writing a whole DDP checkpoint.
# torch's own default for NCCL; Lightning's is 30 minutes.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)

# What gloo's transport raises (a plain RuntimeError) when the other end of a pair is gone: killed
# ("Connection closed by peer", as seen with a SIGKILLed rank), or hung past the timeout.
GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")
# NCCL's error for a peer that exited (ncclRemoteError), raised as a DistBackendError.
NCCL_PEER_GONE = ("ncclRemoteError", "remote process exited")
# Set on an exception by ``PeerGoneReport``: the file its traceback goes to.
ERROR_FILE_ATTRIBUTE = "gpt_lightning_error_file"
# Set on an exception by ``Preemption``: the stop signal this rank had received when a peer went away.
STOP_SIGNAL_ATTRIBUTE = "gpt_lightning_stop_signal"


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
    """Marks a gone peer's error in a fit (at a barrier before setup, the restore, any step) with its traceback
    file, ``error-rank<N>.txt`` in the log directory (before setup, where that is not known yet: in the trainer's
    ``default_root_dir``), for ``exit_if_peer_went_away``. Attached by the CLI."""

    def __init__(self) -> None:
        self._log_dir: Path | None = None  # known once every rank is in this fit's setup

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank is here

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if peer_went_away(exception):
            log_dir = self._log_dir or Path(trainer.default_root_dir)
            setattr(exception, ERROR_FILE_ATTRIBUTE, log_dir / f"error-rank{trainer.global_rank}.txt")
        self._log_dir = None  # a later fit with this callback finds its own

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._log_dir = None


def exit_if_peer_went_away(err: BaseException) -> None:
    """For an error ``PeerGoneReport`` marked: write its traceback to the file, print the one line and exit 1;
    where this rank had a stop signal too (a group signal that ended the peer before its fit set up, or torchrun
    ending the ranks left after one was killed), the stop's line and 143 / 130. Returns for any other error,
    which the caller re-raises with its traceback."""
    if signum := getattr(err, STOP_SIGNAL_ATTRIBUTE, 0):
        print(
            f"gpt-lightning: stopped by {signal.Signals(signum).name}; another rank of this run went away meanwhile "
            "(ended by the same signal before its fit set up, or killed), so no checkpoint could be saved now. Run "
            "the same command with --ckpt_path last to start (or resume) from the last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)  # as below: the groups' destructors would wait for the rank that is gone
    error_file = getattr(err, ERROR_FILE_ATTRIBUTE, None)
    if error_file is None:
        return
    try:
        atomic_write_bytes(Path(error_file), "".join(traceback.format_exception(err)).encode())
    except (OSError, UserError) as write_err:  # a full or read-only disk must not hide the line
        error_file = f"nowhere ({write_err})"
    first_line = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    what = f"{type(err).__name__}: {first_line}"
    print(
        f"gpt-lightning: error: {went_away_message(what, error_file, killed_by=signal_that_ended_a_rank())}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    # Not SystemExit: at exit the process groups' destructors join threads still waiting on the rank
    # that went away (a gloo group's for up to its timeout). Lightning's teardown has run already.
    os._exit(1)


def shorten_strategy_timeouts() -> None:
    """Give every strategy Lightning builds from a name (``ddp``, or ``auto`` on several devices)
    ``PROCESS_GROUP_TIMEOUT``. A strategy given as a class keeps its own. Called by the CLI only."""
    for name, entry in list(StrategyRegistry.items()):
        strategy, init_params = entry["strategy"], entry["init_params"]
        if "timeout" in inspect.signature(strategy).parameters and "timeout" not in init_params:
            StrategyRegistry.register(
                name, strategy, entry.get("description"), override=True, timeout=PROCESS_GROUP_TIMEOUT, **init_params
            )
