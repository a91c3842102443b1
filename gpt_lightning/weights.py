"""Plain GPT weights out of a Lightning checkpoint, for use without Lightning, and back.

The file is safetensors: the ``GPT`` state dict (the tied LM head stored once, as
``transformer.wte.weight``) with the ``GPTConfig`` in its metadata, so ``load_gpt`` needs nothing else.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpt_lightning.atomic import atomic_output
from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT, GPTConfig

_TIED = "lm_head.weight"  # the same tensor as transformer.wte.weight


def export_weights(ckpt_path: str | Path, out_path: str | Path) -> Path:
    """Write the GPT weights and config of a ``GPTLightningModule`` checkpoint to safetensors."""
    ckpt_path, out_path = Path(ckpt_path), Path(out_path)
    if not ckpt_path.is_file():
        raise UserError(f"Checkpoint {ckpt_path} does not exist.")
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    hparams = checkpoint.get("hyper_parameters", {})
    names = {f.name for f in fields(GPTConfig)}
    config = GPTConfig(**{k: v for k, v in hparams.items() if k in names})
    prefix = "model."
    state = {
        k[len(prefix):]: v.contiguous()
        for k, v in checkpoint["state_dict"].items()
        if k.startswith(prefix) and k[len(prefix):] != _TIED
    }
    if not state:
        raise UserError(f"{ckpt_path} holds no GPT weights (no 'model.' keys): is it a gpt-lightning checkpoint?")
    with atomic_output(out_path) as tmp:
        save_file(state, str(tmp), metadata={"gpt_config": json.dumps(asdict(config))})
    return out_path


def load_gpt(path: str | Path, map_location: str | torch.device = "cpu") -> GPT:
    """A ``GPT`` with the weights and config of a file written by ``export_weights``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "gpt_config" not in metadata:
        raise UserError(f"{path} has no gpt_config metadata: it was not written by gpt-lightning export.")
    model = GPT(GPTConfig(**json.loads(metadata["gpt_config"])))
    state = load_file(str(path), device=str(map_location))
    state[_TIED] = state["transformer.wte.weight"]
    model.load_state_dict(state)
    return model.to(map_location)

