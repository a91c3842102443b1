"""The ``gpt-lightning`` command: Lightning's CLI for fit / validate / test, and our own
``bench`` (eager vs compiled), ``sample`` (text from a checkpoint), ``export`` (plain weights) and
``tokenize`` (text folder to shards)."""

from __future__ import annotations

import sys

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from gpt_lightning.data import TokenStreamDataModule
from gpt_lightning.errors import UserError
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


def main(args: list[str] | None = None) -> None:
    """Entry point of ``gpt-lightning`` and ``python -m gpt_lightning``."""
    argv = sys.argv[1:] if args is None else args
    try:
        if argv and argv[0] == "bench":
            from gpt_lightning.bench import main as bench_main

            bench_main(argv[1:])
        elif argv and argv[0] == "export":
            from gpt_lightning.export import main as export_main

            export_main(argv[1:])
        elif argv and argv[0] == "tokenize":
            from gpt_lightning.shards import main as tokenize_main

            tokenize_main(argv[1:])
        elif argv and argv[0] == "sample":
            from gpt_lightning.sample import main as sample_main

            sample_main(argv[1:])
        else:
            GPTLightningCLI(args=args)
    except (UserError, MisconfigurationException) as err:
        print(f"gpt-lightning: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
