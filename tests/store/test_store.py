"""FlatStore behaviour: roundtrips, zero-copy vs staging paths, ordering of async requests, fences."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from lightning_nvme.store import ALIGN, FlatStore, aligned_empty

KiB = 1024
MiB = 1 << 20
CHUNK = 64 * KiB  # small chunks so modest tensors span many chunks and workers


@pytest.fixture(params=["direct", "buffered"])
def store(request, tmp_path):
    s = FlatStore(tmp_path, io_chunk_bytes=CHUNK, io_workers=4, staging_bytes=4 * CHUNK,
                  direct=None if request.param == "direct" else False, io_timeout_s=30)
    if request.param == "direct" and s.mode != "direct":
        s.close()
        pytest.skip("the temp directory's filesystem refuses O_DIRECT")
    yield s
    s.close()


def _random(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _roundtrip(store: FlatStore, name: str, src: torch.Tensor) -> torch.Tensor:
    store.add_region(name, src.numel() * src.element_size())
    store.wait(store.write(name, src))
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    store.wait(store.read(name, out))
    return out


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 3, 1001, 70_001])  # 70_001 elements span several 64 KiB chunks
def test_roundtrip_dtypes_and_odd_sizes(store, dtype, numel):
    src = _random((numel,), dtype, seed=numel)
    out = _roundtrip(store, "t", src)
    assert torch.equal(out, src)


def test_roundtrip_multichunk_and_shapes(store):
    src = _random((37, 129, 33), torch.float32)  # 630 KiB: ten 64 KiB chunks, odd tail
    assert src.numel() * 4 > 5 * CHUNK
    assert torch.equal(_roundtrip(store, "t", src), src)
    empty = torch.empty(0, 5)
    assert _roundtrip(store, "e", empty).shape == (0, 5)
    scalar = torch.tensor(3.5, dtype=torch.float64)
    assert torch.equal(_roundtrip(store, "s", scalar), scalar)


def test_non_contiguous_source(store):
    base = _random((300, 200), torch.float32)
    for i, src in enumerate([base.t(), base[::3, 1::2], base[:, 5]]):
        assert not src.is_contiguous()
        assert torch.equal(_roundtrip(store, f"nc{i}", src), src)


def test_writes_at_offsets_within_region(store):
    store.add_region("r", 3 * ALIGN + 10)
    parts = [_random((ALIGN,), torch.uint8, seed=i) for i in range(3)]
    hs = [store.write("r", p, offset=i * ALIGN) for i, p in enumerate(parts)]
    for h in hs:
        h.wait()
    whole = torch.empty(3 * ALIGN, dtype=torch.uint8)
    store.read("r", whole).wait()
    assert torch.equal(whole, torch.cat(parts))
    second = torch.empty(ALIGN, dtype=torch.uint8)
    store.read("r", second, offset=ALIGN).wait()
    assert torch.equal(second, parts[1])
    with pytest.raises(ValueError, match="multiple of 4096"):
        store.write("r", parts[0], offset=100)
    with pytest.raises(ValueError, match="does not fit"):
        store.write("r", torch.zeros(5 * ALIGN, dtype=torch.uint8))
    with pytest.raises(KeyError, match="nope"):
        store.write("nope", parts[0])


def test_add_regions_is_all_or_nothing(store):
    store.add_region("a", 10)
    size = store.size_bytes
    with pytest.raises(ValueError, match="already exists"):
        store.add_regions([("b", 100), ("c", 100), ("b", 5)])
    with pytest.raises(ValueError, match="nbytes"):
        store.add_regions([("b", 100), ("d", -1)])
    assert "b" not in store and "c" not in store and store.size_bytes == size
    assert store.add_region("b", 100).offset == size  # the names and the space are free again


def _count_staging(store: FlatStore, monkeypatch) -> list[int]:
    calls = [0]
    acquire = store.dispatch.pool.acquire

    def counting(*a, **k):
        calls[0] += 1
        return acquire(*a, **k)

    monkeypatch.setattr(store.dispatch.pool, "acquire", counting)
    return calls


def test_aligned_tensors_skip_staging_unaligned_use_it(tmp_path, monkeypatch):
    with FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=4 * CHUNK) as store:
        if store.mode != "direct":
            pytest.skip("staging is only needed under O_DIRECT")
        calls = _count_staging(store, monkeypatch)
        n = 5 * CHUNK + 100  # padded tail: the aligned tensor's own storage holds the padding
        store.add_regions([("a", n), ("u", n)])
        src = store.aligned_empty(n)
        src.copy_(_random((n,), torch.uint8))
        out = store.aligned_empty(n)
        store.write("a", src).wait()
        store.read("a", out).wait()
        assert torch.equal(out, src) and calls[0] == 0, "page-aligned tensors must move with no staging copy"

        unaligned = aligned_empty(n + 1)[1:]  # one byte off the page: O_DIRECT would refuse it
        unaligned.copy_(src)
        store.write("u", unaligned).wait()
        assert calls[0] == 6  # one staging buffer per chunk
        out_u = aligned_empty(n + 1)[1:]
        store.read("u", out_u).wait()
        assert calls[0] == 12
        assert torch.equal(out_u, src)
        # An aligned tensor that is a view into a larger buffer must not have its neighbours clobbered
        # by the 4 KiB-padded O_DIRECT read: it goes through staging instead.
        big = aligned_empty(2 * ALIGN)
        big.fill_(7)
        view = big[:100]
        store.read("u", view).wait()
        assert torch.equal(view, src[:100]) and bool((big[100:] == 7).all())


def _slow_when(monkeypatch, fn_name: str, predicate, delay: float = 0.05):
    """Make os.<fn_name> sleep before acting when predicate(buffer) holds, to provoke reordering."""
    real = getattr(os, fn_name)

    def slow(fd, buf, offset):
        mv = buf[0] if isinstance(buf, list) else buf
        if predicate(mv, offset):
            time.sleep(delay)
        return real(fd, buf, offset)

    monkeypatch.setattr(os, fn_name, slow)


def test_read_after_write_sees_last_write(store, monkeypatch):
    n = 3 * CHUNK
    store.add_region("r", n)
    # Earlier versions are slow to land: without ordering, the read would overtake them.
    _slow_when(monkeypatch, "pwrite", lambda mv, off: mv[0] != 49, delay=0.01)
    sources = [torch.full((n,), i, dtype=torch.uint8) for i in range(50)]
    for src in sources:
        store.write("r", src)  # no wait
    out = torch.empty(n, dtype=torch.uint8)
    store.read("r", out).wait()
    assert bool((out == 49).all())


def test_write_after_read_keeps_old_data_for_the_read(store, monkeypatch):
    n = 2 * CHUNK
    store.add_region("r", n)
    store.write("r", torch.full((n,), 1, dtype=torch.uint8)).wait()
    _slow_when(monkeypatch, "preadv", lambda mv, off: True)
    out = torch.empty(n, dtype=torch.uint8)
    h_read = store.read("r", out)
    h_write = store.write("r", torch.full((n,), 2, dtype=torch.uint8))
    h_read.wait()
    h_write.wait()
    assert bool((out == 1).all()), "a read issued before a write must see the data from before that write"
    store.read("r", out).wait()
    assert bool((out == 2).all())


def test_write_after_write_last_wins(store, monkeypatch):
    n = 2 * CHUNK
    store.add_region("r", n)
    _slow_when(monkeypatch, "pwrite", lambda mv, off: mv[0] == 1)  # the first write is slow
    store.write("r", torch.full((n,), 1, dtype=torch.uint8))
    store.write("r", torch.full((n,), 2, dtype=torch.uint8))
    store.fence()
    out = torch.empty(n, dtype=torch.uint8)
    store.read("r", out).wait()
    assert bool((out == 2).all())


def test_partial_overlap_is_ordered(store, monkeypatch):
    store.add_region("r", 4 * ALIGN)
    _slow_when(monkeypatch, "pwrite", lambda mv, off: mv[0] == 1)
    store.write("r", torch.full((4 * ALIGN,), 1, dtype=torch.uint8))
    store.write("r", torch.full((ALIGN,), 2, dtype=torch.uint8), offset=2 * ALIGN)
    out = torch.empty(4 * ALIGN, dtype=torch.uint8)
    store.read("r", out).wait()
    expected = torch.full((4 * ALIGN,), 1, dtype=torch.uint8)
    expected[2 * ALIGN:3 * ALIGN] = 2
    assert torch.equal(out, expected)


def test_fence_waits_for_everything_or_named_regions(store, monkeypatch):
    store.add_regions([("a", CHUNK), ("b", CHUNK)])
    _slow_when(monkeypatch, "pwrite", lambda mv, off: True, delay=0.02)
    ha = [store.write("a", torch.full((CHUNK,), i, dtype=torch.uint8)) for i in range(5)]
    store.fence(["a"])
    assert all(h.done() for h in ha)
    hb = [store.write("b", torch.full((CHUNK,), i, dtype=torch.uint8)) for i in range(5)]
    store.fence()
    assert all(h.done() for h in hb)
    assert store.stats.wait_seconds > 0


def test_durable_fence_fdatasyncs(store, monkeypatch):
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    store.add_region("r", CHUNK)
    store.write("r", torch.ones(CHUNK, dtype=torch.uint8))
    store.fence()
    assert synced == []
    store.fence(durable=True)
    assert synced == [store.fd]
    assert store.stats.fsyncs == 1


def test_stats_count_bytes_and_requests(store):
    store.add_region("r", 3 * CHUNK)
    src = torch.ones(3 * CHUNK, dtype=torch.uint8)
    store.write("r", src).wait()
    store.read("r", torch.empty_like(src)).wait()
    s = store.stats
    assert (s.bytes_written, s.bytes_read, s.writes, s.reads) == (3 * CHUNK, 3 * CHUNK, 1, 1)
    assert s.write_seconds > 0 and s.read_seconds > 0


def test_handle_is_awaitable(store):
    store.add_region("r", 100)
    src = torch.arange(25, dtype=torch.int32)

    async def go() -> torch.Tensor:
        await store.write("r", src)
        out = torch.empty_like(src)
        await store.read("r", out)
        return out

    assert torch.equal(asyncio.run(go()), src)


def test_concurrent_submitters_stay_ordered(store):
    """Two threads submitting to disjoint regions, then cross-checking: every read sees its thread's writes."""
    store.add_regions([(f"r{i}", CHUNK) for i in range(2)])
    errors: list[str] = []

    def run(i: int) -> None:
        for v in range(20):
            store.write(f"r{i}", torch.full((CHUNK,), v, dtype=torch.uint8))
            out = torch.empty(CHUNK, dtype=torch.uint8)
            store.read(f"r{i}", out).wait()
            if not bool((out == v).all()):
                errors.append(f"thread {i} version {v}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
