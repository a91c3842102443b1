"""Token ids of a text, tokenized once and cached as a flat uint16 file beside a JSON manifest.

The cache is keyed by the source's sha256, so an edited source is re-tokenized. The manifest records
the tokenizer, the token count and the token file's sha256: a truncated, corrupted or foreign cache is
detected and rebuilt. Both files are written atomically, so concurrent writers cannot tear them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.data.corpus import Corpus, sha256_file
from gpt_lightning.data.tokenizer import gpt2_encoding

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint16  # GPT-2's 50257 ids fit in 16 bits: half the size of int32


@dataclass(frozen=True)
class Manifest:
    format: int
    tokenizer: str
    n_tokens: int
    tokens_sha256: str
    source_sha256: str
    source: str


def cache_paths(cache_dir: Path, source_sha256: str, tokenizer: str = "gpt2") -> tuple[Path, Path]:
    stem = f"{source_sha256[:24]}.{tokenizer}"
    return cache_dir / "tokens" / f"{stem}.bin", cache_dir / "tokens" / f"{stem}.json"


def _problem(bin_path: Path, json_path: Path, source_sha256: str, tokenizer: str) -> str | None:
    """Why the cache can't be used, or None when it is sound."""
    if not json_path.is_file() or not bin_path.is_file():
        return "not built yet"
    try:
        manifest = Manifest(**json.loads(json_path.read_text()))
    except (ValueError, TypeError) as err:
        return f"unreadable manifest ({err})"
    if manifest.format != FORMAT_VERSION:
        return f"format {manifest.format}, expected {FORMAT_VERSION}"
    if manifest.tokenizer != tokenizer:
        return f"made by tokenizer {manifest.tokenizer!r}, expected {tokenizer!r}"
    if manifest.source_sha256 != source_sha256:
        return "made from another source"
    size = bin_path.stat().st_size
    if size != manifest.n_tokens * np.dtype(TOKEN_DTYPE).itemsize:
        return f"token file is {size} bytes, expected {manifest.n_tokens * 2}"
    if sha256_file(bin_path) != manifest.tokens_sha256:
        return "token file's hash does not match its manifest"
    return None


def build_token_cache(corpus: Corpus, cache_dir: Path) -> Path:
    """Tokenize ``corpus`` into the cache unless a sound cache exists; return the token file path."""
    bin_path, json_path = cache_paths(cache_dir, corpus.sha256)
    problem = _problem(bin_path, json_path, corpus.sha256, "gpt2")
    if problem is None:
        return bin_path
    text = corpus.read_text()  # clear errors for empty / non-UTF-8 files, or a damaged package
    if problem != "not built yet":
        log.warning("Rebuilding token cache %s: %s.", bin_path, problem)
    ids = np.asarray(gpt2_encoding().encode_ordinary(text), dtype=TOKEN_DTYPE)
    data = ids.tobytes()
    manifest = Manifest(
        format=FORMAT_VERSION,
        tokenizer="gpt2",
        n_tokens=int(ids.size),
        tokens_sha256=hashlib.sha256(data).hexdigest(),
        source_sha256=corpus.sha256,
        source=corpus.location,
    )
    atomic_write_bytes(bin_path, data)
    atomic_write_bytes(json_path, json.dumps(asdict(manifest), indent=2).encode())  # commit marker last
    return bin_path


def load_tokens(bin_path: Path) -> np.memmap:
    """The cached token ids, memory-mapped read-only: no copy of the corpus in RAM."""
    return np.memmap(bin_path, dtype=TOKEN_DTYPE, mode="r")
