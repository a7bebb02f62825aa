"""What goes through the user's ``CheckpointIO`` and what the strategy writes itself.

The strategy writes a checkpoint file itself (under a temp name, fsynced, switched in atomically, its
optimizer state streamed beside it) only where that is what Lightning would have done anyway: the default
``TorchCheckpointIO``, a local path, no ``storage_options``. Everything else is the plugin's: a checkpoint
without optimizer state (``save_weights_only``) goes to the plugin unchanged, local or remote (fsspec).
A checkpoint *with* offloaded optimizer state is refused there with the reason and the fix: a
``CheckpointIO`` takes the whole checkpoint as one dict in memory (what streaming avoids), and the state is
never written to a local directory named after a URL.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.fabric.utilities.types import _PATH

from lightning_nvme.checkpoint import onefile


def is_local(path: _PATH) -> bool:
    return _is_local_file_protocol(path)


def maps_records(checkpoint_io: CheckpointIO, path: _PATH) -> bool:
    """True where a load may map the file (``torch.load(mmap=True)``) instead of the plugin reading it: the default
    ``TorchCheckpointIO`` on a local path, which would read it with ``torch.load`` anyway; mapped, the optimizer
    state's records are read range by range on resume instead of whole into memory."""
    return type(checkpoint_io) is TorchCheckpointIO and is_local(path) and os.path.isfile(path)


def ship(local: str, path: _PATH, storage_options: Any | None, checkpoint_io: CheckpointIO) -> str:
    """Deliver the one-file checkpoint built at ``local`` to ``path``; returns how, for the save record.

    The default ``TorchCheckpointIO`` without ``storage_options`` (a remote URL): the file's bytes are streamed
    through fsspec in 64 MiB pieces (Lightning's own remote save would pickle the whole checkpoint into memory
    first). Anything else goes to the plugin as the checkpoint dict, each state record a storage mapped from the
    local file: the plugin's writer reads it piece by piece, and ``AsyncCheckpointIO`` (which clones every tensor
    before its thread runs) leaves storages alone; the mapping keeps the bytes readable after the local file is
    deleted."""
    if type(checkpoint_io) is TorchCheckpointIO and storage_options is None:
        fs = get_filesystem(path)
        target = os.fspath(path)
        fs.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with open(local, "rb") as src, fs.open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 64 << 20)
        return f"streamed through fsspec ({type(fs).__name__})"
    checkpoint = onefile.load_mapped(local)
    ref = checkpoint.get("lightning_nvme") or {}
    records = ref.get("records")
    if isinstance(records, dict):
        ref["records"] = {name: t.untyped_storage() if torch.is_tensor(t) else t for name, t in records.items()}
    checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
    return f"handed to {type(checkpoint_io).__name__}"


def writes_itself(checkpoint_io: CheckpointIO, path: _PATH, storage_options: Any | None) -> bool:
    """True where the strategy writes the file itself (atomically), False where the plugin must."""
    return type(checkpoint_io) is TorchCheckpointIO and storage_options is None and is_local(path)


def refuse_streamed(strategy: str, checkpoint_io: CheckpointIO, path: _PATH, storage_options: Any | None,
                    beside_weights: bool = False) -> None:
    """Raise the error for a checkpoint with offloaded optimizer state (or weights streamed beside the file)
    that only the plugin could write."""
    weights_only = ("Checkpoints without optimizer state go through it: ModelCheckpoint(save_weights_only=True) or "
                    "trainer.save_checkpoint(path, weights_only=True).")
    if beside_weights:
        weights_only = ("The model's offloaded weights are larger than inline_weights_bytes, so they are streamed "
                        "beside the file too: raise inline_weights_bytes to gather them into the file (memory: the "
                        "whole model), or export them with trainer.strategy.export_weights(local_path).")
    if not is_local(path):
        reason = (f"{path!r} is a remote URL, and the optimizer state is streamed from the local store to a local "
                  "file system (never to a local directory named after the URL). Save to a local directory "
                  "(ModelCheckpoint(dirpath=...)) and upload the file together with its .optim directory, or "
                  "convert it for upload: python -m lightning_nvme.checkpoint.convert to-lightning. ")
    elif type(checkpoint_io) is not TorchCheckpointIO:
        reason = (f"checkpoint_io={type(checkpoint_io).__name__} cannot carry it: a CheckpointIO takes the whole "
                  "checkpoint as one dict in memory, which is what streaming the optimizer state avoids. Remove the "
                  "plugin for full checkpoints (the strategy writes them atomically itself"
                  + ("; an asynchronous plugin is unnecessary: checkpoint_copy='background' returns after a fence "
                     "and copies the state while training runs (any filesystem), and on the store's XFS/btrfs the "
                     "save is a reflink snapshot, metadata only; see docs/checkpoints.md"
                     if "Async" in type(checkpoint_io).__name__ else "") + "). ")
    else:
        reason = ("storage_options were given, which only a custom CheckpointIO understands, and that cannot "
                  "carry streamed optimizer state. Drop storage_options. ")
    what = "streamed weights" if beside_weights else "offloaded optimizer state"
    raise ValueError(f"{strategy}: cannot save the {what} of checkpoint {path!r}: "
                     f"{reason}{weights_only}")
