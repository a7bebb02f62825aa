"""Convert between lightning_nvme checkpoints and plain single-file Lightning checkpoints.

``to_lightning``: a checkpoint written by ``NVMeOffloadStrategy`` or (sharded, one file per rank) by
``NVMeOffloadDDPStrategy`` — the file and its state (inside it, or a version-2 ``.optim`` directory) — -> one
``.ckpt`` file with the optimizer state and every weight inside (weights streamed beside the file by
``offload_params`` are read back in), that a Trainer without this plugin resumes from (the per-element
state and the model are materialized: this is the way out).
``from_lightning``: a plain ``.ckpt`` -> a lightning_nvme checkpoint (file + ``.optim`` directory). Both
strategies also resume from plain checkpoints directly; this is for moving large state out of the file
ahead of time. The result resumes at any world size: each rank reads only the element ranges it owns.

    lightning-nvme convert to-lightning SRC.ckpt DST.ckpt    (or python -m lightning_nvme.checkpoint.convert ...)
    lightning-nvme convert from-lightning SRC.ckpt DST.ckpt
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch

from lightning_nvme.checkpoint import paired, weights
from lightning_nvme.checkpoint.load import open_checkpoint
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader, SafetensorsWriter
from lightning_nvme.checkpoint.state_files import (
    file_metadata,
    is_padding,
    open_readers,
    optimizer_file,
    parse_tensor_name,
    tensor_name,
)
from lightning_nvme.optim.formats.state_format import STATE_DICT_KEY, StateFormat, decode_entries


def to_lightning(src: str, dst_file: str) -> None:
    checkpoint, parts = open_checkpoint(src)
    if parts is not None and parts.problem is not None:
        raise RuntimeError(parts.problem)
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        marker = parts.markers[i] if parts is not None else None
        if marker is None or parts is None:
            continue
        readers = open_readers(parts.directory, marker, parts.save_id, parts.records, parts.source)
        fmt = StateFormat.from_dict(marker.get("state_format"))
        try:
            for reader in readers:  # one per rank that wrote a shard of a data-parallel save
                for name in reader.entries:
                    if not is_padding(name):
                        _gather(state["state"], reader, name, marker.get("shapes"), fmt)
        finally:
            for reader in readers:
                reader.close()
        _dequantize(state, marker.get("state_format"))
    weights.read_all(checkpoint)
    paired.save_plain(checkpoint, dst_file)


def _dequantize(state: dict, saved: dict | None) -> None:
    """State stored compressed (``state_format`` bf16/int8) -> torch-format fp32 values; the format and the
    bf16_sr step count stay recorded under ``STATE_DICT_KEY``."""
    if not saved:
        return
    fmt = StateFormat.from_dict(saved)
    if fmt.exact:  # nothing to decode or record: the plain checkpoint is torch's own format (as state_dict() gives)
        return
    for entries in state["state"].values():
        decode_entries(fmt, entries)
    state[STATE_DICT_KEY] = dict(saved)


def _gather(state: dict, reader: SafetensorsReader, name: str, shapes: list | None, fmt: StateFormat) -> None:
    """Put entry ``name`` into the torch-format ``state``: a whole tensor, or a range of one (then the
    full tensor, shaped like its parameter, is assembled from the ranges of all shards)."""
    index, key, start, stop = parse_tensor_name(name)
    entries = state.setdefault(index, {})
    if start is None:
        entries[key] = reader.read(name).view(reader.entries[name][1])
        return
    if key not in entries:
        if shapes is None:
            raise ValueError(f"{reader.path}: entry {name!r} holds a range of a parameter's state, but the checkpoint "
                             "records no parameter shapes to assemble it into; the checkpoint is incomplete")
        shape = tuple(shapes[index])
        per = fmt.elements_per_value(key)  # e.g. int8: one block scale per block of elements
        if per > 1:
            shape = (-(-math.prod(shape) // per),)
        entries[key] = torch.empty(shape, dtype=reader.entries[name][0])
    entries[key].view(-1)[start:stop] = reader.read(name)


def pop_state_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Take the per-element tensors out of a torch-format optimizer state dict, named as in the safetensors files;
    the scalar state (``step``) stays."""
    tensors = {}
    for index, entries in state["state"].items():
        for key in [k for k, v in entries.items() if torch.is_tensor(v) and v.dim() > 0]:
            tensors[tensor_name(index, key)] = entries.pop(key)
    return tensors


def write_tensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata)
    try:
        for name, t in tensors.items():
            writer.write(name, 0, t.reshape(-1))
    finally:
        writer.close()


def from_lightning(src_file: str, dst: str) -> None:
    checkpoint = torch.load(src_file, map_location="cpu", weights_only=False)
    checkpoint.setdefault("optimizer_states", [])

    def write_parts(directory: str, save_id: str) -> list[dict[str, Any]]:
        markers = []
        for i, state in enumerate(checkpoint["optimizer_states"]):
            write_tensors(os.path.join(directory, optimizer_file(i)), pop_state_tensors(state), file_metadata(save_id))
            markers.append({"file": optimizer_file(i)})
        return markers

    paired.save(checkpoint, dst, write_parts)


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
