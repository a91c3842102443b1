"""The module's options checked, each mistake one ``UserError`` that names the option: value ranges
when the module is built, and the data against the model's tables when training is set up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from gpt_lightning.errors import UserError
from gpt_lightning.model import GPTConfig
from gpt_lightning.training.optimizers import require_muon


def check_optimizer_settings(hp: Mapping[str, Any]) -> None:
    """Raise ``UserError`` for an optimizer or schedule setting of the module's ``hp`` outside its range."""
    if not hp["learning_rate"] > 0:
        raise UserError(f"model.learning_rate must be > 0, got {hp['learning_rate']!r}.")
    if hp["weight_decay"] < 0:
        raise UserError(f"model.weight_decay must be >= 0, got {hp['weight_decay']!r}.")
    if hp["warmup_steps"] < 0 or (hp["cosine_decay_steps"] is not None and hp["cosine_decay_steps"] <= 0):
        raise UserError("model.warmup_steps must be >= 0 and model.cosine_decay_steps > 0.")
    if hp["lr_schedule"] == "wsd" and not 0 < hp["decay_fraction"] <= 1:
        raise UserError(f"model.decay_fraction must be in (0, 1], got {hp['decay_fraction']!r}.")
    if hp["optimizer"] == "muon":
        require_muon()
        if not hp["muon_learning_rate"] > 0 or hp["muon_weight_decay"] < 0:
            raise UserError("model.muon_learning_rate must be > 0 and model.muon_weight_decay >= 0.")


def check_untied_rates(
    config: GPTConfig, embedding_learning_rate: float | None, head_learning_rate: float | None
) -> None:
    """Raise ``UserError`` for an untied embedding or head rate that is not > 0 or given to a tied head
    (where it would be ignored)."""
    rates = {"embedding_learning_rate": embedding_learning_rate, "head_learning_rate": head_learning_rate}
    given = {name: rate for name, rate in rates.items() if rate is not None}
    if given and config.tie_embeddings:
        raise UserError(
            f"model.{next(iter(given))} is the rate of an untied embedding and head (model.tie_embeddings false); "
            "this model ties them, so they train at model.learning_rate. Leave it out, or add --model.tie_embeddings false."
        )
    for name, rate in given.items():
        if not rate > 0:
            raise UserError(f"model.{name} must be > 0, got {rate!r}.")


def check_strategy_supports(optimizer: str, strategy: Any) -> None:
    """Raise ``UserError`` for Muon under FSDP2, which would orthogonalize each rank's shard."""
    if optimizer == "muon" and isinstance(strategy, ModelParallelStrategy):
        raise UserError(
            "model.optimizer muon does not run under FSDP2 (ModelParallelStrategy): torch.optim.Muon would "
            "orthogonalize each rank's shard, not the whole matrix. Use --trainer.strategy ddp (or "
            "--model.optimizer adamw with FSDP2)."
        )


def run_length(estimated_stepping_batches: float) -> int:
    """The run's optimizer steps, for the "wsd" schedule; ``UserError`` when the run has no end."""
    if estimated_stepping_batches == float("inf"):
        raise UserError(
            "model.lr_schedule wsd decays over the end of the run, which has no end here: set "
            "--trainer.max_steps (or --trainer.max_epochs)."
        )
    return max(1, int(estimated_stepping_batches))


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
