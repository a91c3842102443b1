"""A callback the DDP test attaches through the CLI: each rank writes what it saw to a JSON file."""

import json
import statistics
from pathlib import Path

from lightning.pytorch import Callback

from gpt_lightning.throughput import ThroughputMonitor


class RecordRank(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.windows: list[list[int]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.windows.append(batch[0].tolist())  # (B, T) token ids of the window
        self.losses.append(float(outputs["loss"]))  # this rank's own loss

    def on_train_end(self, trainer, pl_module):
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, ThroughputMonitor))
        measured = [s for s in monitor.steps if s.index >= monitor.warmup_steps]
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "windows": self.windows,
            "losses": self.losses,
            "local_median_tokens_per_sec": statistics.median(s.tokens / s.seconds for s in measured),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
