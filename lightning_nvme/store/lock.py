"""An exclusive lock on a store file, so two live processes can never share one store.

``flock`` is released by the kernel when its holder dies, so a lock left by a killed run is
recognised as stale and taken over, while a live holder is refused with its pid.

``flock`` belongs to the open file, which ``fork`` shares with the child: a forked DataLoader worker
would keep a killed run's lock alive until it noticed its parent was gone, and an immediate restart
would be refused in the name of the dead pid. So a forked child closes its copies at once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import weakref

from lightning_nvme.store.errors import StoreLockedError

log = logging.getLogger(__name__)


_HELD: weakref.WeakSet[StoreLock] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    for lock in list(_HELD):
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


class StoreLock:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self.took_over_stale: bool = False

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"store {self.path[:-5]} is in use by a live process (pid {holder}). Two runs cannot share one "
                f"store: give this run its own store_dir, or stop the other run first."
            ) from None
        previous = os.pread(fd, 64, 0).decode(errors="replace").strip()
        self.took_over_stale = bool(previous) and previous != str(os.getpid())
        if self.took_over_stale:
            log.warning("taking over store %s: its lock was left by pid %s, which is no longer running",
                        self.path[:-5], previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        _HELD.add(self)

    def release(self) -> None:
        if self._fd is None:
            return
        _HELD.discard(self)
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None
