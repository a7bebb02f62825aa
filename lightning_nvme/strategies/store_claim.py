"""One store file per strategy instance: two trainers never share a store silently.

Why: a store file holds one run's optimizer state, and the strategy reopens it after ``fit`` for
``trainer.save_checkpoint`` and ``optimizer.state_dict()``. Two trainers on the same ``store_dir`` (e.g.
the same ``default_root_dir``) in one process would otherwise truncate each other's file. The first live
strategy instance on a directory gets ``store-rank<r>``; any other live instance gets
``store-rank<r>-<token>``, deleted when that instance is garbage collected or the process exits. Across
processes the store's lock refuses a second live user, and the marker region ``owner/<token>`` lets a
strategy detect on reopening that a later run has reused the file (``StoreRef.open``).
"""

from __future__ import annotations

import os
import threading
import weakref

_CLAIMS: dict[str, weakref.ref] = {}
_LOCK = threading.Lock()


def owner_region(token: str) -> str:
    return f"owner/{token}"


def claim_store_name(store_dirs: str | list[str], rank: int, owner: object, token: str) -> str:
    """The store file base name ``owner`` (a strategy instance) uses in ``store_dirs`` (one, or a striped
    store's directories: the first holds the manifest and names the store)."""
    dirs = [store_dirs] if isinstance(store_dirs, str) else store_dirs
    base = f"store-rank{rank}"
    key = os.path.join(os.path.abspath(dirs[0]), base)
    with _LOCK:
        ref = _CLAIMS.get(key)
        holder = ref() if ref is not None else None
        if holder is None or holder is owner:
            _CLAIMS[key] = weakref.ref(owner)
            return base
    name = f"{base}-{token}"
    weakref.finalize(owner, _remove_store_files, [os.path.join(os.path.abspath(d), name) for d in dirs])
    return name


def _remove_store_files(base_paths: list[str]) -> None:
    for base_path in base_paths:
        for suffix in (".bin", ".json", ".bin.lock"):
            try:
                os.remove(base_path + suffix)
            except FileNotFoundError:
                pass
