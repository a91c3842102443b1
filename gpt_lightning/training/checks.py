"""The module's options checked, each mistake one ``UserError`` that names the option: value ranges
when the module is built, and the data against the model's tables when training is set up."""

from __future__ import annotations

from typing import Any

from gpt_lightning.errors import UserError
from gpt_lightning.model import GPTConfig


def check_optimizer_settings(learning_rate: float, weight_decay: float, warmup_steps: int, cosine_decay_steps: int | None) -> None:
    """Raise ``UserError`` for an AdamW or schedule setting outside its range."""
    if not learning_rate > 0:
        raise UserError(f"model.learning_rate must be > 0, got {learning_rate!r}.")
    if weight_decay < 0:
        raise UserError(f"model.weight_decay must be >= 0, got {weight_decay!r}.")
    if warmup_steps < 0 or (cosine_decay_steps is not None and cosine_decay_steps <= 0):
        raise UserError("model.warmup_steps must be >= 0 and model.cosine_decay_steps > 0.")


def check_fits_data(config: GPTConfig, datamodule: Any) -> None:
    """Raise ``UserError`` when the data's tokens or windows do not fit the model's tables."""
    vocab, block = getattr(datamodule, "vocab_size", None), getattr(datamodule, "block_size", None)
    if vocab is not None and vocab > config.vocab_size:
        raise UserError(
            f"model.vocab_size ({config.vocab_size}) is smaller than the tokenizer's {vocab} "
            f"tokens: ids from {config.vocab_size} up would have no embedding row. Use "
            f"--model.vocab_size {vocab} (or 50304, a multiple of 64 that is faster on GPUs)."
        )
    if block is not None and block > config.block_size:
        raise UserError(
            f"data.block_size ({block}) is larger than the model's block_size ({config.block_size}): "
            f"the model has no position embedding past {config.block_size}. "
            f"Use data.block_size <= {config.block_size}."
        )
