"""A callback the two-process HellaSwag test attaches through the CLI: at the end of training it
writes what the run's HellaSwagEval measured, on this rank, to a JSON file."""

import json
from pathlib import Path

from lightning.pytorch import Callback

from gpt_lightning import HellaSwagEval


class RecordHellaSwag(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer, pl_module):
        # Runs after HellaSwagEval's own on_train_end: callbacks run in the order given.
        (evaluator,) = [cb for cb in trainer.callbacks if isinstance(cb, HellaSwagEval)]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "results": evaluator.results}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
