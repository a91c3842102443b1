"""``TokenWindows``: epochs of nanoGPT's ``(B, T)`` windows over a token array, per rank, shuffled on
request, resumable through Lightning's stateful-loader protocol."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import IterableDataset


class ResumableStream(IterableDataset):
    """The epoch and position bookkeeping (``state_dict()``: the epoch and its batches served) shared by
    token arrays and shard folders; an epoch is a whole number of optimizer steps (docs/data.md).

    Args:
        progress: under a trainer, ``(epoch, batches of it already done)`` when a pass starts; None:
            each ``iter()`` is the next epoch, and a restored position goes on if its epoch has batches left.
        accumulate: micro-batches per optimizer step (``trainer.accumulate_grad_batches``).
    """

    def __init__(self, progress: Callable[[], tuple[int, int]] | None = None, accumulate: int = 1) -> None:
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}.")
        self.progress = progress
        self.accumulate = accumulate
        self._epoch: int | None = None  # epoch of the pass being served; None before the first
        self._served = 0  # batches of that epoch served
        self._restored: dict[str, Any] | None = None

    # Subclasses: the whole batches per epoch the data holds on each rank, the layout that a
    # position is counted in, and all of one epoch's batches from ``start``.
    def available(self) -> int:
        raise NotImplementedError

    def layout(self) -> list[int]:
        raise NotImplementedError

    def batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def __len__(self) -> int:
        """Batches per epoch: a whole number of optimizer steps."""
        return self.available() // self.accumulate * self.accumulate

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # A generator: nothing here runs until the first batch is asked for, when the trainer has
        # settled where it stands (Lightning calls iter() before it restores its loops' progress).
        epoch, start = self._next_pass()
        self._epoch, self._served = epoch, start
        for batch in itertools.islice(self.batches(epoch, start), max(0, len(self) - start)):
            self._served += 1  # counted before the batch leaves: a checkpoint after it includes it
            yield batch

    def _next_pass(self) -> tuple[int, int]:
        """The epoch and the first batch of the pass about to start."""
        trainer_epoch, done = self.progress() if self.progress is not None else (None, None)
        restored, self._restored = self._restored, None
        if restored is not None:
            if done is None:
                done = restored["batches"] if restored["batches"] < len(self) else 0
            if done > 0:  # the restored epoch goes on
                return restored["epoch"], done
            return restored["epoch"] + (restored["batches"] > 0), 0  # it had ended: the next one
        if self._epoch is None:  # a fresh start (or a checkpoint without a stream state: the trainer's word)
            return trainer_epoch or 0, done or 0
        return self._epoch + 1, done or 0

    def state_dict(self) -> dict[str, Any]:
        if self._restored is not None:  # restored but not served yet: pass the position on unchanged
            return dict(self._restored)
        return {"epoch": self._epoch or 0, "batches": self._served, "layout": self.layout()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        layout = state_dict.get("layout")
        if layout is not None and list(layout) != self.layout():
            rank_zero_warn(
                f"The checkpoint's data position was counted in batches of another layout ({list(layout)}, now "
                f"{self.layout()}: batch size, block size, processes, data). The resumed epoch starts after "
                f"{state_dict['batches']} of the new batches, which is not where the run stopped."
            )
        self._restored = {"epoch": int(state_dict["epoch"]), "batches": int(state_dict["batches"]), "layout": layout}


class TokenWindows(ResumableStream):
    """Epochs of contiguous ``(x, y)`` windows, each of shape ``(batch_size, block_size)``.

    Args:
        tokens: 1-D token ids (a memory map is fine: only the windows served are read).
        batch_size: rows per batch (B).
        block_size: tokens per row (T).
        rank: this process's rank; it reads batches ``rank, rank + world_size, ...``.
        world_size: number of processes sharing the stream.
        shuffle: serve rows of ``T + 1`` tokens in a seeded random order, a new order each epoch.
        seed: the shuffle's seed, with the epoch: the same order in every run and on every rank.
        progress: the trainer's epoch and batches done (see ``ResumableStream``).
        accumulate: micro-batches per optimizer step; an epoch serves a multiple of it (see ``ResumableStream``).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        block_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int | Sequence[int] = 0,
        progress: Callable[[], tuple[int, int]] | None = None,
        accumulate: int = 1,
    ) -> None:
        super().__init__(progress, accumulate)
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = [seed] if isinstance(seed, int) else list(seed)
        # A batch needs B*T + 1 tokens (the targets are shifted by one).
        self.num_batches = (len(tokens) - 1) // (batch_size * block_size * world_size)

    def available(self) -> int:
        return self.num_batches

    def layout(self) -> list[int]:
        return [self.batch_size, self.block_size, self.world_size, len(self.tokens)]

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of this rank's epoch, in order."""
        B, T = self.batch_size, self.block_size
        begin = (index * self.world_size + self.rank) * B * T
        buf = torch.from_numpy(self.tokens[begin : begin + B * T + 1].astype(np.int64))  # (B*T+1,)
        return buf[:-1].view(B, T), buf[1:].view(B, T)  # (B, T) inputs, (B, T) next-token targets

    def row_order(self, epoch: int) -> np.ndarray:
        """The shuffled epoch's row numbers, batch after batch of the single-process stream."""
        rows = (len(self.tokens) - 1) // self.block_size  # every row of T + 1 tokens the array holds
        used = self.num_batches * self.world_size * self.batch_size  # rows a whole number of batches take
        # The rows left over differ each epoch, so no row is left out for good.
        return np.random.default_rng([*self.seed, epoch]).permutation(rows)[:used]

    def shuffled_window(self, order: np.ndarray, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of this rank's shuffled epoch: ``B`` rows picked by ``order``."""
        B, T = self.batch_size, self.block_size
        slot = (index * self.world_size + self.rank) * B
        starts = order[slot : slot + B] * T
        buf = torch.from_numpy(np.stack([self.tokens[s : s + T + 1] for s in starts]).astype(np.int64))  # (B, T+1)
        return buf[:, :-1], buf[:, 1:]  # (B, T) inputs, (B, T) next-token targets

    def batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.shuffle:
            for index in range(start, self.num_batches):
                yield self.window(index)
            return
        order = self.row_order(epoch)
        for index in range(start, self.num_batches):
            yield self.shuffled_window(order, index)
