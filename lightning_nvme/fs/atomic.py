"""Atomic file-system steps: the old entry or the new one, never half of each.

Every file this package replaces in place goes through here: a checkpoint's file and directories
(``checkpoint.paired``), the store's manifest, an I/O profile (``write_json``). A leaf module (the standard
library only), so the store, below the checkpoints, uses it too.

A file or directory is written under a hidden temporary name beside its target (``.NAME.tmp-PID``),
fsynced, then moved into place in one step: ``os.replace`` when the target is a file or absent,
``renameat2(RENAME_EXCHANGE)`` when it is a directory (e.g. a sharded checkpoint that Lightning's FSDP or
DeepSpeed strategy saved to the same path: a rename cannot put a file over a directory). Where the exchange is
unsupported, the old directory is first renamed aside (``.NAME.old``); ``recover`` puts it back if a crash fell
between the two renames. Deleting renames to a hidden temp name first, so no half-deleted entry is ever visible
under its name.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
from typing import Any

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}")


def aside_name(path: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.old")


def _exchange(a: str, b: str) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    return fn(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) == 0


def delete(path: str) -> None:
    """Delete a file, link or directory tree (already under a hidden name)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def is_dead_temp(path: str) -> bool:
    """A ``.NAME.tmp-PID`` entry whose writer process no longer exists (on this machine)."""
    pid = path.rsplit("-", 1)[-1]
    return ".tmp-" in os.path.basename(path) and pid.isdigit() and not os.path.exists(f"/proc/{pid}")


def sweep_dead_temps(directory: str) -> None:
    """Drop what dead writers left in ``directory``: half-written checkpoints, old ones after an exchange,
    ones being deleted (of any checkpoint there: a deleted or renamed checkpoint's name may never recur)."""
    for tmp in glob.glob(os.path.join(glob.escape(directory), ".*.tmp-*")):
        if is_dead_temp(tmp):
            delete(tmp)


def recover(path: str) -> None:
    """Undo a crash between the two renames of the fallback commit, and sweep dead writers' temp entries."""
    aside = aside_name(path)
    if os.path.lexists(aside):
        if os.path.lexists(path):
            delete(aside)
        else:
            os.rename(aside, path)
    sweep_dead_temps(os.path.dirname(os.path.abspath(path)))


def write_json(path: str, obj: Any, *, durable: bool = True, indent: int | None = None) -> None:
    """Replace the JSON file ``path`` by ``obj`` in one step (a reader sees the old file or the new one).
    ``durable=False`` skips the fsyncs (the caller makes the file durable later with ``fsync_path``)."""
    tmp = temp_name(path)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
            if indent is not None:
                f.write("\n")
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        delete(tmp)
        raise
    if durable:
        fsync_path(os.path.dirname(os.path.abspath(path)))


def commit(tmp: str, path: str) -> None:
    """Move the fully written, fsynced file or directory ``tmp`` to ``path`` atomically, whatever ``path``
    is now (absent, a file, a link, or a directory)."""
    fsync_path(tmp)
    parent = os.path.dirname(os.path.abspath(path))
    if not (os.path.isdir(path) and not os.path.islink(path)):
        os.replace(tmp, path)
        fsync_path(parent)
        return
    if _exchange(tmp, path):
        fsync_path(parent)
        delete(tmp)  # now holds the previous checkpoint
        return
    aside = aside_name(path)
    delete(aside)
    os.rename(path, aside)
    os.rename(tmp, path)
    fsync_path(parent)
    delete(aside)


def remove(path: str) -> None:
    """Delete ``path`` (file, link or directory) as one visible step: rename it to a hidden temp name,
    then delete that. A crash mid-delete leaves only a hidden temp that ``recover`` drops later."""
    path = os.path.abspath(path)
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
        fsync_path(os.path.dirname(path))
        return
    if not os.path.exists(path):
        return
    doomed = temp_name(path)
    delete(doomed)
    os.rename(path, doomed)
    fsync_path(os.path.dirname(path))
    delete(doomed)
