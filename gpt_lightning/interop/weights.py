"""Plain GPT weights out of a Lightning checkpoint and back: one safetensors file of the ``GPT`` state
dict (tied head stored once) with the ``GPTConfig`` in its metadata."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpt_lightning.atomic import atomic_output
from gpt_lightning.errors import UserError
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint, refuse_unknown_settings
from gpt_lightning.model import GPT, GPTConfig

_TIED = "lm_head.weight"  # the same tensor as transformer.wte.weight


def export_weights(ckpt_path: str | Path, out_path: str | Path) -> Path:
    """Write the GPT weights and config of a ``GPTLightningModule`` checkpoint to safetensors."""
    model = gpt_from_checkpoint(ckpt_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != _TIED or not model.config.tie_embeddings}
    out_path = Path(out_path)
    with atomic_output(out_path) as tmp:
        save_file(state, str(tmp), metadata={"gpt_config": json.dumps(asdict(model.config))})
    return out_path


def load_gpt(path: str | Path, map_location: str | torch.device = "cpu") -> GPT:
    """A ``GPT`` with the weights and config of a file written by ``export_weights``."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise UserError(f"Weights file {path} does not exist.")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as err:  # safetensors raises its own SafetensorError for a bad header
        raise UserError(f"{path} is not a readable safetensors file ({err}).") from None
    if "gpt_config" not in metadata:
        raise UserError(f"{path} has no gpt_config metadata: it was not written by gpt-lightning export.")
    saved = json.loads(metadata["gpt_config"])
    refuse_unknown_settings(saved, [f.name for f in fields(GPTConfig)], f"Weights file {path}")
    config = GPTConfig(**saved)
    return GPT.from_state_dict(config, load_file(str(path), device=str(map_location)))
