"""A ``GPTLightningModule`` subclass with its own ``configure_optimizers`` trains with the optimizer
and scheduler it wrote, fresh and resumed (a plain Trainer): gpt-lightning re-applies its learning
rates and settings only to the optimizer and scheduler its own ``configure_optimizers`` built."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.optim.lr_scheduler import StepLR

from gpt_lightning import GPTLightningModule, TokenStreamDataModule

TINY = dict(block_size=16, n_layer=2, n_head=2, n_embd=32, compile=False, val_sample_tokens=0)


class PlainSGD(GPTLightningModule):
    """SGD at lr 1.0, no schedule: the module's learning_rate (1e-3) must play no part."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class SGDStepLR(GPTLightningModule):
    """SGD with a StepLR that halves the rate every 3 optimizer steps."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        scheduler = StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(Callback):
    """Keeps each optimizer step's learning rate and training loss."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.losses.append(float(outputs["loss"]))


def trainer(root: Path, max_steps: int, *callbacks, logger=False, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=list(callbacks),
        **kwargs,
    )


def data(small_text: Path) -> TokenStreamDataModule:
    return TokenStreamDataModule(str(small_text), batch_size=4, block_size=16, val_fraction=0.0, shuffle=False)


@pytest.mark.parametrize("clip", [None, 1.0], ids=["plain", "clipped"])
def test_a_fresh_fit_keeps_the_users_learning_rate(tmp_path, small_text, clip):
    seed_everything(0)
    record, logger = Record(), CSVLogger(tmp_path)
    monitor = LearningRateMonitor(logging_interval="step")
    run = trainer(tmp_path, 12, record, monitor, logger=logger, log_every_n_steps=1, gradient_clip_val=clip)
    run.fit(PlainSGD(**TINY), data(small_text))
    assert record.lrs == [1.0] * 12  # not the module's learning_rate, 1e-3
    logged = [line.split(",") for line in Path(logger.log_dir, "metrics.csv").read_text().splitlines()]
    column = logged[0].index("lr-SGD")
    assert [float(row[column]) for row in logged[1:] if row[column]] == [1.0] * 12  # what the monitor logs
    assert sum(record.losses[-3:]) / 3 < sum(record.losses[:3]) / 3 - 0.5  # lr 1.0 learns fast; 1e-3 barely moves


def test_a_users_scheduler_resumes_exactly(tmp_path, small_text):
    seed_everything(0)
    whole, full = Record(), ModelCheckpoint(tmp_path / "whole", save_last=True, save_top_k=0)
    trainer(tmp_path, 10, whole, full).fit(SGDStepLR(**TINY), data(small_text))
    assert whole.lrs == [0.5 * 0.5 ** (step // 3) for step in range(1, 11)]  # StepLR's own rates

    seed_everything(0)
    first = ModelCheckpoint(tmp_path / "first", save_last=True, save_top_k=0)
    trainer(tmp_path, 5, first).fit(SGDStepLR(**TINY), data(small_text))
    seed_everything(0)
    resumed, second = Record(), ModelCheckpoint(tmp_path / "second", save_last=True, save_top_k=0)
    trainer(tmp_path, 10, resumed, second).fit(SGDStepLR(**TINY), data(small_text), ckpt_path=first.last_model_path)
    assert resumed.lrs == whole.lrs[5:]

    end_whole = torch.load(full.last_model_path, weights_only=False)
    end_resumed = torch.load(second.last_model_path, weights_only=False)
    assert end_resumed["lr_schedulers"] == end_whole["lr_schedulers"]
    for key, value in end_whole["state_dict"].items():
        assert torch.equal(end_resumed["state_dict"][key], value), key
