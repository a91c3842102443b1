"""A callback the preemption tests attach through the CLI: each rank appends ``global_step batch_idx``
to a file as every micro-batch starts (the test signals the process when it sees a chosen one), then
waits a little, so that a signal sent then lands inside that micro-batch; the sanity check's batches
likewise, to ``rank{N}-sanity.log``."""

import os
import time
from pathlib import Path

from lightning.pytorch import Callback


class MicroBatchLog(Callback):
    def __init__(self, out_dir: str, pause: float = 0.2) -> None:
        self.out_dir = Path(out_dir)
        self.pause = pause

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / f"rank{trainer.global_rank}.log", "a") as f:
            f.write(f"{trainer.global_step} {batch_idx} {os.getpid()}\n")
        time.sleep(self.pause)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / f"rank{trainer.global_rank}-sanity.log", "a") as f:
                f.write(f"{batch_idx} {os.getpid()}\n")
            time.sleep(self.pause)
