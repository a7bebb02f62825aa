"""Checkpoints Lightning's loaders open: one file at the path the user gave, the optimizer state inside it.

Layout (format version 3)::

    last.ckpt    a torch zip (``torch.save``'s format, records aligned to 4 KiB) of Lightning's checkpoint dict
                 (weights, hyperparameters, loops, callbacks, LR schedulers...) without ``optimizer_states``; in
                 its place a ``lightning_nvme`` entry: the format version, the save id, each optimizer's param
                 groups and scalar state, and ``records``: each state file of the save as one ``uint8`` record,
                 optimizer-<i>.safetensors (one per rank: optimizer-<i>-rank<r>.safetensors) and, with
                 offload_params, weights.safetensors (block weights streamed beside the dict: ``weights``; the
                 state_dict refers to them). How the records are written and filled: ``onefile``.

Version 2 (still read): the same file without ``records``, the state files in ``last.ckpt.optim/<save id>/``.

Why a file: ``torch.load``, ``LightningModule.load_from_checkpoint`` and ``Trainer(strategy="auto")``'s
validate/test/predict open it as any Lightning checkpoint. Why no ``optimizer_states`` in it: a plain
``Trainer.fit(ckpt_path=...)`` must not restart Adam's moments silently; without the key Lightning
refuses to resume (``KeyError: Trying to restore optimizer state but checkpoint contains only the
model``). Why a save id: the file names the directory of the save that wrote it, and every optimizer file
carries the same id, so a file paired with another save's optimizer state is refused, not mixed.

Commit protocol (a kill -9 at any point leaves the old checkpoint or the new one, never a mix):

1. ``begin``: recover an interrupted commit (``atomic.recover``, ``sweep_orphans``), create the hidden temp
   directory ``last.ckpt.optim/.<id>.tmp-<pid>/``;
2. the state files (and the beside weights) are streamed, cloned or copied into it and fsynced (by every rank,
   when data parallel);
3. ``publish``: fsync that directory (nothing is renamed: the state goes into the file);
4. ``write_main``: the file goes to ``.last.ckpt.tmp-<pid>`` (``stage_main``: the state records reserved; then
   ``switch_main``: filled from the state files, by clones where the filesystem shares extents), fsync, then
   ``os.replace`` over ``last.ckpt`` (over a directory, e.g. another strategy's sharded checkpoint:
   ``RENAME_EXCHANGE``, see ``atomic.commit``): the one switching step;
5. ``finish``: delete ``last.ckpt.optim/`` (the temp state files, and the state of a version-2 save replaced).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_nvme.checkpoint import onefile, weights
from lightning_nvme.checkpoint.state_files import OptimizerParts
from lightning_nvme.fs import atomic

PAIRED_FORMAT_VERSION = 3  # of the checkpoint: one file, its state files as records inside it
BESIDE_FORMAT_VERSION = 2  # still read: the file, its state files beside it in ``<file>.optim/<save id>/``
REF_KEY = onefile.REF_KEY
PARTS_SUFFIX = ".optim"
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
NOTE = ("The optimizer state of this checkpoint is inside it (lightning_nvme.records). Resume with "
        "strategy='nvme_offload' (or 'nvme_offload_ddp'); for a plain checkpoint that any Trainer resumes from, "
        "run: python -m lightning_nvme.checkpoint.convert to-lightning {name} plain.ckpt")


def parts_root(path: str) -> str:
    return os.path.abspath(path) + PARTS_SUFFIX


@dataclass
class Pending:
    """A save in progress: the target file, this save's id and the temp directory its optimizer files go to."""

    path: str
    save_id: str
    tmp: str

    @property
    def final(self) -> str:
        return os.path.join(parts_root(self.path), self.save_id)


def sweep_orphans(path: str) -> None:
    """Drop debris of dead writers in ``path``'s directory: temp entries in ``.optim`` directories, and ``.optim``
    directories whose file is gone (a kill between a removal's two steps). Run by the writer only: a reader
    could take a concurrent writer's published, not yet referenced state for an orphan."""
    parent = os.path.dirname(path)
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        root = os.path.join(parent, entry)
        if not entry.endswith(PARTS_SUFFIX) or entry.startswith(".") or not os.path.isdir(root):
            continue
        atomic.sweep_dead_temps(root)
        if not os.listdir(root):  # a one-file save killed after its switch left only its temp state files
            os.rmdir(root)
            continue
        base = root[:-len(PARTS_SUFFIX)]
        orphan = not os.path.lexists(base) and not os.path.lexists(atomic.aside_name(base))
        if orphan and all(_SAVE_ID.match(e) for e in os.listdir(root)):  # a live writer's temp: not an orphan
            atomic.remove(root)


def begin(path: str) -> Pending:
    """Step 1 (rank 0): recover, then create the temp directory this save's optimizer files are written to."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic.recover(path)
    sweep_orphans(path)
    root = parts_root(path)
    os.makedirs(root, exist_ok=True)
    save_id = uuid.uuid4().hex
    tmp = os.path.join(root, f".{save_id}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    return Pending(path, save_id, tmp)


def publish(pending: Pending) -> None:
    """Step 3: the state files are complete (each writer fsynced its own); their directory entries too."""
    atomic.fsync_path(pending.tmp)


def reference(pending: Pending, optimizer_states: list[dict[str, Any]] | None, markers: list[dict[str, Any]]) -> dict:
    """The entry the main file carries instead of ``optimizer_states`` (``None``: a weights-only checkpoint)."""
    name = os.path.basename(pending.path)
    parts = os.path.join(name + PARTS_SUFFIX, pending.save_id)
    return {"format_version": PAIRED_FORMAT_VERSION, "save_id": pending.save_id, "parts_dir": parts,
            "optimizer_states": optimizer_states, "parts": markers, "note": NOTE.format(parts=parts, name=name)}


def stage_main(checkpoint: dict[str, Any], path: str, parts: str | None = None) -> onefile.Staged:
    """Step 4's first half: the file written under its hidden temp name (not yet visible as ``path``), with a
    reserved record for each state file in ``parts`` (the save's temp directory; ``None``: a file without state).
    A background save stages it at the save, when the weights are those of the saved instant; its state files
    have their final size then (filled later by the copy)."""
    tmp = atomic.temp_name(path)
    try:
        if parts is None:
            torch.save(checkpoint, tmp)
            return onefile.Staged(tmp, "")
        return onefile.stage(checkpoint, tmp, parts, REF_KEY)
    except BaseException:
        if os.path.lexists(tmp):
            atomic.delete(tmp)
        raise


def switch_main(staged: onefile.Staged, path: str) -> tuple[int, int]:
    """Step 4's second half: fill the staged file's state records, fsync it and switch it in (the one visible
    step). Returns the bytes (cloned, copied) into the records."""
    try:
        moved = onefile.fill(staged) if staged.records else (0, 0)
        atomic.commit(staged.tmp, path)
    except BaseException:
        if os.path.lexists(staged.tmp):
            atomic.delete(staged.tmp)
        raise
    return moved


def write_main(checkpoint: dict[str, Any], path: str, parts: str | None = None) -> tuple[int, int]:
    """Step 4: write the file (its state records from ``parts``) under a temp name, fsync, and switch it in."""
    return switch_main(stage_main(checkpoint, path, parts), path)


def finish(pending: Pending) -> None:
    """Step 5: delete the temp state files (now inside the file) and any state of a version-2 save replaced."""
    root = parts_root(pending.path)
    if os.path.isdir(root):
        atomic.remove(root)


def abort(pending: Pending) -> None:
    shutil.rmtree(pending.tmp, ignore_errors=True)
    if os.path.isdir(pending.final):
        atomic.remove(pending.final)
    root = parts_root(pending.path)
    if os.path.isdir(root) and not os.listdir(root):  # created by this save (a version-2 state stays)
        os.rmdir(root)


def save(checkpoint: dict[str, Any], path: str, write_parts: Callable[[str, str], list[dict[str, Any]]]) -> None:
    """The whole protocol in one process: ``write_parts(directory, save_id)`` streams the optimizer files (and
    beside weights) and returns their markers; ``checkpoint["optimizer_states"]`` (without per-element tensors)
    moves into the reference; references to beside weights in its state_dict are bound to this save."""
    checkpoint = dict(checkpoint)
    optimizer_states = checkpoint.pop("optimizer_states", None)
    pending = begin(path)
    try:
        weights.bind(checkpoint.get("state_dict") or {}, pending.path, pending.save_id)
        markers = write_parts(pending.tmp, pending.save_id)
        publish(pending)
        write_main({**checkpoint, REF_KEY: reference(pending, optimizer_states, markers)}, pending.path, pending.tmp)
    except BaseException:
        abort(pending)
        raise
    finish(pending)


@dataclass
class DirectPart:
    """A state file a save writes once, straight into its record of the one file: its name, its size, its marker
    (``None``: the beside weights, which have none), and ``write(fd, offset)``, which writes the file's bytes at
    ``offset`` of the open checkpoint file and fdatasyncs them."""

    name: str
    size: int
    marker: dict[str, Any] | None
    write: Callable[[int, int], None]


def save_direct(checkpoint: dict[str, Any], path: str, plan: Callable[[str], list[DirectPart]]) -> list[DirectPart]:
    """``save`` with each state file written once: ``plan(save_id)`` lists the save's state files with their sizes;
    their records are reserved in the file (the temp directory holds sparse placeholders of those sizes, which the
    zip writer maps and never reads), each is written into its record at its 4 KiB-aligned offset, then the file is
    fsynced and switched in with the one rename (steps 1, 3, 4, 5 as ``save``; a kill before the rename leaves the
    previous checkpoint and hidden temps the next save sweeps). Where the state files would not be clones of the
    store (no reflink), ``save`` writes them into the temp directory and then copies them into their records:
    twice the bytes."""
    checkpoint = dict(checkpoint)
    optimizer_states = checkpoint.pop("optimizer_states", None)
    pending = begin(path)
    staged: onefile.Staged | None = None
    try:
        weights.bind(checkpoint.get("state_dict") or {}, pending.path, pending.save_id)
        parts = plan(pending.save_id)
        for part in parts:
            fd = os.open(os.path.join(pending.tmp, part.name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, part.size)  # sparse: no byte written
            finally:
                os.close(fd)
        publish(pending)
        markers = [part.marker for part in parts if part.marker is not None]
        staged = stage_main({**checkpoint, REF_KEY: reference(pending, optimizer_states, markers)}, pending.path,
                            pending.tmp)
        fd = os.open(staged.tmp, os.O_WRONLY)
        try:
            for part in parts:
                part.write(fd, staged.records[part.name][0])
        finally:
            os.close(fd)
        atomic.commit(staged.tmp, pending.path)
    except BaseException:
        if staged is not None and os.path.lexists(staged.tmp):
            atomic.delete(staged.tmp)
        abort(pending)
        raise
    finish(pending)
    return parts


def save_plain(checkpoint: dict[str, Any], path: str) -> None:
    """A checkpoint without optimizer state (weights only), switched in atomically; the optimizer state of the
    checkpoint it replaces goes afterwards."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic.recover(path)
    write_main(checkpoint, path)
    if os.path.isdir(parts_root(path)):
        atomic.remove(parts_root(path))


def read(checkpoint: dict[str, Any], path: str) -> tuple[dict[str, Any], OptimizerParts | None]:
    """Split a loaded main file into Lightning's usual dict (``optimizer_states`` back in place, without the
    per-element tensors) and where its optimizer state is. A file of another origin passes through."""
    ref = checkpoint.pop(REF_KEY, None)
    if not isinstance(ref, dict) or "save_id" not in ref:
        if ref is not None:
            checkpoint[REF_KEY] = ref  # not ours: leave the user's key alone
        return checkpoint, None
    if ref.get("format_version") not in (PAIRED_FORMAT_VERSION, BESIDE_FORMAT_VERSION):
        raise ValueError(f"{path}: lightning_nvme checkpoint format version {ref.get('format_version')}; this "
                         f"lightning_nvme reads versions {BESIDE_FORMAT_VERSION} and {PAIRED_FORMAT_VERSION}")
    if ref["optimizer_states"] is not None:
        checkpoint["optimizer_states"] = ref["optimizer_states"]
    save_id = ref["save_id"]
    parts = OptimizerParts("", save_id, ref["parts"], source=str(path))
    records = onefile.records_of(ref)
    if records is not None:  # one file: the state is inside it, wherever it was copied or uploaded
        parts.records = records
        weights.resolve(checkpoint.get("state_dict") or {}, "", None, records)
        return checkpoint, parts
    if not isinstance(path, str) or "://" in path:
        parts.problem = (f"checkpoint {path} is remote; its optimizer state ({ref['parts_dir']}) is streamed beside "
                         "it on a local file system. Download the file and its .optim directory, or convert it: "
                         "python -m lightning_nvme.checkpoint.convert to-lightning")
        weights.resolve(checkpoint.get("state_dict") or {}, "", parts.problem)
        return checkpoint, parts
    own = os.path.join(parts_root(path), save_id)
    recorded = os.path.join(os.path.dirname(os.path.abspath(path)), ref["parts_dir"])
    parts.directory = next((d for d in (own, recorded) if os.path.isdir(d)), "")
    if not parts.directory:
        others = sorted(e for e in os.listdir(parts_root(path)) if _SAVE_ID.match(e)) \
            if os.path.isdir(parts_root(path)) else []
        found = (f"{parts_root(path)} holds the state of other saves ({', '.join(others)}): the file and that "
                 "directory come from different saves (copied separately?). Refusing to mix them."
                 if others else f"neither {own} nor {recorded} exists: copy the {PARTS_SUFFIX} directory along "
                 "with the file.")
        beside = weights.has_refs(checkpoint)
        parts.problem = (f"checkpoint {path} was saved with its optimizer state{' and weights' if beside else ''} "
                         f"streamed beside it (save id {save_id}), but {found} " + (
                             "Without it neither the weights nor the optimizer state can be loaded." if beside else
                             "Without it the optimizer cannot resume; the weights still load "
                             "(LightningModule.load_from_checkpoint, trainer.validate/test/predict)."))
    weights.resolve(checkpoint.get("state_dict") or {}, parts.directory, parts.problem)
    return checkpoint, parts


def remove(path: str) -> None:
    """Delete a checkpoint of either format: the file first (one atomic unlink), then its optimizer state. A kill
    in between leaves an orphaned ``.optim`` directory that the next save in the directory sweeps."""
    path = os.path.abspath(path)
    if os.path.islink(path):  # e.g. ModelCheckpoint(save_last="link"): the link only
        os.unlink(path)
        return
    atomic.remove(path)
    if os.path.isdir(parts_root(path)):
        atomic.remove(parts_root(path))
