"""Stop after step k, resume from the checkpoint: the same batches and the same losses."""

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL
from lightning.pytorch import Callback, Trainer, seed_everything

from gpt_lightning.commands.bench import LossRecorder
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.errors import UserError
from gpt_lightning.observing.throughput import ThroughputMonitor
from gpt_lightning.training.module import GPTLightningModule


class BatchRecorder(Callback):
    def __init__(self):
        self.first_tokens: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.first_tokens.append(int(batch[0][0, 0]))


def train(data_path, cache, max_steps, ckpt_path=None, save_to=None):
    seed_everything(0)
    module = GPTLightningModule(**TINY_MODEL)
    data = TokenStreamDataModule(str(data_path), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(cache))
    losses, batches, monitor = LossRecorder(), BatchRecorder(), ThroughputMonitor(warmup_steps=2, filename=None)
    trainer = Trainer(
        accelerator="cpu",
        precision="32-true",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses, batches, monitor],
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return losses.values(), batches.first_tokens, monitor, len(trainer.train_dataloader)


def test_resume_mid_epoch_continues_with_the_same_batches_and_losses(small_text, tmp_path):
    small_text.write_text(small_text.read_text()[:3000])  # about 11 batches an epoch
    full_losses, full_batches, _, epoch_len = train(small_text, tmp_path, max_steps=30)
    k = 7
    assert k % epoch_len != 0 and 30 > epoch_len > k  # stops mid-epoch; the resumed run crosses an epoch end
    ckpt = tmp_path / "step7.ckpt"
    first_losses, first_batches, _, _ = train(small_text, tmp_path, max_steps=k, save_to=ckpt)
    resumed_losses, resumed_batches, monitor, _ = train(small_text, tmp_path, max_steps=30, ckpt_path=ckpt)

    assert first_batches + resumed_batches == full_batches
    np.testing.assert_allclose(first_losses + resumed_losses, full_losses, rtol=0, atol=1e-6)
    # The resumed fit warms up again: its first steps are warm-up, counted from the resume.
    assert [s.index for s in monitor.steps] == list(range(30 - k))
    assert monitor.summary["measured_steps"] == 30 - k - 2


def test_the_position_is_the_loader_state_lightning_saves(small_text, tmp_path):
    """Lightning stores a stateful loader's state_dict in the checkpoint's fit loop."""
    train(small_text, tmp_path, max_steps=3, save_to=tmp_path / "s3.ckpt")
    checkpoint = torch.load(tmp_path / "s3.ckpt", weights_only=False)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 3
    assert "TokenStreamDataModule" not in checkpoint
    # A checkpoint from before the loader kept its state resumes where Lightning's batch count says.
    del checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    checkpoint["TokenStreamDataModule"] = {"train_batches_consumed": 3}
    torch.save(checkpoint, tmp_path / "old.ckpt")
    _, resumed, _, _ = train(small_text, tmp_path, max_steps=5, ckpt_path=tmp_path / "old.ckpt")
    _, whole, _, _ = train(small_text, tmp_path, max_steps=5)
    assert resumed == whole[3:]


class LearningRates(Callback):
    def __init__(self, every_group: bool = False):
        self.values: list = []  # the first group's rate at each step, or every group's
        self.every_group = every_group

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        groups = trainer.optimizers[0].param_groups
        self.values.append([g["lr"] for g in groups] if self.every_group else groups[0]["lr"])


def rates(data_path, cache, max_steps, ckpt_path=None, save_to=None, every_group=False, **schedule):
    module = GPTLightningModule(**{"learning_rate": 1e-3, **TINY_MODEL, **schedule})
    data = TokenStreamDataModule(str(data_path), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(cache))
    recorder = LearningRates(every_group)
    trainer = Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return recorder.values


def test_a_schedule_changed_on_resume_takes_effect_at_the_restored_step(small_text, tmp_path):
    """The learning rate after a resume is the schedule given now at the restored step, whether the
    checkpoint had a schedule or not (before: a removed warm-up froze the rate mid-warm-up, and an
    added decay restarted at its own step 0)."""
    warm, constant = tmp_path / "warm.ckpt", tmp_path / "constant.ckpt"
    rates(small_text, tmp_path, 3, save_to=warm, warmup_steps=10)
    assert rates(small_text, tmp_path, 6, ckpt_path=warm) == [1e-3] * 3  # warm-up removed: the peak at once
    rates(small_text, tmp_path, 3, save_to=constant)
    decayed = dict(warmup_steps=2, cosine_decay_steps=4)
    resumed = rates(small_text, tmp_path, 6, ckpt_path=constant, **decayed)
    schedule = GPTLightningModule(**TINY_MODEL, learning_rate=1e-3, **decayed).lr_multiplier
    assert resumed == [1e-3 * schedule(step) for step in (3, 4, 5)]  # what a fresh run has at steps 3 to 5
    assert resumed[0] < 1e-3  # the decay had started by step 3


def test_muon_s_groups_resume_at_their_own_peaks_times_the_schedule_given_now(small_text, tmp_path):
    """Each parameter group's rate after a resume is its peak given now x the schedule given now at the
    restored step: a new Muon rate and a WSD schedule lengthened from 3 to 6 steps take effect at once."""
    ckpt = tmp_path / "muon.ckpt"
    muon = dict(optimizer="muon", lr_schedule="wsd", warmup_steps=1, decay_fraction=0.5, min_lr_ratio=0.0)
    rates(small_text, tmp_path, 3, save_to=ckpt, **muon)
    resumed = rates(
        small_text, tmp_path, 6, ckpt_path=ckpt, every_group=True, muon_learning_rate=0.01, learning_rate=2e-3, **muon
    )
    multipliers = [1.0, 2 / 3, 1 / 3]  # steps 3 to 5 of 6, the decaying half
    assert resumed == [pytest.approx([0.01 * m, 2e-3 * m, 2e-3 * m]) for m in multipliers]


def test_a_checkpoint_of_the_other_optimizer_is_refused_in_one_line(small_text, tmp_path):
    ckpt = tmp_path / "adamw.ckpt"
    rates(small_text, tmp_path, 1, save_to=ckpt)
    with pytest.raises(
        UserError, match="trained with model.optimizer adamw, this run asks for muon.*--model.optimizer adamw"
    ):
        rates(small_text, tmp_path, 2, ckpt_path=ckpt, optimizer="muon")
