"""The engine's ordering rule for reads (docs/store.md, "Ordering, fences, errors"), one test per clause, with
the interleavings forced by gates on the store's syscalls and the engine's ``observer`` hook, never by sleeps:

1. a read of bytes overlapping a pending write waits for it and sees its bytes;
2. ... and if that write fails, the read fails with it without touching the disk;
3. a read of bytes overlapping a write that already failed fails with it, also when the failure lands
   between the store's "no error yet" check and the read's dependency lookup (issue #20: it returned stale bytes);
4. dependency-free reads are served before queued writes, but a read never jumps ahead of a queued write it
   overlaps (and fails with it when that write fails);
5. a read into memory a pending write still sends (``read(after=...)``: the optimizer's chunk ring reusing a
   buffer) waits for that write in the I/O worker, not in the caller: the write sends the old bytes, the read's
   land after; the ring's read-ahead does not block on such a buffer.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from lightning_nvme.optim.buffers import ChunkRing
from lightning_nvme.optim.pipeline import ReadAhead
from lightning_nvme.optim.plan import Chunk
from lightning_nvme.store import FlatStore, StoreError
from lightning_nvme.store import flat_store as flat_store_mod

MiB = 1 << 20
WAIT_S = 20.0  # bound on every wait below: reached only when the rule is broken


class GatedDisk:
    """Wraps the store's ``os.pwrite``/``os.preadv``: records each transfer on the store file as
    ``(op, region)`` in order, holds writes to ``gated`` regions until ``open()``, fails writes to
    ``failing`` regions with EIO."""

    def __init__(self, store: FlatStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store = store
        self.real_pwrite, self.real_preadv = os.pwrite, os.preadv
        self.log: list[tuple[str, str]] = []
        self.gated: set[str] = set()
        self.failing: set[str] = set()
        self.blocked = threading.Event()  # a gated write is waiting
        self._gate = threading.Event()
        self._lock = threading.Lock()
        monkeypatch.setattr(flat_store_mod.os, "pwrite", self._pwrite)
        monkeypatch.setattr(flat_store_mod.os, "preadv", self._preadv)

    def region_at(self, offset: int) -> str:
        return next(r.name for r in self.store.layout.regions.values() if r.offset <= offset < r.end)

    def _pwrite(self, fd, data, offset):
        if fd != self.store.fd:
            return self.real_pwrite(fd, data, offset)
        region = self.region_at(offset)
        if region in self.gated:
            self.blocked.set()
            assert self._gate.wait(WAIT_S), "gate never opened"
        with self._lock:
            self.log.append(("write", region))
        if region in self.failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.real_pwrite(fd, data, offset)

    def _preadv(self, fd, buffers, offset):
        if fd == self.store.fd:
            with self._lock:
                self.log.append(("read", self.region_at(offset)))
        return self.real_preadv(fd, buffers, offset)

    def open(self) -> None:
        self._gate.set()


@pytest.fixture
def store(tmp_path):
    s = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, io_workers=2, staging_bytes=4 * MiB, io_timeout_s=WAIT_S)
    s.add_regions([("alpha", 1 * MiB), ("beta", 1 * MiB), ("gamma", 1 * MiB)])  # one chunk each
    yield s
    s.dispatch.engine.observer = None
    if not s._closed:
        try:
            s.close()
        except StoreError:
            pass  # the tests that fail a write leave the store failed: close drains it and raises that error


@pytest.fixture
def disk(store, monkeypatch) -> GatedDisk:
    d = GatedDisk(store, monkeypatch)
    yield d
    d.open()  # never leave a worker blocked, whatever the test did


def _filled(store: FlatStore, nbytes: int, value: int) -> torch.Tensor:
    t = store.aligned_empty(nbytes)
    t.fill_(value)
    return t


def _observe(store: FlatStore) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], threading.Event]]:
    """Record the engine's (event, kind, region) in order; ``seen[(event, region)]`` is set when it happens."""
    events: list[tuple[str, str, str]] = []
    seen: dict[tuple[str, str], threading.Event] = {
        (e, r): threading.Event() for e in ("deps", "run") for r in store.layout.regions}
    lock = threading.Lock()

    def observer(event: str, handle) -> None:
        with lock:
            events.append((event, handle.kind, handle.region))
        seen[(event, handle.region)].set()

    store.dispatch.engine.observer = observer
    return events, seen


def test_read_overlapping_a_pending_write_waits_for_it_and_sees_its_bytes(store, disk):
    store.write("alpha", _filled(store, 1 * MiB, 1))
    store.fence()
    disk.gated.add("alpha")
    events, seen = _observe(store)
    w = store.write("alpha", _filled(store, 1 * MiB, 7))
    assert disk.blocked.wait(WAIT_S)  # the write is in the kernel (one worker held)
    out = _filled(store, 1 * MiB, 0)
    r = store.read("alpha", out)
    assert r.deps == [w]
    # the other worker took a chunk of the read and is waiting for the write: nothing read yet
    assert seen[("deps", "alpha")].wait(WAIT_S)
    assert not r.done() and ("read", "alpha") not in disk.log
    disk.open()
    store.wait(r)
    assert torch.equal(out, torch.full_like(out, 7))
    assert disk.log.index(("read", "alpha")) > max(i for i, e in enumerate(disk.log) if e == ("write", "alpha"))


def test_read_overlapping_a_pending_write_that_fails_fails_with_it_without_reading(store, disk):
    disk.gated.add("alpha")
    disk.failing.add("alpha")
    _observe(store)
    w = store.write("alpha", _filled(store, 1 * MiB, 7))
    assert disk.blocked.wait(WAIT_S)
    r = store.read("alpha", _filled(store, 1 * MiB, 0))
    assert r.deps == [w]
    disk.open()
    with pytest.raises(StoreError, match="depends on failed"):
        r.wait(WAIT_S)
    assert ("read", "alpha") not in disk.log


def test_read_after_a_write_that_already_failed_fails_with_it_even_when_racing_the_store_check(store, disk,
                                                                                                monkeypatch):
    """The interleaving of issue #20: the read passes the store's "no error yet" check, then the write fails
    and completes, then the read looks up its dependencies. It must still fail, never hand back the old bytes."""
    store.write("beta", _filled(store, 1 * MiB, 1))
    store.fence()
    disk.gated.add("beta")
    disk.failing.add("beta")
    w = store.write("beta", _filled(store, 1 * MiB, 7))
    assert disk.blocked.wait(WAIT_S)
    real_check = store._check_usable

    def check_then_fail_the_write() -> None:
        real_check()  # passes: the write has not failed yet
        disk.open()
        assert w._event.wait(WAIT_S) and w.error is not None  # failed and completed before the lookup

    monkeypatch.setattr(store, "_check_usable", check_then_fail_the_write)
    out = _filled(store, 1 * MiB, 0)
    r = store.read("beta", out)  # (r.deps is not checked: it is cleared once r has failed, which may be already)
    with pytest.raises(StoreError, match="depends on failed"):
        r.wait(WAIT_S)
    assert ("read", "beta") not in disk.log
    assert torch.equal(out, torch.zeros_like(out))  # untouched: the stale 1s never reached the caller


def test_reads_are_served_before_queued_writes_but_not_before_a_queued_write_they_overlap(tmp_path, monkeypatch):
    store = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, io_workers=1, staging_bytes=4 * MiB, io_timeout_s=WAIT_S)
    try:
        store.add_regions([("alpha", 1 * MiB), ("beta", 1 * MiB), ("gamma", 1 * MiB)])
        store.write("alpha", _filled(store, 1 * MiB, 1))
        store.write("beta", _filled(store, 1 * MiB, 2))
        store.fence()
        disk = GatedDisk(store, monkeypatch)
        disk.gated.add("gamma")
        events, _ = _observe(store)
        store.write("gamma", _filled(store, 1 * MiB, 3))
        assert disk.blocked.wait(WAIT_S)  # the only worker is held: everything below queues
        w_beta = store.write("beta", _filled(store, 1 * MiB, 9))
        out_beta, out_alpha = _filled(store, 1 * MiB, 0), _filled(store, 1 * MiB, 0)
        r_beta = store.read("beta", out_beta)  # overlaps the queued write: after it
        r_alpha = store.read("alpha", out_alpha)  # disjoint, submitted last: served first
        assert r_beta.deps == [w_beta] and r_alpha.deps == []
        disk.open()
        store.fence()
        runs = [(kind, region) for e, kind, region in events if e == "run"]
        assert runs == [("write", "gamma"), ("read", "alpha"), ("write", "beta"), ("read", "beta")]
        assert torch.equal(out_alpha, torch.full_like(out_alpha, 1))
        assert torch.equal(out_beta, torch.full_like(out_beta, 9))
    finally:
        store.dispatch.engine.observer = None
        store.close()


def test_a_read_behind_a_queued_write_that_fails_fails_with_it(tmp_path, monkeypatch):
    store = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, io_workers=1, staging_bytes=4 * MiB, io_timeout_s=WAIT_S)
    try:
        store.add_regions([("alpha", 1 * MiB), ("beta", 1 * MiB), ("gamma", 1 * MiB)])
        store.write("alpha", _filled(store, 1 * MiB, 1))
        store.fence()
        disk = GatedDisk(store, monkeypatch)
        disk.gated.add("gamma")
        disk.failing.add("beta")
        store.write("gamma", _filled(store, 1 * MiB, 3))
        assert disk.blocked.wait(WAIT_S)
        store.write("beta", _filled(store, 1 * MiB, 9))
        out_beta, out_alpha = _filled(store, 1 * MiB, 0), _filled(store, 1 * MiB, 0)
        r_beta = store.read("beta", out_beta)
        r_alpha = store.read("alpha", out_alpha)
        disk.open()
        r_alpha.wait(WAIT_S)  # served before the failing write: unaffected
        assert torch.equal(out_alpha, torch.full_like(out_alpha, 1))
        with pytest.raises(StoreError, match="depends on failed"):
            r_beta.wait(WAIT_S)
        assert ("read", "beta") not in disk.log and torch.equal(out_beta, torch.zeros_like(out_beta))
    finally:
        with pytest.raises(StoreError):
            store.close()


def test_a_read_into_a_buffer_a_pending_write_still_sends_waits_for_it_in_the_worker(store, disk):
    store.write("beta", _filled(store, 1 * MiB, 2))
    store.fence()
    disk.gated.add("alpha")
    buf = _filled(store, 1 * MiB, 7)
    w = store.write("alpha", buf)
    assert disk.blocked.wait(WAIT_S)  # the write is in the kernel, still reading ``buf``
    r = store.read("beta", buf, after=(w,))  # returns at once: the caller does not wait
    assert r.deps == [w] and not r.done() and torch.equal(buf, torch.full_like(buf, 7))
    disk.open()
    store.wait(r)
    assert torch.equal(buf, torch.full_like(buf, 2))
    check = _filled(store, 1 * MiB, 0)
    store.wait(store.read("alpha", check))
    assert torch.equal(check, torch.full_like(check, 7))  # the write sent the bytes it was given
    assert disk.log.index(("read", "beta")) > disk.log.index(("write", "alpha"))
    done = store.write("gamma", _filled(store, 1 * MiB, 3))
    store.wait(done)
    assert store.read("beta", buf, after=(done,)).deps == []  # a completed write is no dependency


def test_the_read_ahead_reuses_a_buffer_whose_write_back_is_pending_without_waiting(store, disk):
    """Chunk 0 is updated and written back (held in the kernel); the read-ahead of chunk 1 gets that buffer
    (a ring of 2: one read ahead, one being written) and returns at once; the update of chunk 1 then sees its
    own state, and chunk 0's region holds chunk 0's."""
    store.write("beta", _filled(store, 1 * MiB, 2))
    store.fence()
    chunks = [Chunk(0, "alpha", [], 1 * MiB), Chunk(1, "beta", [], 1 * MiB)]
    reads = ReadAhead(store, chunks, {0: 1 * MiB, 1: 1 * MiB}, 1, lambda c: c.index == 1)
    reads.ring = ChunkRing(store, 2, 1 * MiB)
    buf = reads.take(0)  # no state yet: no read
    buf.data.fill_(5)  # the update
    disk.gated.add("alpha")
    reads.release(buf, store.write("alpha", buf.data))
    reads.release(reads.live_ring().acquire())  # the other buffer, unused: the write-back's is now next
    assert disk.blocked.wait(WAIT_S)
    reads.prefetch([1], set())  # takes the buffer chunk 0's write-back still sends from
    _, handle = reads.inflight[1]
    assert handle is not None and not handle.done()
    disk.open()
    got = reads.take(1)
    assert got is buf and torch.equal(got.data, torch.full_like(got.data, 2))
    check = _filled(store, 1 * MiB, 0)
    store.wait(store.read("alpha", check))
    assert torch.equal(check, torch.full_like(check, 5))


@pytest.mark.parametrize("workers", [1, 3])
def test_the_read_ahead_over_a_striped_store_keeps_every_chunk_exact_when_buffers_are_reused_in_flight(
        tmp_path, workers):
    """No gates: the real race. Ten chunks striped over two files (one or three workers each), a ring with one
    buffer for write-backs, six passes of "read, add the pass number, write back" in a rotating order: every
    chunk ends holding the sum of its passes, and no request waits forever (buffers reused while their
    write-back runs, reads ordered after it in the workers of either file)."""
    store = FlatStore([tmp_path / "a", tmp_path / "b"], io_chunk_bytes=64 * 1024, io_workers=workers,
                      staging_bytes=256 * 1024, io_timeout_s=WAIT_S, stripe_bytes=64 * 1024)
    try:
        sizes = [(i % 4 + 1) * 96 * 1024 for i in range(10)]
        store.add_regions([(f"c{i}", n) for i, n in enumerate(sizes)])
        chunks = [Chunk(i, f"c{i}", [], n) for i, n in enumerate(sizes)]
        written: set[int] = set()
        reads = ReadAhead(store, chunks, {i: store.region(f"c{i}").capacity for i in range(10)}, 3,
                          lambda c: c.index in written)
        for p in range(1, 7):
            order = [(i + 2 * p) % 10 for i in range(10)]
            done: set[int] = set()
            reads.prefetch(order, done)
            for c in order:
                buf = reads.take(c)
                view = buf.data[:sizes[c]]
                if c not in written:
                    view.zero_()
                view.add_(p)
                written.add(c)
                done.add(c)
                reads.release(buf, store.write(f"c{c}", buf.data[:reads.capacity[c]]))
                reads.prefetch(order, done)
        store.fence()
        for i, n in enumerate(sizes):
            out = store.aligned_empty(store.region(f"c{i}").capacity)
            store.wait(store.read(f"c{i}", out))
            assert torch.equal(out[:n], torch.full((n,), sum(range(1, 7)), dtype=torch.uint8)), f"chunk {i}"
    finally:
        store.close()
