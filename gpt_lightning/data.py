"""The token stream as contiguous ``(B, T)`` windows, served by a ``LightningDataModule``.

Windows are cut exactly as nanoGPT's ``DataLoaderLite`` cuts them: batch ``g`` is
``buf = tokens[g*B*T : (g+1)*B*T + 1]`` with ``x = buf[:-1].view(B, T)`` and ``y = buf[1:].view(B, T)``.
Under distributed training rank ``r`` of ``W`` takes batches ``r, r+W, r+2W, ...``, so ranks read
disjoint windows. The stream position is part of the checkpoint, so a resumed run continues with the
very batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset

from gpt_lightning.corpus import default_cache_dir, tiny_shakespeare
from gpt_lightning.errors import UserError
from gpt_lightning.token_cache import build_token_cache, load_tokens


# Lightning warns that a sized IterableDataset may double-count under multi-worker loading; we load
# in the main process (num_workers=0), where the length is exact.
warnings.filterwarnings("ignore", message=r".*Your `IterableDataset` has `__len__` defined.*")
# val_fraction=0 serves no validation batches on purpose.
warnings.filterwarnings("ignore", message=r".*Total length of `list` across ranks is zero.*")


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


class TokenStreamDataModule(LightningDataModule):
    """GPT-2 tokens of a text file, served as contiguous ``(B, T)`` windows.

    Args:
        data_path: UTF-8 text file to train on. None: the built-in tiny Shakespeare corpus,
            read from the cache directory and downloaded (sha256-checked) when missing.
        batch_size: sequences per batch and per device (B). Also sets nothing else: the model's
            batch is whatever the data serves.
        block_size: tokens per sequence (T). The CLI passes it to the model too.
        val_fraction: share of the tokens, taken from the end, held out for validation. 0 trains on
            everything and skips validation (as the reference experiment does).
        cache_dir: where the corpus and token caches live. None: ``$GPT_LIGHTNING_CACHE_DIR``, else
            ``~/.cache/gpt_lightning``.
    """

    def __init__(
        self,
        data_path: str | None = None,
        batch_size: int = 16,
        block_size: int = 1024,
        val_fraction: float = 0.1,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise UserError(f"data.batch_size must be a positive integer, got {batch_size!r}.")
        if not isinstance(block_size, int) or block_size <= 0:
            raise UserError(f"data.block_size must be a positive integer, got {block_size!r}.")
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"data.val_fraction must be in [0, 1), got {val_fraction!r}.")
        self.save_hyperparameters()
        self.data_path = data_path
        self.batch_size = batch_size
        self.block_size = block_size
        self.val_fraction = val_fraction
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.tokens: np.ndarray | None = None
        self._resume_batches = 0  # train batches consumed before a restore

    # --- preparing -------------------------------------------------------------------------------
    def source_path(self) -> Path:
        if self.data_path is None:
            return tiny_shakespeare(self.cache_dir)
        return Path(self.data_path).expanduser()

    def prepare_data(self) -> None:
        """Fetch the corpus if needed and tokenize it into the cache (once per machine)."""
        build_token_cache(self.source_path(), self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.tokens is not None:
            return
        # build_token_cache returns at once when prepare_data made the cache already.
        self.tokens = load_tokens(build_token_cache(self.source_path(), self.cache_dir))
        n = len(self.tokens)
        rank_zero_info(f"loaded {n} tokens")
        rank_zero_info(f"1 epoch = {n // (self.batch_size * self.block_size)} batches")
        need = self.world_size * self.batch_size * self.block_size + 1
        if self.train_token_count < need:
            raise UserError(
                f"The training split has {self.train_token_count} tokens, but one batch on each of "
                f"{self.world_size} process(es) needs world_size x batch_size x block_size + 1 = "
                f"{need}. Use more text, or a smaller data.batch_size / data.block_size."
            )

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def train_token_count(self) -> int:
        assert self.tokens is not None, "call setup() first"
        return len(self.tokens) - int(len(self.tokens) * self.val_fraction)

    # --- serving ---------------------------------------------------------------------------------
    def _loader(self, tokens: np.ndarray, start: int = 0) -> DataLoader:
        windows = TokenWindows(
            tokens, self.batch_size, self.block_size, self.rank, self.world_size, start=start
        )
        pin = self.trainer is not None and self.trainer.accelerator.__class__.__name__ == "CUDAAccelerator"
        # batch_size=None: each item already is a whole (B, T) batch. Workers would only add IPC:
        # slicing the memory map is far faster than the model consumes tokens.
        return DataLoader(windows, batch_size=None, num_workers=0, pin_memory=pin)

    def train_dataloader(self) -> DataLoader:
        assert self.tokens is not None, "call setup() first"
        loader = self._loader(self.tokens[: self.train_token_count])
        loader.dataset.start = self._resume_batches % max(len(loader.dataset), 1)
        self._resume_batches = 0
        return loader

    def val_dataloader(self) -> DataLoader | list:
        assert self.tokens is not None, "call setup() first"
        val_tokens = self.tokens[self.train_token_count :]
        if self.val_fraction == 0:
            return []
        if len(val_tokens) < self.world_size * self.batch_size * self.block_size + 1:
            raise UserError(
                f"The validation split has {len(val_tokens)} tokens, fewer than one batch on each "
                f"process needs ({self.world_size * self.batch_size * self.block_size + 1}). Raise "
                "data.val_fraction, lower data.batch_size / data.block_size, or set data.val_fraction 0."
            )
        return self._loader(val_tokens)

    def test_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()

    # --- resuming --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Derived from the trainer's optimizer steps, not from the loader: Lightning fetches one
        # batch ahead, so a loader-side count would be one too far at checkpoint time.
        consumed = 0
        if self.trainer is not None:
            consumed = self.trainer.global_step * self.trainer.accumulate_grad_batches
        return {"train_batches_consumed": consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_batches = int(state_dict.get("train_batches_consumed", 0))
