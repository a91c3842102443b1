"""``Preemption``: on SIGTERM (a scheduler stopping the job) or Ctrl-C, finish the optimizer step in
flight, save ``last.ckpt`` there, and stop with exit code 143 (SIGTERM) or 130 (SIGINT).

Lightning 2.6 alone turns SIGTERM into a ``SystemExit(0)`` at the next batch with no checkpoint, and
under DDP broadcasts a flag and reads it on the host before every micro-batch. This callback replaces
Lightning's handler for the fit (Lightning restores the previous handlers when the fit ends), turns
that per-micro-batch broadcast off, and agrees between ranks once per optimizer step over a CPU (gloo)
process group of its own: no device work and no device-to-host read.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from gpt_lightning.lightning_internals import skip_sigterm_broadcast

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """Raised out of ``trainer.fit`` once the checkpoint is saved. Uncaught, the process exits with
    ``code`` = 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a process the signal
    had killed reports it, so a job script can tell a stop from a finished run and requeue.

    Args:
        signum: the signal that stopped the run.
        ckpt_path: the checkpoint saved at the step reached; None when the signal came before this
            fit trained a step (there was nothing new to save).
        step: that step (``trainer.global_step``).
    """

    def __init__(self, signum: int, ckpt_path: str | None, step: int) -> None:
        super().__init__(128 + signum)
        self.signum, self.ckpt_path, self.step = signum, ckpt_path, step


class Preemption(Callback):
    """Saves ``last.ckpt`` at the end of the optimizer step during which SIGTERM or SIGINT arrived
    (a signal mid-accumulation lets that step's remaining micro-batches run first, so the resume is
    exact), then raises ``Preempted``. A second Ctrl-C interrupts at once, as without this callback.

    With several processes a signal may reach every rank or only one: each rank posts its flag in a
    non-blocking all-reduce (MAX) at the end of every optimizer step and reads the result at the end
    of the next one, so all ranks stop at the same step, one step after the signal, without waiting.
    A signal before the first step (the checkpoint's restore, the sanity check) stops the run at
    train start with nothing saved. One during a validation is acted on at the end of the next
    optimizer step; the validation due at the step where the run stops is not redone by the resume.
    List it after your other callbacks, so they see the saved step's ``on_train_batch_end`` too.

    Args:
        dirpath: folder of the ``last.ckpt`` written; default: that of the trainer's
            ``ModelCheckpoint`` (where ``--ckpt_path last`` looks), else ``default_root_dir/checkpoints``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.signum = 0  # the first stop signal received by this process, 0: none
        self._step = -1
        self._group: Any = None
        self._flag = np.zeros(1, dtype=np.int32)  # shared with the all-reduce's CPU tensor: read without a dispatch
        self._pending: Any = None

    # --- signals ------------------------------------------------------------------------------------
    def _handle(self, signum: int, _: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without a checkpoint
        if not self.signum:
            self.signum = signum
            then = ("stopping before the first training step" if self._step < 0 else
                    "saving a checkpoint at the end of this optimizer step, then stopping")
            print(f"gpt-lightning: {signal.Signals(signum).name} received; {then}.", file=sys.stderr, flush=True)

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._listen(trainer)
        if self.signum:  # Lightning's handler took it: its evaluation loop would exit 0 at the first batch
            self._stop(trainer, self.signum, save=False)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._listen(trainer)
        self._step = trainer.global_step
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            skip_sigterm_broadcast(trainer)
            self._group = dist.new_group(backend="gloo")  # every rank calls it, in the same order
            self._pending = None
        signum = self._agreed_now()
        if signum:  # during the sanity check or the restore: no step of this fit to save
            self._stop(trainer, signum, save=False)

    def _listen(self, trainer: Trainer) -> None:
        """Our handlers in place of Lightning's (registered just before the sanity check), which would
        end the fit with exit code 0 and no checkpoint; a SIGTERM Lightning's handler caught counts."""
        if trainer.received_sigterm and not self.signum:
            self.signum = signal.SIGTERM
        for signum in STOP_SIGNALS:
            try:
                signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals cannot be handled here
                pass

    # --- agreeing and stopping ----------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step:
            return  # mid-accumulation: the optimizer step is not done yet
        self._step = trainer.global_step
        signum = self._agreed_signal()
        if signum:
            self._stop(trainer, signum)

    def _agreed_signal(self) -> int:
        """The signal every rank acts on now: this process's own with one process; with several, the
        largest posted by any rank at the previous optimizer step (the all-reduce had a step to run)."""
        if self._group is None:
            return self.signum
        agreed = 0
        if self._pending is not None:
            self._pending.wait()
            agreed = int(self._flag[0])
        self._flag[0] = self.signum
        self._pending = dist.all_reduce(torch.from_numpy(self._flag), op=dist.ReduceOp.MAX, group=self._group,
                                        async_op=True)
        return agreed

    def _agreed_now(self) -> int:
        """The largest signal any rank has received, waiting for every rank: once, at train start."""
        if self._group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())  # a CPU tensor: no device read

    def last_path(self, trainer: Trainer) -> str:
        """Where the checkpoint goes: ``last.ckpt`` beside the trainer's ``ModelCheckpoint`` files."""
        if self.dirpath is not None:
            return os.path.join(self.dirpath, "last.ckpt")
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")

    def _stop(self, trainer: Trainer, signum: int, save: bool = True) -> None:
        path = self.last_path(trainer) if save else None
        if path is not None:
            trainer.save_checkpoint(path, weights_only=False)  # every rank: a collective under FSDP2
        if trainer.is_global_zero:
            name = signal.Signals(signum).name
            saved = (f"at step {trainer.global_step}; saved {path}. Resume with --ckpt_path last (the gpt-lightning "
                     f"command) or ckpt_path={path!r} (your own Trainer or LightningCLI)." if path else
                     f"before this run trained a step: nothing new to save. Run the same command again to start "
                     f"(or resume) from where it was.")
            print(f"gpt-lightning: stopped by {name} {saved}", file=sys.stderr, flush=True)
        self._pending = None
        raise Preempted(signum, path, trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:  # every rank posted the same number of flags: this returns
            self._pending.wait()
            self._pending = None
