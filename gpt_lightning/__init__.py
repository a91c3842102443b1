"""Train GPT-2 style language models with PyTorch Lightning, fast."""

from gpt_lightning.data import ShardWindows, TokenStreamDataModule, TokenWindows, gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.hellaswag import HellaSwagEval
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.module import GPTLightningModule
from gpt_lightning.throughput import ThroughputMonitor
from gpt_lightning.weights import export_weights, load_gpt

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTLightningModule",
    "HellaSwagEval",
    "ShardWindows",
    "ThroughputMonitor",
    "TokenStreamDataModule",
    "TokenWindows",
    "UserError",
    "export_weights",
    "gpt2_encoding",
    "load_gpt",
]
__version__ = "0.1.0"
