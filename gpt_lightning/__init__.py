"""Train GPT-2 style language models with PyTorch Lightning, fast. Names below are imported on first use
(PEP 562), so ``gpt-lightning tokenize`` does not load torch and Lightning."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GPT": "gpt_lightning.model",
    "GPTConfig": "gpt_lightning.config",
    "GPTLightningModule": "gpt_lightning.training.module",
    "HarnessEval": "gpt_lightning.evaluation.callback",
    "HellaSwagEval": "gpt_lightning.evaluation.hellaswag_callback",
    "Preempted": "gpt_lightning.stopping.preemption",
    "Preemption": "gpt_lightning.stopping.preemption",
    "ShardWindows": "gpt_lightning.data.shards",
    "ThroughputMonitor": "gpt_lightning.observing.throughput",
    "TokenStreamDataModule": "gpt_lightning.data.datamodule",
    "TokenWindows": "gpt_lightning.data.windows",
    "UserError": "gpt_lightning.errors",
    "ValidationSamples": "gpt_lightning.observing.samples",
    "export_weights": "gpt_lightning.interop.weights",
    "gpt2_encoding": "gpt_lightning.data.tokenizer",
    "load_gpt": "gpt_lightning.interop.weights",
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'gpt_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
