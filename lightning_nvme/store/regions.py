"""``RegionTable``: a store's regions as they are on disk: appended all or nothing, their blocks allocated in every
file they map to, the layout recorded in each file's header and the manifest.

Why apart from ``FlatStore``: which regions exist and which disk blocks back them is one protocol, the one a reopen
checks (``manifest.read_layout``) and the one that refuses early, naming the file, when a disk is short; the
store's request path only looks regions up. With several files (``stripes.py``) a region's blocks are spread over
them, and ``extents`` says where each piece lies for whoever addresses the files directly.
"""

from __future__ import annotations

from typing import Any

from lightning_nvme.fs import atomic
from lightning_nvme.store import manifest
from lightning_nvme.store.file_io import StoreFile
from lightning_nvme.store.layout import HEADER_BYTES, Layout, Region
from lightning_nvme.store.stripes import StripeMap


class RegionTable:
    """The regions of the store over ``files``: read from the manifest ``recorded`` at a reopen, else a new layout
    holding only the header block (allocated and persisted at once)."""

    def __init__(self, files: list[StoreFile], stripe_map: StripeMap, manifest_path: str, stripes: dict | None,
                 recorded: dict[str, Any] | None, min_free_bytes: int) -> None:
        self.files, self.stripe_map, self.manifest_path = files, stripe_map, manifest_path
        self.stripes = stripes  # the stripe set recorded in the manifest and headers (None: one file)
        self.min_free_bytes = min_free_bytes
        self.unsynced = False  # the last written manifest is not fsynced yet
        if recorded is not None:
            self.layout = manifest.read_layout(files, recorded, manifest_path, stripe_map)
        else:
            self.layout = Layout()
            self._allocate(0, HEADER_BYTES)
            self.persist()

    def persist(self, *, sync: bool = True) -> None:
        """Write the header blocks and the manifest (fsync'ed when ``sync``). ``add`` writes without fsync (one per
        call made many small regions slow, docs/store.md) but at once, before a disk that fills up later could
        refuse it; ``sync`` (the store's ``fence(durable=True)`` and ``close``) makes it durable."""
        manifest.write_layout(self.files, self.layout, self.manifest_path, sync=sync, stripes=self.stripes)
        self.unsynced = not sync

    def sync(self) -> None:
        """Make the last written manifest durable (no new blocks needed: works on a full disk)."""
        if self.unsynced:
            atomic.fsync_path(self.manifest_path)
            self.unsynced = False

    def _allocate(self, start: int, nbytes: int) -> None:
        """Reserve disk blocks for logical [start, start+nbytes) in every file it maps to."""
        for i, file in enumerate(self.files):
            old = self.stripe_map.file_size(i, start) if start else 0
            new = self.stripe_map.file_size(i, start + nbytes)
            if new > old:
                file.allocate(old, new - old, self.min_free_bytes)

    def add(self, specs: list[tuple[str, int]]) -> list[Region]:
        """Append regions ``(name, nbytes)`` and allocate their blocks in one go. All or nothing: if any spec is
        invalid or a disk is short, the layout is left as it was."""
        start = self.layout.end
        regions: list[Region] = []
        try:
            for n, b in specs:
                regions.append(self.layout.add(n, b))
            if self.layout.end > start:
                self._allocate(start, self.layout.end - start)
        except BaseException:
            for r in regions:
                del self.layout.regions[r.name]
            self.layout.end = start
            raise
        self.persist(sync=False)
        return regions

    def extents(self, name: str) -> list[tuple[str, int, int, int]]:
        """Where region ``name``'s bytes (its whole capacity) are on disk: ``(file path, file offset, offset in
        region, length)`` pieces, one per stripe unit (one unstriped)."""
        r = self.layout[name]
        return [(self.files[i].path, file_off, a, n) for i, a, file_off, n in
                self.stripe_map.pieces(r.offset, r.capacity, max(r.capacity, 1))]
