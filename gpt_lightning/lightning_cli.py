"""``GPTLightningCLI``: Lightning's CLI with our module, data, callbacks and defaults."""

from __future__ import annotations

from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from gpt_lightning.data import TokenStreamDataModule
from gpt_lightning.module import GPTLightningModule
from gpt_lightning.throughput import ThroughputMonitor


class GPTLightningCLI(LightningCLI):
    """LightningCLI with the GPT module and token-stream data, TensorBoard logging under ``logs/``,
    and checkpointing, learning-rate and throughput callbacks always attached (``--checkpoint.*``,
    ``--lr_monitor.*`` and ``--throughput.*`` configure them)."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("seed_everything_default", 42)
        super().__init__(GPTLightningModule, TokenStreamDataModule, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # T is given once, to the data; the model's position table follows it.
        parser.link_arguments("data.block_size", "model.block_size")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_lightning_class_args(ThroughputMonitor, "throughput")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "logs", "name": "gpt", "default_hp_metric": False},
                },
                "checkpoint.save_last": True,
                "checkpoint.every_n_train_steps": 100,
            }
        )
