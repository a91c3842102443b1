"""A rank of a multi-process run that went away (killed, out of memory, a lost node): the survivors'
collective then fails, with gloo a ``RuntimeError`` from its transport a moment later, with NCCL a
``torch.distributed.DistError`` (or the watchdog's abort) at the process group's timeout. The
``gpt-lightning`` command turns that failure into one line that says what happened and how to go on
(``--ckpt_path last``; under torchrun, ``--max-restarts`` relaunches every rank by itself)."""

from __future__ import annotations

import os

import torch.distributed as dist

# What gloo's transport says when the other end of a pair is gone (or stopped answering).
GLOO_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                  "Timed out waiting")


def peer_went_away(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank is gone."""
    if isinstance(err, dist.DistError):  # DistBackendError (NCCL), DistNetworkError, DistStoreError
        return True
    return isinstance(err, RuntimeError) and "gloo" in str(err) and any(words in str(err) for words in GLOO_PEER_GONE)


def went_away_message() -> str:
    """The survivor's one line: which rank says it, and how to resume."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
    world = os.environ.get("WORLD_SIZE")
    return (
        f"another rank of this run went away, and this one (rank {rank}{f' of {world}' if world else ''}) "
        "stopped: the log of the rank that failed says why (killed, out of memory, a lost node). Run the same "
        "command with --ckpt_path last to resume from the last checkpoint (under torchrun, --max-restarts does "
        "this by itself; see docs/resume.md)."
    )
