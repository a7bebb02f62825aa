"""What a save did and whether it fits: the save record (how the state reached the file, bytes, seconds; the
strategies' ``checkpoint_saves``, telemetry) and the space check made before a save writes anything."""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme.checkpoint import weights
from lightning_nvme.fs import fsinfo

log = logging.getLogger(__name__)


@dataclass
class SaveRecord:
    """How one save wrote its streamed state: ``path`` is ``"reflink"`` or ``"streamed"`` (with ``reason``)."""

    path: str
    checkpoint: str
    reason: str = ""
    seconds: float = 0.0
    bytes_written: int = 0  # bytes this save wrote into its state files (headers for reflink)
    bytes_cloned: int = 0  # bytes shared with the store instead of written
    files: list[str] = field(default_factory=list)
    base_files: list[str] = field(default_factory=list)  # frozen weights referenced there, not copied (in place)

    def describe(self) -> str:
        moved = (f"{self.bytes_cloned} bytes cloned, {self.bytes_written} written" if self.path == "reflink"
                 else f"{self.bytes_written} bytes written" + (f" ({self.reason})" if self.reason else ""))
        refs = (f"; frozen weights referenced in the base file(s) {self.base_files}, not copied: the checkpoint "
                "needs them unchanged" if self.base_files else "")
        return f"checkpoint {self.checkpoint}: {self.path} save in {self.seconds:.3f} s, {moved}{refs}"


class CheckpointSpaceError(OSError):
    """A save refused before it wrote anything: the checkpoint's filesystem cannot hold it."""


def weight_bytes(checkpoint: dict[str, Any]) -> int:
    """Bytes of the weights a save writes: the file's tensors and the weights streamed beside it."""
    state = checkpoint.get("state_dict") or {}
    inline = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return inline + sum(math.prod(r.shape) * r.torch_dtype.itemsize for r in weights.refs(state).values())


def check_space(path: str, needed: int, how: str) -> None:
    """Refuse a save of ``needed`` bytes into ``path``'s directory before it writes anything, naming the bytes."""
    free = shutil.disk_usage(fsinfo.existing_ancestor(os.path.dirname(os.path.abspath(path)))).free
    if needed > free:
        raise CheckpointSpaceError(errno.ENOSPC, f"checkpoint {path} ({how}) needs {needed} bytes "
                                   f"({needed / 2**30:.2f} GiB) but {free} bytes ({free / 2**30:.2f} GiB) are free "
                                   f"there; nothing was written. Free {needed - free} bytes, keep fewer checkpoints "
                                   "(save_top_k), or save to a larger disk.")


def timed(record: SaveRecord, t0: float) -> SaveRecord:
    record.seconds = time.perf_counter() - t0
    log.info(record.describe())
    return record
