"""The module and data module in someone else's Lightning project: a stock ``LightningCLI()`` with
class paths and a YAML config, and a plain ``Trainer`` with a logger, training on windows shorter
than the model's position table."""

import runpy
import sys
from unittest import mock

import pytest
import yaml
from conftest import TINY_MODEL
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning import GPTLightningModule, TokenStreamDataModule

STOCK_CLI = "from lightning.pytorch.cli import LightningCLI\nLightningCLI()\n"


@pytest.mark.filterwarnings("ignore:No seed found")  # a stock LightningCLI() given no seed, as users run it
def test_a_stock_lightning_cli_with_class_paths(small_text, tmp_path, monkeypatch, in_process_group):
    (tmp_path / "main.py").write_text(STOCK_CLI)
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "accelerator": "cpu",
                    "max_steps": 3,
                    "limit_val_batches": 1,
                    "val_check_interval": 3,
                    "log_every_n_steps": 1,
                    "default_root_dir": str(tmp_path / "runs"),
                    "enable_progress_bar": False,
                },
                "model": {
                    "class_path": "gpt_lightning.GPTLightningModule",
                    "init_args": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 64, "compile": False},
                },
                "data": {
                    "class_path": "gpt_lightning.TokenStreamDataModule",
                    "init_args": {"data_path": str(small_text), "batch_size": 2, "block_size": 32},
                },
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    with mock.patch.object(sys, "argv", ["main.py", "fit", "--config", "config.yaml"]):
        runpy.run_path("main.py", run_name="__main__")  # `python main.py fit ...`, in this process
    (run_dir,) = (tmp_path / "runs" / "lightning_logs").iterdir()
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["block_size"] == 64  # the model's table; the data trained on 32-token windows
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert {"train/loss", "val/loss"} <= set(events.Tags()["scalars"])
    assert list(run_dir.glob("checkpoints/*.ckpt"))


def test_a_plain_trainer_with_a_logger(small_text, tmp_path):
    module = GPTLightningModule(**TINY_MODEL, block_size=64)
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, val_fraction=0.1)
    logger = TensorBoardLogger(tmp_path, name="mine")
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=logger,
        limit_val_batches=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, data)
    assert trainer.global_step == 2
    assert logger.hparams["block_size"] == 64
