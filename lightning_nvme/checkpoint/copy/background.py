"""``checkpoint_copy="background"``: a checkpoint's state copied out of the store while training continues: a point-in-
time snapshot by copy-before-write, through one bounded buffer.

Why copy-before-write: where the filesystem cannot share extents (ext4; ``reflink`` does it on XFS/btrfs), the
state's bytes must be copied, and a save that waits for the copy stalls training for the whole state. Here the save
fences and fdatasyncs the store, so the store holds the saved instant, lays out the checkpoint's files (the reflink
snapshot's layout: each chunk region whole, ``reflink.layout``) and returns; a thread then copies each region from the
store into its place in those files. Training writes the store meanwhile, so the store installs a ``write_barrier``:
before the first write to (or the shelving of) a region not copied yet, the writing thread copies that region first.
Every region therefore reaches the files with the bytes of the save, whoever copies it. Regions kept in memory
(``host_memory_budget``: updated in place, never through a write) are copied at the save, inside the fence.

Memory: one page-aligned buffer of ``buffer_bytes``, shared by the thread and the barrier (a lock; a region larger
than the buffer goes in pieces). A later save may ``join`` a copy in flight: its regions are pending from its own
fence on, so the same rule keeps it consistent, and a region both need is read once. When every region is copied the
barrier is removed, the files are fsynced and each save's ``commit`` (the paired protocol's publish and switch) runs
in the thread, in save order; on any failure ``abort`` removes what the uncommitted saves wrote, the previous
checkpoint stays, and the error waits in ``error`` for the strategy to report it.

The save's side (``start``): the one-file checkpoint laid out at the save, its state copied afterwards. At the save
(the store fenced and fdatasynced by the caller): ``paired.begin``, each optimizer's state file created with its
header and its final size (the reflink snapshot's layout, ``reflink.layout``: every reader of the streamed format
reads it), and the file Lightning opens written under its hidden temp name, with the weights of the saved instant.
Then the copy runs (``BackgroundCopy``) and its ``commit`` does the rest of the protocol: publish the state directory,
switch the file in, drop the state of the save it replaced. A kill before the switch leaves the previous checkpoint
and hidden temps that the next save (or load) sweeps, as for a streamed save.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme.checkpoint import paired, weights
from lightning_nvme.checkpoint.copy import reflink
from lightning_nvme.checkpoint.record import SaveRecord
from lightning_nvme.checkpoint.state_files import file_metadata, format_entry, optimizer_file
from lightning_nvme.constants import ALIGN
from lightning_nvme.fs import atomic
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.store import FlatStore
from lightning_nvme.store.aligned import aligned_empty, memview
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


@dataclass
class Job:
    """One save's share of a copy: its regions (``Target`` by region name), those still to copy, and its protocol."""

    path: str
    targets: dict[str, Target]
    commit: Callable[[], None]
    abort: Callable[[], None]
    pending: set[str] = field(default_factory=set)
    committed: bool = False


class BackgroundCopy:
    """Copies each job's targets from ``store`` into their files, then runs the jobs' ``commit`` in order (or every
    uncommitted job's ``abort`` on failure). A later save can ``join`` while the copy runs: its regions are copied
    by the same thread, through the same buffer (a region pending for several saves is read once)."""

    def __init__(self, store: FlatStore, buffer_bytes: int) -> None:
        self.store = store
        self.buffer_bytes = buffer_bytes
        self.jobs: list[Job] = []
        # One copy at a time (the buffer is shared); guards jobs and _closed. Reentrant: a save laying itself out
        # under ``reserve`` holds it, and a store write of its own thread must pass the barrier.
        self._busy = threading.RLock()
        self._closed = False  # the thread has stopped taking regions (committing, or done): no more joins
        self._buffer: torch.Tensor | None = None
        self._files: dict[str, StoreFile] = {}
        self._removals: list[Callable[[], None]] | None = []  # None once run (or dropped)
        self._lock = threading.Lock()  # guards _removals against the commit
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.reported = False
        self.bytes_copied = 0
        self.copied_by_barrier: list[str] = []  # regions a training write had to copy first (copy-before-write)
        self.seconds = 0.0  # from start to the last commit

    @property
    def path(self) -> str:
        return ", ".join(job.path for job in self.jobs)

    @property
    def targets(self) -> dict[str, Target]:
        return {name: t for job in self.jobs for name, t in job.targets.items()}

    @property
    def bytes_pending(self) -> int:
        """Bytes still to copy: space the checkpoint filesystem must still give (the files are sparse until copied)."""
        return sum(job.targets[name].nbytes for job in self.jobs for name in list(job.pending))

    @property
    def committed(self) -> bool:
        return bool(self.jobs) and all(job.committed for job in self.jobs)

    # ---- the save ---------------------------------------------------------------------------------------
    def start(self, job: Job) -> None:
        """At the save, after the store's durable fence: copy the job's shelved regions now, install the barrier and
        start the thread. Raises (nothing started) if the shelved copy fails."""
        self._t0 = time.perf_counter()
        self._add(job)
        self.store.write_barrier = self._barrier
        self._thread = threading.Thread(target=self._run, name="lightning-nvme-checkpoint-copy", daemon=True)
        self._thread.start()

    @contextmanager
    def reserve(self) -> Iterator[bool]:
        """Around a later save's layout: True, and the copy cannot begin its commits (nor the removals after them)
        until the block ends, so the save's directory work (``paired.begin``'s sweep) never meets a half-done commit;
        the save then ``join``s. False: the copy was already committing or failed, and has been waited for."""
        self._busy.acquire()
        if self._closed or self.error is not None:
            self._busy.release()
            self.wait()
            yield False
            return
        try:
            yield True
        finally:
            self._busy.release()

    def join(self, job: Job) -> None:
        """A later save's job (inside ``reserve``, after the store's durable fence), copied by this copy."""
        with self._busy:
            assert not self._closed and not any(j.path == job.path for j in self.jobs), "join outside reserve"
            self._add(job)

    def _add(self, job: Job) -> None:
        job.pending = set(job.targets)
        self.jobs.append(job)
        try:
            for name in [n for n in job.targets if self.store.shelved(n) is not None]:
                self._copy(name, jobs=[job])
        except BaseException:
            self.jobs.remove(job)
            raise

    def _barrier(self, name: str) -> None:
        """Before training writes region ``name``: copy it first if a snapshot still needs its bytes."""
        if not any(name in job.pending for job in self.jobs):
            return
        try:
            self._copy(name, by_barrier=True)
        except BaseException as e:  # noqa: BLE001 - the checkpoint fails, training goes on; reported at the next step
            self._fail(e)

    def _copy(self, name: str, by_barrier: bool = False, jobs: list[Job] | None = None) -> None:
        """Region ``name`` into the files of every job (of ``jobs``) that still needs it, read once, in pieces."""
        locked = jobs is None
        if locked:
            self._busy.acquire()
        try:
            needing = [j for j in (self.jobs if jobs is None else jobs) if name in j.pending]
            if not needing:
                return
            if self._buffer is None:
                self._buffer = aligned_empty(self.buffer_bytes)
            nbytes = needing[0].targets[name].nbytes
            done = 0
            while done < nbytes:
                n = min(self.buffer_bytes, nbytes - done)
                piece = self._buffer[:n]
                self.store.wait(self.store.read(name, piece, done))
                for job in needing:
                    target = job.targets[name]
                    self._write(self._file(target.file), piece, target.offset + done, name)
                done += n
            for job in needing:
                job.pending.discard(name)
                self.bytes_copied += nbytes
            if by_barrier:
                self.copied_by_barrier.append(name)
        finally:
            if locked:
                self._busy.release()

    def _file(self, path: str) -> StoreFile:
        out = self._files.get(path)
        if out is None:
            out = self._files[path] = StoreFile(path, reopen=True, direct=None)
        return out

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
    def _next(self) -> str | None:
        """The next region to copy, or None: then no job may join any more (the commits begin)."""
        with self._busy:
            name = None if self.error is not None else next(
                (n for job in self.jobs for n in job.targets if n in job.pending), None)
            self._closed = name is None
            return name

    def _run(self) -> None:
        try:
            while (name := self._next()) is not None:
                self._copy(name)
            self._uninstall()
            if self.error is None:
                for out in self._files.values():
                    os.fsync(out.fd)
                self._close_files()
                for job in self.jobs:
                    job.commit()
                    job.committed = True
        except BaseException as e:  # noqa: BLE001 - kept for the strategy to report
            self._fail(e)
        finally:
            with self._busy:
                self._closed = True
            self._buffer = None
            self._close_files()
            self.seconds = time.perf_counter() - self._t0
        if self.error is not None:
            for job in self.jobs:
                if not job.committed:
                    try:
                        job.abort()
                    except BaseException as e:  # noqa: BLE001 - the first error is the one to report
                        log.error("background checkpoint %s: cleaning up after the failure failed too: %s", job.path, e)
        self._run_removals()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            log.error("background checkpoint %s failed: %s", self.path, error)
        for job in self.jobs:
            job.pending.clear()
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

    def settle(self, path: str, mode: str, joins: bool) -> str:
        """Before another save (of ``path``, ``checkpoint_in_flight=mode``; ``joins``: it would take the background
        path) while this copy may run: ``""`` to go on, having waited for the commit unless the save will join (a
        save of the same file cannot: both would stage it under one temp name), else why the save is skipped. Raises
        this copy's failure if not reported yet."""
        if self.in_flight:
            if mode == "skip":
                return f"the background copy of {self.path} is still in flight (checkpoint_in_flight='skip')"
            if mode == "wait" or not joins or any(job.path == path for job in self.jobs):
                self.wait()
        self.report()
        return ""

    def remove_after(self, removal: Callable[[], None]) -> bool:
        """ModelCheckpoint removing an older checkpoint: deferred until this copy's commits (True), refused with the
        failure reported when this copy failed (True: the newer checkpoint never committed, keep the older), or
        False: nothing in flight, remove now."""
        if self.defer(removal):
            return True
        self.wait()  # committing: the removal must not meet a commit's directory work
        if self.error is not None:
            self.report()
            return True
        return False

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
            lost = ", ".join(job.path for job in self.jobs if not job.committed) or self.path
            raise CheckpointCopyError(
                f"the background checkpoint {lost} failed after its save returned: {self.error}. Nothing of it "
                "was committed; the previous checkpoint is intact. Fix the cause (disk space, I/O errors), or set "
                "checkpoint_copy='streamed' to copy during the save.") from self.error


def unsupported(store: FlatStore | None, checkpoint: dict[str, Any]) -> str:
    """Why this save cannot copy in the background ('' if it can): it then streams, saying so."""
    if store is None:
        return ("background copy: the store is reopened for this save only (no training runs now to overlap the "
                "copy with)")
    if len(store.paths) > 1:
        return "background copy: the store is striped over several files (store_dir lists several directories)"
    return ""


def _state_file(off: OffloadedOptimizer, directory: str, i: int, save_id: str) -> tuple[dict, list[Target]]:
    """Optimizer ``i``'s state file with its header and final size (the data to come); its marker and copy targets."""
    entries, regions = reflink.layout(off)
    head = reflink.header(entries, file_metadata(save_id), ALIGN)  # data page-aligned: the copy may use O_DIRECT
    path = os.path.join(directory, optimizer_file(i))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.ftruncate(fd, len(head) + (entries[-1].end if entries else 0))
    finally:
        os.close(fd)
    marker = {"file": optimizer_file(i), **format_entry(off), "shapes": [list(p.shape) for p in off.params]}
    return marker, [Target(name, path, len(head) + pos, n) for name, pos, n in regions]


def _weights_file(checkpoint: dict[str, Any], store: FlatStore, directory: str, save_id: str,
                  in_store: Callable[[Any], bool], read_source: weights.ReadSource) -> list[Target]:
    """The beside weights file (``offload_params``): block regions in the store are copy targets; blocks resident and
    changed since their last write-back are written now, from memory (they are the saved instant's values)."""
    entries, regions, written, end = reflink.weights_layout(checkpoint["state_dict"], store, in_store)
    head = reflink.header(entries, file_metadata(save_id), ALIGN)
    path = os.path.join(directory, weights.WEIGHTS_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.ftruncate(fd, len(head) + end)
        reflink.write_values(fd, len(head), entries, written, read_source)
    finally:
        os.close(fd)
    return [Target(name, path, len(head) + pos, n) for name, pos, n in regions]


def start(store: FlatStore, checkpoint: dict[str, Any], path: str, optimizers: list[OffloadedOptimizer],
          buffer_bytes: int, record: SaveRecord, in_store: Callable[[Any], bool] | None = None,
          read_source: weights.ReadSource | None = None, running: BackgroundCopy | None = None) -> BackgroundCopy:
    """Lay the checkpoint out and start its copy, or have ``running`` (a copy in flight, of other files) take it on;
    the caller has fenced the store durably (and issued the blocks' write-backs). ``in_store``/``read_source``: with
    beside weights, whether a block's values are in the store, and its values. Returns the copy that carries it.
    Raises (and leaves nothing behind) if the layout fails, or if ``running``, which it could not join, failed."""
    if running is None:
        return _start(store, checkpoint, path, optimizers, buffer_bytes, record, in_store, read_source, None)
    with running.reserve() as joins:  # no commit of ``running`` meets this save's directory work
        if not joins:
            running.report()  # it failed: this save is not started
        return _start(store, checkpoint, path, optimizers, buffer_bytes, record, in_store, read_source,
                      running if joins else None)


def _start(store: FlatStore, checkpoint: dict[str, Any], path: str, optimizers: list[OffloadedOptimizer],
           buffer_bytes: int, record: SaveRecord, in_store: Callable[[Any], bool] | None,
           read_source: weights.ReadSource | None, joining: BackgroundCopy | None) -> BackgroundCopy:
    checkpoint = dict(checkpoint)
    optimizer_states = checkpoint.pop("optimizer_states", None)
    pending = paired.begin(path)
    staged: list[paired.onefile.Staged] = []
    switched: list[bool] = []

    def abort() -> None:
        if switched:  # committed: only the sweep of the replaced save failed, the checkpoint stands
            return
        paired.abort(pending)
        for st in staged:
            if os.path.lexists(st.tmp):
                atomic.delete(st.tmp)

    try:
        weights.bind(checkpoint.get("state_dict") or {}, pending.path, pending.save_id)
        markers, targets = [], []
        for i, off in enumerate(optimizers if optimizer_states is not None else []):
            marker, file_targets = _state_file(off, pending.tmp, i, pending.save_id)
            markers.append(marker)
            targets += file_targets
        if weights.has_refs(checkpoint):
            assert in_store is not None and read_source is not None, "beside weights need their blocks' residency"
            targets += _weights_file(checkpoint, store, pending.tmp, pending.save_id, in_store, read_source)
        ref = paired.reference(pending, optimizer_states, markers)
        staged.append(paired.stage_main({**checkpoint, paired.REF_KEY: ref}, pending.path, pending.tmp))
        record.files = sorted(os.listdir(pending.tmp))
        record.bytes_written = sum(os.path.getsize(os.path.join(pending.tmp, f)) for f in record.files)
        record.reason = f"{len(targets)} regions copied after the save returns, through a {buffer_bytes}-byte buffer"

        def commit() -> None:
            paired.publish(pending)
            paired.switch_main(staged[0], pending.path)
            switched.append(True)
            paired.finish(pending)
            log.info("checkpoint %s: background copy committed (%d regions; %d bytes copied so far by its copy, %d "
                     "regions before a training write)", pending.path, len(targets), copy.bytes_copied,
                     len(copy.copied_by_barrier))

        job = Job(pending.path, {t.region: t for t in targets}, commit, abort)
        if joining is not None:
            record.reason += f", joined to the copy in flight of {joining.path}"
            copy = joining
            copy.join(job)
        else:
            copy = BackgroundCopy(store, buffer_bytes)
            copy.start(job)
    except BaseException:
        abort()
        raise
    return copy
