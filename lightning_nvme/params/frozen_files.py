"""Frozen block parameters read where they lie (``frozen_weights="in_place"``): the user's safetensors files, at
each tensor's header offset, instead of a copy in the store.

Why: a LoRA base (or any frozen layer) is only ever read. Its bytes already lie on the SSD in a format whose
offsets are known, so copying them into the store first doubles the disk a run needs and adds the copy's minutes
to every start. Here a block's frozen head (``BlockLayout.writable_offset``: frozen parameters come first) is
read from the base files; the store region of such a block holds only its trainable tail (the adapters), and the
optimizer state of those. The residency sees one read per block as before (``HeadRead`` beside the store's
handle); nothing is ever written to a base file.

How it reads: the block's frozen tensors are sorted by file offset and merged into runs (a gap under ``GAP``
bytes is read through); each run is read in requests of ``read_bytes``, each the aligned superset of its range
(start rounded down, end rounded up to ``ALIGN``) with ``O_DIRECT`` where the filesystem accepts it (no page
cache: memory stays bounded whatever the base's size), into one of ``readers`` page-aligned bounce buffers, and
the tensors' bytes copied out to their slots. Where ``O_DIRECT`` is refused (tmpfs, some network filesystems),
the exact range is read buffered and dropped from the page cache after (``posix_fadvise(DONTNEED)``). Memory:
``readers x read_bytes`` of bounce buffers, plus one tensor's bytes for a tensor whose stored dtype differs from
the parameter's (converted with ``copy_``, exactly as building the model converted it).

Bitwise: the values bound are the file's bytes (or their ``copy_`` conversion), which are the values the model
was built with from the same file (``materialize``); a block whose frozen tensors do not all come from a base
file (built in memory, initialized by ``reset_parameters``) keeps its head in the store.

Files are checked at open (header parsed, every tensor inside the file) and their identity (size, mtime, header
sha256) recorded; ``check`` compares again (each step's end, a resume), so a file changed under a run is refused
by name (``checkpoint.base_file``).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme.checkpoint.base_file import FileIdentity, FileWeight
from lightning_nvme.checkpoint.safetensors_stream import DTYPES, SafetensorsReader
from lightning_nvme.constants import ALIGN, MiB
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.store.aligned import aligned_empty, copy_bytes, memview

READ_BYTES = 8 * MiB  # one request: large enough to reach the disk's sequential rate, small enough to bound memory
READERS = 4  # threads, each with its bounce buffer: the queue depth of the raw baseline (_disk.raw_read), a request
# in flight while another's bytes are copied out (memory: READERS x READ_BYTES = 32 MiB)
GAP = 64 * 1024  # bytes between two tensors of one file read through rather than split into two requests


def _floor(n: int) -> int:
    return n - n % ALIGN


def _ceil(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class BaseFile:
    """One opened base file: its identity as recorded at open, its descriptors, its tensors' offsets."""

    identity: FileIdentity
    fd: int  # buffered
    direct_fd: int  # O_DIRECT, or -1 where the filesystem refuses it
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]]  # key -> (dtype, shape, absolute offset)

    @property
    def path(self) -> str:
        return self.identity.path


@dataclass
class Piece:
    """One frozen parameter's bytes in a base file, and where they go in its block."""

    name: str  # the parameter's state-dict name
    key: str  # the tensor's name in the file
    file: BaseFile
    offset: int  # absolute byte offset in the file
    nbytes: int  # stored bytes
    dtype: torch.dtype  # stored dtype
    slot_offset: int  # in the block
    slot_dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def converts(self) -> bool:
        return self.dtype != self.slot_dtype


@dataclass
class FrozenHead:
    """A block's frozen bytes ``[0, nbytes)`` (its ``writable_offset``) served from base files."""

    block: BlockLayout
    nbytes: int
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class FrozenStats:
    reads: int = 0  # head reads (blocks)
    requests: int = 0  # disk requests
    bytes_read: int = 0  # bytes requested from the disk (aligned supersets and gaps included)
    bytes_served: int = 0  # tensor bytes copied into blocks
    direct_requests: int = 0
    buffered_requests: int = 0


class HeadRead:
    """A head read in flight: its requests' futures (``done``, ``wait``: what the residency asks of a handle)."""

    def __init__(self, futures: list[Future]) -> None:
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        for f in self.futures:
            f.result()


class FrozenFiles:
    """The base files of one run, their frozen tensors per block, and the reads that serve them.

    Args:
        direct: ``None``: ``O_DIRECT`` where the filesystem accepts it; ``False``: buffered + ``posix_fadvise``.
        read_bytes: bytes of one request (and of each bounce buffer).
        readers: reader threads (and bounce buffers).
    """

    def __init__(self, direct: bool | None = None, read_bytes: int = READ_BYTES, readers: int = READERS) -> None:
        if read_bytes % ALIGN or read_bytes <= 0:
            raise ValueError(f"read_bytes={read_bytes} must be a positive multiple of {ALIGN}")
        self.direct = direct
        self.read_bytes = read_bytes
        self.files: dict[str, BaseFile] = {}
        self.heads: dict[int, FrozenHead] = {}  # block index -> its head
        self.stats = FrozenStats()
        self._by_name: dict[str, Piece] = {}
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="lightning-nvme-frozen-read")
        self._bounce: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(readers):
            self._bounce.put(aligned_empty(read_bytes).fill_(0))  # touched now: no page faults inside a read
        self._lock = threading.Lock()

    # ---- opening ------------------------------------------------------------------------------------------
    def open(self, path: str) -> BaseFile:
        """Open (once) and check a base file: its header parsed, every tensor inside it; identity recorded."""
        path = os.path.abspath(path)
        if path in self.files:
            return self.files[path]
        identity = FileIdentity.of(path)
        reader = SafetensorsReader(path)  # refuses a truncated file or a header describing more than it holds
        try:
            entries = {k: (dtype, shape, reader.data_start + off) for k, (dtype, shape, off) in reader.entries.items()}
        finally:
            reader.close(drop_cache=False)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        direct_fd = self._open_direct(path) if self.direct is not False else -1
        if self.direct and direct_fd < 0:
            os.close(fd)
            raise OSError(f"{path}: O_DIRECT was requested but the filesystem refuses it")
        base = BaseFile(identity, fd, direct_fd, entries)
        self.files[path] = base
        return base

    @staticmethod
    def _open_direct(path: str) -> int:
        """An ``O_DIRECT`` descriptor that served one aligned read, or -1."""
        if not hasattr(os, "O_DIRECT"):
            return -1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return -1
        probe = aligned_empty(ALIGN)
        try:
            os.preadv(fd, [memview(probe.data_ptr(), ALIGN)], 0)
        except OSError:
            os.close(fd)
            return -1
        return fd

    def plan(self, blocks: Iterable[BlockLayout], locate: Any) -> dict[int, FrozenHead]:
        """The blocks whose frozen parameters all come from base files: ``locate(name)`` gives a parameter's
        ``(file path, key)`` or ``None``. A block with any other frozen parameter keeps its head in the store."""
        for block in blocks:
            frozen = [s for s in block.slots if s.offset < block.writable_offset]
            if not frozen:
                continue
            pieces = []
            for slot in frozen:
                where = locate(slot.name)
                if where is None:
                    break
                base = self.open(where[0])
                dtype, shape, offset = base.entries[where[1]]
                numel = 1
                for s in shape:
                    numel *= s
                if numel != slot.shape.numel() or dtype not in DTYPES:
                    break
                pieces.append(Piece(slot.name, where[1], base, offset, numel * dtype.itemsize, dtype, slot.offset,
                                    slot.dtype, tuple(slot.shape)))
            else:
                pieces.sort(key=lambda p: (p.file.path, p.offset))
                self.heads[block.index] = FrozenHead(block, block.writable_offset, pieces)
                self._by_name.update({p.name: p for p in pieces})
        return self.heads

    @property
    def head_bytes(self) -> int:
        """Bytes of frozen parameters served from base files (not in the store)."""
        return sum(p.nbytes for h in self.heads.values() for p in h.pieces)

    # ---- reading ------------------------------------------------------------------------------------------
    def read(self, head: FrozenHead, dst: torch.Tensor) -> HeadRead:
        """Start filling ``dst`` (uint8, the block's bytes from 0 on, at least ``head.nbytes`` long) with the
        frozen tensors; returns at once."""
        if dst.numel() < head.nbytes:
            raise ValueError(f"block {head.block.name}: a head read needs {head.nbytes} bytes, got {dst.numel()}")
        self.stats.reads += 1
        futures: list[Future] = []
        run: list[Piece] = []
        for piece in head.pieces:
            if piece.converts:
                futures.append(self._pool.submit(self._read_converted, piece, dst))
                continue
            if run and (piece.file is not run[-1].file or piece.offset - (run[-1].offset + run[-1].nbytes) > GAP):
                futures += self._submit_run(run, dst)
                run = []
            run.append(piece)
        if run:
            futures += self._submit_run(run, dst)
        return HeadRead(futures)

    def read_now(self, head: FrozenHead, dst: torch.Tensor) -> None:
        self.read(head, dst).wait()

    def _submit_run(self, run: list[Piece], dst: torch.Tensor) -> list[Future]:
        """Requests of ``read_bytes`` over the aligned superset of the run's file range."""
        start, end = run[0].offset, max(p.offset + p.nbytes for p in run)
        futures = []
        pos = _floor(start)
        while pos < end:
            stop = min(pos + self.read_bytes, _ceil(end))
            futures.append(self._pool.submit(self._request, run, dst, pos, stop, max(pos, start), min(stop, end)))
            pos = stop
        return futures

    def _request(self, run: list[Piece], dst: torch.Tensor, lo: int, hi: int, need_lo: int, need_hi: int) -> None:
        """Read file bytes ``[lo, hi)`` (aligned) or, buffered, ``[need_lo, need_hi)``; copy each piece's share."""
        base = run[0].file
        bounce = self._bounce.get()
        try:
            at = self._read_range(base, bounce, lo, hi, need_lo, need_hi)
            for p in run:
                a, b = max(p.offset, need_lo), min(p.offset + p.nbytes, need_hi)
                if a < b:
                    # memmove (GIL released), not ``copy_``: its intra-op threads fight the readers for the cores
                    copy_bytes(dst, p.slot_offset + a - p.offset, bounce, a - at, b - a)
                    with self._lock:
                        self.stats.bytes_served += b - a
        finally:
            self._bounce.put(bounce)

    def _read_range(self, base: BaseFile, buf: torch.Tensor, lo: int, hi: int, need_lo: int, need_hi: int) -> int:
        """Fill ``buf`` with file bytes from the returned offset on, covering ``[need_lo, need_hi)``."""
        if base.direct_fd >= 0:
            try:
                got = _pread_full(base.direct_fd, buf, lo, hi - lo)
                if got >= need_hi - lo:
                    with self._lock:
                        self.stats.requests += 1
                        self.stats.direct_requests += 1
                        self.stats.bytes_read += hi - lo
                    return lo
            except OSError:  # refused at read time (EINVAL): buffered from now on for this file
                base.direct_fd = -1
        n = need_hi - need_lo
        got = _pread_full(base.fd, buf, need_lo, n)
        if got < n:
            raise OSError(f"{base.path}: short read ({got} of {n} bytes at offset {need_lo}): the file is shorter "
                          f"than its header says ({base.identity.size} bytes when opened); was it changed?")
        os.posix_fadvise(base.fd, need_lo, n, os.POSIX_FADV_DONTNEED)  # read once: the page cache stays flat
        with self._lock:
            self.stats.requests += 1
            self.stats.buffered_requests += 1
            self.stats.bytes_read += n
        return need_lo

    def _read_converted(self, p: Piece, dst: torch.Tensor) -> None:
        """A tensor stored in another dtype than its parameter's: read whole, converted with ``copy_``."""
        lo, hi = _floor(p.offset), _ceil(p.offset + p.nbytes)
        tmp = aligned_empty(hi - lo)
        at = self._read_range(p.file, tmp, lo, hi, p.offset, p.offset + p.nbytes)
        stored = tmp[p.offset - at:p.offset - at + p.nbytes].view(p.dtype).view(p.shape)
        nbytes = torch.Size(p.shape).numel() * p.slot_dtype.itemsize
        view = dst[p.slot_offset:p.slot_offset + nbytes].view(p.slot_dtype).view(p.shape)
        with torch.no_grad():
            view.copy_(stored)
        with self._lock:
            self.stats.bytes_served += p.nbytes

    # ---- checks and references ------------------------------------------------------------------------------
    def same_as_file(self, head: FrozenHead, values: torch.Tensor) -> list[str]:
        """The frozen parameters whose bytes in ``values`` (the block's bytes from 0) differ from the file's."""
        fresh = aligned_empty(head.nbytes)
        self.read_now(head, fresh)
        differ = []
        for p in head.pieces:
            n = torch.Size(p.shape).numel() * p.slot_dtype.itemsize
            if not torch.equal(fresh[p.slot_offset:p.slot_offset + n], values[p.slot_offset:p.slot_offset + n]):
                differ.append(p.name)
        return differ

    def check(self) -> None:
        """Refuse (``ConfigError(frozen_weights)``, naming the file) a base file changed since it was opened."""
        for base in self.files.values():
            base.identity.check("of this run")

    def reference(self, name: str) -> FileWeight | None:
        """What a checkpoint holds for parameter ``name`` served in place: a reference into its base file."""
        p = self._by_name.get(name)
        if p is None:
            return None
        return FileWeight(name, DTYPES[p.dtype], p.shape, file_key=p.key, identity=p.file.identity)

    def served(self) -> Mapping[str, Piece]:
        return self._by_name

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for base in self.files.values():
            for fd in (base.fd, base.direct_fd):
                if fd >= 0:
                    os.close(fd)
        self.files = {}


def _pread_full(fd: int, buf: torch.Tensor, offset: int, n: int) -> int:
    """Read up to ``n`` bytes at ``offset`` into ``buf``; fewer only at the end of the file."""
    mv = memview(buf.data_ptr(), n)
    done = 0
    while done < n:
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done
