"""``train/loss`` and ``train/grad_norm`` once per optimizer step, and only on the steps the logger
writes: the mean loss of an optimizer step's micro-batches, and when a step's values are logged."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer


class StepLoss:
    """The mean loss of an optimizer step's micro-batches (all of equal size), as build-nanogpt's
    ``loss_accum``; not the last micro-batch's loss.

    ``add`` each micro-batch's loss in ``training_step``; ``pop_mean`` once per optimizer step. The
    sum stays on the device: no host read.
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._micro_batches = 0

    def add(self, loss: torch.Tensor) -> None:
        detached = loss.detach()
        self._sum = detached if self._sum is None else self._sum + detached
        self._micro_batches += 1

    def pop_mean(self) -> torch.Tensor | None:
        """This step's mean (None if no micro-batch was added), and start the next step."""
        if self._sum is None:
            return None
        mean = self._sum / self._micro_batches  # on the device
        self._sum, self._micro_batches = None, 0
        return mean


def written_now(trainer: Trainer, final_step: int | None) -> bool:
    """Whether this optimizer step's values are logged: the steps Lightning's logger writes (every
    ``log_every_n_steps``, none with 0; and the step at which the run is stopped), and the run's
    planned last step, so that ``callback_metrics`` ends on its values. (A callback may still stop
    the run after this is asked, in its ``on_train_batch_end``: see ``stopping``.)

    Other steps log nothing. A ``self.log`` costs about a millisecond of host time in Lightning's
    result collection, on every step, for a value no logger would write; under several processes
    ``sync_dist`` also puts a host-blocking barrier before its all-reduce, which on every step would
    stall the GPU queue. Between logging steps ``callback_metrics`` holds the last logged value.

    Args:
        trainer: the running trainer, at ``on_before_optimizer_step`` (``global_step`` counts the
            optimizer steps done before this one).
        final_step: the run's optimizer steps (``trainer.estimated_stepping_batches``), or None
            for a run without an end.
    """
    step, every = trainer.global_step + 1, trainer.log_every_n_steps  # the condition Lightning applies
    if trainer.fast_dev_run or step == final_step:
        return True
    return every > 0 and (step % every == 0 or trainer.should_stop)


def stopping(trainer: Trainer) -> bool:
    """At ``on_train_batch_end`` of an optimizer step: whether Lightning's logger writes this step
    because the run is stopping, so the module logs the step's values there (again, if its step hook
    logged them already).

    A callback (``Timer`` for ``max_time``, a user's) may stop the run in its own
    ``on_train_batch_end``, after the step hook asked ``written_now``; the module's hook runs after
    the callbacks' and before Lightning writes. Values logged from that hook are a second entry of
    the same names in Lightning's results, which stays for the epoch and is read after the step
    hook's: when a stop comes before ``min_steps`` (or ``min_epochs``) is met, training goes on with
    ``should_stop`` set and every step written, and each of those steps must refresh that entry, or
    the logger writes the stop step's values to the end.
    """
    return trainer.should_stop and trainer.log_every_n_steps > 0
