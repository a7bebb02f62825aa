"""Open a lightning_nvme checkpoint: the file and the optimizer state tied to it (``paired``).

Why one module: the converter, ``load_checkpoint`` and the strategies' resume all start the same way — tell
the file's format version apart, read Lightning's dict, and find where the streamed optimizer state is — and differ only
in how the file itself is read (``torch.load``, or the user's ``CheckpointIO``) and in what they do with the
weights streamed beside it (read them into memory, or stream them into the store).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH

from lightning_nvme.checkpoint import onefile, paired, plugin_io, weights
from lightning_nvme.checkpoint.state_files import OptimizerParts, restore_optimizer
from lightning_nvme.optim import OffloadedOptimizer


def _torch_load(path: str) -> dict[str, Any]:
    """Mapped: the state records of a one-file checkpoint are read range by range where used, never whole."""
    return onefile.load_mapped(path)


def open_checkpoint(path: str | os.PathLike,
                    load_file: Callable[[str], dict[str, Any]] = _torch_load) -> tuple[dict[str, Any], OptimizerParts | None]:
    """Lightning's dict of a checkpoint, and where its optimizer state is (``None``: in the dict,
    or none). Weights streamed beside the file stay ``weights.BesideWeight`` references, found relative to it.
    ``load_file`` reads a checkpoint file (default ``torch.load``; the strategies pass their ``CheckpointIO``)."""
    path = os.fspath(path)
    with weights.deferred():
        checkpoint = load_file(path)
    return paired.read(checkpoint, path)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's dict of a lightning_nvme checkpoint with every weight in it, the beside ones found relative to
    the file (so a checkpoint moved together with its ``.optim`` directory still loads); the whole model in memory."""
    checkpoint, _ = open_checkpoint(path)
    weights.read_all(checkpoint)
    return checkpoint


class Resume:
    """The strategies' way to read a checkpoint back, in Lightning's order: ``open`` (before setup) hands Lightning its
    usual dict and keeps where the streamed optimizer state is; ``state_dict`` reads the weights streamed beside the
    file (or leaves the keys a strategy streams itself); ``restore`` (after setup, when the offloaded optimizers
    exist) streams the state back. Nothing else in ``checkpoint/`` is the strategies' to call for a load."""

    def __init__(self) -> None:
        self.parts: OptimizerParts | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"parts": None}  # open readers of a load stay with this instance

    def open(self, checkpoint_path: _PATH, checkpoint_io: CheckpointIO, load_file: Callable[[str], dict[str, Any]],
             recover: Callable[[str], None], weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's dict of ``checkpoint_path`` (``load_file``: the plugin's reader); ``recover(path)`` first
        finishes or undoes an interrupted commit of a local file. Where the default ``TorchCheckpointIO`` reads a
        local file, it is mapped instead: the state records are read range by range on resume, never whole."""
        self.parts = None
        if plugin_io.is_local(checkpoint_path):
            recover(os.path.abspath(os.fspath(checkpoint_path)))
        if plugin_io.maps_records(checkpoint_io, checkpoint_path):
            load_file = functools.partial(onefile.load_mapped, weights_only=weights_only)
        checkpoint, self.parts = open_checkpoint(os.fspath(checkpoint_path), load_file)
        return checkpoint

    @property
    def plain(self) -> bool:
        """The last opened checkpoint holds no streamed optimizer state (a plain Lightning checkpoint)."""
        return self.parts is None or any(marker is None for marker in self.parts.markers)

    @staticmethod
    def has_beside_weights(checkpoint: Mapping[str, Any]) -> bool:
        return weights.has_refs(checkpoint)

    @staticmethod
    @contextmanager
    def state_dict(checkpoint: Mapping[str, Any],
                   streamed_by: Callable[[weights.WeightReaders], AbstractContextManager[set[str]]]
                   ) -> Iterator[dict[str, Any]]:
        """``checkpoint``'s state dict with the weights beside the file read, except the keys ``streamed_by(readers)``
        says the strategy streams itself (into the store) while inside."""
        with weights.WeightReaders() as readers, streamed_by(readers) as streamed:
            yield {k: readers.read(v) if isinstance(v, weights.BesideWeight) and k not in streamed else v
                   for k, v in checkpoint["state_dict"].items()}

    def restore(self, offloaded: Sequence[OffloadedOptimizer], checkpoint: Mapping[str, Any]) -> None:
        """Stream each offloaded optimizer's state back from the last opened checkpoint (then forget it)."""
        parts, self.parts = self.parts, None
        for i, (off, state) in enumerate(zip(offloaded, checkpoint["optimizer_states"])):
            marker = parts.markers[i] if parts is not None and i < len(parts.markers) else None
            restore_optimizer(off, state, marker, parts)
