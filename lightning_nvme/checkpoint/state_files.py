"""The optimizer state files of a checkpoint (safetensors), and reading them back chunk by chunk into the store.

One file per optimizer (``optimizer-<i>.safetensors``; a data-parallel rank writes
``optimizer-<i>-rank<r>.safetensors``, see ``rank_shards``), one tensor per parameter:
``state.<param index>.<key>`` shaped like the parameter (``master_param`` = fp32 master weights), or
``state.<param index>.<key>[<start>:<stop>]`` for an element range a rank owned. The tensors are what the
store holds: with a compressed ``state_format`` bf16 values, or int8/uint8 codes plus
``state.<param index>.<key>.absmax`` (one fp32 per block of ``BLOCK`` elements; its ranges count blocks);
the marker records the format (``format_entry``) and a resume in another format is refused
(``check_format``). How a save writes them is its copy mode (``copy/``: streamed, reflink, background);
loading streams back chunk by chunk, restoring moments, step counts and master weights exactly. Where the
files live and how they are tied to the checkpoint file is ``paired``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.optim.formats.state_format import StateFormat, StateFormatError

MARKER = "lightning_nvme"
PARTS_VERSION = "1"  # of the safetensors layout (names, metadata); unchanged since the directory format


def optimizer_file(i: int) -> str:
    return f"optimizer-{i}.safetensors"


def file_metadata(save_id: str | None, **extra: str) -> dict[str, str]:
    meta = {"format": MARKER, "format_version": PARTS_VERSION, **extra}
    if save_id is not None:
        meta["save_id"] = save_id
    return meta


def tensor_name(index: int, key: str, start: int | None = None, stop: int | None = None) -> str:
    """``state.<index>.<key>`` (whole parameter) or ``state.<index>.<key>[<start>:<stop>]`` (an element range
    of it, as written by a data-parallel rank for the ranges it owns)."""
    return f"state.{index}.{key}" if start is None else f"state.{index}.{key}[{start}:{stop}]"


PAD_PREFIX = "pad."  # entries that only fill bytes between state (a reflink snapshot's layout, see ``copy.reflink``)


def is_padding(name: str) -> bool:
    return name.startswith(PAD_PREFIX)


_NAME = re.compile(r"^state\.(\d+)\.(.+?)(?:\[(\d+):(\d+)\])?$")


def parse_tensor_name(name: str) -> tuple[int, str, int | None, int | None]:
    """``(param index, key, start, stop)``; start/stop are None for a whole-parameter entry."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"not a lightning_nvme state tensor name: {name!r}")
    index, key, start, stop = m.groups()
    return int(index), key, None if start is None else int(start), None if stop is None else int(stop)


def optimizer_placeholder(off: OffloadedOptimizer) -> dict[str, Any]:
    """Torch-format optimizer state without the per-element tensors (they are streamed separately)."""
    groups, start = [], 0
    for g in off.optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return {"state": off.scalar_state(), "param_groups": groups}


def format_entry(off: OffloadedOptimizer) -> dict[str, Any]:
    """The marker's record of how the state files store the state (and the bf16_sr step count)."""
    return {"state_format": {**off.fmt.to_dict(), "steps": off.steps_done}}


def check_format(off: OffloadedOptimizer, marker: Mapping[str, Any], path: str) -> None:
    """Refuse to resume from state stored in another format than this run's, naming both and the way out."""
    saved = marker.get("state_format") or {}
    stored = StateFormat.from_dict(saved)
    if (stored.state, stored.master) != (off.fmt.state, off.fmt.master):
        raise StateFormatError(
            f"checkpoint {path} stores optimizer state with {stored.describe()}, but this run uses "
            f"{off.fmt.describe()}. Resume with the checkpoint's settings, or convert it: "
            f"`python -m lightning_nvme.checkpoint.convert to-lightning {path} plain.ckpt` (dequantizes) and "
            "resume from plain.ckpt, whose state is stored in this run's format on load")
    off.steps_done = int(saved.get("steps", 0))


@dataclass
class OptimizerParts:
    """Where the streamed state of a loaded checkpoint is: its directory, the id of the save that wrote it
    (``None``: none recorded) and, per optimizer, the marker naming its file(s)."""

    directory: str
    save_id: str | None
    markers: list[dict[str, Any] | None]
    problem: str | None = None  # why the state cannot be read (missing, another save's, remote)
    source: str = ""  # the checkpoint file as the user named it
    records: dict[str, torch.Tensor] | None = None  # one-file checkpoint: state file name -> its record


class _FileSource:
    """Per-element state read range by range from one or more safetensors files (one per rank that wrote a
    shard; a range may span entries of several files when the world size changed since the save)."""

    def __init__(self, readers: Sequence[SafetensorsReader], state: Mapping[int, Mapping[str, Any]]) -> None:
        self.state = state
        self.entries: dict[tuple[int, str], list[tuple[int, int, SafetensorsReader, str]]] = {}
        for reader in readers:
            for name, (_, shape, _) in reader.entries.items():
                if is_padding(name):
                    continue
                index, key, start, stop = parse_tensor_name(name)
                if start is None or stop is None:  # a whole-parameter entry
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


def marker_files(marker: Mapping[str, Any]) -> list[str]:
    return list(marker["files"]) if "files" in marker else [marker["file"]]  # "files": one shard per rank


def open_readers(directory: str, marker: Mapping[str, Any], save_id: str | None,
                 records: Mapping[str, torch.Tensor] | None = None, source: str = "") -> list[SafetensorsReader]:
    """Readers of the files of one optimizer (in ``directory``, or ``records`` of a one-file checkpoint
    ``source``), each checked to belong to the save ``save_id``."""
    readers: list[SafetensorsReader] = []
    try:
        for name in marker_files(marker):
            if records is not None:
                if name not in records:
                    raise FileNotFoundError(f"checkpoint {source} holds no record of its optimizer state file {name}: "
                                            "the checkpoint is damaged")
                readers.append(SafetensorsReader(f"{source}:{name}", records[name]))
                found = readers[-1].metadata.get("save_id")
                if save_id is not None and found != save_id:
                    raise ValueError(f"{source}: its record {name} was written by save {found}, not {save_id}")
                continue
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"optimizer state file {path} is missing: the checkpoint is incomplete")
            readers.append(SafetensorsReader(path))
            found = readers[-1].metadata.get("save_id")
            if save_id is not None and found != save_id:
                raise ValueError(f"optimizer state file {path} was written by save {found}, but the checkpoint file "
                                 f"refers to save {save_id}: the file and its optimizer state come from different "
                                 "saves (copied separately?). Refusing to mix them.")
    except BaseException:
        for r in readers:
            r.close()
        raise
    return readers


def restore_optimizer(off: OffloadedOptimizer, state: Mapping[str, Any], marker: Mapping[str, Any] | None,
                      parts: OptimizerParts | None) -> None:
    """Restore one optimizer: from its streamed files (``marker``), or from a plain torch-format state dict."""
    if marker is None:
        _check_planned(off, {i for i, s in state["state"].items()
                             if any(torch.is_tensor(v) and v.dim() > 0 for v in s.values())})
        off.load_state_dict(dict(state))
        return
    assert parts is not None
    if parts.problem is not None:
        raise RuntimeError(parts.problem)
    check_format(off, marker, parts.source or parts.directory)
    off.set_param_groups(state["param_groups"])
    readers = open_readers(parts.directory, marker, parts.save_id, parts.records, parts.source)
    try:
        source = _FileSource(readers, state["state"])
        _check_planned(off, {index for index, _ in source.entries})
        off.import_state(source, stored=not off.fmt.exact)
    finally:
        for reader in readers:
            reader.close()


def _check_planned(off: OffloadedOptimizer, with_state: set[int]) -> None:
    """Refuse to drop saved moments: every parameter the checkpoint holds per-element state for must be one this
    optimizer updates now (single process; a data-parallel rank plans only the ranges it owns)."""
    if off.owned is not None:
        return
    dropped = sorted(with_state - off.planned_indices())
    if dropped:
        raise ValueError(f"the checkpoint holds optimizer state of parameters {dropped} of "
                         f"{type(off.optimizer).__name__}, but they are not trainable in this run's optimizer at "
                         "restore time (frozen, e.g. by BackboneFinetuning before it unfreezes them), so their "
                         "moments would silently restart. Resume with the same parameters trainable as when the "
                         "checkpoint was saved, or convert it and resume with strategy='auto': "
                         "python -m lightning_nvme.checkpoint.convert to-lightning")
