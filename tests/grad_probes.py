"""Callbacks the clipping and loss tests attach through the CLI: they measure, independently of
the module, what an optimizer step really did, and write it to a JSON file."""

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor


def _grads(pl_module) -> list[torch.Tensor]:
    """Every gradient, whole (an FSDP2 shard is gathered), as float32."""
    grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
    return [(g.full_tensor() if isinstance(g, DTensor) else g).float() for g in grads]


class ClipProbe(Callback):
    """Per optimizer step: the gradients' global 2-norm and largest element before clipping (taken in
    the callbacks' ``on_before_optimizer_step``, which Lightning calls before the module's hook and
    the clipping) and after it (at batch end, after ``optimizer.step``, before the next step's
    ``zero_grad``). Under 16-mixed with fused AdamW the gradients are still multiplied by the
    GradScaler's scale before the step, so the "pre" figures are divided by it; the fused step
    unscales ``.grad`` in place, so the "post" figures are the true ones."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []

    def _scale(self, trainer) -> float:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizer = trainer.optimizers[0]
        return scaler.get_scale() if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False) else 1.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads, scale = _grads(pl_module), self._scale(trainer)
        self._pending = {
            "scale": scale,
            "pre_norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) / scale,
            "pre_max": max(float(g.abs().max()) for g in grads) / scale,
            "fused": bool(optimizer.defaults.get("fused")),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        grads = _grads(pl_module)
        self.steps.append({
            **self._pending,
            "post_norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))),
            "post_max": max(float(g.abs().max()) for g in grads),
        })

    def on_train_end(self, trainer, pl_module):
        self.out.write_text(json.dumps({"steps": self.steps}))


class StepLossProbe(Callback):
    """Per optimizer step: each micro-batch's loss, computed again here before the module's training
    step sees the batch (same weights: they change only at the step; same precision context; the
    model has no dropout), and the ``train/loss`` the module logged for the step."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []
        self._losses: list[float] = []
        self._step = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, y = batch
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            self._losses.append(float(pl_module.model(x, y)[1]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._step:
            return  # mid-accumulation
        self._step = trainer.global_step
        logged = float(trainer.callback_metrics["train/loss"])
        self.steps.append({"micro_batch_losses": self._losses, "logged": logged})
        self._losses = []

    def on_train_end(self, trainer, pl_module):
        self.out.write_text(json.dumps({"steps": self.steps}))
