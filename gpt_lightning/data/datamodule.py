"""The token stream as contiguous ``(B, T)`` windows, disjoint per rank, served by a ``LightningDataModule``
whose stateful loader resumes mid-epoch on the batches an uninterrupted run would see (docs/data.md)."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset

from gpt_lightning.data.corpus import Corpus, default_cache_dir
from gpt_lightning.data.shards import ShardWindows, find_shards, open_shard
from gpt_lightning.data.token_cache import build_token_cache, load_tokens
from gpt_lightning.data.tokenizer import GPT2_VOCAB_SIZE
from gpt_lightning.data.windows import TokenWindows
from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import batches_started, move_batch_progress


class TokenStreamDataModule(LightningDataModule):
    """GPT-2 tokens of a text file or a shard directory, served as contiguous ``(B, T)`` windows.

    Args:
        data_path: a UTF-8 text file (tokenized once, cached), a folder of token shards (``.bin``, ``.npy``;
            ``train`` / ``val`` in their names), or None for the packaged tiny Shakespeare.
        batch_size: sequences per batch and per device (B).
        block_size: tokens per sequence (T). The CLI passes it to the model too.
        val_fraction: for a text file, the share of tokens at its end held out for validation; 0: none.
        tokens_per_step: tokens per optimizer step over all processes: sets gradient accumulation (and makes an
            integer ``trainer.val_check_interval`` count optimizer steps). None: the trainer's own.
        cache_dir: where token caches live. None: ``$GPT_LIGHTNING_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpt_lightning``.
        shuffle: serve the training windows (shards, then rows) in a seeded random order, new each epoch.
        seed: the shuffle's seed: the same order in every run, on every process and after a resume.
    """

    def __init__(
        self,
        data_path: str | None = None,
        batch_size: int = 16,
        block_size: int = 1024,
        val_fraction: float = 0.1,
        tokens_per_step: int | None = None,
        cache_dir: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise UserError(f"data.batch_size must be a positive integer, got {batch_size!r}.")
        if not isinstance(block_size, int) or block_size <= 0:
            raise UserError(f"data.block_size must be a positive integer, got {block_size!r}.")
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"data.val_fraction must be in [0, 1), got {val_fraction!r}.")
        if tokens_per_step is not None and (not isinstance(tokens_per_step, int) or tokens_per_step <= 0):
            raise UserError(f"data.tokens_per_step must be a positive integer, got {tokens_per_step!r}.")
        # Not logged: Lightning refuses a key the module also has (block_size) with another value.
        self.save_hyperparameters(logger=False)
        self.data_path = data_path
        self.batch_size = batch_size
        self.block_size = block_size
        self.val_fraction = val_fraction
        self.tokens_per_step = tokens_per_step
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.shuffle = shuffle
        self.seed = seed
        self.tokens: np.ndarray | None = None  # text sources: all token ids, memory-mapped
        self.shards: dict[str, list[Path]] | None = None  # shard directories: files by split
        self._verified_token_file: Path | None = None  # set by prepare_data in this process
        self._given_val_check_interval: tuple[weakref.ref, int] | None = None  # (trainer, steps) as given

    @property
    def is_sharded(self) -> bool:
        return self.data_path is not None and Path(self.data_path).expanduser().is_dir()

    vocab_size = GPT2_VOCAB_SIZE  # the tokenizer's; the model checks it has as many embedding rows

    def corpus(self) -> Corpus:
        return Corpus.tiny_shakespeare() if self.data_path is None else Corpus.from_file(self.data_path)

    def prepare_data(self) -> None:
        """Tokenize the text into the cache, once per machine (other ranks wait at Lightning's barrier)."""
        if not self.is_sharded:
            self._verified_token_file = build_token_cache(self.corpus(), self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None and stage in ("fit", None) and self.tokens_per_step is not None:
            self._set_gradient_accumulation()  # every fit: a new trainer may have another world size
        if self.tokens is not None or self.shards is not None:
            return
        if self.is_sharded:
            self.shards = find_shards(Path(self.data_path).expanduser())
            n = sum(len(open_shard(p)) for split in self.shards.values() for p in split)
            rank_zero_info(f"loaded {n} tokens in {sum(map(len, self.shards.values()))} shards")
        else:
            # Other ranks verify the cache themselves; this one did in prepare_data.
            token_file = self._verified_token_file or build_token_cache(self.corpus(), self.cache_dir)
            self.tokens = load_tokens(token_file)
            n = len(self.tokens)
            rank_zero_info(f"loaded {n} tokens")
        windows = self._windows("train")
        if windows.available() == 0:
            raise UserError(
                f"The training split is too small: one batch on each of {self.world_size} process(es) "
                f"needs world_size x batch_size x block_size + 1 = "
                f"{self.world_size * self.batch_size * self.block_size + 1} tokens"
                + (" in one shard" if self.is_sharded else f", it has {self.train_token_count}")
                + ". Use more text, or a smaller data.batch_size / data.block_size."
            )
        accumulate, batches = windows.accumulate, len(windows)
        if batches == 0:
            raise UserError(
                f"The training split holds {windows.available()} batches per process, fewer than the {accumulate} "
                "micro-batches of one optimizer step. Use more text, or a smaller data.tokens_per_step / "
                "trainer.accumulate_grad_batches / data.batch_size."
            )
        per_rank = " per process" if self.world_size > 1 else ""
        left_out = windows.available() - batches
        steps = f" = {batches // accumulate} optimizer steps of {accumulate}" if accumulate > 1 else ""
        trimmed = (
            f" ({left_out} of {windows.available()} batches left out so that no step is short)" if left_out else ""
        )
        rank_zero_info(f"1 epoch = {batches} batches{per_rank}{steps}{trimmed}")
        self._round_batch_limit(batches, accumulate)
        self._check_validation_interval(batches)

    def _set_gradient_accumulation(self) -> None:
        W, B, T = self.world_size, self.batch_size, self.block_size
        micro = W * B * T  # tokens of one micro-batch over all processes
        if self.tokens_per_step % micro:
            nearest = sorted(
                {max(micro, self.tokens_per_step // micro * micro), (self.tokens_per_step // micro + 1) * micro}
            )
            raise UserError(
                f"data.tokens_per_step {self.tokens_per_step:,} is not a multiple of world_size x batch_size x "
                f"block_size = {W} x {B} x {T} = {micro:,}. Use {' or '.join(f'{n:,}' for n in nearest)}, or "
                "change data.batch_size."
            )
        accumulate = self.tokens_per_step // micro
        given = self.trainer.accumulate_grad_batches
        if given not in (1, accumulate):
            raise UserError(
                f"trainer.accumulate_grad_batches {given} and data.tokens_per_step {self.tokens_per_step:,} (which "
                f"means {accumulate}) disagree: give only data.tokens_per_step."
            )
        self.trainer.accumulate_grad_batches = accumulate
        rank_zero_info(
            f"{self.tokens_per_step:,} tokens per optimizer step = {W} process(es) x {B} x {T} x {accumulate} "
            "accumulated micro-batches"
        )
        self._count_validation_interval_in_steps(accumulate)

    def _count_validation_interval_in_steps(self, accumulate: int) -> None:
        """Make an integer ``val_check_interval`` count optimizer steps (x ``accumulate``), once per trainer."""
        trainer = self.trainer
        given = self._validation_steps_given() or trainer.val_check_interval
        if not isinstance(given, int) or isinstance(given, bool):
            return  # a fraction of an epoch or a time interval: not a count of steps
        self._given_val_check_interval = (weakref.ref(trainer), given)
        trainer.val_check_interval = given * accumulate
        if accumulate > 1:
            rank_zero_info(f"validation every {given} optimizer steps = {given * accumulate} micro-batches")

    def _validation_steps_given(self) -> int | None:
        """The user's integer ``val_check_interval`` for this trainer before rescaling, else None."""
        remembered = self._given_val_check_interval
        return remembered[1] if remembered is not None and remembered[0]() is self.trainer else None

    def _round_batch_limit(self, batches: int, accumulate: int) -> None:
        """Round ``trainer.limit_train_batches`` down to whole optimizer steps (no short last step)."""
        trainer = self.trainer
        if trainer is None or accumulate == 1 or trainer.fast_dev_run:
            return
        limit = trainer.limit_train_batches
        epoch = self._epoch_batches(batches)
        if epoch % accumulate == 0:
            return
        given = f"{limit}" if isinstance(limit, int) else f"{limit} (= {epoch} of {batches} batches)"
        if epoch < accumulate:
            raise UserError(
                f"trainer.limit_train_batches {given} is less than one optimizer step of {accumulate} micro-batches: "
                f"use {accumulate} or a multiple of it."
            )
        trainer.limit_train_batches = epoch // accumulate * accumulate
        rank_zero_info(
            f"trainer.limit_train_batches {given} rounded down to {trainer.limit_train_batches}, a whole number of "
            f"optimizer steps of {accumulate} micro-batches"
        )

    def _check_validation_interval(self, batches: int) -> None:
        """Say in our words what Lightning's fit loop would raise as a ValueError traceback."""
        trainer = self.trainer
        interval = getattr(trainer, "val_check_interval", None)
        if not isinstance(interval, int) or getattr(trainer, "check_val_every_n_epoch", None) is None:
            return
        epoch = self._epoch_batches(batches)
        if interval > epoch and trainer.limit_val_batches > 0:
            steps = self._validation_steps_given() or interval
            accumulate = interval // steps
            counted = f"{steps} optimizer steps = {interval} batches" if accumulate > 1 else str(interval)
            raise UserError(
                f"trainer.val_check_interval ({counted}) is more than the {epoch} training batches of an "
                "epoch, so validation would never run. Add --trainer.check_val_every_n_epoch null to "
                f"validate every {steps} steps across epochs, or use a val_check_interval <= {epoch // accumulate}."
            )

    def _epoch_batches(self, batches: int) -> int:
        """The batches of an epoch the trainer trains: ``batches``, or fewer under ``limit_train_batches``."""
        limit = self.trainer.limit_train_batches if self.trainer is not None else 1.0
        return min(batches, limit) if isinstance(limit, int) else int(batches * limit)

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def train_token_count(self) -> int:
        assert self.tokens is not None, "call setup() on a text source first"
        return len(self.tokens) - int(len(self.tokens) * self.val_fraction)

    def _windows(self, split: str) -> TokenWindows | ShardWindows | None:
        args = (self.batch_size, self.block_size, self.rank, self.world_size)
        # Training epochs are shuffled on request and whole optimizer steps; validation is always the same.
        train = (
            {
                "shuffle": self.shuffle,
                "seed": self.seed,
                "progress": self._trainer_progress,
                "accumulate": self._accumulation(),
                "moved": self._move_trainer_progress,
            }
            if split == "train"
            else {}
        )
        if self.shards is not None:
            return ShardWindows(self.shards[split], *args, **train) if self.shards[split] else None
        assert self.tokens is not None, "call setup() first"
        if split == "train":
            return TokenWindows(self.tokens[: self.train_token_count], *args, **train)
        return TokenWindows(self.tokens[self.train_token_count :], *args) if self.val_fraction > 0 else None

    def _trainer_progress(self) -> tuple[int, int]:
        """The trainer's epoch and the batches of it already done."""
        if self.trainer is None:
            return 0, 0
        return self.trainer.current_epoch, batches_started(self.trainer)

    def _move_trainer_progress(self, batches: int, accumulated: int, ended: bool) -> None:
        """A resume on another layout: the trainer's batch counts become this layout's, so its epochs end
        with the stream's."""
        if self.trainer is None:
            return
        epoch = self._epoch_batches(len(self._windows("train")))
        ended = ended or batches >= epoch
        move_batch_progress(self.trainer, min(batches, epoch), self._accumulation(), accumulated, ended)

    def _accumulation(self) -> int:
        return 1 if self.trainer is None else self.trainer.accumulate_grad_batches

    def _loader(self, windows: IterableDataset, loader: type[DataLoader] = DataLoader) -> DataLoader:
        pin = self.trainer is not None and self.trainer.accelerator.__class__.__name__ == "CUDAAccelerator"
        # Each item already is a whole (B, T) batch; workers would only add IPC to slicing a memory map.
        return loader(windows, batch_size=None, num_workers=0, pin_memory=pin)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._windows("train"), ResumableLoader)

    def val_dataloader(self) -> DataLoader | list:
        windows = self._windows("val")
        if windows is None:
            return []
        if len(windows) == 0:
            raise UserError(
                "The validation split is smaller than one batch on each process "
                f"({self.world_size * self.batch_size * self.block_size + 1} tokens). Raise "
                "data.val_fraction, lower data.batch_size / data.block_size, or set data.val_fraction 0."
            )
        return self._loader(windows)

    def test_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()


class ResumableLoader(DataLoader):
    """A ``DataLoader`` whose ``ResumableStream`` position Lightning saves and restores (stateful loader)."""

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict)
