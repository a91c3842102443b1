"""``ValidationSamples`` by itself, on a plain ``Trainer``: the module's settings or its own, the
``samples`` tag, and a clear error for a module it cannot sample from."""

from __future__ import annotations

import pytest
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning import GPTLightningModule, TokenStreamDataModule, UserError, ValidationSamples

from conftest import TINY_MODEL


def logged_samples(log_dir) -> list[str]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = [tag for tag in events.Tags()["tensors"] if tag.startswith("samples")]
    return [event.tensor_proto.string_val[0].decode() for tag in tags for event in events.Tensors(tag)]


def test_the_callback_samples_after_each_validation_with_its_own_settings(small_text, tmp_path):
    module = GPTLightningModule(**TINY_MODEL, block_size=32, val_sample_tokens=0)  # the module's: off
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, val_fraction=0.1)
    logger = TensorBoardLogger(tmp_path, name="mine")
    trainer = Trainer(accelerator="cpu", max_steps=2, val_check_interval=1, check_val_every_n_epoch=None,
                      limit_val_batches=1, num_sanity_val_steps=1, logger=logger, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False,
                      callbacks=[ValidationSamples(tokens=3, prompt="ROMEO:")])
    trainer.fit(module, data)
    samples = logged_samples(logger.log_dir)
    assert len(samples) == 2  # one per validation, none in the sanity check
    assert all(text.startswith("    ROMEO:") for text in samples)  # indented: a Markdown code block


def test_a_module_without_a_gpt_is_refused():
    with pytest.raises(UserError, match="module.model.generate"):
        ValidationSamples(tokens=4).setup(None, LightningModule(), "fit")


def test_without_tokens_the_module_must_say_how_many():
    class WithGPT(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPTLightningModule(**TINY_MODEL, block_size=16).model

    with pytest.raises(UserError, match="tokens=N"):
        ValidationSamples().setup(None, WithGPT(), "fit")
