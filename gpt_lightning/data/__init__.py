"""The data side: text and shards in, ``(B, T)`` GPT-2 token windows out. Names are imported on first
use, so tokenizing does not load torch and Lightning."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ShardWindows": "gpt_lightning.data.shards",
    "TokenStreamDataModule": "gpt_lightning.data.datamodule",
    "TokenWindows": "gpt_lightning.data.windows",
    "gpt2_encoding": "gpt_lightning.data.tokenizer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
