"""``HellaSwagEval``: build-nanogpt's HellaSwag (``interop.hellaswag``) on the model being trained,
the examples split across ranks."""

from __future__ import annotations

import itertools
from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from gpt_lightning.data.corpus import default_cache_dir
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.evaluation.periodic import PeriodicEvaluation
from gpt_lightning.interop.hellaswag import VAL_URL, Example, batches, cached_file, count_correct, read_examples


class HellaSwagEval(PeriodicEvaluation):
    """Score the model being trained on HellaSwag at step 0, every ``every_n_steps`` steps and at the end
    (``eval/hellaswag_acc_norm``, ``eval/hellaswag_acc``); without the file it says where to put it, never downloads.

    Args:
        data_file: ``hellaswag_val.jsonl``. None: where ``gpt-lightning eval --task hellaswag`` downloads it.
        every_n_steps: optimizer steps between evaluations.
        limit: score only the first N examples (None: all 10,042).
        batch_size: examples per forward pass (4 rows each).
    """

    def __init__(
        self, data_file: str | None = None, every_n_steps: int = 250, limit: int | None = None, batch_size: int = 8
    ) -> None:
        super().__init__(every_n_steps, limit, batch_size)
        self.data_file = data_file
        self.examples: list[Example] | None = None
        self.results: list[dict] = []  # step, acc_norm, acc, examples (all ranks), examples_here (this rank)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        path = Path(self.data_file).expanduser() if self.data_file else cached_file(default_cache_dir())
        if not path.is_file():
            rank_zero_warn(
                f"HellaSwag evaluation is off: {path} does not exist. To score the model on it during "
                f"training, download {VAL_URL} there (or run `gpt-lightning eval --task hellaswag` once online)."
            )
            return
        self.examples = list(itertools.islice(read_examples(path), self.limit))
        if not self.examples:
            raise UserError(f"HellaSwag file {path} holds no examples.")
        rank_zero_info(f"HellaSwag: {len(self.examples)} examples from {path}, every {self.every_n_steps} steps.")

    @property
    def enabled(self) -> bool:
        return self.examples is not None

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        model = getattr(pl_module, "model", pl_module)
        encode = gpt2_encoding().encode_ordinary
        rank, world = trainer.global_rank, trainer.world_size
        mine = self.examples[rank::world]
        most = -(-len(self.examples[0::world]) // self.batch_size)  # forward passes of rank 0, the busiest
        own = list(batches(mine, encode, model.config.block_size, self.batch_size))
        padded = own + [None] * (most - len(own))  # every rank runs as many forward passes
        counts = count_correct(model, padded, pl_module.device, trainer.precision_plugin.forward_context)
        correct_norm, correct, n = trainer.strategy.reduce(counts, reduce_op="sum").tolist()  # the host read
        result = {
            "step": step,
            "acc_norm": correct_norm / n,
            "acc": correct / n,
            "examples": n,
            "examples_here": len(mine),
        }
        self.results.append(result)
        for logger in trainer.loggers:
            logger.log_metrics(
                {"eval/hellaswag_acc_norm": result["acc_norm"], "eval/hellaswag_acc": result["acc"]}, step=step
            )
        rank_zero_info(
            f"step {step}: hellaswag acc_norm {result['acc_norm']:.4f}, acc {result['acc']:.4f} over {n} examples"
        )
