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


def apply_optimizer_settings(
    checkpoint: dict[str, Any],
    optimizer: str,
    settings: Sequence[Mapping[str, Any]],
    optimizers: Iterable[torch.optim.Optimizer] = (),
) -> None:
    """Rewrite the restored optimizer state's group settings (betas, eps, weight decay, Muon's
    momentum ...) with ``settings``, keeping the moments: what the user gave now is what training
    continues with. The learning rates are ``place_schedule``'s, at train start.

    Args:
        checkpoint: the checkpoint dict, before Lightning restores the optimizer from it.
        optimizer: the module's ``optimizer`` now ("adamw" or "muon"); a checkpoint of the other
            one is refused (its state has other groups and moments).
        settings: each parameter group's settings, in the order the module builds its groups
            (``optimizers.group_settings``); their ``lr`` is the group's peak.
        optimizers: the trainer's optimizers, for strategies (``ModelParallelStrategy``) that load
            the sharded optimizer state in place before the module's ``on_load_checkpoint``.
    """
    saved = (checkpoint.get("hyper_parameters") or {}).get("optimizer", "adamw")
    if saved != optimizer:
        raise UserError(
            f"The checkpoint was trained with model.optimizer {saved}, this run asks for {optimizer}: their "
            f"optimizer states differ. Resume with --model.optimizer {saved}, or start a new run "
            "(model.init_from takes weights only, from a Hugging Face export)."
        )
    if "optimizer_states" in checkpoint:  # restored from this dict after this hook
        param_groups = [group for state in checkpoint["optimizer_states"] for group in state.get("param_groups", [])]
    else:  # loaded in place already
        param_groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    for group, given in zip(param_groups, settings):
        group.update({key: value for key, value in given.items() if key != "lr"})
        if "initial_lr" in group:  # LambdaLR's record of the peak
            group["initial_lr"] = given["lr"]


def place_schedule(trainer: Any, peaks: Sequence[float], multiplier: Callable[[int], float]) -> None:
    """Set every parameter group's learning rate, and each scheduler's position, to what the
    schedule given now (the group's peak in ``peaks`` x ``multiplier(step)``) has after
    ``trainer.global_step`` steps: the restored values come from the checkpoint's schedule and
    learning rates, which may differ or be absent. On a fresh run (step 0) this is what
    ``configure_optimizers`` built already."""
    step = trainer.global_step
    for optimizer in trainer.optimizers:
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * multiplier(step)
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
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
