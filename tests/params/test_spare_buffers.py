"""``params.spare.SpareBuffers``: block-sized work buffers come back for reuse, but never while anything still holds
their storage, and the pool keeps at most ``per_size`` of a size."""

from __future__ import annotations

import torch

from lightning_nvme.params.spare import SpareBuffers

CPU = torch.device("cpu")


def test_a_buffer_given_back_is_taken_again_instead_of_a_fresh_one():
    spare = SpareBuffers(per_size=2)
    a = spare.take(1000, torch.float32, CPU)
    ptr = a.data_ptr()
    spare.give(a)
    del a
    b = spare.take(1000, torch.float32, CPU)
    assert b.data_ptr() == ptr and spare.reused == 1
    assert spare.take(1000, torch.float32, CPU).data_ptr() != ptr  # b is out: another buffer
    assert spare.take(1000, torch.bfloat16, CPU).dtype == torch.bfloat16  # another size and dtype, another key


def test_a_buffer_still_viewed_elsewhere_is_passed_over_until_its_holder_lets_go():
    spare = SpareBuffers(per_size=2)
    a = spare.take(1000, torch.float32, CPU)
    ptr = a.data_ptr()
    saved = a[10:20].view(2, 5)  # as autograd keeps a view of a bound weight
    spare.give(a)
    del a
    b = spare.take(1000, torch.float32, CPU)
    assert b.data_ptr() != ptr and spare.held == 1  # never overwrites what ``saved`` points at
    del saved
    c = spare.take(1000, torch.float32, CPU)
    assert c.data_ptr() == ptr


def test_at_most_per_size_buffers_of_a_size_are_pooled_and_others_are_freed_as_usual():
    spare = SpareBuffers(per_size=1)
    a, b = spare.take(64, torch.float32, CPU), spare.take(64, torch.float32, CPU)
    pa = a.data_ptr()
    spare.give(a)
    spare.give(b)  # beyond the pool: not kept
    assert len(spare._free[(64, torch.float32)]) == 1
    spare.give(a)  # twice: kept once
    assert len(spare._free[(64, torch.float32)]) == 1
    del a, b
    assert spare.take(64, torch.float32, CPU).data_ptr() == pa
    spare.give(torch.empty(64))  # not the pool's: ignored
    assert spare._free[(64, torch.float32)] == []


def test_device_memory_and_a_zero_pool_pass_through():
    assert SpareBuffers(per_size=2).take(8, torch.float32, torch.device("meta")).is_meta
    off = SpareBuffers(per_size=0)
    t = off.take(8, torch.float32, CPU)
    off.give(t)
    assert off.take(8, torch.float32, CPU) is not t and off.reused == 0
