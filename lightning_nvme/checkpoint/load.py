"""Open a lightning_nvme checkpoint of either format: the paired file (``paired``) or the old directory
(``legacy``).

Why one module: the converter, ``load_checkpoint`` and the strategies' resume all start the same way — tell
the formats apart, read Lightning's dict, and find where the streamed optimizer state is — and differ only
in how the file itself is read (``torch.load``, or the user's ``CheckpointIO``) and in what they do with the
weights streamed beside it (read them into memory, or stream them into the store).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning_nvme.checkpoint import legacy, onefile, paired, weights
from lightning_nvme.checkpoint.streamed import OptimizerParts


def _torch_load(path: str) -> dict[str, Any]:
    """Mapped: the state records of a one-file checkpoint are read range by range where used, never whole."""
    return onefile.load_mapped(path)


def open_checkpoint(path: str | os.PathLike,
                    load_file: Callable[[str], dict[str, Any]] = _torch_load) -> tuple[dict[str, Any], OptimizerParts | None]:
    """Lightning's dict of a checkpoint of either format, and where its optimizer state is (``None``: in the dict,
    or none). Weights streamed beside the file stay ``weights.BesideWeight`` references, found relative to it.
    ``load_file`` reads a checkpoint file (default ``torch.load``; the strategies pass their ``CheckpointIO``)."""
    path = os.fspath(path)
    if legacy.is_legacy_dir(path):
        return legacy.load_legacy(path)
    with weights.deferred():
        checkpoint = load_file(path)
    return paired.read(checkpoint, path)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's dict of a lightning_nvme checkpoint with every weight in it, the beside ones found relative to
    the file (so a checkpoint moved together with its ``.optim`` directory still loads); the whole model in memory."""
    checkpoint, _ = open_checkpoint(path)
    weights.read_all(checkpoint)
    return checkpoint
