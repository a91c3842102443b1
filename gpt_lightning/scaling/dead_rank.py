"""A rank of a multi-process run that went away (killed, out of memory, a lost node): the survivors'
collective then fails, with gloo a ``RuntimeError`` from its transport a moment later, with NCCL a
``torch.distributed.DistError`` (or the watchdog's abort) at the process group's timeout. The
``gpt-lightning`` command turns that failure into one line that says what happened and how to go on
(``--ckpt_path last``; under torchrun, ``--max-restarts`` relaunches every rank by itself), and sets
that timeout to ``PROCESS_GROUP_TIMEOUT`` instead of Lightning's 30 minutes."""

from __future__ import annotations

import inspect
import os
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

# How long a rank waits at a collective for the others before it gives up (what a rank that hangs,
# or a dead one under NCCL, costs the survivors). Where healthy ranks wait for each other: a first
# step's compile that takes longer on one rank (GPT-2 XL: minutes), and rank 0 writing a whole DDP
# checkpoint while the others wait at the barrier after it (GPT-2 large, 9 GB: 1.5 min at 100 MB/s).
# 10 minutes is torch's own default for NCCL; Lightning's is 30.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)

# What gloo's transport says when the other end of a pair is gone (or stopped answering).
GLOO_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                  "Timed out waiting")
# Failures of the launch itself, not of a peer: their own traceback says what to fix.
STARTUP_FAILURES = ("EADDRINUSE", "address already in use")


def peer_went_away(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank is gone."""
    if isinstance(err, dist.DistError):  # DistBackendError (NCCL), DistNetworkError, DistStoreError
        return not any(words in str(err) for words in STARTUP_FAILURES)
    return isinstance(err, RuntimeError) and "gloo" in str(err) and any(words in str(err) for words in GLOO_PEER_GONE)


def went_away_message(err: BaseException) -> str:
    """The survivor's one line: which rank says it, the error's first line, and how to resume."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
    world = os.environ.get("WORLD_SIZE")
    return (
        f"another rank of this run went away, and this one (rank {rank}{f' of {world}' if world else ''}) "
        f"stopped ({type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}): the log of "
        "the rank that failed says why (killed, out of memory, a lost node). Run the same "
        "command with --ckpt_path last to resume from the last checkpoint (under torchrun, --max-restarts does "
        "this by itself; see docs/resume.md)."
    )


def shorten_strategy_timeouts(timeout: timedelta = PROCESS_GROUP_TIMEOUT) -> None:
    """Give every strategy Lightning builds from a name (``--trainer.strategy ddp``, or ``auto`` on
    several devices, which becomes ``ddp``) ``timeout`` as its process group's timeout, through
    Lightning's public registry of names. A strategy given as a class (``--trainer.strategy.class_path
    DDPStrategy --trainer.strategy.init_args.timeout 0:30:00``) keeps its own. Called by the CLI only."""
    for name, entry in list(StrategyRegistry.items()):
        strategy, init_params = entry["strategy"], entry["init_params"]
        if "timeout" in inspect.signature(strategy).parameters and "timeout" not in init_params:
            StrategyRegistry.register(name, strategy, entry.get("description"), override=True, timeout=timeout,
                                      **init_params)
