"""Shard folders written by ``gpt-lightning tokenize`` (build-nanogpt's ``.npy``, llm.c's ``.bin``, raw
uint16), each shard streamed and renamed into place whole. No torch: tiktoken and numpy only."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from gpt_lightning.atomic import atomic_output, atomic_write_bytes
from gpt_lightning.data.documents import CHUNK_CHARS, find_inputs, work_items
from gpt_lightning.data.encode import Progress, default_workers, encode_items
from gpt_lightning.errors import UserError

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
SHARD_SUFFIXES = (".bin", ".npy")
FORMATS = {"npy": ".npy", "llmc": ".bin", "ours": ".bin"}  # --format: the shard files' suffix
NPY_HEADER_BYTES = 128  # magic, version, length and the header dict, padded: room for any 1-D shape


class ShardWriter:
    """Token ids in, shards of ``shard_tokens`` out into an ``output_dir`` without shards, each streamed to a
    temporary file and renamed into place once whole. Files are ``{prefix}_{val|train}_{number:06d}``:
    shard 0 is the validation split."""

    def __init__(self, output_dir: Path, shard_tokens: int, format: str = "npy", prefix: str = "shard") -> None:
        if format not in FORMATS:
            raise UserError(f"--format {format!r} is not one of {', '.join(FORMATS)}.")
        if shard_tokens < 2:
            raise UserError(f"--shard_tokens must be at least 2, got {shard_tokens}.")
        output_dir.mkdir(parents=True, exist_ok=True)
        existing = [p.name for p in output_dir.iterdir() if p.suffix in SHARD_SUFFIXES]
        if existing:
            raise UserError(
                f"{output_dir} already holds shards ({', '.join(sorted(existing)[:3])}, ...): new ones "
                "would mix with them. Choose an empty --output folder, or delete them first."
            )
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

    def abort(self, remove_finished: bool = False) -> None:
        """Remove the shard being written (its temporary file), and the finished ones if asked."""
        if self._file is not None:
            self._file.close()
            self._context.__exit__(RuntimeError, RuntimeError("aborted"), None)
            self._file = None
        for path, _ in self.written if remove_finished else ():
            path.unlink(missing_ok=True)

    def _open(self) -> None:
        split = "val" if not self.written else "train"
        path = self.output_dir / f"{self.prefix}_{split}_{len(self.written):06d}{FORMATS[self.format]}"
        self._context = atomic_output(path)
        self._path, tmp = path, self._context.__enter__()
        self._file = open(tmp, "wb")
        self._file.write(self._header(0))  # rewritten once the count is known
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


def tokenize_to_shards(
    inputs: str,
    output_dir: Path,
    shard_tokens: int = 100_000_000,
    format: str = "npy",
    workers: int | None = None,
    text_key: str = "text",
    separator: str | None = None,
    progress: bool = True,
    chunk_chars: int = CHUNK_CHARS,
) -> list[tuple[Path, int]]:
    """Tokenize ``inputs`` into shards of ``shard_tokens`` GPT-2 ids on ``workers`` processes; shard 0 is
    validation, and ``tokenize.json``, written last, lists them (docs/data.md)."""
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
        # Finished shards stay (each is whole); tokenize.json, the mark of a finished folder, is not written.
        writer.abort()
        raise
    bar.close()
    if len(written) < 2:
        writer.abort(remove_finished=True)
        count = written[0][1] if written else 0
        raise UserError(
            f"{inputs} holds {count:,} tokens, one shard of --shard_tokens {shard_tokens:,}. The first "
            "shard is the validation split, so nothing would be left to train on; nothing was written. "
            f"Use --shard_tokens {max(2, count // 10)} (or less) for ten or more shards."
        )
    manifest = {
        "tokenizer": "gpt2",
        "format": format,
        "tokens": sum(n for _, n in written),
        "shards": [{"file": p.name, "tokens": n} for p, n in written],
        "inputs": [str(p) for p in files],
    }
    atomic_write_bytes(output_dir / "tokenize.json", json.dumps(manifest, indent=1).encode())
    return written
