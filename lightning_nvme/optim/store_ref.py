"""``StoreRef``: how to reopen the store file an offloaded optimizer's state lives in.

Why: the strategy closes its store at teardown (threads, lock, file handle), but
``trainer.save_checkpoint`` and ``optimizer.state_dict()`` still work after ``fit``, and a copied or
unpickled strategy holds no open store at all. A ref is plain data (picklable) and checks, when
``owner`` is set, that the file still holds this run's state: another run may have reused the file
since (same ``store_dir``), and reading its state as ours would be silently wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_nvme.store import FlatStore, StoreFormatError


@dataclass(frozen=True)
class StoreRef:
    directory: str | tuple[str, ...]  # one, or a striped store's directories in order
    name: str  # file base name: ``<directory>/<name>.bin`` (the first directory's, when striped)
    io_chunk_bytes: int
    owner: str | None = None  # a region only this run's store has

    @classmethod
    def of(cls, store: FlatStore, owner: str | None = None) -> StoreRef:
        where = store.directory if len(store.directories) == 1 else tuple(store.directories)
        return cls(where, os.path.basename(store.path)[:-len(".bin")], store.io_chunk_bytes, owner)

    @property
    def path(self) -> str:
        first = self.directory if isinstance(self.directory, str) else self.directory[0]
        return os.path.join(first, self.name + ".bin")

    def open(self) -> FlatStore:
        store = FlatStore(self.directory, name=self.name, io_chunk_bytes=self.io_chunk_bytes, reopen=True)
        if self.owner is not None and self.owner not in store:
            store.close()
            raise StoreFormatError(
                f"store {self.path} now holds another run's optimizer state (it was reused by a later run on the "
                f"same store_dir after this run's fit ended), so this run's optimizer state is gone. Save "
                f"checkpoints before starting another run on that store_dir, or give each run its own store_dir.")
        return store
