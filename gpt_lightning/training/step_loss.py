"""``train/loss`` once per optimizer step, without a host read on the steps the logger skips."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer


class StepLoss:
    """The mean loss of an optimizer step's micro-batches (all of equal size) and of the ranks, as
    build-nanogpt's ``loss_accum``; not the last micro-batch's loss.

    ``add`` each micro-batch's loss in ``training_step``; ``log`` once in ``on_before_optimizer_step``.
    The sum stays on the device. Not ``prog_bar``: Lightning turns every prog_bar value into a Python
    number after every batch, a host read each step; ``StepProgressBar`` reads it at logging intervals.
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._micro_batches = 0

    def add(self, loss: torch.Tensor) -> None:
        detached = loss.detach()
        self._sum = detached if self._sum is None else self._sum + detached
        self._micro_batches += 1

    def log(self, module: LightningModule) -> None:
        """Log this step's mean as ``train/loss`` (if the logger writes it now) and start the next."""
        if self._sum is None:
            return
        mean = self._sum / self._micro_batches  # on the device: no host read
        self._sum, self._micro_batches = None, 0
        if written_now(module.trainer):
            module.log("train/loss", mean, sync_dist=True)  # the mean over ranks


def written_now(trainer: Trainer) -> bool:
    """Whether the logger writes this step's values. With several processes the loss is logged only
    then: ``sync_dist`` puts a host-blocking barrier before its all-reduce, which on every step would
    stall the GPU queue. Other steps leave ``callback_metrics`` at the last written value. One
    process logs every step (there is nothing to synchronize)."""
    if trainer.world_size == 1 or trainer.fast_dev_run or trainer.should_stop:
        return True
    every = trainer.log_every_n_steps
    # the condition Lightning's logger connector applies after this batch (global_step is the
    # number of optimizer steps done before this one)
    return every > 0 and (trainer.global_step + 1) % every == 0
