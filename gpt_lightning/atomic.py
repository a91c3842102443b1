"""Atomic file writes: readers see the old file or the whole new one, never a part of it."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpt_lightning.errors import UserError

_TMP = ".tmp"  # temporary files are named .NAME.PID.RANDOM.tmpSUFFIX, beside NAME

# What a write into a full disk (or a full quota) raises: ENOSPC, EDQUOT.
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to, renamed onto ``path`` if the block succeeds and
    removed if not. It gets ``open(path, "w")``'s permissions (not ``mkstemp``'s 0600)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP}{path.suffix}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"Cannot write {path}: cannot make the folder {path.parent} ({err.strerror or err}).") from None
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the kernel applies the umask
    except OSError as err:  # named by the path the user gave, not the temporary one
        raise UserError(f"Cannot write {path}: {err.strerror or err}.") from None
    mode = tmp.stat().st_mode & 0o777
    try:
        yield tmp
        os.chmod(tmp, mode)  # a writer that replaced the file (safetensors' save_file: 0600) gets it too
        try:
            os.replace(tmp, path)
        except IsADirectoryError:  # only the destination's: one the writer met is its own error
            raise UserError(
                f"Cannot write {path}: it is a directory. Give a file path, or remove the directory."
            ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)  # the rename itself survives a power cut


def remove_leftovers(path: Path) -> None:
    """Remove the temporary files that killed writers of ``path`` left beside it (one writer at a time)."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*{_TMP}{glob.escape(path.suffix)}"):
        tmp.unlink(missing_ok=True)


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where the filesystem cannot."""
    with contextlib.suppress(OSError):  # some filesystems (and all of Windows) do not sync folders
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, flushed to disk before the rename."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def no_room_message(path: Path, needed: int, free: int, estimated: bool = False) -> str:
    """The one line of a save that the disk has no room for: where, how many bytes, what to do."""
    bytes_needed = (
        f"about {needed:,} bytes needed, the previous one's size" if estimated else f"{needed:,} bytes needed"
    )
    return (
        f"Cannot save the checkpoint {path}: its folder {path.parent} has no room for it ({bytes_needed}, "
        f"{free:,} free); the previous checkpoint there is kept. Free some space, or save to a disk with room "
        "(--checkpoint.dirpath)."
    )
