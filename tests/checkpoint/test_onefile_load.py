"""``onefile.load_mapped``: how this package opens a one-file checkpoint. The file is mapped shared (a private
map of the whole file is charged as memory and fails for a checkpoint larger than RAM + swap: a 40 GiB private
``UntypedStorage.from_file`` fails on a 24 GiB machine, a shared one does not), so nothing loaded may write
through to it: every tensor outside the state records is an in-memory copy."""

from __future__ import annotations

import collections
import hashlib
import os

import torch

from lightning_nvme import memory
from lightning_nvme.checkpoint import onefile


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _maps_of(path) -> list[str]:
    real = os.path.realpath(path)
    return [line.split()[1] for line in open("/proc/self/maps") if line.rstrip().endswith(real)]


def test_records_stay_mapped_shared_and_nothing_loaded_writes_to_the_file(tmp_path):
    path = tmp_path / "last.ckpt"
    weight = torch.arange(12, dtype=torch.float32)
    state = collections.OrderedDict(w=weight, tied=weight)
    state._metadata = {"": {"version": 3}}  # what load_state_dict's version hooks read
    record = torch.arange(256, dtype=torch.uint8).repeat(64)
    torch.save({"state_dict": state, "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(4)}}}],
                onefile.REF_KEY: {onefile.RECORDS_KEY: {"optimizer-0.safetensors": record}}}, path)
    before = _digest(path)

    loaded = onefile.load_mapped(str(path))
    assert any("s" in perms for perms in _maps_of(path)), "the file is mapped shared"
    got = loaded[onefile.REF_KEY][onefile.RECORDS_KEY]["optimizer-0.safetensors"]
    assert torch.equal(got, record)
    sd = loaded["state_dict"]
    assert isinstance(sd, collections.OrderedDict) and sd._metadata == {"": {"version": 3}}
    assert sd["w"] is sd["tied"]  # one copy for a tensor referenced twice
    sd["w"].add_(1)  # what an optimizer or a module would do to a loaded tensor
    loaded["optimizer_states"][0]["state"][0]["exp_avg"].mul_(3)
    del loaded, got, sd
    assert _digest(path) == before


def _meminfo_bytes(key: str) -> int:
    return memory._proc_kib("/proc/meminfo", key + ":") or 0  # the package's /proc reader (bytes)


def test_a_checkpoint_larger_than_ram_and_swap_opens(tmp_path):
    """The case the shared map is for, on any machine: a one-file checkpoint whose record is larger than RAM +
    swap (a sparse file: its space reserved with ``skip_data``, nothing written) opens, without reading it."""
    size = _meminfo_bytes("MemTotal") + _meminfo_bytes("SwapTotal") + (1 << 30)
    sparse = tmp_path / "sparse"
    sparse.touch()
    os.truncate(sparse, size)
    big = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(str(sparse), True, size))
    path = tmp_path / "big.ckpt"
    with torch.serialization.skip_data():
        torch.save({"state_dict": {"w": torch.ones(3)},
                    onefile.REF_KEY: {onefile.RECORDS_KEY: {"optimizer-0.safetensors": big}}}, path)
    del big
    loaded = onefile.load_mapped(str(path))
    assert loaded[onefile.REF_KEY][onefile.RECORDS_KEY]["optimizer-0.safetensors"].numel() == size
    assert loaded["state_dict"]["w"].shape == (3,)  # (skip_data wrote no bytes for it either)
