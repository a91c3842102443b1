"""Shared fixtures: a private token cache for the whole session, small texts, tiny configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpt_lightning.data.corpus import CACHE_ENV, Corpus

REPO = Path(__file__).resolve().parents[1]

# A model small enough to train in a second per few steps on 2 CPU cores.
TINY_MODEL = dict(n_layer=2, n_head=2, n_embd=32, compile=False)
# configs/modern-tiny-cpu.yaml's switches as CLI flags, for tests that keep their own config's sizes.
MODERN_FLAGS = ["--model.bias", "false", "--model.rotary", "true", "--model.norm", "rmsnorm", "--model.norm_affine", "false",
                "--model.qk_norm", "true", "--model.activation", "relu2", "--model.tie_embeddings", "false",
                "--model.zero_init_proj", "true", "--model.logit_softcap", "15.0", "--model.value_embeddings", "true"]


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh token cache, exported as GPT_LIGHTNING_CACHE_DIR: no test reads or writes ~/.cache."""
    path = tmp_path_factory.mktemp("cache")
    os.environ[CACHE_ENV] = str(path)
    return path


@pytest.fixture(scope="session")
def shakespeare() -> str:
    """The packaged tiny Shakespeare text."""
    return Corpus.tiny_shakespeare().read_text()


@pytest.fixture
def small_text(tmp_path: Path, shakespeare: str) -> Path:
    """A file of about 12k tokens: the first 50,000 characters of tiny Shakespeare."""
    path = tmp_path / "small.txt"
    path.write_text(shakespeare[:50_000])
    return path


@pytest.fixture
def in_process_group():
    """For a test that runs ModelParallelStrategy (or any process group) in the pytest process.
    Lightning exports MASTER_PORT and friends into os.environ and leaves its process group (and
    the TCP store on that port) behind: later subprocess launches would inherit the taken port."""
    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
