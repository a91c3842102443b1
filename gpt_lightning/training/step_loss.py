"""``train/loss`` and ``train/grad_norm`` once per optimizer step, only on the steps the logger writes."""

from __future__ import annotations

from lightning.pytorch import Trainer


def written_now(trainer: Trainer, final_step: int | None) -> bool:
    """Whether this optimizer step's values are logged: the steps Lightning's logger writes, and
    ``final_step``. Other steps skip ``self.log`` (host time, and a barrier under ``sync_dist``)."""
    step, every = trainer.global_step + 1, trainer.log_every_n_steps
    if trainer.fast_dev_run or step == final_step:
        return True
    return every > 0 and (step % every == 0 or trainer.should_stop)


def stopping(trainer: Trainer) -> bool:
    """Whether a callback stopped the run after ``written_now`` was asked, so the step is logged anyway."""
    return trainer.should_stop and trainer.log_every_n_steps > 0
