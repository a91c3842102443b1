"""``ValidationSamples`` by itself, on a plain ``Trainer``: the module's settings or its own, the
``samples`` tag, and a clear error for a module it cannot sample from."""

from __future__ import annotations

import pytest
from conftest import TINY_MODEL
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning import GPTLightningModule, TokenStreamDataModule, UserError, ValidationSamples


def logged_samples(log_dir) -> list[str]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = [tag for tag in events.Tags()["tensors"] if tag.startswith("samples")]
    return [event.tensor_proto.string_val[0].decode() for tag in tags for event in events.Tensors(tag)]


def test_the_callback_samples_after_each_validation_with_its_own_settings(small_text, tmp_path):
    module = GPTLightningModule(**TINY_MODEL, block_size=32, val_sample_tokens=0)  # the module's: off
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, val_fraction=0.1)
    logger = TensorBoardLogger(tmp_path, name="mine")
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[ValidationSamples(tokens=3, prompt="ROMEO:")],
    )
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


def test_fsdp2_on_a_cpu_samples_at_its_first_validation(small_text, tmp_path, in_process_group, monkeypatch):
    """`gpt-lightning fit --config configs/tiny-cpu.yaml --config configs/fsdp2.yaml`, shrunk in size
    and steps, with validation and its sample on: sampling runs on the sharded blocks. It died in a
    private oneDNN op that has no DTensor rule, on CPUs with native bfloat16 (AVX512-BF16, AMX),
    where bf16-mixed's gathered bf16 weights sent the decode steps; this CPU is made to say it has
    it (nothing in gpt_lightning asks any more)."""
    import torch

    from gpt_lightning.cli import main

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)

    from conftest import REPO, TINY_FIT, tiny_flags

    main(
        [
            *TINY_FIT,
            "--config",
            str(REPO / "configs/fsdp2.yaml"),
            *tiny_flags(
                {
                    "model.n_layer": 2,
                    "model.val_sample_tokens": None,
                    "data.block_size": 32,
                    "data.data_path": small_text,
                    "trainer.max_steps": 2,
                    "trainer.val_check_interval": 2,
                    "trainer.limit_val_batches": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ]
    )
    samples = logged_samples(next((tmp_path / "tb" / "tiny-cpu").glob("version_*")))
    assert len(samples) == 1 and samples[0].strip()


def test_samples_are_drawn_in_the_runs_precision(small_text, tmp_path, monkeypatch):
    """Under bf16-mixed the samples run in bf16 autocast, as validation does (not float32)."""
    import torch

    import gpt_lightning.observing.samples as samples

    seen = []

    def spy(model, idx, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return idx

    monkeypatch.setattr(samples, "generate", spy)
    module = GPTLightningModule(**TINY_MODEL, block_size=32, val_sample_tokens=2)
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, val_fraction=0.1)
    trainer = Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=1,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[ValidationSamples()],
    )
    trainer.fit(module, data)
    assert seen == [(True, torch.bfloat16)]
