"""``NonFiniteGuard``: a non-finite loss or gradient never updates the weights, with no per-step host
sync (the skip is a device ``found_inf``, read at logging intervals; docs/gpu-fast-path.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.distributed.tensor import DTensor

from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import loss_scale, unscales_in_step
from gpt_lightning.precision import matmul_dtype
from gpt_lightning.training.optimizers import MuonWithAdamW


class NonFiniteGuard:
    """Tracks non-finite losses and gradients on the device: ``observe_loss`` every micro-batch,
    ``skip_update`` once per optimizer step, ``raise_if_found`` when the host may wait."""

    def __init__(self) -> None:
        self._loss_bad: torch.Tensor | None = None  # a micro-batch of this step had a non-finite loss
        self._first_bad: torch.Tensor | None = None  # first bad optimizer step; -1 while there is none
        self.grad_norm: torch.Tensor | None = None  # total 2-norm of the last step's gradients, on the device
        self._checked_at = -1  # the optimizer step at which the host last read the guard
        self._float16 = False  # whether the run is in float16 (its advice: bf16-mixed)

    def observe_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def skip_update(self, step: int, grads: list[torch.Tensor] | None) -> torch.Tensor:
        """Whether optimizer step ``step`` (``trainer.global_step``) must not update the weights: a 0-dim bool
        tensor, no host read. ``grads``: the gradients to check, None where ``GradScaler`` does (``16-mixed``)."""
        bad = self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool)
        self.grad_norm = None
        if grads:
            self.grad_norm = self.total_norm(grads)  # before any clipping
            bad = bad.to(grads[0].device) | ~torch.isfinite(self.grad_norm)
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Ranks must agree, or their weights drift apart. With the norm they do without a collective: the
            # gradients (NaN and inf survive every sum) are reduced across ranks before it is taken. Without it
            # (16-mixed, no gradients) only the loss tells: the flag is all-reduced on the device, no host barrier.
            flag = bad.to(torch.uint8)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = flag.bool()
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.long, device=bad.device)
        self._first_bad = torch.where((self._first_bad < 0) & bad, step, self._first_bad)
        self._loss_bad = None
        return self._first_bad >= 0  # once bad, every later update is skipped too

    @staticmethod
    def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of all ``grads`` together, a plain 0-dim tensor on their device."""
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):  # FSDP2: each rank holds a shard's part
            norm = norm.full_tensor()  # an all-reduce, no host read
        return norm

    # --- the LightningModule's hooks ---------------------------------------------------------------
    def before_optimizer_step(self, module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """``on_before_optimizer_step``: decide on the device whether this update is skipped; the
        pre-clipping norm is left in ``grad_norm`` (a device tensor, the same on every rank; unscaled under
        ``16-mixed``, where it is logged but an overflow is the GradScaler's to skip)."""
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)  # 16-mixed: it handles overflows
        self._float16 = matmul_dtype(str(module.trainer.precision)) == torch.float16
        grads = _gradients(module)
        skip = self.skip_update(module.global_step, None if scaler is not None else grads)
        if scaler is not None and grads:
            norm = self.total_norm(grads)  # Lightning unscaled them, unless the optimizer unscales in its step
            self.grad_norm = norm / loss_scale(scaler) if _unscaled_in_step(module.trainer, optimizer) else norm
        if _unscaled_in_step(module.trainer, optimizer):
            # 16-mixed with fused AdamW: the GradScaler skips, inside optimizer.step, an update whose gradients
            # are not finite (an fp16 overflow, routine). A non-finite loss is an error: NaN gradients make it
            # skip this update and every later one until the host reads the guard at the next logging interval.
            if grads:
                grads[0].masked_fill_(skip, float("nan"))
        elif scaler is None and (
            optimizer.defaults.get("fused")
            or isinstance(optimizer, MuonWithAdamW)
            and optimizer.adamw.defaults.get("fused")
        ):
            # The fused kernel (and MuonWithAdamW, whose AdamW part is fused) leaves weights and moments untouched.
            optimizer.found_inf = skip.float()
        elif bool(skip):
            # Any other optimizer (a non-fused AdamW or MuonWithAdamW: MPS, XPU; or under 16-mixed,
            # where the GradScaler reads its own flag every step anyway) cannot skip on the device:
            # decide on the host, every step (one read).
            self.raise_if_found(module.global_step)

    def clip_gradients(
        self,
        module: LightningModule,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float | None,
        algorithm: str | None,
    ) -> None:
        """``configure_gradient_clipping``: ``--trainer.gradient_clip_val`` on the device for every precision,
        fused AdamW kept (Lightning's refuses fused optimizers under ``*-mixed``)."""
        if not clip_val:
            return
        grads = _gradients(module)
        if not grads:
            return
        algorithm = GradClipAlgorithmType(algorithm or GradClipAlgorithmType.NORM)
        scaled = _unscaled_in_step(module.trainer, optimizer)
        scale = loss_scale(module.trainer.precision_plugin.scaler) if scaled else None  # a tensor: no host read
        norm = self.grad_norm  # before_optimizer_step's: unscaled, as the gradients will be
        if scale is not None:
            # An infinite norm would zero (norm) or bound (value) the gradients and hide the
            # overflow from the GradScaler, which must skip this update and lower its scale.
            grads[0].masked_fill_(~torch.isfinite(norm), float("nan"))
        parameters = [p for p in module.parameters() if p.grad is not None]
        if algorithm == GradClipAlgorithmType.NORM:
            # x min(1, clip / (norm + 1e-6)); a non-finite norm keeps some gradient non-finite
            # (inf x 0 = nan), which the skip decided in before_optimizer_step already covers.
            torch.nn.utils.clip_grads_with_norm_(parameters, clip_val, norm)
        elif scale is None:
            torch.nn.utils.clip_grad_value_(parameters, clip_val)
        else:
            bound = scale * clip_val
            for grad in grads:
                grad.clamp_(-bound, bound)

    def check_at_logging_interval(self, trainer: Trainer) -> None:
        """``on_train_batch_end``: read the guard at each logging interval (with none: before checkpoints and at the end)."""
        step, every = trainer.global_step, trainer.log_every_n_steps
        if every > 0 and step % every == 0 and step != self._checked_at:
            self.raise_if_found(step)

    def raise_if_found(self, step: int) -> None:
        """Raise ``UserError`` if a step so far was non-finite (``on_save_checkpoint``: no checkpoint
        is written after a bad step; ``on_train_end``). One host read."""
        self._checked_at = step
        bad_step = -1 if self._first_bad is None else int(self._first_bad)  # the first bad optimizer step
        if bad_step >= 0:
            raise UserError(
                f"train/loss or a gradient became non-finite (nan or inf) at step {bad_step}. That update "
                "and every one after it were skipped, and no checkpoint was written since, so the weights "
                "and the last checkpoint are those from before it. Lower model.learning_rate"
                + (
                    ", add model.warmup_steps, or use bf16-mixed instead of float16."
                    if self._float16
                    else " or add model.warmup_steps."
                )
            )


def _gradients(module: LightningModule) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


def _unscaled_in_step(trainer: Trainer, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the gradients are still scaled: 16-mixed with an optimizer that unscales in its own step (fused AdamW)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler is not None and unscales_in_step(optimizer)
