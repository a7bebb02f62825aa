"""Opening a store's files: the stripe set checked, each file locked before it is opened (and truncated).

Why apart from ``FlatStore``: what may be opened, in which order, and what is released when a reopen is
refused, is one protocol; the store's logic starts from files it owns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lightning_nvme.store import manifest
from lightning_nvme.store.errors import StoreFormatError
from lightning_nvme.store.file_io import StoreFile
from lightning_nvme.store.lock import StoreLock
from lightning_nvme.store.stripes import StripeMap, check_stripe_set, find_manifest, new_stripe_set


@dataclass
class OpenedFiles:
    locks: list[StoreLock]
    files: list[StoreFile]
    stripes: dict | None  # the stripe set recorded in the manifest (None: one directory)
    stripe_map: StripeMap
    manifest_path: str
    recorded: dict[str, Any] | None  # the manifest read at reopen (None: a new store)

    def release(self) -> None:
        for file in self.files:
            file.close()  # a refused reopen must not leak descriptors
        for lock in self.locks:
            lock.release()


def open_files(directories: list[str], base: str, *, reopen: bool, direct: bool | None,
               stripe_bytes: int) -> OpenedFiles:
    """Lock and open ``<dir>/<base>.bin`` in every directory; on reopen, check them against the manifest's stripe
    set first. Whatever was taken is released again if anything fails."""
    paths = [os.path.join(d, base + ".bin") for d in directories]
    opened = OpenedFiles([], [], new_stripe_set(directories, stripe_bytes), StripeMap(1, stripe_bytes),
                         os.path.join(directories[0], base + ".json"), None)
    try:
        missing = [p for p in paths if reopen and not os.path.exists(p)]
        if missing:
            raise StoreFormatError(f"cannot reopen store {missing[0]}: the file does not exist (directory "
                                   f"{os.path.dirname(missing[0])})")
        if reopen:
            opened.manifest_path = find_manifest(directories, base)
            opened.recorded = manifest.read_manifest(opened.manifest_path)
            opened.stripes = opened.recorded.get("stripes")
            check_stripe_set(opened.stripes, directories, opened.manifest_path)
        opened.stripe_map = StripeMap(len(paths), opened.stripes["bytes"] if opened.stripes else stripe_bytes)
        for path in paths:
            opened.locks.append(StoreLock(path + ".lock"))
            opened.locks[-1].acquire()
            opened.files.append(StoreFile(path, reopen=reopen, direct=direct))
    except BaseException:
        opened.release()
        raise
    return opened
