"""Lightning's own weight averaging (``lightning.pytorch.callbacks.EMAWeightAveraging``, or any
``WeightAveraging``) with the rest of gpt-lightning (docs/optimizers.md, "A weight EMA").

The stock callback keeps a copy of the module, updates it after each optimizer step, swaps it in for
validation, saves it as the checkpoint's ``state_dict`` (the trained weights as ``current_model_state``,
restored on resume) and copies it into the module when training ends. What it does not know about,
added here: our samples and evaluations run outside its swap (``averaged_weights``), a fit resumed
without it would train on from the averaged weights (``train_on_from_trained_weights``), and FSDP2
would shard nothing of its copy (``check_weight_averaging``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import (
    averaged_model,
    averaging_device,
    fit_ends_this_epoch,
    swap_averaged_weights,
)

# Where a checkpoint written with a WeightAveraging callback keeps the trained (not averaged) weights.
CURRENT_WEIGHTS = "current_model_state"


def averaging_callback(trainer: Trainer) -> WeightAveraging | None:
    """The trainer's ``WeightAveraging`` callback (``EMAWeightAveraging``...), None without one."""
    return next((c for c in getattr(trainer, "callbacks", None) or [] if isinstance(c, WeightAveraging)), None)


def check_weight_averaging(trainer: Trainer) -> None:
    """Refuse what the stock callback cannot do: FSDP2, and two averaging callbacks at once."""
    found = [c for c in trainer.callbacks if isinstance(c, WeightAveraging)]
    if not found:
        return
    name = type(found[0]).__name__
    if isinstance(trainer.strategy, ModelParallelStrategy):
        raise UserError(
            f"{name} does not run under FSDP2 (ModelParallelStrategy): Lightning's weight averaging keeps a whole, "
            "unsharded copy of the model on every rank. Use --trainer.strategy ddp, or leave the callback out."
        )
    if len(found) > 1:
        raise UserError(
            f"{len(found)} weight-averaging callbacks ({', '.join(type(c).__name__ for c in found)}): each would "
            "swap its copy in and out of the same weights at every validation. Keep one."
        )


def averages_on_device(trainer: Trainer, device: Any) -> bool:
    """Whether the trainer has an averaging callback whose copy lives on ``device``'s kind (the memory guide)."""
    callback = averaging_callback(trainer)
    if callback is None:
        return False
    own = averaging_device(callback)
    if own is None:
        return True  # the callback's default: the model's device
    own_type = "cuda" if isinstance(own, int) else torch.device(own).type  # "cuda:0", a torch.device: their kind
    return own_type == torch.device(device).type


def _position(trainer: Trainer, callback: Callback) -> int:
    return next((i for i, c in enumerate(trainer.callbacks) if c is callback), len(trainer.callbacks))


def holds_average(trainer: Trainer, callback: WeightAveraging, caller: Callback, hook: str) -> bool:
    """Whether the module holds the averaged weights while ``caller``'s ``hook`` runs. Lightning calls a
    hook of every callback in the order of ``trainer.callbacks``: the averaging swaps the trained weights
    back at its own ``on_validation_epoch_end``, and copies the average in at its ``on_train_end``. ``hook``:
    one of those two, or a training hook."""
    averaging_first = _position(trainer, callback) < _position(trainer, caller)
    if hook == "on_validation_epoch_end":
        return not averaging_first
    if hook == "on_train_end":
        return averaging_first
    return False  # a training hook (on_train_batch_start, ...): the trained weights


@contextmanager
def averaged_weights(trainer: Trainer, pl_module: LightningModule, caller: Callback, hook: str) -> Iterator[None]:
    """Run the body on the averaged weights where the trainer averages them (else as it is): swapped in
    and back unless ``caller``'s ``hook`` already sees them (``holds_average``)."""
    callback = averaging_callback(trainer)
    if callback is None or averaged_model(callback) is None or holds_average(trainer, callback, caller, hook):
        yield
        return
    swap_averaged_weights(callback, pl_module)
    try:
        yield
    finally:
        swap_averaged_weights(callback, pl_module)


def train_on_from_trained_weights(checkpoint: dict[str, Any], trainer: Trainer) -> None:
    """A fit resumed without the averaging callback from a checkpoint written with it trains on from the
    trained weights, not the averaged ones its ``state_dict`` holds (what export, eval and validate read).
    Called from the module's ``on_load_checkpoint``, before Lightning loads ``state_dict``."""
    if CURRENT_WEIGHTS not in checkpoint or trainer.state.fn != TrainerFn.FITTING:
        return
    if averaging_callback(trainer) is not None:
        return  # the callback restores both itself
    checkpoint["state_dict"] = checkpoint[CURRENT_WEIGHTS]
    rank_zero_info(
        "The checkpoint was written with weight averaging (EMAWeightAveraging) and this run has none: it trains "
        "on from the trained weights; the average is dropped. Add the same callback to keep averaging."
    )


class TrainedWeightsAtEnd:
    """The trained weights of a fit's end, for a ``last.ckpt`` written after the averaging callback's
    ``on_train_end`` has copied the average over them (``ModelCheckpoint`` writes one there when the fit
    saved none before): without them its ``current_model_state`` would be the average, and a resume
    would train on from it. Kept on the CPU, once, only with an averaging callback."""

    def __init__(self) -> None:
        self._kept: dict[str, Any] | None = None

    def keep(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At the module's ``on_train_epoch_end``: a copy of the weights, if the fit ends here and averages."""
        self._kept = None
        if averaging_callback(trainer) is not None and fit_ends_this_epoch(trainer):
            self._kept = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}

    def put_in(self, checkpoint: dict[str, Any]) -> None:
        """At the module's ``on_save_checkpoint``: the kept weights as the trained ones."""
        if self._kept is not None and CURRENT_WEIGHTS in checkpoint:
            checkpoint[CURRENT_WEIGHTS] = self._kept

    def drop(self) -> None:
        self._kept = None
