"""The training FLOPs of one batch, for MFU and the model summary: Lightning's ``measure_flops`` on a
meta-device copy, every matmul counted (embedding lookups count nothing).
"""

from __future__ import annotations

from dataclasses import astuple
from functools import lru_cache

import torch
from lightning.fabric.utilities.throughput import measure_flops

from gpt_lightning.model import GPT, GPTConfig


def training_flops(config: GPTConfig, batch_size: int, seq_len: int) -> float:
    """FLOPs of one training step (forward + backward) of a GPT of ``config`` on a
    ``(batch_size, seq_len)`` batch; counted once per architecture and shape."""
    return _counted(astuple(config), batch_size, seq_len)


@lru_cache(maxsize=16)
def _counted(config: tuple, batch_size: int, seq_len: int) -> float:
    with torch.device("meta"):
        model = GPT(GPTConfig(*config))
        x = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return float(measure_flops(model, lambda: model(x, x)[1], lambda loss: loss))
