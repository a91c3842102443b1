"""Reading a ``gpt-lightning`` checkpoint (``.ckpt`` or FSDP2 folder) with ``weights_only`` and ``mmap``,
each failure one ``UserError`` that says what to do."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT, GPTConfig

# Values of Trainer.fit(ckpt_path=...) that Lightning resolves itself rather than reading a file.
LIGHTNING_CKPT_ALIASES = ("last", "best", "hpc", "registry")
# What Lightning writes beside the shards of a sharded checkpoint: everything but the tensors.
SHARDED_METADATA = "meta.pt"
# Keys saved with the hyper-parameters that are not constructor arguments: Lightning's, and the source of
# an ``init_from`` run's weights (``training/architecture.py``).
_BOOKKEEPING_KEYS = ("_instantiator", "_class_path", "pretrained_from")


def refuse_unknown_settings(saved: dict[str, Any], known: Iterable[str], source: str) -> None:
    """Raise ``UserError`` where ``saved`` (a file's recorded settings) names one that is not in ``known``."""
    unknown = sorted(set(saved) - set(known) - set(_BOOKKEEPING_KEYS))
    if unknown:
        raise UserError(
            f"{source} records settings this gpt-lightning does not have: {', '.join(unknown)}. "
            "Load it with the gpt-lightning version that wrote it."
        )


def read_checkpoint(path: str | Path, weights: bool = True) -> dict[str, Any]:
    """The checkpoint dict of a ``.ckpt`` file or sharded folder, tensors memory-mapped on the CPU; a sharded
    one's ``state_dict`` gathered into whole tensors unless ``weights`` is False (only its settings read)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(
            f"Checkpoint {path} does not exist. Check --ckpt_path: a run keeps its checkpoints in "
            "logs/<name>/version_N/checkpoints/ (last.ckpt is the newest)."
        )
    if path.is_dir() and not (path / SHARDED_METADATA).is_file():
        raise UserError(
            f"Checkpoint {path} is a directory without {SHARDED_METADATA}, so not a sharded checkpoint either. "
            f"Pass a .ckpt file to --ckpt_path, e.g. {path / 'last.ckpt'}."
        )
    checkpoint = _load(path / SHARDED_METADATA if path.is_dir() else path)
    if path.is_dir() and isinstance(checkpoint, dict):
        if "n_embd" not in (checkpoint.get("hyper_parameters") or {}):
            raise UserError(
                f"{path} is not a gpt-lightning checkpoint (no model settings in its {SHARDED_METADATA}). "
                "Pass a checkpoint written by gpt-lightning fit to --ckpt_path."
            )
        if not weights:
            return checkpoint
        checkpoint["state_dict"] = _gather_sharded_weights(path, checkpoint)
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or "model.transformer.wte.weight" not in state:
        raise UserError(
            f"{path} is not a gpt-lightning checkpoint (it holds no GPT weights). Pass a .ckpt written by "
            "gpt-lightning fit to --ckpt_path."
        )
    return checkpoint


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for a bad file
        raise UserError(
            f"Checkpoint {path} cannot be read ({type(err).__name__}): it is truncated or damaged, or not a "
            "PyTorch checkpoint. Pass another file to --ckpt_path, e.g. an earlier checkpoint of the same run."
        ) from None


def _gather_sharded_weights(path: Path, checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` of a sharded checkpoint, read by DCP's ``load`` (no process group) into
    empty tensors of the saved architecture: the model's entries only, not the optimizer's moments."""
    from torch.distributed.checkpoint import load

    with torch.device("meta"):  # shapes and dtypes only: no initialization of weights about to be replaced
        shapes = GPT(saved_config(checkpoint)).state_dict()
    state = {f"model.{name}": torch.empty_like(tensor, device="cpu") for name, tensor in shapes.items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load({"state_dict": state}, checkpoint_id=path, no_dist=True)
    except Exception as err:  # CheckpointException wraps each rank's error
        raise UserError(
            f"The shards of checkpoint {path} cannot be read ({type(err).__name__}): a file is missing or damaged, "
            "or they are of another architecture. Pass another checkpoint to --ckpt_path."
        ) from None
    return state


def saved_arguments(checkpoint: dict[str, Any], cls: type, key: str = "hyper_parameters") -> dict[str, Any]:
    """The constructor arguments of ``cls`` saved in ``checkpoint[key]``, Lightning's own keys dropped."""
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    saved = checkpoint.get(key) or {}
    return {k: v for k, v in saved.items() if k in accepted and k not in _BOOKKEEPING_KEYS}


def saved_config(checkpoint: dict[str, Any]) -> GPTConfig:
    """The architecture recorded in a checkpoint's hyper-parameters."""
    hparams = checkpoint.get("hyper_parameters") or {}
    return GPTConfig(**{f.name: hparams[f.name] for f in fields(GPTConfig) if f.name in hparams})


def gpt_from_checkpoint(path: str | Path) -> GPT:
    """The plain ``GPT`` of a checkpoint, its architecture from the saved hyper-parameters (on the CPU)."""
    checkpoint = read_checkpoint(path)
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    try:  # the memory-mapped tensors become the weights: no random model first, no copy
        return GPT.from_state_dict(saved_config(checkpoint), state)
    except RuntimeError as err:
        raise UserError(f"Checkpoint {path} does not match its own saved architecture: {err}") from None
