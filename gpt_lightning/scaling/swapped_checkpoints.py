"""FSDP2 checkpoint folders replaced whole, so a folder that resumes exists after a crash at any moment
(Lightning's ``ModelParallelStrategy`` overwrites the folder in place; docs/resume.md)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from gpt_lightning.atomic import no_room_message, sync_folder
from gpt_lightning.errors import UserError
from gpt_lightning.stopping.dead_rank import PROCESS_GROUP_TIMEOUT

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


class SwappedCheckpointStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2) whose checkpoints, folders or files, are written beside
    their destination and swapped in, so the previous checkpoint resumes until the new one is whole.

    A save needs room for two checkpoints (else it fails at once, in one line). The swap is one atomic
    exchange where the filesystem has one (Linux ``renameat2``), else two renames (docs/resume.md).

    Args:
        timeout: how long a rank waits at a collective for the others (``stopping.dead_rank.PROCESS_GROUP_TIMEOUT``,
            not Lightning's 30 minutes); the other arguments are ``ModelParallelStrategy``'s.
    """

    def __init__(self, *, timeout: timedelta | None = PROCESS_GROUP_TIMEOUT, **kwargs: Any) -> None:
        super().__init__(timeout=timeout, **kwargs)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Write the checkpoint to ``.NAME.new`` beside ``filepath`` (a folder of shards, or a file), then swap
        it in; ``storage_options`` are not supported, as in ``ModelParallelStrategy``."""
        path = Path(self.broadcast(str(filepath)))
        new, old = path.parent / f".{path.name}.new", path.parent / f".{path.name}.old"
        if self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            put_back_swapped_aside(path)
            _remove(new)  # a killed save's
            _remove(old)
        no_room = self.broadcast(_no_room_for(path) if self.is_global_zero else None)
        if no_room is not None:
            raise UserError(no_room)
        try:
            super().save_checkpoint(checkpoint, new, storage_options)
        except BaseException:
            if self.is_global_zero:
                _remove(new)  # the previous checkpoint stays as it was
            raise
        self.barrier()  # every rank's shards are written
        if self.is_global_zero:
            _flush(new)
            if path.exists() and _exchange(new, path):
                old = new  # now holding the previous checkpoint
            elif path.exists():
                os.replace(path, old)
                os.replace(new, path)
            else:
                os.replace(new, path)
            sync_folder(path.parent)
            _remove(old)
        self.barrier()


def put_back_swapped_aside(path: Path) -> None:
    """After a kill between a swap's two renames, rename the newest whole checkpoint (``.NAME.new``,
    looked for first so racing ranks never pick the older, else ``.NAME.old``) to ``path``."""
    new, old = path.parent / f".{path.name}.new", path.parent / f".{path.name}.old"
    newer = new.exists()
    if path.exists() or not old.exists():
        return
    with contextlib.suppress(FileNotFoundError):  # another rank put it back first
        os.replace(new if newer else old, path)


def _no_room_for(path: Path) -> str | None:
    """Why a new checkpoint the size of the one at ``path`` would not fit beside it, or None."""
    if not path.exists():
        return None
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    needed, free = sum(p.stat().st_size for p in files), shutil.disk_usage(path.parent).free
    return None if free >= needed else no_room_message(path, needed, free, estimated=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or filesystem cannot (then nothing moved)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # not Linux, or glibc before 2.28
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. NFS
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _flush(path: Path) -> None:
    """Flush a checkpoint folder's top-level files to disk (torch.save does not; DCP's shards are)."""
    for file in path.iterdir() if path.is_dir() else ():
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    sync_folder(path)
