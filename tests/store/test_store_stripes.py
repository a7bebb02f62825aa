"""A store striped over several directories: the same bytes back as one directory, each file with its own
workers, lock, header and checks, and a reopen over a different stripe set refused naming the directory."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from lightning_nvme.store import FlatStore, StoreFormatError, StoreLockedError
from lightning_nvme.store.layout import HEADER_BYTES
from lightning_nvme.store.stripes import StripeMap

KiB, MiB = 1 << 10, 1 << 20
STRIPE = 64 * KiB


def _dirs(tmp_path, n: int) -> list[str]:
    return [str(tmp_path / f"disk{i}") for i in range(n)]


def _data(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _fill(store: FlatStore) -> dict[str, torch.Tensor]:
    sizes = {"a": 3 * STRIPE + 4 * KiB, "b": 5 * KiB, "c": 11 * STRIPE + 123}
    store.add_regions(list(sizes.items()))
    data = {name: _data(n, i) for i, (name, n) in enumerate(sizes.items())}
    for name, t in data.items():
        store.write(name, t)
    store.write("c", _data(2 * STRIPE, 99), offset=STRIPE - 8 * KiB)  # an overwrite across stripe units
    data["c"][STRIPE - 8 * KiB:3 * STRIPE - 8 * KiB] = _data(2 * STRIPE, 99)
    store.fence(durable=True)
    return data


def _read_all(store: FlatStore, names) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        r = store.region(name)
        for aligned in (True, False):  # zero-copy and staged
            t = store.aligned_empty(r.nbytes) if aligned else torch.empty(r.nbytes, dtype=torch.uint8)
            store.read(name, t).wait()
            out.setdefault(name, t)
            assert torch.equal(out[name], t)
    return out


def test_stripe_map_is_identity_for_one_file_and_round_robin_for_several():
    one = StripeMap(1, STRIPE)
    assert one.pieces(HEADER_BYTES, 3 * MiB, MiB) == [(0, a, HEADER_BYTES + a, MiB) for a in (0, MiB, 2 * MiB)]
    assert one.file_size(0, 12345) == 12345
    three = StripeMap(3, STRIPE)
    pieces = three.pieces(HEADER_BYTES + STRIPE - 4 * KiB, 3 * STRIPE, MiB)
    assert [(f, n) for f, _, _, n in pieces] == [(0, 4 * KiB), (1, STRIPE), (2, STRIPE), (0, STRIPE - 4 * KiB)]
    assert pieces[-1][2] == HEADER_BYTES + STRIPE  # file 0's second unit
    end = HEADER_BYTES + 7 * STRIPE + 100  # units 0..6 full, unit 7 (file 1) partial
    assert [three.file_size(i, end) for i in range(3)] == [HEADER_BYTES + 3 * STRIPE, HEADER_BYTES + 2 * STRIPE + 100,
                                                           HEADER_BYTES + 2 * STRIPE]


@pytest.mark.parametrize("n", [2, 3])
def test_striped_store_returns_what_one_directory_returns(tmp_path, n):
    with FlatStore(str(tmp_path / "one"), io_chunk_bytes=32 * KiB, staging_bytes=64 * KiB) as one:
        expect = _fill(one)
        assert _read_all(one, expect).keys() == expect.keys()
        layout = one.layout.to_json()
    dirs = _dirs(tmp_path, n)
    with FlatStore(dirs, io_chunk_bytes=32 * KiB, staging_bytes=64 * KiB, stripe_bytes=STRIPE) as store:
        data = _fill(store)
        got = _read_all(store, data)
        assert store.layout.to_json() == layout  # the logical layout does not depend on the disks
        threads = {t.name for t in threading.enumerate() if t.name.startswith("lightning-nvme-io-s")}
        assert {name.rsplit("-", 1)[0] for name in threads} == {f"lightning-nvme-io-s{i}" for i in range(n)}
    for name in expect:
        assert torch.equal(got[name], expect[name]), name
    with FlatStore(dirs, reopen=True) as again:  # the stripe unit comes from the manifest
        assert again.stripe_map == StripeMap(n, STRIPE)
        for name, t in _read_all(again, data).items():
            assert torch.equal(t, expect[name])
    sizes = [os.path.getsize(os.path.join(d, "store-rank0.bin")) for d in dirs]
    assert all(s > HEADER_BYTES + STRIPE for s in sizes)  # every disk holds data
    assert sum(sizes) == layout["end"] + (n - 1) * HEADER_BYTES
    assert sorted(os.listdir(dirs[1])) == ["store-rank0.bin", "store-rank0.bin.lock"]  # manifest in the first only


def test_one_directory_keeps_the_unstriped_format(tmp_path):
    with FlatStore(tmp_path) as store:
        store.add_region("r", 3 * MiB)
    with open(tmp_path / "store-rank0.json") as f:
        manifest = json.load(f)
    assert set(manifest) == {"magic", "version", "digest", "layout"}
    with open(tmp_path / "store-rank0.bin", "rb") as f:
        header = json.loads(f.read(HEADER_BYTES).rstrip(b"\0"))
    assert set(header) == {"magic", "version", "layout", "end"}


def test_durable_fence_fdatasyncs_every_file(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    with FlatStore(_dirs(tmp_path, 3), stripe_bytes=STRIPE) as store:
        store.add_region("r", 6 * STRIPE)
        store.write("r", torch.ones(6 * STRIPE, dtype=torch.uint8))
        store.fence(durable=True)
        assert sorted(synced) == sorted(f.fd for f in store._files)


def test_each_stripe_file_is_locked(tmp_path):
    dirs = _dirs(tmp_path, 2)
    with FlatStore(dirs, stripe_bytes=STRIPE):
        with pytest.raises(StoreLockedError, match="disk1"):
            FlatStore(dirs[1])  # the second disk's file is held too
        other = str(tmp_path / "disk9")
        with pytest.raises(StoreLockedError, match="disk1"):
            FlatStore([other, dirs[1]])  # never half-opened: the first file's lock is released again
        FlatStore(other).close(delete=True)
    FlatStore(dirs[1]).close(delete=True)  # closing the striped store released every lock


def _striped(tmp_path, n=3) -> list[str]:
    dirs = _dirs(tmp_path, n)
    with FlatStore(dirs, stripe_bytes=STRIPE) as store:
        store.add_region("r", 10 * STRIPE)
        store.write("r", _data(10 * STRIPE, 1))
    return dirs


def test_reopen_refuses_a_missing_stripe_directory_naming_it(tmp_path):
    dirs = _striped(tmp_path)
    with pytest.raises(StoreFormatError, match=f"directory {dirs[2]} of its stripe set is not listed"):
        FlatStore(dirs[:2], reopen=True)
    os.remove(os.path.join(dirs[1], "store-rank0.bin"))  # the disk is listed but its file is gone
    with pytest.raises(StoreFormatError, match=f"does not exist \\(directory {dirs[1]}\\)"):
        FlatStore(dirs, reopen=True)


def test_reopen_refuses_reordered_directories_naming_them(tmp_path):
    dirs = _striped(tmp_path)
    with pytest.raises(StoreFormatError, match=f"manifest is in {dirs[0]}, not in the first directory {dirs[1]}"):
        FlatStore([dirs[1], dirs[0], dirs[2]], reopen=True)
    with pytest.raises(StoreFormatError, match=f"directory {dirs[2]} is listed at position 2"):
        FlatStore([dirs[0], dirs[2], dirs[1]], reopen=True)


def test_reopen_refuses_a_directory_swapped_for_another_stores(tmp_path):
    dirs = _striped(tmp_path / "x")
    other = _striped(tmp_path / "y")
    os.replace(os.path.join(other[1], "store-rank0.bin"), os.path.join(dirs[1], "store-rank0.bin"))
    with pytest.raises(StoreFormatError, match=f"belongs to another striped store.*directory {dirs[1]} was swapped"):
        FlatStore(dirs, reopen=True)
    extra = str(tmp_path / "z")
    with FlatStore(extra) as unstriped:  # a disk holding some other, unstriped store of the same name
        unstriped.add_region("r", STRIPE)
    with pytest.raises(StoreFormatError, match=f"directory {extra} is not part of it"):
        FlatStore([*dirs, extra], reopen=True)


def test_reopen_refuses_a_truncated_or_tampered_stripe_naming_its_path(tmp_path):
    dirs = _striped(tmp_path)
    path = os.path.join(dirs[2], "store-rank0.bin")
    size = os.path.getsize(path)
    os.truncate(path, size - 4 * KiB)
    with pytest.raises(StoreFormatError, match=f"{path} is truncated"):
        FlatStore(dirs, reopen=True)
    os.truncate(path, size)
    with open(path, "r+b") as f:
        header = json.loads(f.read(HEADER_BYTES).rstrip(b"\0"))
        header["stripe"]["index"] = 1
        f.seek(0)
        f.write(json.dumps(header).encode().ljust(HEADER_BYTES, b"\0"))
    with pytest.raises(StoreFormatError, match=f"{path}: its header records stripe"):
        FlatStore(dirs, reopen=True)


def test_extents_say_where_a_regions_bytes_are(tmp_path):
    dirs = _dirs(tmp_path, 2)
    with FlatStore(dirs, stripe_bytes=STRIPE) as store:
        store.add_regions([("pad", 4 * KiB), ("r", 2 * STRIPE)])
        data = _data(2 * STRIPE, 5)
        store.write("r", data)
        store.fence(durable=True)
        extents = store.extents("r")
        assert [(p, n) for p, _, _, n in extents] == [(store.paths[0], STRIPE - 4 * KiB), (store.paths[1], STRIPE),
                                                       (store.paths[0], 4 * KiB)]
        for path, file_off, a, n in extents:
            with open(path, "rb") as f:
                f.seek(file_off)
                assert f.read(n) == data[a:a + n].numpy().tobytes()
    with FlatStore(tmp_path / "one") as one:
        r = one.add_region("r", 3 * MiB)
        assert one.extents("r") == [(one.path, r.offset, 0, 3 * MiB)]
