"""``NonFiniteGuard``: a non-finite loss or gradient never updates the weights, with no per-step
host sync.

The obvious guard, ``if not torch.isfinite(loss)`` after every backward, makes the CPU wait until
the GPU has drained its queue, so the next step's kernels cannot be queued ahead. Here the decision
stays on the device: a 0-dim tensor that the fused AdamW takes as ``found_inf`` (the way
``torch.amp.GradScaler`` skips a step) and that skips every update from the first bad step on. The
first bad step is kept in another device tensor that the host reads only when asked: at logging
intervals and before a checkpoint is written.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class NonFiniteGuard:
    """Tracks non-finite losses and gradients on the device.

    Use: ``observe_loss`` for every micro-batch, ``skip_update`` once per optimizer step (after
    backward, before ``optimizer.step``), and ``first_bad_step`` when the host may wait.
    """

    def __init__(self) -> None:
        self._loss_bad: torch.Tensor | None = None  # a micro-batch of this step had a non-finite loss
        self._first_bad: torch.Tensor | None = None  # first bad optimizer step; -1 while there is none
        self.grad_norm: torch.Tensor | None = None  # total 2-norm of the last step's gradients, on the device

    def observe_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def skip_update(self, step: int, grads: list[torch.Tensor] | None) -> torch.Tensor:
        """Whether this optimizer step must not update the weights: a 0-dim bool tensor, computed
        without reading anything back.

        Args:
            step: the optimizer step about to be taken (``trainer.global_step``).
            grads: the gradients to check, or None when something else handles non-finite gradients
                (``GradScaler`` under ``16-mixed``, where an overflow is routine, not an error).
        """
        bad = self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool)
        self.grad_norm = None
        if grads:
            self.grad_norm = self.total_norm(grads)  # before any clipping
            bad = bad.to(grads[0].device) | ~torch.isfinite(self.grad_norm)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Ranks see different losses: they must agree, or their weights would drift apart. A
            # plain all-reduce is queued on the device; Lightning's reduce adds a host barrier.
            flag = bad.to(torch.uint8)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = flag.bool()
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.long, device=bad.device)
        self._first_bad = torch.where((self._first_bad < 0) & bad, step, self._first_bad)
        self._loss_bad = None
        return self._first_bad >= 0  # once bad, every later update is skipped too

    @staticmethod
    def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of all ``grads`` together, a plain 0-dim tensor on their device."""
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):  # FSDP2: each rank holds a shard's part
            norm = norm.full_tensor()  # an all-reduce, no host read
        return norm

    def first_bad_step(self) -> int | None:
        """The first optimizer step whose loss or gradients were non-finite, or None. Reads one
        number back from the device: call it where the host may wait."""
        if self._first_bad is None:
            return None
        step = int(self._first_bad)
        return step if step >= 0 else None
