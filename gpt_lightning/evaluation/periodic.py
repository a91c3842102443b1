"""``PeriodicEvaluation``: the schedule and timing shared by the evaluation callbacks
(``HellaSwagEval``, ``HarnessEval``); a subclass says how to score and log."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gpt_lightning.averaging import averaged_weights
from gpt_lightning.errors import UserError


class PeriodicEvaluation(Callback):
    """Run ``evaluate`` as step 0 starts, every ``every_n_steps`` optimizer steps and at the end of
    training, in eval mode, on the averaged weights where kept. Each pass's seconds go to ``durations``,
    which ``ThroughputMonitor`` takes out of the step they ran in."""

    def __init__(self, every_n_steps: int, limit: int | None = None, batch_size: int = 8) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("limit", limit), ("batch_size", batch_size)):
            if value is not None and value < 1:
                raise UserError(f"{type(self).__name__} {name} must be at least 1, got {value}.")
        self.every_n_steps, self.limit, self.batch_size = every_n_steps, limit, batch_size
        self.durations: list[float] = []  # wall seconds of each pass, in order
        self._evaluated_at: int | None = None

    @property
    def enabled(self) -> bool:
        return True

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Score the model and log the results, returning after a host read of the scores."""
        raise NotImplementedError

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._timed_evaluation(trainer, pl_module, "on_train_batch_start")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._timed_evaluation(trainer, pl_module, "on_train_end")

    def _timed_evaluation(self, trainer: Trainer, pl_module: LightningModule, hook: str) -> None:
        step = trainer.global_step
        if not self.enabled or self._evaluated_at == step:  # once a step, not once per micro-batch
            return
        self._evaluated_at = step
        if pl_module.device.type == "cuda":  # the pass's time starts once the queued training work is done
            torch.cuda.synchronize(pl_module.device)
        began, was_training = time.perf_counter(), pl_module.training
        try:
            with averaged_weights(trainer, pl_module, self, hook):
                pl_module.eval()
                self.evaluate(trainer, pl_module)
        finally:
            pl_module.train(was_training)
        self.durations.append(time.perf_counter() - began)
