"""FlatStore sequential throughput vs a raw O_DIRECT loop on the same disk, and vs aiofiles.

Each pair writes then reads ``--gib`` GiB three ways, back to back on the same disk:
  store:    FlatStore.write/read of 32 MiB page-aligned tensors, all submitted asynchronously
            (as the offload strategy does), writes timed through ``fence(durable=True)``;
  raw:      8 MiB ``pwrite``/``pread`` at consecutive offsets from ``--raw-threads`` threads, writes
            timed through ``fdatasync`` (benchmarks/_disk.py);
  aiofiles: the project's pinned async-file library, same mode and queue depth (one file handle per
            concurrent task, ``seek`` + ``write``/``readinto`` of 8 MiB), writes timed through fdatasync.
Reads are cold: O_DIRECT, or in buffered mode the file's cache is dropped first. The order of store
and raw alternates between pairs (A B, B A, ...). Figures are medians over pairs; ratios are medians
of per-pair ratios. Memory stays bounded: the sources/destinations are a few 32 MiB buffers reused.

Last line printed: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import aiofiles
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import GiB, Memory, MiB, Pairs, current_rss_mib, direct_supported, drop_file_cache, gbps, peak_rss_mib, raw_read, raw_write  # noqa: E402

from lightning_nvme.store import FlatStore  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUEST = 32 * MiB  # one store request: a large tensor, as an optimizer-state chunk would be
BUFFERS = 4  # distinct source / destination tensors cycled through


def store_write(store: FlatStore, srcs: list[torch.Tensor], nbytes: int) -> float:
    t0 = time.perf_counter()
    for i, off in enumerate(range(0, nbytes, REQUEST)):
        store.write("bench", srcs[i % len(srcs)], offset=off)
    store.fence(durable=True)
    return time.perf_counter() - t0


def store_read(store: FlatStore, dsts: list[torch.Tensor], nbytes: int) -> float:
    if store.mode == "buffered":
        drop_file_cache(store.path)
    in_flight = [None] * len(dsts)
    t0 = time.perf_counter()
    for i, off in enumerate(range(0, nbytes, REQUEST)):
        k = i % len(dsts)
        if in_flight[k] is not None:
            store.wait(in_flight[k])  # the destination is about to be refilled: its last read must be done
        in_flight[k] = store.read("bench", dsts[k], offset=off)
    store.fence()
    return time.perf_counter() - t0


def aiofiles_io(path: str, nbytes: int, *, write: bool, direct: bool, tasks: int, base: int, memory: Memory,
                block: int = 8 * MiB) -> float:
    """Seconds for aiofiles to write ``nbytes`` from ``memory`` (through fdatasync) or cold-read them
    into it, at offset ``base`` of ``path``."""
    if not write and not direct:
        drop_file_cache(path)
    opener = (lambda p, flags: os.open(p, flags | os.O_DIRECT)) if direct else None
    next_off = [0]

    async def worker() -> None:
        async with aiofiles.open(path, "r+b", buffering=0, opener=opener) as f:
            while next_off[0] < nbytes:
                off = next_off[0]
                next_off[0] += block
                n = min(block, nbytes - off)
                await f.seek(base + off)
                buf = memory(off, n)
                done = await (f.write(buf) if write else f.readinto(buf))
                if done != n:
                    raise OSError(f"aiofiles short {'write' if write else 'read'} at {off}: {done} of {n}")
            if write:
                os.fdatasync(f.fileno())

    async def run() -> None:
        await asyncio.gather(*(worker() for _ in range(tasks)))

    t0 = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - t0


def _vs_raw(name: str, writes: list[float], reads: list[float], raw_w: list[float], raw_r: list[float]) -> dict:
    """Median GB/s of a subject measured in the same pairs as the raw baseline, and its per-pair ratios."""
    prefix = "store_staged" if name == "staged" else name
    return {
        f"{prefix}_write_GBps": round(statistics.median(writes), 3),
        f"{prefix}_read_GBps": round(statistics.median(reads), 3),
        f"{name}_write_ratio": round(statistics.median(a / b for a, b in zip(writes, raw_w)), 3),
        f"{name}_read_ratio": round(statistics.median(a / b for a, b in zip(reads, raw_r)), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB written and read per measurement")
    ap.add_argument("--pairs", type=int, default=9, help="store/raw pairs (>= 3)")
    ap.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir in the checkout)")
    ap.add_argument("--chunk-mib", type=int, default=None, help="FlatStore chunk_bytes in MiB (default: the store's)")
    ap.add_argument("--workers", type=int, default=None, help="FlatStore io_workers (default: the store's)")
    ap.add_argument("--staging-mib", type=int, default=None, help="FlatStore staging_bytes in MiB (default: the store's)")
    ap.add_argument("--raw-threads", type=int, default=4, help="threads (queue depth) of the raw baseline")
    ap.add_argument("--mode", choices=["auto", "direct", "buffered"], default="auto")
    ap.add_argument("--no-aiofiles", action="store_true")
    args = ap.parse_args()
    if args.pairs < 3:
        ap.error("--pairs must be >= 3 for a median of per-pair ratios")

    nbytes = int(args.gib * GiB) // REQUEST * REQUEST
    workdir = tempfile.mkdtemp(prefix=".bench-store-", dir=args.dir or REPO)
    try:
        kw = {k: v for k, v in [("io_chunk_bytes", args.chunk_mib and args.chunk_mib * MiB),
                                ("io_workers", args.workers), ("staging_bytes", args.staging_mib and args.staging_mib * MiB)]
              if v}
        direct = {"auto": None, "direct": True, "buffered": False}[args.mode]
        rss_start = current_rss_mib()
        store = FlatStore(workdir, direct=direct, **kw)
        raw_direct = store.mode == "direct"
        if raw_direct and not direct_supported(workdir):
            raise SystemExit(f"{workdir}: the store opened O_DIRECT but the raw probe could not")
        base = store.add_region("bench", nbytes).offset
        # Each buffer has a page-aligned view (moved zero-copy) and a view 64 bytes in (O_DIRECT refuses
        # it, so the store stages it through its bounded pool): the staged path is measured too.
        src_bufs = [store.aligned_empty(REQUEST + 4096) for _ in range(BUFFERS)]
        for k, b in enumerate(src_bufs):
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(k)))
        dst_bufs = [store.aligned_empty(REQUEST + 4096) for _ in range(BUFFERS)]
        srcs, dsts = [b[:REQUEST] for b in src_bufs], [b[:REQUEST] for b in dst_bufs]
        srcs_u, dsts_u = [b[64:64 + REQUEST] for b in src_bufs], [b[64:64 + REQUEST] for b in dst_bufs]
        # Baselines run on the store's own file, blocks and bytes: on a virtual disk, speed can depend on
        # where blocks lie and what they hold (host caching, dedup), which must not count as software.
        # And on the same memory: writes from the store's sources, reads into its destinations.
        src_views = [memoryview(s.numpy()) for s in srcs]
        dst_views = [memoryview(d.numpy()) for d in dsts]

        def source(off: int, n: int) -> memoryview:
            return src_views[(off // REQUEST) % BUFFERS][off % REQUEST:off % REQUEST + n]

        def destination(off: int, n: int) -> memoryview:
            return dst_views[(off // REQUEST) % BUFFERS][off % REQUEST:off % REQUEST + n]

        same = dict(threads=args.raw_threads, direct=raw_direct, offset=base)
        print(f"# {nbytes / GiB:.2f} GiB x {args.pairs} pairs in {workdir}; mode={store.mode} "
              f"chunk={store.io_chunk_bytes // MiB} MiB workers={store.dispatch.engine.alive_threads} "
              f"staging={store.staging_bytes // MiB} MiB raw_threads={args.raw_threads}", flush=True)

        def check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
            """The reads returned what was written: the last BUFFERS requests cycled through the buffers."""
            n_req = nbytes // REQUEST
            for i in range(max(0, n_req - BUFFERS), n_req):
                if not torch.equal(got[i % BUFFERS], want[i % BUFFERS]):
                    raise SystemExit(f"store read back wrong data for request {i}")
            for d in dst_bufs:
                d.zero_()

        # Warm-up, untimed: the first write into fresh fallocated blocks converts extents, a one-off cost
        # that would otherwise land on whichever side of pair 0 runs first.
        raw_write(store.path, nbytes, memory=source, **same)
        store_write(store, srcs, nbytes)

        w, r, aw, ar, sw, sr = Pairs([], []), Pairs([], []), [], [], [], []
        t_start = time.perf_counter()
        for p in range(args.pairs):
            def subject_w():
                w.subject.append(gbps(nbytes, store_write(store, srcs, nbytes)))

            def baseline_w():
                w.baseline.append(gbps(nbytes, raw_write(store.path, nbytes, memory=source, **same)))

            def subject_r():
                r.subject.append(gbps(nbytes, store_read(store, dsts, nbytes)))
                check(dsts, srcs)

            def baseline_r():
                r.baseline.append(gbps(nbytes, raw_read(store.path, nbytes, memory=destination, **same)))

            order = [subject_w, baseline_w, subject_r, baseline_r] if p % 2 == 0 else \
                [baseline_w, subject_w, baseline_r, subject_r]
            for step in order:
                step()
            if store.mode == "direct":  # buffered mode moves every tensor in place: nothing is staged
                sw.append(gbps(nbytes, store_write(store, srcs_u, nbytes)))  # staged path, once per pair
                sr.append(gbps(nbytes, store_read(store, dsts_u, nbytes)))
                check(dsts_u, srcs_u)
            if not args.no_aiofiles:
                aio = dict(direct=raw_direct, tasks=args.raw_threads, base=base)
                aw.append(gbps(nbytes, aiofiles_io(store.path, nbytes, write=True, memory=source, **aio)))
                ar.append(gbps(nbytes, aiofiles_io(store.path, nbytes, write=False, memory=destination, **aio)))
            print(f"pair {p}: write store {w.subject[-1]:.2f} raw {w.baseline[-1]:.2f} GB/s | "
                  f"read store {r.subject[-1]:.2f} raw {r.baseline[-1]:.2f} GB/s"
                  + (f" | staged write {sw[-1]:.2f} read {sr[-1]:.2f}" if sw else "")
                  + (f" | aiofiles write {aw[-1]:.2f} read {ar[-1]:.2f} GB/s" if aw else ""), flush=True)
        elapsed = time.perf_counter() - t_start
        stats = store.stats
        result = {
            "benchmark": "store_throughput",
            "gib": round(nbytes / GiB, 3),
            "pairs": args.pairs,
            "mode": store.mode,
            "store_write_GBps": round(w.subject_median, 3),
            "store_read_GBps": round(r.subject_median, 3),
            "raw_write_GBps": round(w.baseline_median, 3),
            "raw_read_GBps": round(r.baseline_median, 3),
            "write_ratio": round(w.ratio, 3),
            "read_ratio": round(r.ratio, 3),
            "write_ratio_min": round(min(s / b for s, b in zip(w.subject, w.baseline)), 3),
            "read_ratio_min": round(min(s / b for s, b in zip(r.subject, r.baseline)), 3),
            "peak_rss_MiB": round(peak_rss_mib(), 1),
            "rss_at_start_MiB": round(rss_start, 1),
            "staging_MiB": store.staging_bytes // MiB,
            "buffers_MiB": 2 * BUFFERS * (REQUEST + 4096) // MiB,
            "data_MiB": nbytes // MiB,
            "chunk_MiB": store.io_chunk_bytes // MiB,
            "workers": store.dispatch.engine.alive_threads,
            "raw_threads": args.raw_threads,
            "fsyncs": stats.fsyncs,
            "seconds": round(elapsed, 1),
        }
        for name, subject_w, subject_r in (("staged", sw, sr), ("aiofiles", aw, ar)):
            if subject_w:
                result.update(_vs_raw(name, subject_w, subject_r, w.baseline, r.baseline))
        store.close(delete=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
