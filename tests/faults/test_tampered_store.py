"""A truncated or tampered store file or manifest is refused on reopen with a StoreFormatError that
names the file, and the refused open leaves no lock behind."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_nvme.store import FlatStore, StoreFormatError

MiB = 1 << 20


@pytest.fixture
def saved(tmp_path):
    store = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB)
    store.add_regions([("w", 2 * MiB), ("m", 3000)])
    data = store.aligned_empty(2 * MiB)
    data.copy_(torch.arange(2 * MiB, dtype=torch.int64).to(torch.uint8))
    store.write("w", data)
    store.fence(durable=True)
    path, manifest = store.path, store.manifest_path
    store.close()
    return tmp_path, path, manifest, data


def _reopen(d):
    return FlatStore(d, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB, reopen=True)


def test_intact_store_reopens_with_data(saved):
    d, _, _, data = saved
    store = _reopen(d)
    out = store.aligned_empty(2 * MiB)
    store.wait(store.read("w", out))
    assert torch.equal(out, data)
    store.close()


@pytest.mark.parametrize("size", [0, 100, 4096, 4096 + MiB])
def test_truncated_store_is_refused(saved, size):
    d, path, _, _ = saved
    os.truncate(path, size)
    with pytest.raises(StoreFormatError, match="truncated") as ei:
        _reopen(d)
    assert path in str(ei.value)
    os.truncate(path, 8 * MiB)  # the refused open released its lock and fd: a fresh store can start
    FlatStore(d, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB).close()


def test_tampered_header_is_refused(saved):
    d, path, _, _ = saved
    with open(path, "r+b") as f:
        head = f.read(4096)
        f.seek(0)
        f.write(head.replace(b'"end": ', b'"end": 1'))
    with pytest.raises(StoreFormatError, match="header does not match"):
        _reopen(d)


def test_garbage_header_is_refused(saved):
    d, path, _, _ = saved
    with open(path, "r+b") as f:
        f.write(os.urandom(64))
    with pytest.raises(StoreFormatError, match="header"):
        _reopen(d)


def _edit_manifest(manifest, change):
    with open(manifest) as f:
        m = json.load(f)
    change(m)
    with open(manifest, "w") as f:
        json.dump(m, f)


def test_manifest_region_edit_breaks_layout_hash(saved):
    d, _, manifest, _ = saved
    _edit_manifest(manifest, lambda m: m["layout"]["regions"][0].update(nbytes=1))
    with pytest.raises(StoreFormatError, match="layout hash mismatch"):
        _reopen(d)


def test_other_format_version_is_refused(saved):
    d, _, manifest, _ = saved
    _edit_manifest(manifest, lambda m: m.update(version=99))
    with pytest.raises(StoreFormatError, match="format version"):
        _reopen(d)


def test_missing_or_corrupt_manifest_is_refused(saved):
    d, _, manifest, _ = saved
    with open(manifest, "w") as f:
        f.write('{"magic": "lightning-nvme-st')
    with pytest.raises(StoreFormatError, match="missing or unreadable"):
        _reopen(d)
    os.remove(manifest)
    with pytest.raises(StoreFormatError, match="missing or unreadable"):
        _reopen(d)


def test_header_from_another_store_is_refused(saved, tmp_path_factory):
    d, path, _, _ = saved
    other = tmp_path_factory.mktemp("other")
    s = FlatStore(other, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB)
    s.add_region("x", MiB)
    s.close()
    with open(s.path, "rb") as src, open(path, "r+b") as dst:
        dst.write(src.read(4096))
    with pytest.raises(StoreFormatError, match="layout hash"):
        _reopen(d)


def test_digest_detects_changed_data_bytes(saved):
    """Header checks cannot see data changes; region digests recorded at commit time can."""
    d, path, _, data = saved
    store = _reopen(d)
    recorded = store.digest()
    assert set(recorded) == {"w", "m"} and store.digest(["w"]) == {"w": recorded["w"]}
    store.close()
    offset = _reopen_offset(d, "w")
    with open(path, "r+b") as f:
        f.seek(offset + MiB + 123)
        byte = f.read(1)
        f.seek(offset + MiB + 123)
        f.write(bytes([byte[0] ^ 0xFF]))
    store = _reopen(d)  # the header/layout checks pass: only the data changed
    now = store.digest()
    assert now["w"] != recorded["w"] and now["m"] == recorded["m"]
    store.close()


def test_digest_matches_independent_hash_of_written_bytes(tmp_path):
    import hashlib

    store = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB)
    store.add_region("odd", 3 * MiB + 5)  # not a multiple of the chunk or of 4 KiB
    src = torch.randint(0, 256, (3 * MiB + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    store.write("odd", src)
    expected = hashlib.blake2b(src.numpy().tobytes(), digest_size=16).hexdigest()
    assert store.digest() == {"odd": expected}
    store.close()


def _reopen_offset(d, name):
    store = _reopen(d)
    try:
        return store.region(name).offset
    finally:
        store.close()
