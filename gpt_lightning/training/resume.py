"""What a resumed run checks and re-applies on loading a checkpoint: the same architecture, else a
``UserError`` naming each difference; the optimizer settings and schedule given now (docs/resume.md)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import batches_that_stepped, mark_step_saved, set_batches_that_stepped
from gpt_lightning.model import GPTConfig

# The GPTConfig fields a resumed run must share with its checkpoint; dropout may change.
ARCHITECTURE = tuple(f.name for f in fields(GPTConfig) if f.name != "dropout")


def architecture_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The GPTConfig fields that a checkpoint's weight shapes pin down."""
    if "model.transformer.wte.weight" not in state_dict:
        return {}
    vocab_size, n_embd = state_dict["model.transformer.wte.weight"].shape
    layers = {key.split(".")[3] for key in state_dict if key.startswith("model.transformer.h.")}
    shown = {}
    if "model.transformer.wpe.weight" in state_dict:  # rotary models have no position table
        shown["block_size"] = state_dict["model.transformer.wpe.weight"].shape[0]
    return shown | {
        "vocab_size": vocab_size,
        "n_embd": n_embd,
        "n_layer": len(layers),
        "bias": "model.transformer.h.0.attn.c_attn.bias" in state_dict,
    }


def refuse_other_architecture(checkpoint: dict[str, Any], config: GPTConfig) -> None:
    """Raise ``UserError`` naming every difference between the checkpoint's architecture and ``config``."""
    saved = {
        # What the checkpoint recorded, then what its weights' shapes show, which wins.
        **{name: value for name, value in (checkpoint.get("hyper_parameters") or {}).items() if name in ARCHITECTURE},
        **architecture_of(checkpoint.get("state_dict", {})),
    }
    differences = [
        f"{name}: checkpoint {value}, this model {getattr(config, name)}"
        for name, value in saved.items()
        if value != getattr(config, name)
    ]
    if differences:
        raise UserError(
            "The checkpoint is of another architecture (" + "; ".join(differences) + "). "
            "Use the checkpoint's architecture (its config.yaml / hparams.yaml) or start a new run."
        )


def refuse_other_optimizer(checkpoint: dict[str, Any], optimizer: str) -> None:
    """Raise ``UserError`` when the checkpoint was trained with the other ``model.optimizer``."""
    saved = (checkpoint.get("hyper_parameters") or {}).get("optimizer", "adamw")
    if saved != optimizer:
        raise UserError(
            f"The checkpoint was trained with model.optimizer {saved}, this run asks for {optimizer}: their "
            f"optimizer states differ. Resume with --model.optimizer {saved}, or start a new run "
            "(model.init_from takes weights only, from a Hugging Face export)."
        )


def continue_own_schedule(
    trainer: Any,
    built: tuple[torch.optim.Optimizer, Any] | None,
    settings: Sequence[Mapping[str, Any]],
    multiplier: Callable[[int], float],
) -> None:
    """At train start, give the module's own optimizer and scheduler (``built``) each group's ``settings``
    (``lr``: the peak; ``params`` ignored) and the schedule ``multiplier`` given now, at the restored step,
    keeping the moments; a subclass's own are left as restored."""
    if built is None or not any(optimizer is built[0] for optimizer in trainer.optimizers):
        return
    (optimizer, scheduler), step = built, trainer.global_step
    for group, given in zip(optimizer.param_groups, settings):
        group.update({key: value for key, value in given.items() if key not in ("lr", "params")})
        group["lr"] = given["lr"] * multiplier(step)
        if "initial_lr" in group:  # LambdaLR's record of the peak
            group["initial_lr"] = given["lr"]
    if any(config.scheduler is scheduler for config in trainer.lr_scheduler_configs):
        scheduler.base_lrs = [given["lr"] for given in settings][: len(optimizer.param_groups)]
        # One public step from the step before, so get_last_lr() reports the rate too.
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)` before `optimizer\.step\(\)`.*")
            scheduler.step()


def align_logging_step(trainer: Any) -> None:
    """Log at the optimizer step count again: Lightning's restored logging step can be one ahead."""
    if batches_that_stepped(trainer) != trainer.global_step:
        set_batches_that_stepped(trainer, trainer.global_step)


def keep_the_restored_step(trainer: Any) -> None:
    """At train start: the step a run resumed from is saved already, so no ``ModelCheckpoint`` saves it again after
    the first micro-batch, mid-accumulation, where a kill before the next save would leave a checkpoint that
    resumes one micro-batch late, off the uninterrupted run's weights."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            mark_step_saved(callback, trainer.global_step)
