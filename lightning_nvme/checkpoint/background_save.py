"""A background save: the paired checkpoint laid out at the save, its state copied afterwards (``background``).

At the save (the store fenced and fdatasynced by the caller): ``paired.begin``, each optimizer's state file created
with its header and its final size (the reflink snapshot's layout, ``snapshot.layout``: every reader of the streamed
format reads it), and the file Lightning opens written under its hidden temp name, with the weights of the saved
instant. Then the copy runs (``BackgroundCopy``) and its ``commit`` does the rest of the protocol: publish the state
directory, switch the file in, drop the state of the save it replaced. A kill before the switch leaves the previous
checkpoint and hidden temps that the next save (or load) sweeps, as for a streamed save.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from lightning_nvme.checkpoint import paired, snapshot, weights
from lightning_nvme.checkpoint.background import BackgroundCopy, Job, Target
from lightning_nvme.checkpoint.streamed import file_metadata, format_entry, optimizer_file
from lightning_nvme.constants import ALIGN
from lightning_nvme.fs import atomic
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.store import FlatStore

log = logging.getLogger(__name__)


def unsupported(store: FlatStore | None, checkpoint: dict[str, Any]) -> str:
    """Why this save cannot copy in the background ('' if it can): it then streams, saying so."""
    if store is None:
        return ("background copy: the store is reopened for this save only (no training runs now to overlap the "
                "copy with)")
    if len(store.paths) > 1:
        return "background copy: the store is striped over several files (store_dir lists several directories)"
    return ""


def _state_file(off: OffloadedOptimizer, directory: str, i: int, save_id: str) -> tuple[dict, list[Target]]:
    """Optimizer ``i``'s state file with its header and final size (the data to come); its marker and copy targets."""
    entries, regions = snapshot.layout(off)
    head = snapshot.header(entries, file_metadata(save_id), ALIGN)  # data page-aligned: the copy may use O_DIRECT
    path = os.path.join(directory, optimizer_file(i))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.ftruncate(fd, len(head) + (entries[-1].end if entries else 0))
    finally:
        os.close(fd)
    marker = {"file": optimizer_file(i), **format_entry(off), "shapes": [list(p.shape) for p in off.params]}
    return marker, [Target(name, path, len(head) + pos, n) for name, pos, n in regions]


def _weights_file(checkpoint: dict[str, Any], store: FlatStore, directory: str, save_id: str,
                  in_store: Callable[[Any], bool], read_source: weights.ReadSource) -> list[Target]:
    """The beside weights file (``offload_params``): block regions in the store are copy targets; blocks resident and
    changed since their last write-back are written now, from memory (they are the saved instant's values)."""
    entries, regions, written, end = snapshot.weights_layout(checkpoint["state_dict"], store, in_store)
    head = snapshot.header(entries, file_metadata(save_id), ALIGN)
    path = os.path.join(directory, weights.WEIGHTS_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.ftruncate(fd, len(head) + end)
        snapshot.write_values(fd, len(head), entries, written, read_source)
    finally:
        os.close(fd)
    return [Target(name, path, len(head) + pos, n) for name, pos, n in regions]


def start(store: FlatStore, checkpoint: dict[str, Any], path: str, optimizers: list[OffloadedOptimizer],
          buffer_bytes: int, record: snapshot.SaveRecord, in_store: Callable[[Any], bool] | None = None,
          read_source: weights.ReadSource | None = None, running: BackgroundCopy | None = None) -> BackgroundCopy:
    """Lay the checkpoint out and start its copy, or have ``running`` (a copy in flight, of other files) take it on;
    the caller has fenced the store durably (and issued the blocks' write-backs). ``in_store``/``read_source``: with
    beside weights, whether a block's values are in the store, and its values. Returns the copy that carries it.
    Raises (and leaves nothing behind) if the layout fails, or if ``running``, which it could not join, failed."""
    if running is None:
        return _start(store, checkpoint, path, optimizers, buffer_bytes, record, in_store, read_source, None)
    with running.reserve() as joins:  # no commit of ``running`` meets this save's directory work
        if not joins:
            running.report()  # it failed: this save is not started
        return _start(store, checkpoint, path, optimizers, buffer_bytes, record, in_store, read_source,
                      running if joins else None)


def _start(store: FlatStore, checkpoint: dict[str, Any], path: str, optimizers: list[OffloadedOptimizer],
           buffer_bytes: int, record: snapshot.SaveRecord, in_store: Callable[[Any], bool] | None,
           read_source: weights.ReadSource | None, joining: BackgroundCopy | None) -> BackgroundCopy:
    checkpoint = dict(checkpoint)
    optimizer_states = checkpoint.pop("optimizer_states", None)
    pending = paired.begin(path)
    staged: list[paired.onefile.Staged] = []
    switched: list[bool] = []

    def abort() -> None:
        if switched:  # committed: only the sweep of the replaced save failed, the checkpoint stands
            return
        paired.abort(pending)
        for st in staged:
            if os.path.lexists(st.tmp):
                atomic.delete(st.tmp)

    try:
        weights.bind(checkpoint.get("state_dict") or {}, pending.path, pending.save_id)
        markers, targets = [], []
        for i, off in enumerate(optimizers if optimizer_states is not None else []):
            marker, file_targets = _state_file(off, pending.tmp, i, pending.save_id)
            markers.append(marker)
            targets += file_targets
        if weights.has_refs(checkpoint):
            assert in_store is not None and read_source is not None, "beside weights need their blocks' residency"
            targets += _weights_file(checkpoint, store, pending.tmp, pending.save_id, in_store, read_source)
        ref = paired.reference(pending, optimizer_states, markers)
        staged.append(paired.stage_main({**checkpoint, paired.REF_KEY: ref}, pending.path, pending.tmp))
        record.files = sorted(os.listdir(pending.tmp))
        record.bytes_written = sum(os.path.getsize(os.path.join(pending.tmp, f)) for f in record.files)
        record.reason = f"{len(targets)} regions copied after the save returns, through a {buffer_bytes}-byte buffer"

        def commit() -> None:
            paired.publish(pending)
            paired.switch_main(staged[0], pending.path)
            switched.append(True)
            paired.finish(pending)
            log.info("checkpoint %s: background copy committed (%d regions; %d bytes copied so far by its copy, %d "
                     "regions before a training write)", pending.path, len(targets), copy.bytes_copied,
                     len(copy.copied_by_barrier))

        job = Job(pending.path, {t.region: t for t in targets}, commit, abort)
        if joining is not None:
            record.reason += f", joined to the copy in flight of {joining.path}"
            copy = joining
            copy.join(job)
        else:
            copy = BackgroundCopy(store, buffer_bytes)
            copy.start(job)
    except BaseException:
        abort()
        raise
    return copy
