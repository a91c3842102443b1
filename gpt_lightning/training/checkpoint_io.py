"""Checkpoint files written in their own folder, flushed and renamed over the old one: a reader or a
resume after a crash sees the previous checkpoint or the whole new one."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO

from gpt_lightning.atomic import NO_ROOM_ERRNOS, atomic_output, no_room_message, remove_leftovers
from gpt_lightning.errors import UserError


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and whose full disk is one clear error; remote
    (fsspec) paths are saved as Lightning saves them."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path``: the old file stays whole until the new one replaces it."""
        local = _local_path(path)
        if local is None or storage_options is not None:  # Lightning's behaviour, its error included
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getbuffer()
        remove_leftovers(local)  # a killed save's partial file: its space is needed now
        try:
            with atomic_output(local) as tmp, open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            if err.errno not in NO_ROOM_ERRNOS:
                raise
            free = shutil.disk_usage(local.parent).free  # measured after the partial file was removed
            raise UserError(no_room_message(local, len(data), free)) from None


def _local_path(path: str | Path) -> Path | None:
    fs, local = fsspec.core.url_to_fs(str(path))
    return Path(local) if isinstance(fs, LocalFileSystem) else None


def use_atomic_checkpoints(trainer: Trainer) -> None:
    """Give ``trainer`` an ``AtomicCheckpointIO`` where it has Lightning's default one."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
