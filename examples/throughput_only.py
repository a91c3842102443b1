"""Attach only gpt-lightning's ThroughputMonitor to a LightningModule of your own.

The callback counts tokens as the elements of the batch's first tensor; give it FLOPs per batch
(here analytic) and a peak FLOP/s to get MFU on hardware it does not know.

    python examples/throughput_only.py --max_steps 30
"""

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from gpt_lightning import ThroughputMonitor

VOCAB, CONTEXT, WIDTH, BATCH = 1000, 32, 64, 16


class BigramMLP(LightningModule):
    """Not a GPT: an embedding and an MLP predicting the next token from the current one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, WIDTH),
            torch.nn.Linear(WIDTH, 4 * WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(4 * WIDTH, VOCAB),
        )
        # Lightning's convention, read by the callback: training FLOPs of one batch (6 x matmul params x tokens).
        self.flops_per_batch = 6 * (WIDTH * 4 * WIDTH + 4 * WIDTH * VOCAB) * BATCH * CONTEXT

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, T), (B, T)
        logits = self.net(x)  # (B, T, VOCAB)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


parser = argparse.ArgumentParser()
parser.add_argument("--max_steps", type=int, default=30)
parser.add_argument("--peak_flops", type=float, default=1e11, help="assumed peak FLOP/s of one device")
args = parser.parse_args()

tokens = torch.randint(0, VOCAB, (BATCH * 64, CONTEXT + 1))
loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
monitor = ThroughputMonitor(warmup_steps=5, peak_flops=args.peak_flops, filename=None)
trainer = Trainer(
    accelerator="cpu", max_steps=args.max_steps, logger=False, enable_checkpointing=False, callbacks=[monitor]
)
trainer.fit(BigramMLP(), loader)
print(f"median tokens/s {monitor.summary['tokens_per_sec_median']:.0f}, MFU {monitor.summary['mfu']:.2%}")
