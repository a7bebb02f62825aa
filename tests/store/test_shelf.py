"""The store's shelf (regions served from memory) and the placement plan (which regions go there)."""

from __future__ import annotations

import pytest
import torch

from lightning_nvme.constants import GiB
from lightning_nvme.store import FlatStore
from lightning_nvme.strategies.placement import AUTO_HEADROOM, AUTO_SHARE, block_item, chunk_item, plan_shelf, resolve_budget


@pytest.fixture
def store(tmp_path):
    s = FlatStore(tmp_path, io_chunk_bytes=1 << 20)
    yield s
    s.close()


def test_shelved_region_is_served_from_memory_and_written_back_at_close(tmp_path):
    store = FlatStore(tmp_path, io_chunk_bytes=1 << 20)
    store.add_regions([("a", 8192), ("b", 8192)])
    before = torch.arange(8192, dtype=torch.int32).view(torch.uint8)[:8192].clone()
    store.wait(store.write("a", before))
    store.shelve(["a"])  # its bytes come from the disk once
    disk = store.stats
    out = torch.zeros(8192, dtype=torch.uint8)
    store.wait(store.read("a", out))
    assert torch.equal(out, before)
    after = before.flip(0).contiguous()
    store.wait(store.write("a", after))
    store.wait(store.read("a", out))
    assert torch.equal(out, after)
    partial = torch.full((4096,), 7, dtype=torch.uint8)
    store.wait(store.write("a", partial, offset=4096))
    assert store.stats.bytes_read == disk.bytes_read and store.stats.bytes_written == disk.bytes_written
    assert store.shelf.bytes_read == 2 * 8192 and store.shelf.bytes_written == 8192 + 4096
    store.close()  # writes the shelf back: a reopened store reads the true bytes
    reopened = FlatStore(tmp_path, reopen=True, io_chunk_bytes=1 << 20)
    try:
        reopened.wait(reopened.read("a", out))
        assert torch.equal(out[:4096], after[:4096]) and torch.equal(out[4096:], partial)
    finally:
        reopened.close()


def test_a_discarded_shelved_region_is_not_written_back(tmp_path):
    """``discard_shelved``: for an owner that never reads the region again (parameter blocks restored into the
    module): close writes nothing for it, and its disk copy keeps the bytes it had before it was shelved."""
    store = FlatStore(tmp_path, io_chunk_bytes=1 << 20)
    store.add_regions([("a", 8192), ("b", 8192)])
    old = torch.full((8192,), 1, dtype=torch.uint8)
    store.wait(store.write("a", old))
    store.wait(store.write("b", old))
    store.shelve(["a", "b"])
    store.wait(store.write("a", torch.full((8192,), 2, dtype=torch.uint8)))
    store.wait(store.write("b", torch.full((8192,), 3, dtype=torch.uint8)))
    store.discard_shelved(["a"])
    written = store.stats.bytes_written
    assert store.shelved("a") is None and store.shelf.nbytes == 8192
    store.close()
    assert store.stats.bytes_written == written + 8192  # "b" only
    reopened = FlatStore(tmp_path, reopen=True, io_chunk_bytes=1 << 20)
    out = torch.empty(8192, dtype=torch.uint8)
    try:
        reopened.wait(reopened.read("a", out))
        assert torch.equal(out, old)
        reopened.wait(reopened.read("b", out))
        assert bool((out == 3).all())
    finally:
        reopened.close()


def test_work_in_the_shelf_itself_costs_no_copy(store):
    store.add_regions([("a", 4096)])
    store.shelve(["a"], load=False)
    held = store.shelved("a")
    assert held is not None and held.numel() == store.region("a").capacity
    assert store.shelved("nope") is None
    held.fill_(3)
    store.wait(store.write("a", held))  # the caller updated the shelf in place
    out = torch.zeros(4096, dtype=torch.uint8)
    store.wait(store.read("a", out))
    assert (out == 3).all()


def test_placement_is_greedy_by_io_per_byte():
    blocks = [block_item(f"params/{i}", 100, 0, True) for i in range(3)]  # 3 bytes of I/O per byte
    frozen = block_item("params/frozen", 100, 100, False)  # read twice, never written: 2
    chunks = [chunk_item(f"opt/{i}", 60) for i in range(4)]  # read + written: 2
    lora = block_item("params/lora", 100, 96, True)  # frozen head, 4 trainable bytes: 2.04
    plan = plan_shelf([*chunks, frozen, lora, *blocks], 500)
    assert {f"params/{i}" for i in range(3)} <= plan.kept  # densest first
    assert "params/lora" in plan.kept  # 2.04 > 2
    assert plan.kept & {"params/frozen", *(c.region for c in chunks)} == {"opt/0"}  # what still fits after
    assert plan.kept_bytes == 460 <= plan.budget
    assert plan.io_before == 3 * 300 + 200 + 204 + 4 * 120 and plan.io_after == 200 + 3 * 120
    assert plan_shelf(chunks, 0).kept == set() and plan_shelf(chunks, 0).io_after == 4 * 120
    new = plan.extend([chunk_item("opt/9", 40), chunk_item("opt/0", 60)])  # added mid-run; known ones kept
    assert new == ["opt/9"] and plan.kept_bytes == 500
    d = plan.as_dict()
    assert d["blocks_on_shelf"] == 4 and d["chunks_on_shelf"] == 2 and d["chunks_on_ssd"] == 3
    assert "in RAM" in plan.summary()


def test_auto_budget_is_a_share_of_available_memory_less_headroom():
    assert resolve_budget("auto", available=10 * GiB) == int(10 * GiB * AUTO_SHARE) - AUTO_HEADROOM
    assert resolve_budget("auto", available=GiB) == 0
    assert resolve_budget(123) == 123
