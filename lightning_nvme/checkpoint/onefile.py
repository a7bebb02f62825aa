"""The one checkpoint file: torch's own zip format, each state file of a save one 4 KiB-aligned record inside it.

A save still produces its state files (``optimizer-<i>.safetensors``, one per rank under DDP, and
``weights.safetensors`` for streamed weights) the way it chose: streamed, cloned from the store (reflink) or
copied by the background thread, into the save's hidden temp directory. ``stage`` then writes the file Lightning
names with ``torch.save``'s own writer (``torch.serialization._save`` into a ``PyTorchFileWriter``) with
``storage_alignment`` 4096, every storage written as usual except those of the state files: for them only the
record's space is reserved (``write_record_metadata``, what ``torch.serialization.skip_data`` does for all).
``fill`` puts each state file's bytes into its record: ``FICLONERANGE`` where both share a clone-capable
filesystem (the state files of a reflink save are themselves clones of the store's extents, so the one file shares
them too: metadata only), else ``copy_file_range`` (the kernel's copy, bounded memory). Then the caller fsyncs and
commits it with one rename, and drops the temp directory.

Why records of whole state files rather than one record per tensor: the store packs many pieces (ranges of
parameters, several keys, several dtypes) into one chunk region, and a clone moves whole regions; torch's format
forbids two tensors of different dtypes viewing one storage. A state file is a byte record (``uint8``) that
``torch.load`` returns as a tensor (also ``weights_only=True``; ``mmap=True`` maps it without reading), and that
``SafetensorsReader`` reads in place, range by range, on resume.

Why the records' storages are the part files mapped (``UntypedStorage.from_file``): ``_save`` needs a storage of
the record's size to pickle; a file mapping costs no memory (never touched: its record is reserved, not written)
and no overcommit, whatever the state's size.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme.checkpoint import weights
from lightning_nvme.constants import ALIGN, align_up
from lightning_nvme.fs import reflink

REF_KEY = "lightning_nvme"  # this package's entry in a checkpoint (``paired.REF_KEY``)
RECORDS_KEY = "records"  # in the ``lightning_nvme`` entry: state file name -> uint8 record


class _Reserving:
    """A ``PyTorchFileWriter`` that reserves (does not write) the records of the given storages."""

    def __init__(self, writer: Any, reserved: dict[int, str]) -> None:
        self.writer = writer
        self.reserved = reserved  # storage data_ptr -> state file name
        self.names: dict[str, str] = {}  # record name -> state file name

    def write_record(self, name: str, data: Any, num_bytes: int) -> None:
        if isinstance(data, torch.UntypedStorage) and data.data_ptr() in self.reserved and num_bytes:
            self.names[name] = self.reserved[data.data_ptr()]
            self.writer.write_record_metadata(name, num_bytes)
        else:
            self.writer.write_record(name, data, num_bytes)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.writer, attr)


@dataclass
class Staged:
    """A checkpoint file written under its temp name, its state records reserved: ``records`` maps each state
    file of ``parts_dir`` to its record's (offset, size) in ``tmp``."""

    tmp: str
    parts_dir: str
    records: dict[str, tuple[int, int]] = field(default_factory=dict)


def _mapped(path: str) -> torch.Tensor:
    size = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]


def record_offsets(path: str) -> dict[str, tuple[int, int]]:
    """Each zip record's data offset and size (a local header is 30 bytes + name + extra, torch pads the extra
    field to the archive's storage alignment)."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
            out[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


def stage(checkpoint: dict[str, Any], tmp: str, parts_dir: str, ref_key: str) -> Staged:
    """``torch.save(checkpoint, tmp)`` with ``checkpoint[ref_key][RECORDS_KEY]`` holding every file of ``parts_dir``
    as a reserved ``uint8`` record (the files padded to a multiple of 4 KiB: a clone moves whole blocks)."""
    names = sorted(n for n in os.listdir(parts_dir) if not n.startswith("."))
    records: dict[str, torch.Tensor] = {}
    for name in names:
        path = os.path.join(parts_dir, name)
        size = os.path.getsize(path)
        if size % ALIGN:
            os.truncate(path, align_up(size))
        records[name] = _mapped(path)
    beside = weights.refs(checkpoint.get("state_dict") or {}).values()
    for ref in beside:  # pickled with the record: torch.load resolves them without the directory
        ref.record = records.get(weights.WEIGHTS_FILE)
    checkpoint = {**checkpoint, ref_key: {**checkpoint[ref_key], RECORDS_KEY: records}}
    reserving: _Reserving | None = None
    from torch.utils.serialization import config

    old = config.save.storage_alignment
    config.save.storage_alignment = ALIGN
    try:
        with torch.serialization._open_zipfile_writer(tmp) as writer:
            reserving = _Reserving(writer, {t.untyped_storage().data_ptr(): n for n, t in records.items()})
            torch.serialization._save(checkpoint, reserving, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    finally:
        config.save.storage_alignment = old
        for ref in beside:
            ref.record = None
        del records
    assert reserving is not None
    offsets = record_offsets(tmp)
    staged = Staged(tmp, parts_dir)
    for record, name in reserving.names.items():
        (full,) = [k for k in offsets if k.endswith("/" + record)]
        offset, size = offsets[full]
        if offset % ALIGN or size != os.path.getsize(os.path.join(parts_dir, name)):
            raise AssertionError(f"{tmp}: record {full} of {name} at offset {offset}, {size} bytes: not the 4 KiB-"
                                 "aligned record of the state file's size this writer reserved")
        staged.records[name] = (offset, size)
    missing = set(names) - set(staged.records)
    if missing:
        raise AssertionError(f"{tmp}: no record reserved for {sorted(missing)}")
    return staged


def fill(staged: Staged) -> tuple[int, int]:
    """Each state file's bytes into its record: cloned where the filesystem shares extents, else copied by the
    kernel. Returns (bytes cloned, bytes copied); the caller fsyncs and commits."""
    cloned = copied = 0
    fd = os.open(staged.tmp, os.O_WRONLY)
    try:
        block = os.fstatvfs(fd).f_bsize
        for name, (offset, size) in staged.records.items():
            src = os.open(os.path.join(staged.parts_dir, name), os.O_RDONLY)
            try:
                if size % block == 0 and offset % block == 0:
                    try:
                        reflink.clone_range(src, 0, fd, offset, size, block)
                        cloned += size
                        continue
                    except OSError:
                        pass  # not clone-capable here (another filesystem, ext4): the kernel copies
                done = 0
                while done < size:
                    n = os.copy_file_range(src, fd, size - done, done, offset + done)
                    if n <= 0:
                        raise OSError(f"short copy of {name} into {staged.tmp} at {offset + done}")
                    done += n
                copied += size
            finally:
                os.close(src)
    finally:
        os.close(fd)
    return cloned, copied


def records_of(ref: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The state records of a loaded one-file checkpoint's entry (``None``: the state is beside the file)."""
    records = ref.get(RECORDS_KEY)
    if not isinstance(records, dict):
        return None
    # a checkpoint that went through a CheckpointIO plugin holds its records as storages (see plugin_io.ship)
    return {name: r if torch.is_tensor(r) else torch.empty(0, dtype=torch.uint8).set_(r)
            for name, r in records.items()}


def load_mapped(path: str, weights_only: bool | None = False) -> dict[str, Any]:
    """``torch.load(path, mmap=True)`` for the strategies and tools of this package, that works for a file larger
    than memory.

    Why not torch's default: it maps the whole file ``MAP_PRIVATE``, which the kernel's overcommit heuristics
    charge as memory, so a one-file checkpoint larger than RAM + swap (the state of a model bigger than memory)
    fails with ENOMEM. A ``MAP_SHARED`` map is not charged, but a write to a loaded tensor would reach the file:
    so every tensor outside the state records (read only, range by range) is cloned into memory, what the
    checkpoint file held before the state moved inside it. Falls back to torch's private map where the file
    cannot be mapped shared (e.g. opened read-only)."""
    try:
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    ref = checkpoint.get(REF_KEY) if isinstance(checkpoint, dict) else None
    records = ref.pop(RECORDS_KEY, None) if isinstance(ref, dict) else None
    _own(checkpoint, {})
    if records is not None:
        checkpoint[REF_KEY][RECORDS_KEY] = records
    return checkpoint


def _own(value: Any, memo: dict[int, torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by an in-memory copy, containers updated in place (a state dict keeps
    its ``_metadata``); a tensor referenced twice is copied once."""
    if torch.is_tensor(value):
        if id(value) not in memo:
            memo[id(value)] = value.clone()
        return memo[id(value)]
    if isinstance(value, dict):
        for k in list(value):
            value[k] = _own(value[k], memo)
    elif isinstance(value, list):
        value[:] = [_own(v, memo) for v in value]
    elif isinstance(value, tuple):
        items = [_own(v, memo) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
