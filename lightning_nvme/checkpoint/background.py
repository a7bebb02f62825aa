"""A checkpoint's state copied out of the store while training continues: a point-in-time snapshot by
copy-before-write, through one bounded buffer.

Why copy-before-write: where the filesystem cannot share extents (ext4; ``snapshot`` does it on XFS/btrfs), the
state's bytes must be copied, and a save that waits for the copy stalls training for the whole state. Here the save
fences and fdatasyncs the store, so the store holds the saved instant, lays out the checkpoint's files (the reflink
snapshot's layout: each chunk region whole, ``snapshot.layout``) and returns; a thread then copies each region from
the store into its place in those files. Training writes the store meanwhile, so the store installs a
``write_barrier``: before the first write to (or the shelving of) a region not copied yet, the writing thread copies
that region first. Every region therefore reaches the files with the bytes of the save, whoever copies it. Regions
kept in memory (``host_memory_budget``: updated in place, never through a write) are copied at the save, inside
the fence.

Memory: one page-aligned buffer of ``buffer_bytes``, shared by the thread and the barrier (a lock; a region larger
than the buffer goes in pieces). When every region is copied the barrier is removed, the files are fsynced and
``commit`` (the paired protocol's publish and switch) runs in the thread; on any failure ``abort`` removes what the
save wrote, the previous checkpoint stays, and the error waits in ``error`` for the strategy to report it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_nvme.store import FlatStore
from lightning_nvme.store.buffers import aligned_empty, memview
from lightning_nvme.store.file_io import StoreFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """Region ``region`` of the store goes, whole, to ``[offset, offset + nbytes)`` of the state file ``file``."""

    region: str
    file: str
    offset: int
    nbytes: int


class CheckpointCopyError(RuntimeError):
    """A background checkpoint failed after its save returned; the previous checkpoint is intact."""


class BackgroundCopy:
    """Copies ``targets`` from ``store`` into their files, then runs ``commit`` (or ``abort`` on failure)."""

    # Test hook: called by the copy thread with a region's name before it copies that region, so a test can hold
    # the copy while training steps run (and their writes take the copy-before-write path) without sleeps.
    gate: ClassVar[Callable[[str], None] | None] = None

    def __init__(self, store: FlatStore, targets: list[Target], buffer_bytes: int, path: str,
                 commit: Callable[[], None], abort: Callable[[], None]) -> None:
        self.store = store
        self.targets = {t.region: t for t in targets}
        self.buffer_bytes = buffer_bytes
        self.path = path
        self._commit, self._abort = commit, abort
        self._pending = set(self.targets)
        self._busy = threading.Lock()  # one copy at a time: the buffer is shared
        self._buffer: torch.Tensor | None = None
        self._files: dict[str, StoreFile] = {}
        self._removals: list[Callable[[], None]] | None = []  # None once run (or dropped)
        self._lock = threading.Lock()  # guards _removals against the commit
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.reported = False
        self.committed = False
        self.bytes_copied = 0
        self.copied_by_barrier: list[str] = []  # regions a training write had to copy first (copy-before-write)
        self.seconds = 0.0  # from start to commit

    # ---- the save ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """At the save, after the store's durable fence: copy the shelved regions now, install the barrier and
        start the thread. Raises (nothing started, barrier removed) if the shelved copy fails."""
        self._t0 = time.perf_counter()
        try:
            for name in [n for n in self.targets if self.store.shelved(n) is not None]:
                self._copy(name)
        except BaseException:
            self._close_files()
            raise
        self.store.write_barrier = self._barrier
        self._thread = threading.Thread(target=self._run, name="lightning-nvme-checkpoint-copy", daemon=True)
        self._thread.start()

    def _barrier(self, name: str) -> None:
        """Before training writes region ``name``: copy it first if the snapshot still needs its bytes."""
        if name not in self._pending:
            return
        try:
            self._copy(name, by_barrier=True)
        except BaseException as e:  # noqa: BLE001 - the checkpoint fails, training goes on; reported at the next step
            self._fail(e)

    def _copy(self, name: str, by_barrier: bool = False) -> None:
        with self._busy:
            if name not in self._pending:
                return
            target = self.targets[name]
            if self._buffer is None:
                self._buffer = aligned_empty(self.buffer_bytes)
            out = self._files.get(target.file)
            if out is None:
                out = self._files[target.file] = StoreFile(target.file, reopen=True, direct=None)
            done = 0
            while done < target.nbytes:
                n = min(self.buffer_bytes, target.nbytes - done)
                piece = self._buffer[:n]
                self.store.wait(self.store.read(name, piece, done))
                self._write(out, piece, target.offset + done, name)
                done += n
            self._pending.discard(name)
            self.bytes_copied += target.nbytes
            if by_barrier:
                self.copied_by_barrier.append(name)

    @staticmethod
    def _write(out: StoreFile, piece: torch.Tensor, offset: int, name: str) -> None:
        view = memview(piece.data_ptr(), piece.numel())
        try:
            out.pwrite_full(view, offset, name)
        except OSError as e:
            if not out.direct or e.errno != 22:  # EINVAL: O_DIRECT accepted at open, refused at write time
                raise
            out.fall_back_to_buffered()
            out.pwrite_full(view, offset, name)
        out.drop_cache(offset, piece.numel())

    # ---- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for name in list(self.targets):
                gate = BackgroundCopy.gate
                if gate is not None and name in self._pending:
                    gate(name)
                if self.error is not None:
                    break
                self._copy(name)
            self._uninstall()
            if self.error is None:
                for out in self._files.values():
                    os.fsync(out.fd)
                self._close_files()
                self._commit()
                self.committed = True
        except BaseException as e:  # noqa: BLE001 - kept for the strategy to report
            self._fail(e)
        finally:
            self._buffer = None
            self._close_files()
            self.seconds = time.perf_counter() - self._t0
        if self.error is not None:
            try:
                self._abort()
            except BaseException as e:  # noqa: BLE001 - the first error is the one to report
                log.error("background checkpoint %s: cleaning up after the failure failed too: %s", self.path, e)
        self._run_removals()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            log.error("background checkpoint %s failed: %s", self.path, error)
        self._pending.clear()
        self._uninstall()

    def _uninstall(self) -> None:
        if self.store.write_barrier == self._barrier:
            self.store.write_barrier = None

    def _close_files(self) -> None:
        files, self._files = self._files, {}
        for out in files.values():
            out.close()

    # ---- what the strategy asks -------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def defer(self, removal: Callable[[], None]) -> bool:
        """Run ``removal`` (of an older checkpoint) once this save has committed; dropped if it fails, so a removal
        never leaves the user without a committed checkpoint. False: nothing in flight, remove now."""
        with self._lock:
            if self._thread is None or self._removals is None:
                return False
            self._removals.append(removal)
            return True

    def _run_removals(self) -> None:
        with self._lock:
            removals, self._removals = self._removals or [], None
        if self.error is not None:
            if removals:
                log.warning("background checkpoint %s failed: %d older checkpoint(s) ModelCheckpoint asked to remove "
                            "are kept", self.path, len(removals))
            return
        for removal in removals:
            try:
                removal()
            except BaseException as e:  # noqa: BLE001 - a leftover file is not worth losing the run
                log.error("background checkpoint %s: removing an older checkpoint after the commit failed: %s",
                          self.path, e)

    def report(self) -> None:
        """Raise the failure once (at the next step, the next save or the end of fit)."""
        if self.error is not None and not self.reported:
            self.reported = True
            raise CheckpointCopyError(
                f"the background checkpoint {self.path} failed after its save returned: {self.error}. Nothing of it "
                "was committed; the previous checkpoint is intact. Fix the cause (disk space, I/O errors), or set "
                "checkpoint_copy='streamed' to copy during the save.") from self.error
