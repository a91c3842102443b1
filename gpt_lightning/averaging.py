"""Lightning's own weight averaging (``EMAWeightAveraging``, any ``WeightAveraging``) with the rest of
gpt-lightning: our samples and evaluations on the average, a fit resumed without the callback on the
trained weights, FSDP2 refused (docs/optimizers.md, "A weight EMA")."""

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
    """Whether the module holds the averaged weights while ``caller``'s ``hook`` runs, by the callbacks'
    order: the averaging swaps them out at its ``on_validation_epoch_end`` and in at its ``on_train_end``."""
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
    trained weights, not the averaged ones its ``state_dict`` holds. Called from ``on_load_checkpoint``."""
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
    """The trained weights of a fit's end (on the CPU, only with an averaging callback), for a ``last.ckpt``
    written after the callback's ``on_train_end`` has copied the average over them."""

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
