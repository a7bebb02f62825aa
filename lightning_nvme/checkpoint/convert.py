"""Convert between streamed checkpoint directories and plain single-file Lightning checkpoints.

``to_lightning``: a directory written by ``NVMeOffloadStrategy`` or (sharded, one file per rank) by
``NVMeOffloadDDPStrategy`` -> one ``.ckpt`` file that a Trainer without this plugin resumes from (the
per-element state is materialized: this is the way out).
``from_lightning``: a plain ``.ckpt`` -> a streamed directory (both strategies also resume from plain
checkpoints directly; this is for moving large state into the directory layout ahead of time). The
directory resumes at any world size: each rank reads only the element ranges it owns.

    python -m lightning_nvme.checkpoint.convert to-lightning SRC_DIR DST.ckpt
    python -m lightning_nvme.checkpoint.convert from-lightning SRC.ckpt DST_DIR
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

import torch

from lightning_nvme.checkpoint.atomic import commit_dir, fsync_path, temp_name
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader, SafetensorsWriter
from lightning_nvme.checkpoint.streamed import (FORMAT_VERSION, MARKER, META_FILE, load_streamed, optimizer_file,
                                                parse_tensor_name, tensor_name)
from lightning_nvme.optim.state_format import BLOCK, SCALE_SUFFIX, STATE_DICT_KEY, StateFormat, decode_entries


def _atomic_torch_save(obj, path: str) -> None:
    tmp = temp_name(path)
    torch.save(obj, tmp)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def to_lightning(src_dir: str, dst_file: str) -> None:
    checkpoint = load_streamed(src_dir)
    directory = checkpoint.pop("_lightning_nvme")["dir"]
    for state in checkpoint.get("optimizer_states", []):
        marker = state.pop(MARKER, None)
        if marker is None:
            continue
        for file in marker.get("files", [marker.get("file")]):  # "files": the shards of a data-parallel save
            reader = SafetensorsReader(os.path.join(directory, file))
            try:
                for name in reader.entries:
                    _gather(state["state"], reader, name, marker.get("shapes"))
            finally:
                reader.close()
        _dequantize(state, marker.get("state_format"))
    _atomic_torch_save(checkpoint, dst_file)


def _dequantize(state: dict, saved: dict | None) -> None:
    """State stored compressed (``state_format`` bf16/int8) -> torch-format fp32 values; the format and the
    bf16_sr step count stay recorded under ``STATE_DICT_KEY``."""
    if not saved:
        return
    fmt = StateFormat(saved["state_format"], saved["master_format"])
    for entries in state["state"].values():
        decode_entries(fmt, entries)
    state[STATE_DICT_KEY] = dict(saved)


def _gather(state: dict, reader: SafetensorsReader, name: str, shapes: list | None) -> None:
    """Put entry ``name`` into the torch-format ``state``: a whole tensor, or a range of one (then the
    full tensor, shaped like its parameter, is assembled from the ranges of all shards)."""
    index, key, start, stop = parse_tensor_name(name)
    entries = state.setdefault(index, {})
    if start is None:
        entries[key] = reader.read(name).view(reader.entries[name][1])
        return
    if key not in entries:
        shape = tuple(shapes[index])
        if key.endswith(SCALE_SUFFIX):  # one int8 block scale per BLOCK elements
            shape = (-(-math.prod(shape) // BLOCK),)
        entries[key] = torch.empty(shape, dtype=reader.entries[name][0])
    entries[key].view(-1)[start:stop] = reader.read(name)


def from_lightning(src_file: str, dst_dir: str) -> None:
    checkpoint = torch.load(src_file, map_location="cpu", weights_only=False)
    tmp = temp_name(dst_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        tensors = {}
        for index, entries in state["state"].items():
            for key in [k for k, v in entries.items() if torch.is_tensor(v) and v.dim() > 0]:
                tensors[tensor_name(index, key)] = entries.pop(key)
        writer = SafetensorsWriter(os.path.join(tmp, optimizer_file(i)),
                                   [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                                   {"format": MARKER, "format_version": str(FORMAT_VERSION)})
        try:
            for name, t in tensors.items():
                writer.write(name, 0, t.reshape(-1))
        finally:
            writer.close()
        state[MARKER] = {"format_version": FORMAT_VERSION, "file": optimizer_file(i)}
    torch.save(checkpoint, os.path.join(tmp, META_FILE))
    fsync_path(os.path.join(tmp, META_FILE))
    commit_dir(tmp, dst_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-nvme convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["to-lightning", "from-lightning"])
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    (to_lightning if args.direction == "to-lightning" else from_lightning)(args.src, args.dst)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
