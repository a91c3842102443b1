"""Where text comes from: a user's UTF-8 file, or tiny Shakespeare, which ships inside the package."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gpt_lightning.errors import UserError

# Karpathy's char-rnn tinyshakespeare/input.txt: 1,115,394 bytes, 338,025 GPT-2 tokens.
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_SHAKESPEARE_RESOURCE = "tinyshakespeare.txt.gz"  # package data of gpt_lightning.data, ~434 KB
CACHE_ENV = "GPT_LIGHTNING_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$GPT_LIGHTNING_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpt_lightning``, else ``~/.cache/gpt_lightning``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "gpt_lightning"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Corpus:
    """A text to tokenize, at ``location``: read as a stream, from ``file`` or with its sha256 known in advance
    (the packaged corpus)."""

    location: str
    open_text: Callable[[], io.TextIOBase]
    known_sha256: str | None = None
    file: Path | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> Corpus:
        """A user's UTF-8 text file, with a clear error when it is missing, empty or a directory."""
        path = Path(path).expanduser().absolute()
        if not path.exists():
            raise UserError(
                f"Data path {path} does not exist. Check --data.data_path: a UTF-8 text file, or a folder of "
                "token shards (make one with `gpt-lightning tokenize --input TEXTS/ --output SHARDS/`, or "
                "build-nanogpt's fineweb.py)."
            )
        if not path.is_file():
            raise UserError(f"Data path {path} is not a file. Pass a UTF-8 text file to --data.data_path.")
        return cls(str(path), lambda: _open_text_file(path), file=path)

    @classmethod
    def tiny_shakespeare(cls) -> Corpus:
        """Tiny Shakespeare from the package itself, checked when read."""
        resource = resources.files(__package__) / TINY_SHAKESPEARE_RESOURCE
        return cls(
            str(resource),
            lambda: io.StringIO(_read_packaged(resource), newline=""),
            known_sha256=TINY_SHAKESPEARE_SHA256,
        )


def _read_packaged(resource) -> str:
    raw = gzip.decompress(resource.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        raise UserError(
            f"The packaged corpus {resource} is damaged (sha256 {digest}, expected "
            f"{TINY_SHAKESPEARE_SHA256}). Reinstall gpt-lightning, or pass your own text with --data.data_path."
        )
    return raw.decode("utf-8")


def _open_text_file(path: Path) -> io.TextIOBase:
    """A stream of the file's text; a small file is checked whole first (empty? UTF-8?)."""
    if path.stat().st_size > 1 << 20:
        return open(path, encoding="utf-8", newline="")  # decoding errors surface while it is read
    raw = path.read_bytes()
    if not raw.strip():
        raise UserError(f"Data file {path} is empty. Pass a UTF-8 text file with some text in it.")
    try:
        return io.StringIO(raw.decode("utf-8"), newline="")
    except UnicodeDecodeError as err:
        raise UserError(
            f"Data file {path} is not UTF-8 text (undecodable byte at offset {err.start}). "
            "Convert it, e.g. `iconv -f latin1 -t utf-8`, or point --data.data_path at a text file."
        ) from err
