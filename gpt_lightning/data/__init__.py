"""The data side: text and shards in, contiguous ``(B, T)`` GPT-2 token windows out.

- ``corpus``: where text comes from (a user's file, or the packaged tiny Shakespeare);
- ``tokenizer``: the offline GPT-2 tiktoken encoding;
- ``token_cache``: tokenize a text once, cache the ids as uint16 with a verified manifest;
- ``windows`` and ``shards``: iterable datasets of ``(x, y)`` windows, rank-aware and resumable;
- ``datamodule``: ``TokenStreamDataModule``, the ``LightningDataModule`` that serves them.
"""

from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.data.shards import ShardWindows
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.data.windows import TokenWindows

__all__ = ["ShardWindows", "TokenStreamDataModule", "TokenWindows", "gpt2_encoding"]
