"""Pre-tokenized shard directories: read nanoGPT, build-nanogpt and llm.c shards; write all three.

Formats read (memory-mapped, one shard open at a time, so memory stays bounded):

- ``*.npy``: a 1-D integer array (build-nanogpt / FineWeb-edu shards, usually uint16);
- ``*.bin`` with llm.c's header: 256 int32 (magic 20240520, version 1, token count), then uint16;
- ``*.bin`` without it: raw uint16 ids (nanoGPT's ``train.bin`` / ``val.bin``).

Files whose names contain ``val`` are the validation split, those with ``train`` the training split.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from gpt_lightning.atomic import atomic_output, atomic_write_bytes
from gpt_lightning.data.documents import CHUNK_CHARS, find_inputs, work_items
from gpt_lightning.data.encode import Progress, default_workers, encode_items
from gpt_lightning.data.windows import ResumableStream, TokenWindows
from gpt_lightning.errors import UserError

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
SHARD_SUFFIXES = (".bin", ".npy")


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
            raise UserError(f"Shard {path} is llm.c version {header[1]}; only version 1 (uint16 GPT-2 ids) is supported.")
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
    """``(B, T)`` windows over a list of shards, shard after shard, rank-aware and resumable.

    Within each shard the windows are those of ``TokenWindows`` (rank ``r`` of ``W`` takes batches
    ``r, r+W, ...``); a window never straddles two shards, as in build-nanogpt's loader. Shuffled,
    each epoch reads the shards in a seeded random order, and each shard's rows in a seeded random
    order of their own; one shard is open at a time, so memory stays bounded.

    Args:
        shards: shard files, in reading order.
        batch_size: rows per batch (B).
        block_size: tokens per row (T).
        rank: this process's rank.
        world_size: number of processes.
        shuffle: a new seeded order of shards, and of rows within each shard, every epoch.
        seed: the shuffle's seed: the same orders in every run and on every rank.
        progress: the trainer's epoch and batches done (see ``ResumableStream``).
    """

    def __init__(
        self,
        shards: list[Path],
        batch_size: int,
        block_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        progress: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(progress)
        self.shards = list(shards)
        self.batch_size, self.block_size = batch_size, block_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        per_batch = batch_size * block_size * world_size
        self.batches_per_shard = [max(0, (len(open_shard(p)) - 1) // per_batch) for p in self.shards]

    def __len__(self) -> int:
        return sum(self.batches_per_shard)

    def layout(self) -> list[int]:
        return [self.batch_size, self.block_size, self.world_size, *self.batches_per_shard]

    def shard_order(self, epoch: int) -> list[int]:
        """Indices into ``shards`` in this epoch's reading order."""
        if not self.shuffle:
            return list(range(len(self.shards)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)).tolist()

    def batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        skip = start
        for i in self.shard_order(epoch):
            count = self.batches_per_shard[i]
            if skip >= count:
                skip -= count
                continue
            # Rows within the shard: seeded by the shard's own number too, so orders differ by shard.
            windows = TokenWindows(open_shard(self.shards[i]), self.batch_size, self.block_size, self.rank,
                                   self.world_size, shuffle=self.shuffle, seed=[self.seed, i])
            yield from windows.batches(epoch, skip)  # the shard's memory map is dropped when the next one opens
            skip = 0


FORMATS = {"npy": ".npy", "llmc": ".bin", "ours": ".bin"}  # --format: the shard files' suffix
NPY_HEADER_BYTES = 128  # magic, version, length and the header dict, padded: room for any 1-D shape


class ShardWriter:
    """Token ids in, shard files out: each shard streamed to a temporary file and renamed into place
    once whole, so a shard in the folder is always complete, and memory holds no shard.

    Args:
        output_dir: the folder to write into; it must hold no shards yet.
        shard_tokens: ids per shard (the last holds the rest).
        format: ``npy`` (build-nanogpt), ``llmc`` (llm.c's header, then uint16) or ``ours`` (raw
            uint16, nanoGPT's ``train.bin`` layout, counted in ``tokenize.json``).
        prefix: file names are ``{prefix}_{val|train}_{number:06d}``; shard 0 is the validation split.
    """

    def __init__(self, output_dir: Path, shard_tokens: int, format: str = "npy", prefix: str = "shard") -> None:
        if format not in FORMATS:
            raise UserError(f"--format {format!r} is not one of {', '.join(FORMATS)}.")
        if shard_tokens < 2:
            raise UserError(f"--shard_tokens must be at least 2, got {shard_tokens}.")
        output_dir.mkdir(parents=True, exist_ok=True)
        existing = [p.name for p in output_dir.iterdir() if p.suffix in SHARD_SUFFIXES]
        if existing:
            raise UserError(f"{output_dir} already holds shards ({', '.join(sorted(existing)[:3])}, ...): new ones "
                            "would mix with them. Choose an empty --output folder, or delete them first.")
        self.output_dir, self.shard_tokens, self.format, self.prefix = output_dir, shard_tokens, format, prefix
        self.written: list[tuple[Path, int]] = []  # (path, tokens) of finished shards
        self._file = None
        self._context = None
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.uint16)
        while ids.size:
            if self._file is None:
                self._open()
            take = min(self.shard_tokens - self._count, ids.size)
            self._file.write(ids[:take].tobytes())
            self._count += take
            ids = ids[take:]
            if self._count == self.shard_tokens:
                self._close()

    def close(self) -> list[tuple[Path, int]]:
        if self._file is not None:
            self._close()
        return self.written

    def abort(self) -> None:
        """Remove the shard being written (its temporary file) and every finished one."""
        if self._file is not None:
            self._file.close()
            self._context.__exit__(RuntimeError, RuntimeError("aborted"), None)
            self._file = None
        for path, _ in self.written:
            path.unlink(missing_ok=True)

    @property
    def header_bytes(self) -> int:
        return {"npy": NPY_HEADER_BYTES, "llmc": LLMC_HEADER_INTS * 4, "ours": 0}[self.format]

    def _open(self) -> None:
        split = "val" if not self.written else "train"
        path = self.output_dir / f"{self.prefix}_{split}_{len(self.written):06d}{FORMATS[self.format]}"
        self._context = atomic_output(path)
        self._path, tmp = path, self._context.__enter__()
        self._file = open(tmp, "wb")
        self._file.write(b"\0" * self.header_bytes)  # rewritten once the count is known
        self._count = 0

    def _close(self) -> None:
        f = self._file
        f.seek(0)
        f.write(self._header(self._count))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        self._context.__exit__(None, None, None)  # renamed into place
        self.written.append((self._path, self._count))

    def _header(self, count: int) -> bytes:
        if self.format == "llmc":
            header = np.zeros(LLMC_HEADER_INTS, dtype=np.int32)
            header[:3] = (LLMC_MAGIC, 1, count)
            return header.tobytes()
        if self.format == "npy":
            text = repr({"descr": "<u2", "fortran_order": False, "shape": (count,)})
            room = NPY_HEADER_BYTES - 10 - 1  # magic (6) + version (2) + length (2); the dict ends in \n
            return b"\x93NUMPY\x01\x00" + struct.pack("<H", room + 1) + text.ljust(room).encode("latin1") + b"\n"
        return b""


def tokenize_to_shards(inputs: str, output_dir: Path, shard_tokens: int = 100_000_000, format: str = "npy",
                       workers: int | None = None, text_key: str = "text", separator: str | None = None,
                       progress: bool = True, chunk_chars: int = CHUNK_CHARS) -> list[tuple[Path, int]]:
    """Tokenize ``inputs`` (a file, folder or glob of .txt / .jsonl(.gz) / .parquet) into shards of
    ``shard_tokens`` GPT-2 ids on ``workers`` processes (all cores by default).

    Each document starts with ``<|endoftext|>``; a .txt file is one document unless ``separator``
    splits it. The first shard is the validation split (``shard_val_000000``), the rest training, as
    build-nanogpt writes them; the bytes do not depend on ``workers``. ``tokenize.json``, written
    last, lists the shards with their token counts.
    """
    files = find_inputs(inputs)
    writer = ShardWriter(output_dir, shard_tokens, format)
    bar = Progress(sum(p.stat().st_size for p in files), enabled=progress)
    items = work_items(files, text_key=text_key, separator=separator, chunk_chars=chunk_chars)
    try:
        for position, ids in encode_items(items, workers or default_workers()):
            writer.write(ids)
            bar.update(len(ids), position)
        written = writer.close()
    except BaseException:
        writer.abort()
        raise
    bar.close()
    if len(written) < 2:
        writer.abort()
        count = written[0][1] if written else 0
        raise UserError(
            f"{inputs} holds {count:,} tokens, one shard of --shard_tokens {shard_tokens:,}. The first "
            "shard is the validation split, so nothing would be left to train on; nothing was written. "
            f"Use --shard_tokens {max(2, count // 10)} (or less) for ten or more shards."
        )
    manifest = {"tokenizer": "gpt2", "format": format, "tokens": sum(n for _, n in written),
                "shards": [{"file": p.name, "tokens": n} for p, n in written], "inputs": [str(p) for p in files]}
    atomic_write_bytes(output_dir / "tokenize.json", json.dumps(manifest, indent=1).encode())
    return written
