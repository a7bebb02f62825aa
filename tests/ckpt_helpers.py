"""Test helpers for lightning_nvme checkpoints: where a checkpoint's streamed optimizer state is, and a writer of
the old directory format (this lightning_nvme only reads it), to check that old checkpoints still load."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import tempfile

import torch

from lightning_nvme.checkpoint import onefile
from lightning_nvme.checkpoint.convert import pop_state_tensors, write_tensors
from lightning_nvme.checkpoint.legacy import LEGACY_FORMAT_VERSION, META_FILE
from lightning_nvme.checkpoint.state_files import MARKER, optimizer_file

_EXTRACTED = tempfile.mkdtemp(prefix="lightning_nvme-records-")
atexit.register(shutil.rmtree, _EXTRACTED, True)


def extract(path: str, directory: str) -> list[str]:
    """Write the state files of one-file checkpoint ``path`` into ``directory`` as they were before the save
    embedded them (each record cut to its safetensors length); returns their names. For tools and inspection:
    resume and ``convert`` read the records in place."""
    ref = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("lightning_nvme") or {}
    records = onefile.records_of(ref) or {}
    os.makedirs(directory, exist_ok=True)
    for name, record in records.items():
        (hlen,) = struct.unpack("<Q", record[:8].numpy().tobytes())
        header = json.loads(record[8:8 + hlen].numpy().tobytes())
        end = 8 + hlen + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        with open(os.path.join(directory, name), "wb") as f:
            for start in range(0, end, 64 << 20):  # bounded memory
                f.write(record[start:min(end, start + (64 << 20))].numpy().tobytes())
    return sorted(records)


def parts_dir(path) -> str:
    """A directory holding the state files of checkpoint file ``path``: for a one-file checkpoint, its records
    written out (``extract``, outside the checkpoint's directory); for a version-2 checkpoint, the
    ``.optim/<save id>`` directory beside it."""
    ref = torch.load(path, weights_only=True, mmap=True)["lightning_nvme"]
    if onefile.records_of(ref) is None:
        return os.path.join(os.path.dirname(os.path.abspath(path)), ref["parts_dir"])
    out = os.path.join(_EXTRACTED, ref["save_id"])
    if not os.path.isdir(out):
        extract(os.fspath(path), out)
    return out


def write_legacy(plain_file, dst_dir) -> None:
    """Write a plain Lightning checkpoint in the old directory format (``checkpoint.pt`` + safetensors), as
    lightning_nvme up to the paired-file format wrote it."""
    checkpoint = torch.load(plain_file, map_location="cpu", weights_only=False)
    os.makedirs(dst_dir)
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        write_tensors(os.path.join(dst_dir, optimizer_file(i)), pop_state_tensors(state),
                      {"format": MARKER, "format_version": str(LEGACY_FORMAT_VERSION)})
        state[MARKER] = {"format_version": LEGACY_FORMAT_VERSION, "file": optimizer_file(i)}
    torch.save(checkpoint, os.path.join(dst_dir, META_FILE))


def write_beside(onefile_path, dst) -> None:
    """Rewrite a one-file checkpoint as format version 2 (lightning_nvme before the one-file layout wrote it): the
    file without its state records, the state files beside it in ``<dst>.optim/<save id>/``. This lightning_nvme
    only reads that format; the helper checks that it still does."""
    from lightning_nvme.checkpoint import weights

    with weights.deferred():  # weights streamed beside the dict stay references, now to the .optim directory
        checkpoint = torch.load(onefile_path, map_location="cpu", weights_only=False)
    ref = checkpoint["lightning_nvme"]
    for beside in weights.refs(checkpoint.get("state_dict") or {}).values():
        beside.record = None
    weights.bind(checkpoint.get("state_dict") or {}, os.fspath(dst), ref["save_id"])
    name = os.path.basename(os.fspath(dst))
    extract(os.fspath(onefile_path), os.path.join(os.fspath(dst) + ".optim", ref["save_id"]))
    del ref[onefile.RECORDS_KEY]
    ref.update(format_version=2, parts_dir=os.path.join(name + ".optim", ref["save_id"]))
    torch.save(checkpoint, dst)
