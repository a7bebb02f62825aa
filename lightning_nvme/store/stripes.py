"""Striping: a store's logical bytes laid out round-robin over one file per directory (one per disk).

Why: one large request then runs on every disk at once, so the store's bandwidth is the sum of the
disks', without RAID0 (which needs root and a spare array). The logical address space is the one the
layout (``layout.py``) hands out; ``StripeMap`` says where each logical byte lives.

Mapping with ``n`` files and stripe unit ``S``: every file keeps its own header block (bytes
``[0, HEADER_BYTES)``); logical byte ``L >= HEADER_BYTES`` is in unit ``k = (L - HEADER_BYTES) // S``,
stored in file ``k % n`` at offset ``HEADER_BYTES + (k // n) * S + (L - HEADER_BYTES) % S``. With one
file this is the identity, so a single-directory store is byte-identical to an unstriped one.

The stripe set (count, unit, a random id, the directories) is recorded in the manifest and each file's
header; a reopen whose directories differ (one missing, swapped for another store's, reordered) is
refused naming the directory (``check_stripe_set``).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

from lightning_nvme.constants import ALIGN, MiB
from lightning_nvme.store.errors import StoreFormatError
from lightning_nvme.store.layout import HEADER_BYTES

# Default stripe unit: the store's default request size (8 MiB), so striping splits no request below what a
# single disk gets; a 32 MiB optimizer chunk still spans 4 disks.
STRIPE_BYTES = 8 * MiB


@dataclass(frozen=True)
class StripeMap:
    """Where the logical bytes of a store live: ``count`` files, ``stripe_bytes`` per unit."""

    count: int = 1
    stripe_bytes: int = STRIPE_BYTES

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a store needs at least one directory, got {self.count}")
        if self.stripe_bytes <= 0 or self.stripe_bytes % ALIGN:
            raise ValueError(f"stripe_bytes must be a positive multiple of {ALIGN}, got {self.stripe_bytes}")

    def pieces(self, start: int, nbytes: int, chunk: int) -> list[tuple[int, int, int, int]]:
        """Disk requests for logical ``[start, start + nbytes)``: ``(file, request offset, file offset,
        length)``, none longer than ``chunk`` nor crossing a stripe unit. One file: chunks counted from
        ``start`` (the unstriped store's requests); several: cut on the stripe grid, so only a request's
        first and last pieces are short."""
        if self.count == 1:
            return [(0, a, start + a, min(chunk, nbytes - a)) for a in range(0, nbytes, chunk)]
        out = []
        pos, end = start, start + nbytes
        while pos < end:
            unit, within = divmod(pos - HEADER_BYTES, self.stripe_bytes)
            n = min(end - pos, self.stripe_bytes - within, chunk)
            file_off = HEADER_BYTES + (unit // self.count) * self.stripe_bytes + within
            out.append((unit % self.count, pos - start, file_off, n))
            pos += n
        return out

    def file_size(self, index: int, end: int) -> int:
        """Bytes file ``index`` needs to hold logical ``[0, end)`` (its header included)."""
        if self.count == 1:
            return end
        units, rest = divmod(max(0, end - HEADER_BYTES), self.stripe_bytes)
        mine = units // self.count + (1 if index < units % self.count else 0)
        return HEADER_BYTES + mine * self.stripe_bytes + (rest if index == units % self.count else 0)


def new_stripe_set(directories: list[str], stripe_bytes: int) -> dict | None:
    """The manifest's record of a new store's stripe set; ``None`` for one directory (the unstriped format)."""
    if len(directories) == 1:
        return None
    return {"count": len(directories), "bytes": stripe_bytes, "id": uuid.uuid4().hex, "dirs": list(directories)}


def header_stripe(stripes: dict | None, index: int) -> dict | None:
    """What file ``index``'s header records of the stripe set: its place in it and the set's id."""
    return None if stripes is None else {"index": index, "count": stripes["count"], "id": stripes["id"]}


def find_manifest(directories: list[str], base: str) -> str:
    """The manifest of the store ``base``: in the first directory; if it is not there but in another listed
    one, the directories were reordered, which is refused naming the order the store was created with."""
    first = os.path.join(directories[0], base + ".json")
    if os.path.exists(first):
        return first
    for d in directories[1:]:
        other = os.path.join(d, base + ".json")
        if os.path.exists(other):
            created = _created_order(other)
            raise StoreFormatError(
                f"store {base}: its manifest is in {d}, not in the first directory {directories[0]}: the stripe "
                f"directories are listed in another order than the store was created with ({created}). List them "
                f"in that order (store_dir).")
    return first  # missing: the caller's reopen check reports it


def _created_order(manifest_path: str) -> str:
    try:
        with open(manifest_path) as f:
            return str(json.load(f).get("stripes", {}).get("dirs", "?"))
    except (OSError, ValueError, AttributeError):
        return "unreadable manifest"


def check_stripe_set(stripes: dict | None, directories: list[str], manifest_path: str) -> None:
    """Refuse a reopen whose directories are not the stripe set the store was created with."""
    recorded = [os.path.dirname(manifest_path)] if stripes is None else list(stripes.get("dirs", []))
    if stripes is not None and (not isinstance(stripes.get("count"), int) or len(recorded) != stripes["count"]):
        raise StoreFormatError(f"{manifest_path}: the manifest's stripe set is malformed ({stripes!r})")
    missing = [d for d in recorded if d not in directories]
    extra = [d for d in directories if d not in recorded]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"directory {', '.join(missing)} of its stripe set is not listed")
        if extra:
            parts.append(f"directory {', '.join(extra)} is not part of it")
        raise StoreFormatError(
            f"store {manifest_path} was created over {len(recorded)} director{'y' if len(recorded) == 1 else 'ies'} "
            f"{recorded}, but this run lists {directories}: {'; '.join(parts)}. A striped store can only be "
            f"reopened over the same directories in the same order (store_dir).")
    for i, (given, want) in enumerate(zip(directories, recorded)):
        if given != want:
            raise StoreFormatError(
                f"store {manifest_path}: directory {given} is listed at position {i + 1}, but it holds stripe "
                f"{recorded.index(given) + 1} of {len(recorded)}; the store was created over {recorded}. List the "
                f"directories in that order (store_dir).")


def check_header_stripe(found: object, stripes: dict | None, index: int, path: str) -> None:
    """Refuse a stripe file whose header belongs to another place in the set, or to another store."""
    want = header_stripe(stripes, index)
    if found == want:
        return
    if isinstance(found, dict) and stripes is not None and found.get("id") != stripes["id"]:
        raise StoreFormatError(f"{path} belongs to another striped store (stripe set {found.get('id')}, expected "
                               f"{stripes['id']}): directory {os.path.dirname(path)} was swapped for another "
                               f"store's. Point store_dir at the directories the store was created over.")
    raise StoreFormatError(f"{path}: its header records stripe {found!r}, but it is stripe {want!r} of this store "
                           f"(directory {os.path.dirname(path)}); the file was replaced or tampered with.")
