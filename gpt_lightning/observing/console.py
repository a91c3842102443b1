"""What a run prints: a progress bar in optimizer steps and a model summary with real FLOPs."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from gpt_lightning.averaging import averages_on_device
from gpt_lightning.lightning_internals import format_summary_table
from gpt_lightning.model import GPTConfig
from gpt_lightning.precision import PRECISIONS
from gpt_lightning.scaling.memory import GIB, TrainingMemory, fit_warning, training_memory
from gpt_lightning.scaling.sharding import shard_count

# Shown on the bar under short names. The first two are logged without prog_bar (a host read per batch)
# and read here once per logging interval.
_READ_AT_INTERVALS = {"train/loss": "loss", "throughput/tokens_per_sec": "tok/s"}
_BAR_NAMES = {"val/loss": "val_loss"}


class StepProgressBar(TQDMProgressBar):
    """One training bar for the whole run in optimizer steps, showing loss, validation loss and tokens/sec
    as of the last logging interval: no host sync per step, unlike Lightning's bar.

    Args:
        refresh_rate: redraw the bar every this many steps. The finished bar stays on screen.
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=True)
        self._shown_step = -1

    def init_train_tqdm(self) -> Tqdm:
        total = self.trainer.estimated_stepping_batches
        return Tqdm(
            desc="step",
            total=None if math.isinf(total) else int(total),
            initial=self.trainer.global_step,  # a resumed run continues its count
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        pass  # one bar across epochs: nothing to reset

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # Read when the next step starts: by then every callback has logged its values for the step.
        step, every = trainer.global_step, trainer.log_every_n_steps
        if not self.train_progress_bar.disable and every > 0 and step % every == 0 and step != self._shown_step:
            self._shown_step = step
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if bar.disable or step == bar.n:
            return  # disabled (e.g. not rank 0), or mid-accumulation: no optimizer step yet
        bar.n = step
        if step % self.refresh_rate == 0 or step == bar.total:
            bar.refresh()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass  # the bar lives until on_train_end

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        super().on_train_end(trainer, pl_module)  # closing draws the bar one last time

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        shown: dict[str, Any] = {}
        for name, label in _READ_AT_INTERVALS.items():
            value = trainer.callback_metrics.get(name)
            if value is not None:
                value = float(value)
                shown[label] = f"{value:,.0f}" if label == "tok/s" else f"{value:.3f}"
        for name, value in super().get_metrics(trainer, pl_module).items():
            if name == "v_num":
                continue  # the version is in the log directory's name
            shown[_BAR_NAMES.get(name, name)] = f"{value:.3f}" if isinstance(value, float) else value
        return shown


class TrainingFlopsSummary(ModelSummary):
    """Lightning's model summary with the training FLOPs of one batch, and a line estimating this run's
    memory per device (``scaling.memory``), with a warning where it won't fit.

    Args:
        max_depth: depth of the layer table, as for ``ModelSummary``.
    """

    def __init__(self, max_depth: int = 1) -> None:
        super().__init__(max_depth=max_depth)
        self._flops_per_batch: float | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        flops = getattr(pl_module, "training_flops", None)
        sizes = [getattr(trainer.datamodule, name, None) for name in ("batch_size", "block_size")]
        self._flops_per_batch = flops(*sizes) if callable(flops) and all(sizes) else None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is not supported by the model summary.*")
            super().on_fit_start(trainer, pl_module)
        estimate = run_memory(trainer, pl_module)
        if estimate is None:
            return
        parts = [
            (estimate.weights_grads_optimizer, "weights, gradients and optimizer states"),
            (estimate.ddp_buckets, "DDP buckets"),
            (estimate.bf16_weight_copies, "half-precision weight copies (autocast's)"),
            (estimate.activations, f"activations of {estimate.tokens:,} tokens"),
            (estimate.weight_average, "the averaged weights (EMAWeightAveraging)"),
        ]
        rank_zero_info(
            f"{estimate.total / GIB:.2f} GiB per device, estimated (eager; the memory guide, docs/multi-gpu.md): "
            + " + ".join(f"{value / GIB:.2f} {what}" for value, what in parts if value)
        )
        if pl_module.device.type == "cuda":
            properties = torch.cuda.get_device_properties(pl_module.device)
            warning = fit_warning(estimate, properties.total_memory, properties.name)
            if warning:
                rank_zero_warn(warning)

    def summarize(self, summary_data: list[tuple[str, list[str]]], *totals: Any, **summarize_kwargs: Any) -> None:
        # totals: parameters, trainable parameters, model size and training modes; Lightning's FLOPs are replaced
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        lines = format_summary_table(*totals[:4], int(self._flops_per_batch or 0), *columns).splitlines()
        if self._flops_per_batch:
            lines = [line.replace("Total Flops", "Training FLOPs per batch (forward + backward)") for line in lines]
        else:
            lines = [line for line in lines if not line.endswith("Total Flops")]
        rank_zero_info("\n" + "\n".join(lines))


def run_memory(trainer: Trainer, pl_module: LightningModule) -> TrainingMemory | None:
    """The memory estimate of this run per device: its model, micro-batch, precision and strategy."""
    config = getattr(pl_module, "config", None)
    batch_size = getattr(trainer.datamodule, "batch_size", None)
    block_size = getattr(trainer.datamodule, "block_size", None)
    if not isinstance(config, GPTConfig) or not batch_size or not block_size:
        return None
    if str(trainer.precision) not in PRECISIONS:  # transformer-engine's: not counted
        return None
    mesh = getattr(pl_module, "device_mesh", None) if isinstance(trainer.strategy, ModelParallelStrategy) else None
    return training_memory(
        config,
        batch_size,
        block_size,
        shards=shard_count(mesh) if mesh is not None else 1,
        precision=str(trainer.precision),
        activation_checkpointing=bool(getattr(getattr(pl_module, "model", None), "activation_checkpointing", False)),
        ddp=trainer.world_size > 1,
        chunked_loss=pl_module.uses_chunked_loss(pl_module.device) if hasattr(pl_module, "uses_chunked_loss") else True,
        states_per_parameter=optimizer_states_per_parameter(trainer),
        weight_average=averages_on_device(trainer, getattr(pl_module, "device", None)),
    )


def optimizer_states_per_parameter(trainer: Trainer) -> float:
    """Optimizer states per parameter of ``trainer``'s optimizers, on average: Adam's two (three with
    ``amsgrad``), one momentum (Muon, SGD), else none; 2 before there are optimizers."""
    groups = [group for optimizer in getattr(trainer, "optimizers", []) for group in optimizer.param_groups]

    def states(group: dict) -> int:
        return 2 + bool(group.get("amsgrad")) if "betas" in group else int(bool(group.get("momentum")))

    total = sum(p.numel() for group in groups for p in group["params"])
    held = sum(states(group) * p.numel() for group in groups for p in group["params"])
    return held / total if total else 2.0
