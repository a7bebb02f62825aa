"""The store's on-disk format: a header block at offset 0 and a JSON manifest beside the file, both
carrying the layout's hash, so a reopened store is checked before any of its bytes is trusted.

Why two copies: the manifest holds the table (readable without the big file); the header ties the file
(each file, when the store is striped over several) to that table. A file and manifest that disagree
(another run's store, a truncated or edited file) are refused with ``StoreFormatError`` instead of being
read as garbage.
"""

from __future__ import annotations

import errno as errno_mod
import json
from collections.abc import Sequence

import torch

from lightning_nvme.fs import atomic
from lightning_nvme.store.aligned import aligned_empty, memview
from lightning_nvme.store.errors import StoreFormatError, StoreIOError
from lightning_nvme.store.file_io import StoreFile
from lightning_nvme.store.layout import HEADER_BYTES, STORE_FORMAT_VERSION, Layout
from lightning_nvme.store.stripes import StripeMap, check_header_stripe, header_stripe

MAGIC = "lightning-nvme-store"


def _header(layout: Layout, stripe: dict | None = None) -> bytes:
    fields = {"magic": MAGIC, "version": STORE_FORMAT_VERSION, "layout": layout.digest(), "end": layout.end}
    header = json.dumps(fields if stripe is None else {**fields, "stripe": stripe}).encode()
    return header.ljust(HEADER_BYTES, b"\0")


def write_layout(files: Sequence[StoreFile], layout: Layout, manifest_path: str, *, sync: bool,
                 stripes: dict | None = None) -> None:
    """Write the header block of every file and the manifest (``atomic.write_json``; fsync'ed when ``sync``).
    ``stripes``: the stripe set of a store over several files (``stripes.py``), recorded in both."""
    buf = aligned_empty(HEADER_BYTES)
    for i, file in enumerate(files):
        buf.copy_(torch.frombuffer(bytearray(_header(layout, header_stripe(stripes, i))), dtype=torch.uint8))
        try:
            file.pwrite_full(memview(buf.data_ptr(), HEADER_BYTES), 0, "<header>")
        except StoreIOError as e:
            if file.direct and e.errno == errno_mod.EINVAL:  # O_DIRECT opened but refused at write time
                file.fall_back_to_buffered()
                file.pwrite_full(memview(buf.data_ptr(), HEADER_BYTES), 0, "<header>")
            else:
                raise
    manifest: dict = {"magic": MAGIC, "version": STORE_FORMAT_VERSION, "digest": layout.digest(), "layout": layout.to_json()}
    if stripes is not None:
        manifest["stripes"] = stripes
    atomic.write_json(manifest_path, manifest, durable=sync)


def read_manifest(manifest_path: str) -> dict:
    """The manifest of an existing store, refused if missing, unreadable or of another format."""
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise StoreFormatError(f"store manifest {manifest_path} is missing or unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("magic") != MAGIC or manifest.get("version") != STORE_FORMAT_VERSION:
        found = manifest if not isinstance(manifest, dict) else f"{manifest.get('magic')!r} v{manifest.get('version')}"
        raise StoreFormatError(f"{manifest_path}: not a lightning-nvme store of format version "
                               f"{STORE_FORMAT_VERSION} (found {found})")
    return manifest


def read_layout(files: Sequence[StoreFile], manifest: dict, manifest_path: str, stripe_map: StripeMap) -> Layout:
    """The layout of an existing store; refused if its manifest, a file's header or a file's size disagree."""
    try:
        layout = Layout.from_json(manifest["layout"])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreFormatError(f"{manifest_path}: the manifest's layout is malformed ({e!r})") from e
    if layout.digest() != manifest.get("digest"):
        raise StoreFormatError(f"{manifest_path}: layout hash mismatch; the manifest was modified")
    buf = aligned_empty(HEADER_BYTES)
    for i, file in enumerate(files):
        # Size first: a header read from a file truncated below one block would be a short read.
        size, needed = file.size, stripe_map.file_size(i, layout.end)
        if size < needed:
            raise StoreFormatError(f"{file.path} is truncated: {size} bytes, layout needs {needed}. "
                                   f"The store cannot be reopened; start a new one (reopen=False).")
        file.pread_full(memview(buf.data_ptr(), HEADER_BYTES), 0, "<header>")
        try:
            header = json.loads(bytes(buf.numpy()).rstrip(b"\0"))
        except ValueError:
            header = {}
        if not isinstance(header, dict):
            header = {}
        check_header_stripe(header.get("stripe"), manifest.get("stripes"), i, file.path)
        if (header.get("magic") != MAGIC or header.get("version") != STORE_FORMAT_VERSION
                or header.get("layout") != layout.digest() or header.get("end") != layout.end):
            raise StoreFormatError(f"{file.path}: header does not match manifest {manifest_path} "
                                   f"(layout hash {header.get('layout')} vs {layout.digest()})")
    return layout
