"""Shared fixtures: a token cache seeded from ../shared's tiny Shakespeare, and tiny configs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpt_lightning.data.corpus import CACHE_ENV, TINY_SHAKESPEARE_FILENAME

REPO = Path(__file__).resolve().parents[1]
SHARED_SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

# A model small enough to train in a second per few steps on 2 CPU cores.
TINY_MODEL = dict(n_layer=2, n_head=2, n_embd=32, compile=False)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh cache dir holding tiny Shakespeare (from ../shared), exported as GPT_LIGHTNING_CACHE_DIR."""
    if not SHARED_SHAKESPEARE.is_file():
        pytest.skip(f"{SHARED_SHAKESPEARE} is not present")
    path = tmp_path_factory.mktemp("cache")
    shutil.copy(SHARED_SHAKESPEARE, path / TINY_SHAKESPEARE_FILENAME)
    os.environ[CACHE_ENV] = str(path)
    return path


@pytest.fixture
def small_text(tmp_path: Path) -> Path:
    """About 12k tokens of Shakespeare (or of generated English when ../shared is missing)."""
    path = tmp_path / "small.txt"
    if SHARED_SHAKESPEARE.is_file():
        path.write_text(SHARED_SHAKESPEARE.read_text()[:50_000])
    else:
        path.write_text(" ".join(f"line {i} of a small corpus, with words." for i in range(4000)))
    return path
