"""What a resumed run checks and re-applies when ``GPTLightningModule`` loads a checkpoint.

- The architecture must be the checkpoint's: one that differs is refused with a message naming each
  difference, before Lightning's ``load_state_dict`` fails on a shape (or, for ``n_head``, which
  changes no shape, silently computes something else).
- The optimizer settings are the ones given now: the restored optimizer state keeps its moments,
  but takes this run's betas, eps, weight decay (and Muon's momentum), and a checkpoint of the
  other optimizer (AdamW vs Muon) is refused in one line.
- So are the learning rates and the schedule: when training starts, each parameter group's rate is
  its peak given now times the schedule given now at the restored step, with or without a
  scheduler in the checkpoint (``fit --ckpt_path last.ckpt --model.learning_rate 3e-4`` continues at
  3e-4; a warm-up removed, or a decay added or lengthened, takes effect at once).
- Both only for the optimizer and scheduler the module's own ``configure_optimizers`` built: a
  subclass's own optimizer and scheduler run as written, resumed as their checkpoint saved them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch

from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import batches_that_stepped, set_batches_that_stepped
from gpt_lightning.model import GPTConfig

# The GPTConfig fields a resumed run must share with its checkpoint. Dropout is a training setting:
# it changes no weight and no function at inference, so it may change on resume.
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
        # Every architecture field the checkpoint recorded (n_head changes no shape, yet the
        # computation), then what the weights' shapes show, which wins: load_from_checkpoint
        # writes its keyword arguments over the recorded ones.
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
    """Raise ``UserError`` when the checkpoint was trained with the other ``model.optimizer``
    ("adamw" vs "muon"): its state has other groups and moments."""
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
    """At train start, give the optimizer and scheduler the module's own ``configure_optimizers``
    built (``built``) the settings and schedule given now, at the (restored) step. Any other
    optimizer or scheduler (a subclass's own ``configure_optimizers``) is left as its author wrote
    it and as its checkpoint restored it.

    Args:
        trainer: the trainer, its optimizers and schedulers set up and restored.
        built: the optimizer and scheduler (or None) the module built; None when a subclass built its own.
        settings: each parameter group's settings, in the order the module builds its groups
            (``optimizers.group_settings``); their ``lr`` is the group's peak.
        multiplier: the schedule, a fraction of the peak at each optimizer step.
    """
    if built is None or not any(optimizer is built[0] for optimizer in trainer.optimizers):
        return
    optimizer, scheduler = built
    apply_optimizer_settings(optimizer, settings)
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs if config.scheduler is scheduler]
    place_schedule(trainer.global_step, optimizer, schedulers, [given["lr"] for given in settings], multiplier)


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, settings: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite the (restored) group settings (betas, eps, weight decay, Muon's momentum ...) with
    ``settings``, keeping the moments: what the user gave now is what training continues with.
    The learning rates are ``place_schedule``'s."""
    for group, given in zip(optimizer.param_groups, settings):
        group.update({key: value for key, value in given.items() if key != "lr"})
        if "initial_lr" in group:  # LambdaLR's record of the peak
            group["initial_lr"] = given["lr"]


def place_schedule(
    step: int,
    optimizer: torch.optim.Optimizer,
    schedulers: Sequence[Any],
    peaks: Sequence[float],
    multiplier: Callable[[int], float],
) -> None:
    """Set each parameter group's learning rate, and each scheduler's position, to what the
    schedule given now (the group's peak in ``peaks`` x ``multiplier(step)``) has after ``step``
    optimizer steps: the restored values come from the checkpoint's schedule and learning rates,
    which may differ or be absent. On a fresh run (step 0) this is what ``configure_optimizers``
    built already."""
    for group, peak in zip(optimizer.param_groups, peaks):
        group["lr"] = peak * multiplier(step)
    for scheduler in schedulers:
        scheduler.base_lrs = list(peaks[: len(scheduler.optimizer.param_groups)])
        # One public step from the step before: the scheduler sets each group's rate to its peak x
        # multiplier(step), and get_last_lr() reports it. A scheduler new to this run (the checkpoint
        # had none) has not seen optimizer.step() yet, which torch warns about; here that is expected.
        scheduler.last_epoch = step - 1  # a scheduler steps once per optimizer step after its first
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)` before `optimizer\.step\(\)`.*")
            scheduler.step()


def align_logging_step(trainer: Any) -> None:
    """Make the step logged metrics carry the optimizer step count again.

    Lightning logs at its epoch loop's ``_batches_that_stepped``, which it saves and restores, then
    adds one on restart when it guesses the checkpoint was written before its own increment.
    A checkpoint written at the end of ``fit`` after a final validation is guessed wrong, so every
    point of the resumed run was drawn one step to the right of the uninterrupted run's. In
    automatic optimization the two counts are equal at the start of every batch, so setting it is
    a no-op except after such a resume. (Lightning issue #19367 is the same family.)"""
    if batches_that_stepped(trainer) != trainer.global_step:
        set_batches_that_stepped(trainer, trainer.global_step)
