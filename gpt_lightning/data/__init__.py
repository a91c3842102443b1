"""The data side: text and shards in, contiguous ``(B, T)`` GPT-2 token windows out.

- ``corpus``: where text comes from (a user's file, or the packaged tiny Shakespeare);
- ``documents``: .txt / .jsonl / .parquet inputs read as a stream of work items;
- ``encode``: work items to ids on every core, in order; ``tokenizer``: the offline GPT-2 encoding;
- ``token_cache``: tokenize a text once, cache the ids as uint16 with a verified manifest;
- ``windows`` and ``shards``: iterable datasets of ``(x, y)`` windows, rank-aware, shuffled on
  request and resumable; ``shards`` also writes shard folders;
- ``datamodule``: ``TokenStreamDataModule``, the ``LightningDataModule`` that serves them.

Names are imported on first use, so tokenizing does not load torch and Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ShardWindows": "gpt_lightning.data.shards",
    "TokenStreamDataModule": "gpt_lightning.data.datamodule",
    "TokenWindows": "gpt_lightning.data.windows",
    "gpt2_encoding": "gpt_lightning.data.tokenizer",
}
_SUBMODULES = {"corpus", "datamodule", "documents", "encode", "shard_writer", "shards", "token_cache", "tokenizer", "windows"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    if name in _SUBMODULES:  # `from gpt_lightning.data import token_cache`, as before
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
