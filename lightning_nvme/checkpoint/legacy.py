"""Reading checkpoints of the old directory format (lightning_nvme before the paired-file format).

Layout of such a ``<name>.ckpt/``::

    checkpoint.pt                          Lightning's dict; each ``optimizer_states`` entry holds the param
                                           groups and scalar state plus a ``lightning_nvme`` marker naming
                                           its file(s) (``format_version`` 1)
    optimizer-<i>.safetensors              single-process state, or
    optimizer-<i>-rank<r>.safetensors      one shard per data-parallel rank

They are read (resume, convert) and replaced by a save to the same path; never written any more.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_nvme.checkpoint.state_files import MARKER, OptimizerParts

LEGACY_FORMAT_VERSION = 1  # of the old checkpoint directory format (read only)
META_FILE = "checkpoint.pt"


def is_legacy_dir(path: Any) -> bool:
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META_FILE))


def load_legacy(path: str) -> tuple[dict[str, Any], OptimizerParts | None]:
    """Lightning's checkpoint dict of an old-format directory, markers moved out into ``OptimizerParts``."""
    path = os.path.abspath(path)
    checkpoint = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=False)
    markers = [state.pop(MARKER, None) for state in checkpoint.get("optimizer_states", [])]
    for marker in markers:
        if marker is not None and marker.get("format_version") != LEGACY_FORMAT_VERSION:
            raise ValueError(f"{path}: optimizer state has format version {marker.get('format_version')}, this "
                             f"lightning_nvme reads version {LEGACY_FORMAT_VERSION} of the directory format")
    if not any(m is not None for m in markers):
        return checkpoint, None
    return checkpoint, OptimizerParts(path, None, markers, source=path)
