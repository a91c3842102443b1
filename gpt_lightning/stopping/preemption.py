"""``Preemption``: on SIGTERM or Ctrl-C, finish the optimizer step in flight, save ``last.ckpt`` and
exit 143 / 130, where Lightning alone exits 0 unsaved. Ranks agree once per step over a gloo group of
their own, in place of Lightning's per-micro-batch device broadcast (docs/resume.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from gpt_lightning.lightning_internals import process_group_timeout, skip_sigterm_broadcast
from gpt_lightning.stopping.dead_rank import PROCESS_GROUP_TIMEOUT, STOP_SIGNAL_ATTRIBUTE, peer_went_away
from gpt_lightning.stopping.launched_ranks import run_ends

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long a rank whose side group failed at once waits before agreeing over the default group, so
# that ranks still waiting in the group's creation (up to its timeout) get there before it gives up.
_FAILED_EARLY_WAIT_S = 5.0


class Preempted(SystemExit):
    """Raised out of ``trainer.fit`` once ``ckpt_path`` (None when no step was trained) holds ``step``; exit code
    128 + ``signum`` (143 for SIGTERM, 130 for SIGINT), so a job script can tell a stop from a finished run."""

    def __init__(self, signum: int, ckpt_path: str | None, step: int) -> None:
        super().__init__(128 + signum)
        self.signum, self.ckpt_path, self.step = signum, ckpt_path, step


class Preemption(Callback):
    """Saves ``last.ckpt`` at the end of the optimizer step during which SIGTERM or SIGINT arrived,
    then raises ``Preempted``. A second Ctrl-C interrupts at once.

    List it after your other callbacks, so they see the saved step's ``on_train_batch_end`` too;
    what a signal does at each stage of a run: docs/resume.md.

    Args:
        dirpath: folder of the ``last.ckpt`` written; default: that of the trainer's
            ``ModelCheckpoint`` (where ``--ckpt_path last`` looks), else ``default_root_dir/checkpoints``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self._previous: dict[int, Any] = {}  # the handlers ours replaced, put back when the fit ends
        self._armed = False
        self._pid = os.getpid()  # the process whose fit this is; a process forked during it is not
        self._reset()

    def _reset(self) -> None:
        self.signum = 0  # the first stop signal this process received during the fit, 0: none
        self._announced = False
        self._step = -1  # the optimizer step last seen ending; -1 before training starts
        self._between_steps = False  # an optimizer step has just ended and the next not yet started
        self._saved_step = -1  # the step of the last checkpoint saved between steps
        self._several = False  # whether the ranks agree (several processes)
        self._group: Any = None  # the gloo side group; None: the default group
        self._flag = np.zeros(1, dtype=np.int32)  # shared with the CPU flag tensor: read without a dispatch
        self._flag_tensor = torch.from_numpy(self._flag)
        self._pending: Any = None  # the all-reduce posted at the end of the last step

    # --- signals ------------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Only records; the loop prints and acts (a write to stderr here can fail when it interrupts tqdm's)."""
        forked = os.getpid() != self._pid  # a worker of a pool (a DataLoader's) forked during the fit
        if forked and signum == signal.SIGINT:
            return  # Ctrl-C reaches every process of the terminal: a DataLoader worker feeds the step being saved
        if forked or not self._armed:  # a pool's terminate, or the fit is over (Lightning may put this handler back)
            signal.signal(signum, self._previous.get(signum) or signal.SIG_DFL)  # as if ours had never been here
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without a checkpoint
        self.signum = self.signum or signum

    def _install(self) -> None:
        for signum in STOP_SIGNALS:
            try:
                previous = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals cannot be handled here
                continue
            if previous != self._handle and not self._armed:
                self._previous[signum] = previous

    def _release(self) -> None:
        self._armed = False
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # before the checkpoint's restore
            self._pid = os.getpid()
            self._reset()
            skip_sigterm_broadcast(trainer)
            self._install()
            self._armed = True

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        run_ends()  # before Lightning kills the launched ranks on a Ctrl-C: no news for its watcher
        self._release()
        if self.signum and peer_went_away(exception):  # a group signal ended that rank before its fit set up
            setattr(exception, STOP_SIGNAL_ATTRIBUTE, self.signum)

    def _announce(self, trainer: Trainer, in_step: bool = True) -> None:
        """Says once, from the loop, what the recorded signal will do."""
        if not self.signum or self._announced:
            return
        self._announced = True
        which = ["this", "the next", "the one after next"][int(not in_step) + int(self._several)]
        then = (
            "stopping before the first training step"
            if self._step < 0
            else f"saving a checkpoint at the end of {which} optimizer step, then stopping"
        )
        rank = f" (rank {trainer.global_rank})" if trainer.world_size > 1 else ""
        print(f"gpt-lightning: {signal.Signals(self.signum).name} received{rank}; {then}.", file=sys.stderr, flush=True)

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install()  # ours again in place of the handler Lightning registers after the restore (which calls ours)
        self._announce(trainer)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._announce(trainer, in_step=False)

    # --- agreeing and stopping ----------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install()
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            self._several = True
            self._group = self._side_group(trainer)
            if self._group is None and trainer.strategy.root_device.type != "cpu":
                self._flag_tensor = torch.zeros(1, dtype=torch.int32, device=trainer.strategy.root_device)
        signum = self._agreed_now()  # every rank, whatever it received before this point
        self._announce(trainer)
        self._step = trainer.global_step
        if signum:
            self._stop(trainer, signum, save=False)

    def _side_group(self, trainer: Trainer) -> Any:
        """A gloo group for the per-step flag, with the run's timeout; None (said once) where gloo cannot form one."""
        timeout = process_group_timeout(trainer) or PROCESS_GROUP_TIMEOUT
        trainer.strategy.barrier("preemption-group")  # every rank starts waiting for the others together
        started, group, error = time.monotonic(), None, None
        try:
            group = dist.new_group(backend="gloo", timeout=timeout)
        except RuntimeError as err:  # DistError included
            error = err
            if time.monotonic() - started < timeout.total_seconds() / 2:
                time.sleep(_FAILED_EARLY_WAIT_S)  # others may still be waiting for this rank
        world, rank = trainer.world_size, trainer.global_rank
        # The reporter: the lowest rank that failed of itself, else the lowest that failed waiting.
        key = 2 * world if error is None else (world if isinstance(error, dist.DistStoreError) else 0) + rank
        agreed = torch.tensor([key], dtype=torch.int64, device=trainer.strategy.root_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # once: a host read at train start
        if int(agreed.item()) == 2 * world:
            return group
        if error is not None and int(agreed.item()) == key:
            reason = " ".join(str(error).split())[:300]
            print(
                f"gpt-lightning: rank {rank} could not form the CPU (gloo) group that agrees on stopping "
                f"({type(error).__name__}: {reason}); agreeing over the run's own process group instead "
                "(under NCCL, one small all-reduce and host read per optimizer step). Set GLOO_SOCKET_IFNAME to the "
                "network interface the nodes reach each other by (docs/resume.md).",
                file=sys.stderr,
                flush=True,
            )
        return None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._announce(trainer)
        if self._between_steps and self._just_saved(trainer):  # a save has brought every rank here
            signum = self._agreed_now()
            if signum:
                self._stop(trainer, signum)
        self._between_steps = False

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._announce(trainer)
        if trainer.global_step == self._step:
            return  # mid-accumulation: the optimizer step is not done yet
        self._step = trainer.global_step
        self._between_steps = True
        signum = self._agreed_now() if self._just_saved(trainer) else self._agreed_signal()
        if signum:
            self._stop(trainer, signum)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        between = self._between_steps or 0 <= self._step != trainer.global_step  # a callback before this one
        self._saved_step = trainer.global_step if between else -1

    def _post(self) -> None:
        if self._flag_tensor.is_cpu:
            self._flag[0] = self.signum
        else:
            self._flag_tensor.fill_(self.signum)
        self._pending = dist.all_reduce(self._flag_tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def _read(self) -> int:
        self._pending.wait()
        self._pending = None
        return int(self._flag[0]) if self._flag_tensor.is_cpu else int(self._flag_tensor.item())

    def _agreed_signal(self) -> int:
        """The signal every rank acts on now: the largest any rank posted at the previous optimizer step."""
        if not self._several:
            return self.signum
        agreed = self._read() if self._pending is not None else 0
        self._post()
        return agreed

    def _agreed_now(self) -> int:
        """The largest signal any rank has received, waiting for every rank."""
        if not self._several:
            return self.signum
        if self._pending is not None:
            self._read()
        self._post()
        return self._read()

    def last_path(self, trainer: Trainer) -> str:
        """Where the checkpoint goes: ``last.ckpt`` beside the trainer's ``ModelCheckpoint`` files."""
        if self.dirpath is not None:
            return os.path.join(self.dirpath, "last.ckpt")
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")

    def _just_saved(self, trainer: Trainer) -> bool:
        """Whether a ``ModelCheckpoint`` has just written this step to ``last_path``."""
        path = os.path.abspath(self.last_path(trainer))
        return self._saved_step == trainer.global_step and any(
            isinstance(c, ModelCheckpoint) and c.last_model_path and os.path.abspath(c.last_model_path) == path
            for c in trainer.checkpoint_callbacks
        )

    def _stop(self, trainer: Trainer, signum: int, save: bool = True) -> None:
        run_ends()  # every rank stops: the launcher's watcher, seeing one exit 143 first, stays quiet
        path = self.last_path(trainer) if save else None
        if path is not None and not self._just_saved(trainer):
            trainer.save_checkpoint(path, weights_only=False)  # every rank: a collective under FSDP2
        if trainer.is_global_zero:
            name = signal.Signals(signum).name
            saved = (
                f"at step {trainer.global_step}; saved {path}. Resume with --ckpt_path last (the gpt-lightning "
                f"command) or ckpt_path={path!r} (your own Trainer or LightningCLI)."
                if path
                else "before this run trained a step: nothing new to save. Run the same command again to start "
                "(or resume) from where it was."
            )
            print(f"gpt-lightning: stopped by {name} {saved}", file=sys.stderr, flush=True)
        self._pending = None
        raise Preempted(signum, path, trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:  # every rank posted the same number of flags: this returns
            self._read()
