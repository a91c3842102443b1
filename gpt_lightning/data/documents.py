"""Documents read as a stream (``.txt``, ``.jsonl(.gz)``, ``.parquet``; a folder or glob), cut into work
items only where GPT-2's pre-tokenizer splits anyway."""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt_lightning.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
CHUNK_CHARS = 1 << 20  # text per work item: large enough that inter-process traffic is noise


@dataclass(frozen=True)
class WorkItem:
    """What one worker encodes. ``pieces``: ``(starts_document, text)``; ``lines``: raw JSONL lines
    whose ``text_key`` field is one document each."""

    pieces: tuple[tuple[bool, str], ...] = ()
    lines: tuple[bytes, ...] = ()
    text_key: str = "text"
    source: str = ""
    position: int = 0  # about how many bytes of all the inputs were read up to this item's end (progress)


def kind(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), "")


def find_inputs(spec: str) -> list[Path]:
    """The input files a ``--input`` names: one file, a folder (searched recursively) or a glob."""
    path = Path(spec).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and kind(p))
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file() and kind(Path(p)))
        if not files and not any(c in spec for c in "*?["):
            raise UserError(
                f"Input {spec} does not exist. Give a file, a folder or a glob of {', '.join(SUFFIXES)} files."
            )
    if not files or any(not kind(p) for p in files):
        odd = [p.name for p in files if not kind(p)]
        raise UserError(
            f"Input {spec} holds no {', '.join(SUFFIXES)} files"
            + (f" ({', '.join(odd[:3])} is not one)" if odd else "")
            + ". Give a file, a folder or a glob of them."
        )
    return files


def safe_cut(text: str) -> int:
    """The last index at which ``text`` may be cut so that GPT-2's pre-tokenizer splits the two parts
    exactly as the whole (just after ``x\n`` before ``c``, or between ``x\r`` and ``\nc``, ``x`` and ``c``
    not whitespace), or 0 if there is none. BPE never merges across pieces: equal pieces, equal ids."""
    i = len(text) - 1
    while True:
        i = text.rfind("\n", 0, i)
        if i < 1:
            return 0
        after = i + 1
        if after < len(text) and not text[after].isspace():
            before = text[i - 1]
            if not before.isspace():
                return after  # x\n | c
            if before == "\r" and i >= 2 and not text[i - 2].isspace():
                return i  # x\r | \nc
        # try the newline before this one


def text_pieces(stream: io.TextIOBase, chunk_chars: int, starts_document: bool) -> Iterator[tuple[bool, str]]:
    """A text stream as pieces of about ``chunk_chars`` characters cut at safe points; the first
    piece carries ``starts_document``. A stretch with no safe point grows until one comes."""
    carry = ""
    while block := stream.read(chunk_chars):
        carry += block
        cut = safe_cut(carry)
        if cut:
            yield starts_document, carry[:cut]
            starts_document, carry = False, carry[cut:]
    if carry or starts_document:
        yield starts_document, carry


def work_items(
    files: list[Path], text_key: str = "text", separator: str | None = None, chunk_chars: int = CHUNK_CHARS
) -> Iterator[WorkItem]:
    """Every document of ``files``, in order, as work items of about ``chunk_chars`` characters."""
    base = 0
    for path in files:
        suffix, size = kind(path), path.stat().st_size
        try:
            if suffix == ".txt":
                items = _text_items(path, separator, chunk_chars)
            elif suffix in (".jsonl", ".jsonl.gz"):
                items = _jsonl_items(path, text_key, chunk_chars)
            else:
                items = _parquet_items(path, text_key, chunk_chars)
            for item, done in items:  # done: the share of this file read
                yield dataclasses.replace(item, position=base + int(min(done, 1.0) * size))
        except UnicodeDecodeError as err:
            raise UserError(
                f"{path} is not UTF-8 text ({err.reason} at byte {err.start} of a block). Convert it, "
                "e.g. `iconv -f latin1 -t utf-8`."
            ) from None
        base += size


def _batched(
    entries: Iterator[tuple[Any, int, float]], chunk_chars: int, make: Callable[[tuple], WorkItem]
) -> Iterator[tuple[WorkItem, float]]:
    """``(entry, its characters, the share of the file read)`` gathered into work items of ``chunk_chars``."""
    batch, chars = [], 0
    for entry, size, done in entries:
        batch.append(entry)
        chars += size
        if chars >= chunk_chars:
            yield make(tuple(batch)), done
            batch, chars = [], 0
    if batch:
        yield make(tuple(batch)), 1.0


def _text_items(path: Path, separator: str | None, chunk_chars: int) -> Iterator[tuple[WorkItem, float]]:
    size = max(path.stat().st_size, 1)
    with open(path, encoding="utf-8", newline="") as stream:  # newline="": \r\n stays two characters
        pieces = (
            text_pieces(stream, chunk_chars, True) if separator is None else _separated(stream, separator, chunk_chars)
        )
        entries = ((piece, len(piece[1]), stream.buffer.tell() / size) for piece in pieces)
        yield from _batched(entries, chunk_chars, lambda batch: WorkItem(pieces=batch, source=str(path)))


def _separated(stream: io.TextIOBase, separator: str, chunk_chars: int) -> Iterator[tuple[bool, str]]:
    """Documents separated by ``separator`` (each a whole piece; a document is not cut)."""
    carry = ""
    while block := stream.read(chunk_chars):
        carry += block
        *documents, carry = carry.split(separator)
        for document in documents:
            if document.strip():
                yield True, document
    if carry.strip():
        yield True, carry


def _jsonl_items(path: Path, text_key: str, chunk_chars: int) -> Iterator[tuple[WorkItem, float]]:
    size = max(path.stat().st_size, 1)
    compressed = path.name.lower().endswith(".gz")
    with open(path, "rb") as raw, gzip.open(raw, "rb") if compressed else raw as f:
        lines = ((line, len(line), raw.tell() / size) for line in f if line.strip())
        yield from _batched(
            lines, chunk_chars, lambda batch: WorkItem(lines=batch, text_key=text_key, source=str(path))
        )


def _parquet_items(path: Path, text_key: str, chunk_chars: int) -> Iterator[tuple[WorkItem, float]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"Reading {path} needs pyarrow: pip install 'gpt-lightning[parquet]'.") from None
    parquet = pq.ParquetFile(path)
    if text_key not in parquet.schema_arrow.names:
        raise UserError(
            f"{path} has no column {text_key!r} (it has {', '.join(parquet.schema_arrow.names)}). "
            "Name the text column with --text_key."
        )
    rows = max(parquet.metadata.num_rows, 1)

    def texts() -> Iterator[tuple[tuple[bool, str], int, float]]:
        read = 0
        # One row group's text column at a time (iter_batches reads ahead: its memory grew with the file).
        for group in range(parquet.num_row_groups):
            column = parquet.read_row_group(group, columns=[text_key], use_threads=False).column(0)
            for chunk in column.chunks:
                for start in range(0, len(chunk), 1024):  # Python strings for 1,024 rows at a time
                    for text in chunk.slice(start, 1024).to_pylist():
                        read += 1
                        if text:
                            yield (True, text), len(text), read / rows
            del column

    yield from _batched(texts(), chunk_chars, lambda batch: WorkItem(pieces=batch, source=str(path)))
