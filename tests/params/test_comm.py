"""``params.comm``: the shared-memory all-gather and all-to-all deliver exactly what Gloo's do (2 and 3 processes,
uneven and empty pieces, several dtypes, an arena small enough that every collective takes many chunks, several
collectives in flight at once), and ``open_comm`` chooses, or refuses, by name."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_nvme.params.comm import BackendComm, SharedMemoryComm, open_comm


def _init(rank: int, world: int, path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)


def _cases(rank: int, world: int):
    """(dtype, per-rank shard length, all-to-all counts): the same on every rank; values differ per rank."""
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (0, 1, 7, 1000, 4099):
            counts = [(n * (r + 1)) % 97 + (r == 1) * n for r in range(world)]
            counts[0] = 0 if n == 7 else counts[0]  # a rank that owns nothing
            yield dtype, n, counts


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-2**40, 2**40, (n,), generator=g, dtype=dtype)


def _worker(rank: int, world: int, path: str, arena: int, out_dir: str) -> None:
    _init(rank, world, path)
    group = dist.new_group(list(range(world)))
    shm = open_comm("shared_memory", group, torch.device("cpu"), arena)
    gloo = open_comm("backend", group, torch.device("cpu"), arena)
    assert isinstance(shm, SharedMemoryComm) and isinstance(gloo, BackendComm)
    mismatches = []
    for k, (dtype, n, counts) in enumerate(_cases(rank, world)):
        shard = _values(dtype, n, seed=1000 * k + rank)
        flat = _values(dtype, sum(counts), seed=1000 * k + 100 + rank)
        outs = {}
        for name, comm in (("shm", shm), ("gloo", gloo)):
            gathered = torch.full((n * world,), 7, dtype=dtype)
            recv = torch.full((counts[rank] * world,), 7, dtype=dtype)
            works = [comm.all_gather(gathered, shard), comm.all_to_all(recv, flat, counts)]  # both in flight
            for w in works:
                w.wait()
            outs[name] = (gathered, recv)
        for what, a, b in zip(("all_gather", "all_to_all"), outs["shm"], outs["gloo"]):
            if not torch.equal(a, b):
                mismatches.append((what, str(dtype), n, counts))
    # many collectives started before any is waited for, each larger than the arena
    big = [_values(torch.float32, 3000, seed=rank * 10 + i) for i in range(5)]
    outs = [torch.empty(3000 * world) for _ in big]
    works = [shm.all_gather(o, b) for o, b in zip(outs, big)]
    for w in works:
        w.wait()
    for i, o in enumerate(outs):
        for r in range(world):
            if not torch.equal(o[r * 3000:(r + 1) * 3000], _values(torch.float32, 3000, seed=r * 10 + i)):
                mismatches.append(("in flight", i, r))
    torch.save({"mismatches": mismatches, "chunks": shm._chunks}, os.path.join(out_dir, f"rank{rank}.pt"))
    shm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_deliver_what_gloo_delivers(world):
    arena = 4096  # bytes: a few hundred elements per cell, so most collectives take several chunks
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rendezvous"), arena, tmp), nprocs=world, join=True)
        seen = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    for r, s in enumerate(seen):
        assert s["mismatches"] == [], f"rank {r}"
        assert s["chunks"] > 60  # the small arena did cut them into chunks
    assert len({s["chunks"] for s in seen}) == 1  # every rank met the same barriers


def _choose(rank: int, world: int, path: str, out_dir: str) -> None:
    _init(rank, world, path)
    group = dist.new_group(list(range(world)))
    chosen = {}
    auto = open_comm("auto", group, torch.device("cpu"), 1 << 20)
    chosen["auto_cpu"] = auto.name
    auto.close()
    chosen["auto_meta"] = open_comm("auto", group, torch.device("meta"), 1 << 20).name
    chosen["backend"] = open_comm("backend", group, torch.device("cpu"), 1 << 20).name
    try:
        open_comm("shared_memory", group, torch.device("cpu"), 64)
        chosen["too_small"] = ""
    except ValueError as e:
        chosen["too_small"] = str(e)
    torch.save(chosen, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_open_comm_chooses_shared_memory_only_for_cpu_tensors_and_names_what_it_refuses():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_choose, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True)
        seen = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    for s in seen:
        assert s["auto_cpu"] == "shared_memory"
        assert s["auto_meta"] == "backend"  # not CPU tensors (a GPU's would go through NCCL)
        assert s["backend"] == "backend"
        assert "collective_buffer_bytes=64" in s["too_small"] and "collectives='auto'" in s["too_small"]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="collectives='fast'"):
        open_comm("fast", None, torch.device("cpu"), 1 << 20)
