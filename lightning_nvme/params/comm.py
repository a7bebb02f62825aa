"""The two collectives that move block-sized tensors between ranks (``all_gather``, ``all_to_all``), through the
process group's backend or, when every rank runs on this host with CPU tensors, through shared memory.

Why shared memory: Gloo moves a CPU tensor between processes of one host over TCP on loopback. Each byte is copied
into a socket, through the kernel and out again by Gloo's threads, on the same cores that the ranks' compute uses:
an all-gather of 64 MiB ran at 0.35–0.51 GB/s on the 2-core machine of docs/performance.md, so a 2.56 B model's
15 GB of collectives per rank and step took ~30 s of the cores' time, the largest term after the disk's. Here each
rank copies its part into an arena every rank maps (a ``memfd``) and copies what it receives out of it: one memory
copy each way, at memory speed, and a barrier per chunk on a small process group of the comm's own (the only use of
the backend). Bytes are moved, never added, so the results are bitwise the backend's; the rank-order sums stay
``ordered_sum.ScatterSum``'s.

Order: collectives are started in the same order on every rank (the same model, the same hooks) and each rank's
comm runs them one after another on its own thread, so the chunks of every rank meet at the same barriers. A
``Work``'s ``wait()`` returns when this rank's part is done (its output filled, its input no longer read).
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

MODES = ("auto", "shared_memory", "backend")  # the ``collectives`` setting
_ALIGN = 64  # bytes: every cell of the arena starts on a cache line


class Work(Protocol):
    def wait(self) -> Any: ...


class Comm(Protocol):
    """What ``ShardedParams`` and ``ScatterSum`` call: ``out`` gets every rank's ``shard`` in rank order;
    ``recv`` gets, from each rank in rank order, that rank's piece ``counts[me]`` of its ``flat`` (cut into
    consecutive pieces of ``counts``)."""

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work: ...

    def all_to_all(self, recv: torch.Tensor, flat: torch.Tensor, counts: Sequence[int]) -> Work: ...

    def close(self) -> None: ...


class BackendComm:
    """The process group's own collectives, started asynchronously."""

    name = "backend"

    def __init__(self, group: Any) -> None:
        self.group = group

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return gather(out, shard, group=self.group, async_op=True)

    def all_to_all(self, recv: torch.Tensor, flat: torch.Tensor, counts: Sequence[int]) -> Work:
        me = dist.get_rank(self.group)
        return dist.all_to_all_single(recv, flat, output_split_sizes=[counts[me]] * len(counts),
                                      input_split_sizes=list(counts), group=self.group, async_op=True)

    def close(self) -> None:
        pass


class _Done:
    """A shared-memory collective's completion, set by the comm's thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise RuntimeError(f"a shared-memory collective failed on this rank: {self.error!r}") from self.error

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._event.set()


class SharedMemoryComm:
    """Collectives among the ``world`` ranks of ``group``, all on this host, through an arena of ``arena_bytes`` in
    shared memory (the pool's one size: resident in every rank once touched). The arena has two halves used in
    turn, one chunk per barrier: a rank writes chunk k+2 into a half only after the barrier of chunk k+1, which every
    rank passes only after reading chunk k out of it. Build it with ``open_comm``."""

    name = "shared_memory"

    def __init__(self, arena: mmap.mmap, rank: int, world: int, sync_group: Any) -> None:
        self.rank, self.world, self._sync = rank, world, sync_group
        self._map = arena
        self._bytes = torch.frombuffer(arena, dtype=torch.uint8)
        self._half = (self._bytes.numel() // 2) // _ALIGN * _ALIGN
        self._chunks = 0  # chunks moved so far: which half the next one uses
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], _Done] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lightning_nvme-shm-comm", daemon=True)
        self._thread.start()

    # ---- the collectives ------------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work:
        n = shard.numel()
        if out.numel() != n * self.world or out.dtype != shard.dtype:
            raise ValueError(f"all_gather: out has {out.numel()} {out.dtype} elements, need {n * self.world} "
                             f"{shard.dtype}")
        src, dst = shard.reshape(-1), out.view(self.world, n)

        def run() -> None:
            per = self._cell(self.world, shard.element_size())
            for a in range(0, max(n, 1), per):
                b = min(n, a + per)
                cells = self._cells(self.world, per, shard.dtype)
                cells[self.rank, :b - a].copy_(src[a:b])
                dist.barrier(group=self._sync)
                dst[:, a:b].copy_(cells[:, :b - a])

        return self._submit(run)

    def all_to_all(self, recv: torch.Tensor, flat: torch.Tensor, counts: Sequence[int]) -> Work:
        counts = list(counts)
        mine = counts[self.rank]
        if len(counts) != self.world or flat.numel() != sum(counts) or recv.numel() != mine * self.world:
            raise ValueError(f"all_to_all: {flat.numel()} elements cut into {counts}, recv {recv.numel()} "
                             f"(need {mine} x {self.world})")
        starts = [sum(counts[:r]) for r in range(self.world)]
        src, dst = flat.reshape(-1), recv.view(self.world, mine)
        longest = max(counts)

        def run() -> None:
            # cell (i, j): rank i's piece for rank j; a rank's own piece never goes through the arena
            per = self._cell(self.world * self.world, flat.element_size())
            for a in range(0, max(longest, 1), per):
                cells = self._cells(self.world * self.world, per, flat.dtype).view(self.world, self.world, per)
                for j in range(self.world):
                    b = min(counts[j], a + per)
                    if j != self.rank and b > a:
                        cells[self.rank, j, :b - a].copy_(src[starts[j] + a:starts[j] + b])
                dist.barrier(group=self._sync)
                b = min(mine, a + per)
                if b > a:
                    for i in range(self.world):
                        part = src[starts[self.rank] + a:starts[self.rank] + b] if i == self.rank else cells[i, self.rank, :b - a]
                        dst[i, a:b].copy_(part)

        return self._submit(run)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if dist.is_initialized():
            dist.destroy_process_group(self._sync)
        del self._bytes
        try:
            self._map.close()
        except BufferError:  # a view still points into the arena (an error mid-collective): unmapped at exit
            pass

    # ---- the arena ------------------------------------------------------------------------------------
    def _cell(self, cells: int, itemsize: int) -> int:
        """Elements per cell when half the arena is cut into ``cells`` aligned cells."""
        per = (self._half // cells) // _ALIGN * _ALIGN // itemsize
        if per < 1:
            raise ValueError(f"the shared-memory arena ({2 * self._half} bytes) is too small for {cells} cells")
        return per

    def _cells(self, cells: int, per: int, dtype: torch.dtype) -> torch.Tensor:
        """The next chunk's half of the arena as ``cells`` rows of ``per`` elements."""
        half = self._chunks % 2
        self._chunks += 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = self._bytes[half * self._half: half * self._half + cells * per * itemsize]
        return raw.view(dtype).view(cells, per)

    # ---- the thread -----------------------------------------------------------------------------------
    def _submit(self, run: Callable[[], None]) -> Work:
        done = _Done()
        self._queue.put((run, done))
        return done

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            run, done = item
            try:
                with torch.no_grad():
                    run()
            except BaseException as error:  # handed to whoever waits for it
                done.set(error)
            else:
                done.set()


def open_comm(mode: str, group: Any, device: torch.device, arena_bytes: int) -> Comm:
    """The comm for ``mode`` (``MODES``): ``"backend"``; ``"shared_memory"`` (an error naming why if the ranks
    cannot share memory); ``"auto"``: shared memory for CPU tensors when every rank maps the same arena, else the
    backend. A collective: every rank of ``group`` calls it, in the same order."""
    if mode not in MODES:
        raise ValueError(f"collectives={mode!r}: one of {MODES}")
    if mode == "backend" or group is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return BackendComm(group)
    why = None if device.type == "cpu" else f"the tensors are on {device}, not the CPU"
    if why is None and arena_bytes < 4 * _ALIGN * dist.get_world_size(group) ** 2:
        why = f"collective_buffer_bytes={arena_bytes} bytes is too small for {dist.get_world_size(group)} ranks"
    shared = None if why else _share_arena(group, arena_bytes)
    if shared is None:
        why = why or "the ranks do not run on one host (they cannot map one another's memory)"
        if mode == "shared_memory":
            raise ValueError(f"collectives='shared_memory': {why}. Fix: collectives='auto' or 'backend'.")
        return BackendComm(group)
    ranks = dist.get_process_group_ranks(group)
    sync = dist.new_group(ranks, backend="gloo")
    return SharedMemoryComm(shared, dist.get_rank(group), len(ranks), sync)


def _share_arena(group: Any, nbytes: int) -> mmap.mmap | None:
    """Rank 0 of ``group`` makes an anonymous shared file of ``nbytes`` and writes a random token into it; every rank
    maps it through ``/proc/<pid>/fd`` (which works only on the same host, in the same process namespace) and checks
    the token. Returns the mapping when every rank succeeded, else ``None`` on every rank."""
    first = dist.get_global_rank(group, 0)
    me = dist.get_rank(group)
    fd = -1
    offer: list[Any] = [None]
    if me == 0:
        fd = os.memfd_create("lightning_nvme-collectives", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        token = os.urandom(16)
        os.pwrite(fd, token, 0)
        offer = [(os.getpid(), fd, token)]
    dist.broadcast_object_list(offer, src=first, group=group)
    pid, their_fd, token = offer[0]
    arena = None
    try:
        if me != 0:
            fd = os.open(f"/proc/{pid}/fd/{their_fd}", os.O_RDWR | os.O_CLOEXEC)
        if os.pread(fd, 16, 0) == token and os.fstat(fd).st_size == nbytes:
            arena = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        arena = None
    agreed: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(agreed, arena is not None, group=group)  # rank 0 keeps its fd open until all have mapped
    if fd >= 0:
        os.close(fd)
    if not all(agreed):
        if arena is not None:
            arena.close()
        return None
    return arena
