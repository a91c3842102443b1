"""Token ids of a text, tokenized once and cached as uint16 beside a verified JSON manifest, keyed by the
source's sha256 (rehashed only when size or mtime changes), written atomically (docs/data.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gpt_lightning.atomic import atomic_output, atomic_write_bytes
from gpt_lightning.data.corpus import Corpus, sha256_file
from gpt_lightning.data.documents import CHUNK_CHARS, WorkItem, text_pieces
from gpt_lightning.data.encode import TOKEN_DTYPE, default_workers, encode_items
from gpt_lightning.errors import UserError

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    format: int
    tokenizer: str
    n_tokens: int
    tokens_sha256: str
    source_sha256: str
    source: str


# A file's mtime must be this old before its size and mtime stand for its hash: timestamps tick coarsely.
SETTLED_NS = 2_000_000_000


def cache_paths(cache_dir: Path, source_sha256: str) -> tuple[Path, Path]:
    stem = f"{source_sha256[:24]}.gpt2"
    return cache_dir / "tokens" / f"{stem}.bin", cache_dir / "tokens" / f"{stem}.json"


def stamped_sha256(path: Path, cache_dir: Path) -> str:
    """The sha256 of the file at ``path``: its stamp's while size and mtime match, else hashed and stamped."""
    path = Path(path).absolute()
    stamp_path = cache_dir / "stamps" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:24]}.json"
    before = path.stat()
    try:
        stamp = json.loads(stamp_path.read_text())
        if (stamp["path"], stamp["size"], stamp["mtime_ns"]) == (str(path), before.st_size, before.st_mtime_ns):
            return stamp["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not stamped yet, or an unreadable stamp: hash the file
    digest = sha256_file(path)
    after = path.stat()
    unchanged = (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    if unchanged and time.time_ns() - after.st_mtime_ns >= SETTLED_NS:
        stamp = {"path": str(path), "size": after.st_size, "mtime_ns": after.st_mtime_ns, "sha256": digest}
        atomic_write_bytes(stamp_path, json.dumps(stamp, indent=2).encode())
    return digest


def _problem(bin_path: Path, json_path: Path, source_sha256: str, cache_dir: Path | None = None) -> str | None:
    """Why the cache can't be used, or None when it is sound (``cache_dir``: trust its stamps)."""
    if not json_path.is_file() or not bin_path.is_file():
        return "not built yet"
    try:
        manifest = Manifest(**json.loads(json_path.read_text()))
    except (ValueError, TypeError) as err:
        return f"unreadable manifest ({err})"
    if manifest.format != FORMAT_VERSION:
        return f"format {manifest.format}, expected {FORMAT_VERSION}"
    if manifest.tokenizer != "gpt2":
        return f"made by tokenizer {manifest.tokenizer!r}, expected 'gpt2'"
    if manifest.source_sha256 != source_sha256:
        return "made from another source"
    size = bin_path.stat().st_size
    if size != manifest.n_tokens * np.dtype(TOKEN_DTYPE).itemsize:
        return f"token file is {size} bytes, expected {manifest.n_tokens * 2}"
    if (sha256_file(bin_path) if cache_dir is None else stamped_sha256(bin_path, cache_dir)) != manifest.tokens_sha256:
        return "token file's hash does not match its manifest"
    return None


def build_token_cache(
    corpus: Corpus, cache_dir: Path, workers: int | None = None, chunk_chars: int = CHUNK_CHARS
) -> Path:
    """Tokenize ``corpus`` into the cache (streamed, on ``workers`` processes) unless a sound cache
    exists; return the token file path."""
    source_sha256 = corpus.known_sha256 if corpus.file is None else stamped_sha256(corpus.file, cache_dir)
    bin_path, json_path = cache_paths(cache_dir, source_sha256)
    problem = _problem(bin_path, json_path, source_sha256, cache_dir)
    if problem is None:
        return bin_path
    stream = corpus.open_text()  # clear errors for empty / non-UTF-8 files, or a damaged package
    if problem != "not built yet":
        log.warning("Rebuilding token cache %s: %s.", bin_path, problem)
    digest, count = hashlib.sha256(), 0
    with stream, atomic_output(bin_path) as tmp, open(tmp, "wb") as out:
        items = (WorkItem(pieces=(piece,), source=corpus.location) for piece in text_pieces(stream, chunk_chars, False))
        large = corpus.file is not None and corpus.file.stat().st_size > 4 * chunk_chars
        if workers is None:  # a pool pays off from a few pieces on
            workers = default_workers() if large else 1
        try:
            for _, ids in encode_items(items, workers):  # the pieces start no document: no <|endoftext|>
                data = ids.tobytes()
                out.write(data)
                digest.update(data)
                count += ids.size
        except UnicodeDecodeError as err:
            raise UserError(
                f"Data file {corpus.location} is not UTF-8 text ({err.reason}). Convert it, e.g. "
                "`iconv -f latin1 -t utf-8`, or point --data.data_path at a text file."
            ) from None
        out.flush()
        os.fsync(out.fileno())
    manifest = Manifest(
        format=FORMAT_VERSION,
        tokenizer="gpt2",
        n_tokens=count,
        tokens_sha256=digest.hexdigest(),
        source_sha256=source_sha256,
        source=corpus.location,
    )
    atomic_write_bytes(json_path, json.dumps(asdict(manifest), indent=2).encode())  # commit marker last
    return bin_path


def load_tokens(bin_path: Path) -> np.memmap:
    """The cached token ids, memory-mapped read-only: no copy of the corpus in RAM."""
    return np.memmap(bin_path, dtype=TOKEN_DTYPE, mode="r")
