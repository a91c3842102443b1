"""``TokenWindows``: one epoch of contiguous ``(B, T)`` windows over a token array, rank-aware."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

# Lightning warns that a sized IterableDataset may double-count under multi-worker loading; we load
# in the main process (num_workers=0), where the length is exact.
warnings.filterwarnings("ignore", message=r".*Your `IterableDataset` has `__len__` defined.*")


class TokenWindows(IterableDataset):
    """One epoch of contiguous ``(x, y)`` windows, each of shape ``(batch_size, block_size)``.

    Args:
        tokens: 1-D token ids (a memory map is fine: only the windows served are read).
        batch_size: rows per batch (B).
        block_size: tokens per row (T).
        rank: this process's rank; it reads batches ``rank, rank + world_size, ...``.
        world_size: number of processes sharing the stream.
        start: batches of this epoch already consumed; the first iteration starts there.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        block_size: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
    ) -> None:
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.start = start
        # A batch needs B*T + 1 tokens (the targets are shifted by one).
        self.num_batches = (len(tokens) - 1) // (batch_size * block_size * world_size)

    def __len__(self) -> int:
        return self.num_batches

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of this rank's epoch."""
        B, T = self.batch_size, self.block_size
        begin = (index * self.world_size + self.rank) * B * T
        buf = torch.from_numpy(self.tokens[begin : begin + B * T + 1].astype(np.int64))  # (B*T+1,)
        return buf[:-1].view(B, T), buf[1:].view(B, T)  # (B, T) inputs, (B, T) next-token targets

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self.start = self.start, 0  # a resumed position applies to the first pass only
        for index in range(start, self.num_batches):
            yield self.window(index)
