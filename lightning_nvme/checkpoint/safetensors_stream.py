"""Write and read a standard safetensors file piece by piece, with positioned I/O.

Why not ``safetensors.torch.save_file``: it needs every tensor in memory at once, which is exactly
what offloading avoids. The header (names, dtypes, shapes, offsets) is known up front from the plan,
so each piece of state is written at its final offset as it streams out of the store. The result is
an ordinary safetensors file (``safetensors.torch.load_file`` reads it).
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import torch

from lightning_nvme.store.aligned import memview

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
CODES = {v: k for k, v in DTYPES.items()}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _layout(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
            ) -> tuple[bytes, dict[str, tuple[int, torch.dtype]], int]:
    """The file's header (``<u64 length><json>``, padded to 8 bytes), each entry's (data offset, dtype), data bytes."""
    header: dict = {"__metadata__": dict(metadata or {})}
    offsets: dict[str, tuple[int, torch.dtype]] = {}
    pos = 0
    for name, dtype, shape in entries:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * _itemsize(dtype)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets[name] = (pos, dtype)
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offsets, pos


def safetensors_size(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                     metadata: dict[str, str] | None = None) -> int:
    """Bytes of the file ``SafetensorsWriter(path, entries, metadata)`` writes (known before a byte is written)."""
    head, _, data = _layout(entries, metadata)
    return len(head) + data


class SafetensorsWriter:
    """Writes the file ``path``; or, given ``fd``, the same bytes at offset ``base`` of that open file (a record of a
    one-file checkpoint, reserved for it: the state is written once, straight into the checkpoint)."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, fd: int | None = None, base: int = 0) -> None:
        self.path = path
        head, self.offsets, data = _layout(entries, metadata)
        self.data_start = len(head)
        self.total = self.data_start + data
        self.base = base
        self.own = fd is None
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if fd is None else fd
        self._pwrite(head, 0)

    def _pwrite(self, data, offset: int) -> None:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            n = os.pwrite(self.fd, mv[done:], self.base + offset + done)
            if n <= 0:
                raise OSError(f"short write to {self.path} at offset {offset + done}")
            done += n

    def write(self, name: str, elem_offset: int, values: torch.Tensor) -> None:
        start, dtype = self.offsets[name]
        values = values.contiguous()
        if values.dtype != dtype:
            raise TypeError(f"{name}: expected {dtype}, got {values.dtype}")
        nbytes = values.numel() * values.element_size()
        if nbytes:
            self._pwrite(memview(values.data_ptr(), nbytes), self.data_start + start + elem_offset * _itemsize(dtype))

    def close(self) -> None:
        """fsync, then drop the bytes from the page cache: a checkpoint must not spend the RAM we saved. A writer
        into another file's range leaves that file open (and its size alone) for its owner."""
        if not self.own:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, self.base, self.total, os.POSIX_FADV_DONTNEED)
            return
        os.ftruncate(self.fd, self.total)
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(self.fd)


def file_backing(record: torch.Tensor) -> tuple[int, int] | None:
    """(an open descriptor of the file, the offset) whose bytes a file-mapped tensor shows (``torch.load(...,
    mmap=True)``): read with ``pread``, the pages go to the page cache, not into this process's RSS as touched
    mapped pages would. ``None`` for a tensor in memory, or a mapping whose file was since replaced or deleted."""
    ptr = record.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if not lo <= ptr < hi or len(fields) < 6 or not fields[5].startswith("/"):
                    continue
                path, inode = fields[5].rstrip("\n"), int(fields[4])
                fd = os.open(path, os.O_RDONLY)
                if os.fstat(fd).st_ino != inode or ptr + record.numel() > hi:
                    os.close(fd)
                    return None
                return fd, int(fields[2], 16) + ptr - lo
    except OSError:
        return None
    return None


class SafetensorsReader:
    """Reads a safetensors file range by range: a file of its own (``path``), or a record of a one-file checkpoint
    (``record``: the ``uint8`` tensor ``torch.load(..., mmap=True)`` returns for it; ``path`` names it in errors),
    read in place."""

    def __init__(self, path: str, record: torch.Tensor | None = None) -> None:
        self.path = path
        self.record = record
        self.base = 0  # the record's offset in the file read with pread
        self.fd = os.open(path, os.O_RDONLY) if record is None else -1
        backing = file_backing(record) if record is not None else None
        if backing is not None:  # a mapped record: pread + fadvise, so pages read do not stay in this process's RSS
            self.fd, self.base, self.record = backing[0], backing[1], None
        self.size = os.fstat(self.fd).st_size if record is None else record.numel()
        size = self.size
        (hlen,) = struct.unpack("<Q", self._pread(8, 0))
        if hlen > size - 8:
            raise ValueError(f"{path}: truncated or not a safetensors file (header length {hlen}, size {size})")
        header = json.loads(self._pread(hlen, 8))
        self.metadata = header.pop("__metadata__", {})
        self.data_start = 8 + hlen
        self.entries = {k: (CODES[v["dtype"]], tuple(v["shape"]), v["data_offsets"][0]) for k, v in header.items()}
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self.data_start + end > size:
            raise ValueError(f"{path} is truncated: {size} bytes, its header describes {self.data_start + end}")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str, start: int = 0, stop: int | None = None, drop_cache: bool = False) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened (all of it by default), 1-D, in its stored dtype.
        ``drop_cache``: the pages read leave the page cache at once (a reader kept open for many reads, each read
        once: ``close`` would drop them only at the end)."""
        dtype, shape, off = self.entries[name]
        numel = 1
        for s in shape:
            numel *= s
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:  # beyond it lie other tensors' bytes
            raise ValueError(f"{self.path}: {name} has {numel} elements, elements [{start}, {stop}) were asked for")
        out = torch.empty(stop - start, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        pos = self.data_start + off + start * out.element_size()
        if self.record is not None:
            out.view(torch.uint8).copy_(self.record[pos:pos + nbytes])
            return out
        pos += self.base
        mv = memview(out.data_ptr(), nbytes) if nbytes else memoryview(b"")
        done = 0
        while done < nbytes:
            n = os.preadv(self.fd, [mv[done:]], pos + done)
            if n <= 0:
                raise OSError(f"short read from {self.path} ({name}) at offset {pos + done}")
            done += n
        if drop_cache and nbytes:
            os.posix_fadvise(self.fd, pos, nbytes, os.POSIX_FADV_DONTNEED)
        return out

    def mapped(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` mapped from the file (private, copy on write, as ``torch.load(..., mmap=True)`` maps),
        not read: no page is read until the tensor is used. Each tensor its own mapping, so its own storage
        (``torch.save`` refuses views of one storage as different dtypes: a loaded checkpoint can be saved again).
        ``None`` for a reader of a record in memory, or where the offset is not a multiple of the element size."""
        if self.record is not None:
            return None
        dtype, shape, off = self.entries[name]
        numel = 1
        for s in shape:
            numel *= s
        pos = self.base + self.data_start + off
        if pos % _itemsize(dtype) or numel == 0:
            return None
        start = pos - pos % mmap.ALLOCATIONGRANULARITY
        region = mmap.mmap(self.fd, pos - start + numel * _itemsize(dtype), access=mmap.ACCESS_COPY, offset=start)
        return torch.frombuffer(region, dtype=dtype, count=numel, offset=pos - start).view(shape)

    def _pread(self, n: int, offset: int) -> bytes:
        if self.record is None:
            return os.pread(self.fd, n, self.base + offset)
        return self.record[offset:offset + n].numpy().tobytes()

    def close(self, drop_cache: bool = True) -> None:
        """``drop_cache``: the pages read leave the page cache (a resume streams through them once); ``False``
        where the file's pages are mapped and used in place (``view``)."""
        if self.record is not None:
            self.record = None
            return
        if drop_cache:  # of a record of a checkpoint file: its range only
            os.posix_fadvise(self.fd, self.base, self.size if self.base else 0, os.POSIX_FADV_DONTNEED)
        os.close(self.fd)
