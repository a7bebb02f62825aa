"""The store's on-disk format: a header block at offset 0 and a JSON manifest beside the file, both
carrying the layout's hash, so a reopened store is checked before any of its bytes is trusted.

Why two copies: the manifest holds the table (readable without the big file); the header ties the file
to that table. A file and manifest that disagree (another run's store, a truncated or edited file) are
refused with ``StoreFormatError`` instead of being read as garbage.
"""

from __future__ import annotations

import errno as errno_mod
import json

import torch

from lightning_nvme import atomic
from lightning_nvme.store.buffers import aligned_empty, memview
from lightning_nvme.store.errors import StoreFormatError, StoreIOError
from lightning_nvme.store.file_io import StoreFile
from lightning_nvme.store.layout import HEADER_BYTES, STORE_FORMAT_VERSION, Layout

MAGIC = "lightning-nvme-store"


def _header(layout: Layout) -> bytes:
    header = json.dumps({"magic": MAGIC, "version": STORE_FORMAT_VERSION, "layout": layout.digest(),
                         "end": layout.end}).encode()
    return header.ljust(HEADER_BYTES, b"\0")


def write_layout(file: StoreFile, layout: Layout, manifest_path: str, *, sync: bool) -> None:
    """Write the header block and the manifest (``atomic.write_json``; fsync'ed when ``sync``)."""
    buf = aligned_empty(HEADER_BYTES)
    buf.copy_(torch.frombuffer(bytearray(_header(layout)), dtype=torch.uint8))
    try:
        file.pwrite_full(memview(buf.data_ptr(), HEADER_BYTES), 0, "<header>")
    except StoreIOError as e:
        if file.direct and e.errno == errno_mod.EINVAL:  # O_DIRECT opened but refused at write time
            file.fall_back_to_buffered()
            file.pwrite_full(memview(buf.data_ptr(), HEADER_BYTES), 0, "<header>")
        else:
            raise
    manifest = {"magic": MAGIC, "version": STORE_FORMAT_VERSION, "digest": layout.digest(), "layout": layout.to_json()}
    atomic.write_json(manifest_path, manifest, durable=sync)


def read_layout(file: StoreFile, manifest_path: str) -> Layout:
    """The layout of an existing store; refused if its manifest, header or size disagree."""
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise StoreFormatError(f"store manifest {manifest_path} is missing or unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("magic") != MAGIC or manifest.get("version") != STORE_FORMAT_VERSION:
        found = manifest if not isinstance(manifest, dict) else f"{manifest.get('magic')!r} v{manifest.get('version')}"
        raise StoreFormatError(f"{manifest_path}: not a lightning-nvme store of format version "
                               f"{STORE_FORMAT_VERSION} (found {found})")
    try:
        layout = Layout.from_json(manifest["layout"])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreFormatError(f"{manifest_path}: the manifest's layout is malformed ({e!r})") from e
    if layout.digest() != manifest.get("digest"):
        raise StoreFormatError(f"{manifest_path}: layout hash mismatch; the manifest was modified")
    # Size first: a header read from a file truncated below one block would be a short read.
    size = file.size
    if size < layout.end:
        raise StoreFormatError(f"{file.path} is truncated: {size} bytes, layout needs {layout.end}. "
                               f"The store cannot be reopened; start a new one (reopen=False).")
    buf = aligned_empty(HEADER_BYTES)
    file.pread_full(memview(buf.data_ptr(), HEADER_BYTES), 0, "<header>")
    try:
        header = json.loads(bytes(buf.numpy()).rstrip(b"\0"))
    except ValueError:
        header = {}
    if not isinstance(header, dict):
        header = {}
    if (header.get("magic") != MAGIC or header.get("version") != STORE_FORMAT_VERSION
            or header.get("layout") != layout.digest() or header.get("end") != layout.end):
        raise StoreFormatError(f"{file.path}: header does not match manifest {manifest_path} "
                               f"(layout hash {header.get('layout')} vs {layout.digest()})")
    return layout
