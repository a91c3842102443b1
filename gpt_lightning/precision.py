"""What a Lightning precision (``--trainer.precision``) means to the package, in one table: the dtype the
matmuls run in, that of the weights, gradients and optimizer states, and whether a GradScaler scales the
loss. Plain torch, as the model; Transformer Engine's precisions are not in it (nothing is estimated)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """One Lightning precision, as the package needs it."""

    # The dtype matmuls run in, and the matmul inputs autograd keeps: autocast's under a mixed precision,
    # the weights' under a true one.
    matmul: torch.dtype
    # The dtype of the weights, their gradients and the optimizer's states, and of the values autocast leaves
    # alone (the residual stream, norms, the loss): float32 under a mixed precision, the module cast under a true one.
    weights: torch.dtype
    # Whether Lightning scales the loss by a GradScaler, for float16 gradients that would underflow (16-mixed).
    scaler: bool = False


# Lightning's precisions as its Trainer names them (``str(trainer.precision)``: 16 and "16" are "16-mixed").
PRECISIONS = {
    "32-true": Precision(torch.float32, torch.float32),
    "bf16-mixed": Precision(torch.bfloat16, torch.float32),
    "16-mixed": Precision(torch.float16, torch.float32, scaler=True),
    "bf16-true": Precision(torch.bfloat16, torch.bfloat16),
    "16-true": Precision(torch.float16, torch.float16),
    "64-true": Precision(torch.float64, torch.float64),
}


def matmul_dtype(precision: str) -> torch.dtype | None:
    """The dtype matmuls run in under a Lightning ``precision``; None for one not in ``PRECISIONS``."""
    return PRECISIONS[precision].matmul if precision in PRECISIONS else None


def compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The dtype a matmul runs in on ``device_type`` now: autocast's where it is on, else ``default`` (its inputs')."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else default
