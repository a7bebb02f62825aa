"""Streamed checkpoints of offloaded optimizers: a directory instead of one pickled file.

Layout of ``<name>.ckpt/``::

    checkpoint.pt              Lightning's checkpoint dict; each entry of ``optimizer_states`` holds the
                               param groups and scalar state (``step``) in torch's format, plus a
                               ``lightning_nvme`` marker naming the file with the per-element state
    optimizer-<i>.safetensors  per-element state of optimizer i: ``state.<param index>.<key>``, shaped
                               like the parameter (``master_param`` = fp32 master weights), as the store
                               holds it: with a compressed ``state_format`` bf16 values, or int8/uint8
                               codes plus ``state.<param index>.<key>.absmax`` (one fp32 per block)

Saving streams chunk by chunk from the store (memory bounded by the optimizer's ring buffers);
loading streams back the same way, restoring moments, step counts and master weights exactly.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Mapping, Sequence

import torch

from lightning_nvme.checkpoint.atomic import begin_dir, commit_dir, fsync_path, recover, temp_name
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader, SafetensorsWriter
from lightning_nvme.optim import OffloadedOptimizer, Piece
from lightning_nvme.optim.state_format import StateFormat, StateFormatError

FORMAT_VERSION = 1
MARKER = "lightning_nvme"
META_FILE = "checkpoint.pt"


def optimizer_file(i: int) -> str:
    return f"optimizer-{i}.safetensors"


def tensor_name(index: int, key: str, start: int | None = None, stop: int | None = None) -> str:
    """``state.<index>.<key>`` (whole parameter) or ``state.<index>.<key>[<start>:<stop>]`` (an element range
    of it, as written by a data-parallel rank for the ranges it owns)."""
    return f"state.{index}.{key}" if start is None else f"state.{index}.{key}[{start}:{stop}]"


_NAME = re.compile(r"^state\.(\d+)\.(.+?)(?:\[(\d+):(\d+)\])?$")


def parse_tensor_name(name: str) -> tuple[int, str, int | None, int | None]:
    """``(param index, key, start, stop)``; start/stop are None for a whole-parameter entry."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"not a lightning_nvme state tensor name: {name!r}")
    index, key, start, stop = m.groups()
    return int(index), key, None if start is None else int(start), None if stop is None else int(stop)


def is_streamed(path: Any) -> bool:
    return os.path.isdir(os.fspath(path)) and os.path.isfile(os.path.join(os.fspath(path), META_FILE))


def optimizer_placeholder(off: OffloadedOptimizer, index: int) -> dict[str, Any]:
    """Torch-format optimizer state without the per-element tensors (they are streamed separately)."""
    opt = off.optimizer
    groups, start = [], 0
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    scalars = {i: dict(off.scalars[(i, pieces[0][1].start)]) for i, pieces in off.pieces_of.items()
               if (i, pieces[0][1].start) in off.scalars}
    return {"state": scalars, "param_groups": groups,
            MARKER: {"format_version": FORMAT_VERSION, "file": optimizer_file(index), **format_entry(off)}}


def format_entry(off: OffloadedOptimizer) -> dict[str, Any]:
    """The marker's record of how the state files store the state (and the bf16_sr step count)."""
    return {"state_format": {**off.fmt.to_dict(), "steps": off.steps_done}}


def check_format(off: OffloadedOptimizer, marker: Mapping[str, Any], path: str) -> None:
    """Refuse to resume from state stored in another format than this run's, naming both and the way out."""
    saved = marker.get("state_format") or {}
    stored = StateFormat(saved.get("state_format", "exact"), saved.get("master_format", "fp32"))
    if (stored.state, stored.master) != (off.fmt.state, off.fmt.master):
        raise StateFormatError(
            f"checkpoint {path} stores optimizer state with {stored.describe()}, but this run uses "
            f"{off.fmt.describe()}. Resume with the checkpoint's settings, or convert it: "
            f"`python -m lightning_nvme.checkpoint.convert to-lightning {path} plain.ckpt` (dequantizes) and "
            "resume from plain.ckpt, whose state is stored in this run's format on load")
    off.steps_done = int(saved.get("steps", 0))


class _FileSink:
    def __init__(self, writer: SafetensorsWriter) -> None:
        self.writer = writer

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None:
        self.writer.write(tensor_name(piece.index, key), piece.start // per, values)


def _write_optimizer(off: OffloadedOptimizer, path: str) -> None:
    entries = []
    for index, pieces in sorted(off.pieces_of.items()):
        first = pieces[0][1]
        if (index, first.start) in off.scalars:
            entries += [(tensor_name(index, c.name), c.dtype,
                         tuple(first.param.shape) if c.per == 1 else (c.count(first.param.numel()),))
                        for c in first.stored()]
    writer = SafetensorsWriter(path, entries, {"format": MARKER, "format_version": str(FORMAT_VERSION)})
    try:
        off.export_state(_FileSink(writer))
    finally:
        writer.close()


def save_streamed(checkpoint: dict[str, Any], path: str, offloaded: list[OffloadedOptimizer]) -> None:
    """Write ``checkpoint`` and the offloaded state under a temp name, fsync, then commit atomically."""
    path = os.path.abspath(path)
    tmp = begin_dir(path, temp_name(path))
    try:
        for i, off in enumerate(offloaded):
            _write_optimizer(off, os.path.join(tmp, optimizer_file(i)))
        meta = os.path.join(tmp, META_FILE)
        torch.save(checkpoint, meta)
        fsync_path(meta)
        commit_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_streamed(path: str, recover_first: bool = True) -> dict[str, Any]:
    """Lightning's checkpoint dict of a streamed directory. ``recover_first=False`` for every rank but one
    of a data-parallel job (recovery renames and deletes; one process does it, then the others read)."""
    path = os.path.abspath(path)
    if recover_first:
        recover(path)
    checkpoint = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=False)
    checkpoint.setdefault("_lightning_nvme", {})["dir"] = path
    return checkpoint


def remove_streamed(path: str) -> None:
    """Delete a checkpoint directory as one step: rename it to a hidden temp name, then delete that.
    A crash mid-delete leaves no half-deleted checkpoint under its name, only a hidden temp that
    ``recover`` drops later."""
    path = os.path.abspath(path)
    if os.path.islink(path):  # e.g. ModelCheckpoint(save_last="link")
        os.unlink(path)
        return
    if not os.path.exists(path):
        return
    doomed = temp_name(path)
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    fsync_path(os.path.dirname(path))
    shutil.rmtree(doomed, ignore_errors=True)


class _FileSource:
    """Per-element state read range by range from one or more safetensors files (one per rank that wrote a
    shard; a range may span entries of several files when the world size changed since the save)."""

    def __init__(self, readers: Sequence[SafetensorsReader], state: Mapping[int, Mapping[str, Any]]) -> None:
        self.state = state
        self.entries: dict[tuple[int, str], list[tuple[int, int, SafetensorsReader, str]]] = {}
        for reader in readers:
            for name, (_, shape, _) in reader.entries.items():
                index, key, start, stop = parse_tensor_name(name)
                if start is None:
                    start, stop = 0, int(torch.Size(shape).numel())
                self.entries.setdefault((index, key), []).append((start, stop, reader, name))
        for spans in self.entries.values():
            spans.sort(key=lambda e: e[0])

    def tensor(self, index: int, key: str, start: int, stop: int) -> torch.Tensor | None:
        spans = self.entries.get((index, key))
        if spans is None:
            value = self.state.get(index, {}).get(key)
            return value.reshape(-1)[start:stop] if torch.is_tensor(value) else None
        parts, pos = [], start
        for lo, hi, reader, name in spans:
            if hi <= pos or lo >= stop:
                continue
            if lo > pos:
                break
            end = min(hi, stop)
            parts.append(reader.read(name, pos - lo, end - lo))
            pos = end
        if pos < stop and stop > start:
            raise ValueError(f"checkpoint holds {key} of parameter {index} only partly: elements [{pos}, {stop}) "
                             f"are in none of {sorted({r.path for _, _, r, _ in spans})}")
        return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0)

    def scalars(self, index: int, tensor_keys: set[str]) -> dict[str, Any]:
        return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.state.get(index, {}).items()
                if k not in tensor_keys}


def restore_optimizer(off: OffloadedOptimizer, state: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> None:
    """Restore one optimizer from a streamed entry, or from a plain Lightning checkpoint's state dict."""
    marker = state.get(MARKER)
    if marker is None:
        off.load_state_dict(dict(state))
        return
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint optimizer state has format version {marker.get('format_version')}, "
                         f"this lightning_nvme reads version {FORMAT_VERSION}")
    directory = checkpoint.get("_lightning_nvme", {}).get("dir")
    if directory is None:
        raise ValueError("this optimizer state refers to a streamed checkpoint directory, but the checkpoint was "
                         "not loaded from one; load it with NVMeOffloadStrategy or convert it first "
                         "(python -m lightning_nvme.checkpoint.convert)")
    check_format(off, marker, directory)
    off.set_param_groups(state["param_groups"])
    files = marker["files"] if "files" in marker else [marker["file"]]  # "files": one shard per rank
    readers = [SafetensorsReader(os.path.join(directory, f)) for f in files]
    try:
        off.import_state(_FileSource(readers, state["state"]), stored=not off.fmt.exact)
    finally:
        for reader in readers:
            reader.close()
