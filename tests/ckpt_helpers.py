"""Test helpers for lightning_nvme checkpoints: where a checkpoint's streamed optimizer state is, and a writer of
format version 2 (this lightning_nvme only reads it), to check that such checkpoints still load."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import tempfile

import torch

from lightning_nvme.checkpoint import onefile

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
