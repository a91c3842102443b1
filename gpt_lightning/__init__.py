"""Train GPT-2 style language models with PyTorch Lightning, fast."""

from gpt_lightning.data import TokenStreamDataModule, TokenWindows
from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.module import GPTLightningModule
from gpt_lightning.throughput import ThroughputMonitor
from gpt_lightning.tokenizer import gpt2_encoding

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTLightningModule",
    "ThroughputMonitor",
    "TokenStreamDataModule",
    "TokenWindows",
    "UserError",
    "gpt2_encoding",
]
__version__ = "0.1.0"
