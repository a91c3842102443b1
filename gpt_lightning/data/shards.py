"""Pre-tokenized shard directories (``*.npy``, llm.c's ``*.bin`` with header, raw uint16 ``*.bin``),
memory-mapped one shard at a time; ``val`` / ``train`` in the name picks the split (docs/data.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpt_lightning.data.shard_writer import LLMC_HEADER_INTS, LLMC_MAGIC, SHARD_SUFFIXES
from gpt_lightning.data.windows import ResumableStream
from gpt_lightning.errors import UserError


def open_shard(path: Path) -> np.ndarray:
    """The token ids of one shard, memory-mapped read-only."""
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise UserError(f"Shard {path} holds a {tokens.ndim}-D {tokens.dtype} array; expected 1-D token ids.")
        return tokens
    header = np.fromfile(path, dtype=np.int32, count=LLMC_HEADER_INTS)
    if len(header) >= 3 and header[0] == LLMC_MAGIC:  # llm.c; raw GPT-2 uint16 can't start so (55240 > vocab)
        if header[1] != 1:
            raise UserError(
                f"Shard {path} is llm.c version {header[1]}; only version 1 (uint16 GPT-2 ids) is supported."
            )
        count = int(header[2])
        expected = LLMC_HEADER_INTS * 4 + 2 * count
        if path.stat().st_size != expected:
            raise UserError(f"Shard {path} is {path.stat().st_size} bytes, its header promises {expected}: truncated?")
        return np.memmap(path, dtype=np.uint16, mode="r", offset=LLMC_HEADER_INTS * 4, shape=(count,))
    return np.memmap(path, dtype=np.uint16, mode="r")


def find_shards(directory: Path) -> dict[str, list[Path]]:
    """Shard files of ``directory`` by split: ``{"train": [...], "val": [...]}``, sorted by name."""
    if not directory.is_dir():
        raise UserError(f"Shard directory {directory} does not exist.")
    files = sorted(p for p in directory.iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
    splits = {
        "train": [p for p in files if "train" in p.name],
        "val": [p for p in files if "val" in p.name],
    }
    if not splits["train"]:
        names = ", ".join(p.name for p in files[:5]) or "no .bin/.npy files"
        raise UserError(
            f"{directory} has no training shards ({names}). Shards are .bin or .npy files with 'train' "
            "(or 'val' for validation) in their names; `gpt-lightning tokenize` writes such a folder."
        )
    return splits


class ShardWindows(ResumableStream):
    """``(B, T)`` windows over ``shards`` (files in reading order), shard after shard: a row never straddles
    two, a batch may. Shuffled, the order of shards and of rows within each changes every epoch, fixed by
    ``seed``. The other arguments: ``ResumableStream``'s."""

    def __init__(self, shards: list[Path], *args: Any, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shards = list(shards)
        self.seed = seed
        self.rows_per_shard = [max(0, (len(open_shard(p)) - 1) // self.block_size) for p in self.shards]

    def segment_rows(self) -> list[int]:
        return self.rows_per_shard

    def segment_tokens(self, segment: int) -> np.ndarray:
        return open_shard(self.shards[segment])  # dropped when the next shard opens

    def segment_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.shards)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)).tolist()

    def row_order(self, segment: int, epoch: int) -> np.ndarray | None:
        rows = self.rows_per_shard[segment]
        return np.random.default_rng([self.seed, segment, epoch]).permutation(rows) if self.shuffle else None

    def order(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "shuffle": self.shuffle, "seed": self.seed, "rows": self.rows_per_shard}
