"""A frozen weight a checkpoint references in the user's own safetensors file instead of copying it.

Why: with ``frozen_weights="in_place"`` the frozen base of a run (a LoRA base, frozen layers) is read during fit
straight from the Hugging Face checkpoint the model was built from; copying it into every checkpoint would cost
the disk and the minutes the in-place read saved. A checkpoint of such a run holds, for each of those tensors, a
``FileWeight``: the file's path, the tensor's name in it, and the file's identity as recorded when the run opened it
(size, modification time, sha256 of its header). A file that changed since is refused by name (``check``), never
read as if it were the same weights.

What each loader gets (as for ``weights.BesideWeight``): ``torch.load`` / ``load_from_checkpoint`` read the tensor
from the base file (checked); the offload strategies load under ``weights.deferred()`` and get the reference, which
a resume reads block by block.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_nvme.checkpoint import weights
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader
from lightning_nvme.checks import ConfigError

KEY = "frozen_weights"  # the setting a refusal names


@dataclass(frozen=True)
class FileIdentity:
    """What a run recorded of a base file when it opened it: a later check compares the file against it."""

    path: str
    size: int
    mtime_ns: int
    header_sha256: str

    @classmethod
    def of(cls, path: str) -> FileIdentity:
        """The file's identity now (its header read and hashed: a few KiB)."""
        path = os.path.abspath(path)
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: {st.st_size} bytes, not a safetensors file")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > st.st_size - 8:
                raise ValueError(f"{path}: truncated or not a safetensors file (header length {hlen}, size {st.st_size})")
            digest = hashlib.sha256(head + f.read(hlen)).hexdigest()
        return cls(path, st.st_size, st.st_mtime_ns, digest)

    def changes(self) -> list[str]:
        """How the file differs from this record now (empty: unchanged)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return [f"it cannot be opened ({e.strerror})"]
        found = []
        if st.st_size != self.size:
            found.append(f"size {self.size} -> {st.st_size} bytes")
        if st.st_mtime_ns != self.mtime_ns:
            found.append(f"modification time {self.mtime_ns} -> {st.st_mtime_ns} ns")
        if not found:
            return []
        try:
            now = FileIdentity.of(self.path)
        except (OSError, ValueError) as e:
            return [*found, f"its header cannot be read ({e})"]
        if now.header_sha256 != self.header_sha256:
            found.append("its header (tensor names, dtypes, shapes, offsets) differs")
        return found

    def check(self, what: str) -> None:
        """Raise ``ConfigError(frozen_weights)`` naming the file and what changed, if it did."""
        changed = self.changes()
        if changed:
            raise ConfigError(KEY, f"{self.path}: the frozen weights {what} are read from this file in place, but it "
                              f"changed since it was recorded ({'; '.join(changed)}). Its tensors are no longer the "
                              "weights the run trained against. Fix: restore the original file, or start a new run "
                              "from the new one (a run that must not depend on the file later: "
                              "frozen_weights='store' copies the frozen weights into the store).")


@dataclass
class FileWeight(weights.BesideWeight):
    """A state-dict entry (``key``) whose tensor is ``file_key`` of the base file ``identity.path`` (stored dtype
    ``dtype``). A ``BesideWeight`` to whoever streams references (an export reads it like one), but never written
    into a checkpoint's beside file (``weights.refs`` leaves it out): it is read from the user's file, checked."""

    file_key: str = ""
    identity: FileIdentity | None = None
    read_alone: ClassVar[bool] = True

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        i = self.identity
        assert i is not None
        return file_weight, (self.key, self.file_key, self.dtype, tuple(self.shape), i.path, i.size, i.mtime_ns,
                             i.header_sha256)

    def check_readable(self) -> None:
        assert self.identity is not None
        self.identity.check(f"({self.key!r} of a checkpoint)")

    def read(self) -> torch.Tensor:
        """The tensor, read from the base file after checking it is the file the checkpoint recorded."""
        self.check_readable()
        assert self.identity is not None
        reader = SafetensorsReader(self.identity.path)
        try:
            return reader.read(self.file_key).view(self.shape)
        finally:
            reader.close()


def file_weight(key: str, file_key: str, dtype: str, shape: tuple[int, ...], path: str, size: int, mtime_ns: int,
                header_sha256: str) -> torch.Tensor | FileWeight:
    """Unpickling a ``FileWeight``: the tensor, or (under ``weights.deferred()``) the reference itself."""
    ref = FileWeight(key, dtype, tuple(shape), file_key=file_key,
                     identity=FileIdentity(path, size, mtime_ns, header_sha256))
    return ref if weights.is_deferred() else ref.read()


def file_refs(state_dict: Any) -> dict[str, FileWeight]:
    return {k: v for k, v in (state_dict or {}).items() if isinstance(v, FileWeight)}


def base_files(state_dict: Any) -> list[FileIdentity]:
    """The base files a checkpoint's state dict references (each once)."""
    return list({v.identity.path: v.identity for v in file_refs(state_dict).values() if v.identity is not None}.values())

