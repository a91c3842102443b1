"""Where text comes from: a user's file, or the built-in tiny Shakespeare corpus.

Tiny Shakespeare is read from the cache directory; when it is not there it is downloaded once,
checked against its sha256 and written atomically, so a broken download never poisons the cache.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from pathlib import Path

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.errors import UserError

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_SHAKESPEARE_FILENAME = "tinyshakespeare.txt"
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


def tiny_shakespeare(cache_dir: Path, url: str = TINY_SHAKESPEARE_URL) -> Path:
    """Path of the cached tiny Shakespeare text, downloading and verifying it if needed."""
    path = cache_dir / TINY_SHAKESPEARE_FILENAME
    if path.is_file() and sha256_file(path) == TINY_SHAKESPEARE_SHA256:
        return path
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as err:
        raise UserError(
            f"Could not download tiny Shakespeare from {url} ({err}). Either download that file "
            f"yourself and put it at {path}, or train on your own text with --data.data_path FILE."
        ) from err
    digest = hashlib.sha256(data).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        raise UserError(
            f"The file downloaded from {url} has sha256 {digest}, expected {TINY_SHAKESPEARE_SHA256}; "
            "nothing was cached. Try again, or pass your own text with --data.data_path FILE."
        )
    atomic_write_bytes(path, data)
    return path


def read_text(path: Path) -> str:
    """The UTF-8 text of a user's file, with a clear error when it is missing, empty or binary."""
    if not path.exists():
        raise UserError(f"Data file {path} does not exist. Check --data.data_path.")
    if not path.is_file():
        raise UserError(f"Data path {path} is not a file. Pass a UTF-8 text file to --data.data_path.")
    raw = path.read_bytes()
    if not raw.strip():
        raise UserError(f"Data file {path} is empty. Pass a UTF-8 text file with some text in it.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(
            f"Data file {path} is not UTF-8 text (undecodable byte at offset {err.start}). "
            "Convert it, e.g. `iconv -f latin1 -t utf-8`, or point --data.data_path at a text file."
        ) from err
