"""Use gpt-lightning's pieces from your own project: your Trainer, no CLI.

python examples/own_trainer.py --data_path my_corpus.txt --max_steps 50
"""

import argparse

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from gpt_lightning import (
    GPTLightningModule,
    Preempted,
    Preemption,
    ThroughputMonitor,
    TokenStreamDataModule,
    ValidationSamples,
)
from gpt_lightning.observing.console import StepProgressBar

parser = argparse.ArgumentParser()
parser.add_argument("--data_path", default=None, help="a UTF-8 text file; default: tiny Shakespeare")
parser.add_argument("--max_steps", type=int, default=50)
parser.add_argument("--log_dir", default="logs")
args = parser.parse_args()

seed_everything(42)
data = TokenStreamDataModule(args.data_path, batch_size=8, block_size=64)
model = GPTLightningModule(block_size=64, n_layer=2, n_head=2, n_embd=64, compile=False, learning_rate=3e-3)
monitor = ThroughputMonitor(warmup_steps=3)
trainer = Trainer(
    accelerator="auto",
    max_steps=args.max_steps,
    val_check_interval=args.max_steps,
    limit_val_batches=2,
    log_every_n_steps=5,
    logger=TensorBoardLogger(args.log_dir, name="own-trainer"),
    # StepProgressBar: optimizer steps, train/loss and tok/s, drawn in the step (the bar a plain
    # Trainer picks when rich is installed, RichProgressBar, redraws from a thread beside the step);
    # ValidationSamples: text samples after each validation, in TensorBoard; Preemption: on SIGTERM
    # or Ctrl-C, last.ckpt at the end of the optimizer step in flight, then Preempted is raised
    callbacks=[monitor, StepProgressBar(), ValidationSamples(), Preemption()],
)
try:
    trainer.fit(model, data)
except Preempted as stop:  # a SystemExit: uncaught, the script exits 143 (SIGTERM) or 130 (Ctrl-C)
    if stop.ckpt_path:  # None: stopped before a step was trained, nothing new to resume from
        print(f"stopped at step {stop.step}; resume with trainer.fit(model, data, ckpt_path={stop.ckpt_path!r})")
    raise
print(f"final train/loss {trainer.callback_metrics['train/loss']:.3f}")
print(f"median tokens/s {monitor.summary['tokens_per_sec_median']:.0f}")
