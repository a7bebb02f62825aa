"""Commit a checkpoint directory atomically: the old checkpoint or the new one, never half of each.

A checkpoint is written under a hidden temporary name beside its target, every file fsynced, then
swapped into place with ``renameat2(RENAME_EXCHANGE)`` (one atomic step even when the target exists,
e.g. ``last.ckpt``) and the parent directory fsynced. Where the exchange is unsupported, the old one is
first renamed aside; ``recover`` puts it back if a crash fell between the two renames.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil

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


def _aside_name(path: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.old")


def _exchange(a: str, b: str) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    return fn(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) == 0


def recover(path: str) -> None:
    """Undo a crash between the two renames of the fallback path, and drop temp dirs of dead writers
    (of any checkpoint in the same directory: a deleted or renamed checkpoint's name may never recur)."""
    aside = _aside_name(path)
    if os.path.isdir(aside):
        if os.path.exists(path):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, path)
    head = os.path.dirname(os.path.abspath(path))
    for tmp in glob.glob(os.path.join(glob.escape(head), ".*.tmp-*")):
        pid = tmp.rsplit("-", 1)[-1]
        if pid.isdigit() and os.path.isdir(tmp) and not os.path.islink(tmp) and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(tmp, ignore_errors=True)


def begin_dir(path: str, tmp: str) -> str:
    """Recover an interrupted commit of ``path`` and create ``tmp``, the empty directory to write into."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    recover(path)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def commit_dir(tmp: str, path: str) -> None:
    """Move the fully written, fsynced directory ``tmp`` to ``path`` atomically."""
    fsync_path(tmp)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path):
        if _exchange(tmp, path):
            fsync_path(parent)
            shutil.rmtree(tmp)  # now holds the previous checkpoint
            return
        aside = _aside_name(path)
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
        os.rename(tmp, path)
        fsync_path(parent)
        shutil.rmtree(aside)
        return
    os.rename(tmp, path)
    fsync_path(parent)
