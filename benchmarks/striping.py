"""Striping the store over 1, 2 and 4 simulated drives: store write/read GB/s and the disk-bound optimizer step.

Method (docs/striping.md): each drive is a loop device (``losetup --direct-io=on``) over an image file on this
machine's disk, with its own ext4; this process joins a cgroup-v1 ``blkio`` group that throttles every loop
device's reads and writes to the same rate (``blkio.throttle.read_bps_device``/``write_bps_device``). The rate is
chosen from this disk's raw bandwidth measured first in the same run: ``--rate-fraction`` of the slower of raw
write/read, divided by the largest N, so even N drives together stay below what the disk underneath can do and
each drive is bound by its throttle, not by the shared disk. Needs root, cgroup-v1 blkio, losetup, mkfs.ext4.

Rounds alternate the order of N (1 2 4, 4 2 1, ...); scaling figures are per-round ratios (so the disk's drift
cancels), reported as median with min-max: ``scaling_write`` = GB/s(N) / (N x GB/s(1)), ``step_vs_ideal`` =
step_s(1) / (N x step_s(N)); ``compute_s`` is the same Adam update with its state in memory, the floor
a step cannot go below however many drives. Last line: one JSON object ``{"drives": [...], ...}``.

    flock /tmp/lightning_nvme_bench.lock python benchmarks/striping.py   # about 3-6 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import MiB, raw_disk, spread  # noqa: E402

BLKIO = "/sys/fs/cgroup/blkio"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout.strip()


class Drives:
    """``count`` throttled loop-device drives mounted under ``base``; ``close`` undoes everything."""

    def __init__(self, base: str, count: int, image_bytes: int) -> None:
        self.base, self.loops, self.mounts, self.images = base, [], [], []
        self.cgroup: str | None = None
        os.makedirs(base, exist_ok=True)
        try:
            for i in range(count):
                image = os.path.join(base, f"drive{i}.img")
                with open(image, "wb") as f:
                    f.truncate(image_bytes)
                self.images.append(image)
                loop = sh("losetup", "--direct-io=on", "--find", "--show", image)
                self.loops.append(loop)
                sh("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
                mnt = os.path.join(base, f"mnt{i}")
                os.makedirs(mnt, exist_ok=True)
                sh("mount", loop, mnt)
                self.mounts.append(mnt)
        except BaseException:
            self.close()
            raise

    def throttle(self, bytes_per_s: int) -> None:
        """Join a new blkio cgroup limiting each drive to ``bytes_per_s`` each way."""
        self.cgroup = os.path.join(BLKIO, f"lightning_nvme_striping_{os.getpid()}")
        os.mkdir(self.cgroup)
        for loop in self.loops:
            rdev = os.stat(loop).st_rdev
            for kind in ("read", "write"):
                with open(os.path.join(self.cgroup, f"blkio.throttle.{kind}_bps_device"), "w") as f:
                    f.write(f"{os.major(rdev)}:{os.minor(rdev)} {bytes_per_s}")
        with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))  # every thread of this process, the store's I/O workers included

    def close(self) -> None:
        if self.cgroup is not None:
            with open(os.path.join(BLKIO, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            os.rmdir(self.cgroup)
            self.cgroup = None
        for mnt in self.mounts:
            subprocess.run(["umount", mnt], capture_output=True, timeout=120)
        for loop in self.loops:
            subprocess.run(["losetup", "-d", loop], capture_output=True, timeout=120)
        for image in self.images:
            os.remove(image)
        self.mounts, self.loops, self.images = [], [], []


def measure(dirs: list[str], args, stripe_bytes: int) -> dict[str, float]:
    """Store write and read GB/s of ``args.mib`` MiB, then the optimizer step of ``args.state_mib`` of Adam state,
    all on a store striped over ``dirs`` (one directory: the unstriped store)."""
    import torch

    from lightning_nvme.optim import OffloadedOptimizer
    from lightning_nvme.store import FlatStore

    sub = [os.path.join(d, "bench") for d in dirs]
    store = FlatStore(sub if len(sub) > 1 else sub[0], io_workers=args.workers, stripe_bytes=stripe_bytes,
                      min_free_bytes=0)
    try:
        piece = 32 * MiB
        count = args.mib * MiB // piece
        store.add_regions([(f"w{i}", piece) for i in range(count)])
        bufs = [store.aligned_empty(piece) for _ in range(4)]
        for b in bufs:
            b.fill_(7)
        t0 = time.perf_counter()
        for i in range(count):
            store.write(f"w{i}", bufs[i % len(bufs)])
            if i >= len(bufs) - 1:
                store.fence([f"w{i - len(bufs) + 1}"])  # a buffer is reused once its write is done
        store.fence(durable=True)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        handles = []
        for i in range(count):
            if len(handles) >= len(bufs):
                handles.pop(0).wait()
            handles.append(store.read(f"w{i}", bufs[i % len(bufs)]))
        for h in handles:
            h.wait()
        read_s = time.perf_counter() - t0
        torch.manual_seed(0)
        n = args.state_mib * MiB // 8  # Adam: two fp32 moments per parameter
        params = [torch.nn.Parameter(torch.randn(n // 8)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        # the update's compute alone (state in memory), so a step that stops being disk-bound is seen as such
        resident = torch.optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-4)
        for q, p in zip(resident.param_groups[0]["params"], params):
            q.grad = p.grad
        resident.step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            resident.step()
        compute_s = (time.perf_counter() - t0) / args.steps
        del resident
        opt = torch.optim.Adam(params, lr=1e-4)
        off = OffloadedOptimizer(opt, store, chunk_bytes=32 * MiB)
        opt.step()  # creates the state
        store.fence(durable=True)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        store.fence(durable=True)
        step_s = (time.perf_counter() - t0) / args.steps
        off.close()
    finally:
        store.close(delete=True)
    total = count * piece
    return {"write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9, "step_s": step_s,
            "compute_s": compute_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drives", default="1,2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mib", type=int, default=256, help="MiB written then read through the store per measurement")
    p.add_argument("--state-mib", type=int, default=128, help="Adam state of the disk-bound optimizer step")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--workers", type=int, default=4, help="I/O workers per drive")
    p.add_argument("--stripe-mib", type=int, default=8)
    p.add_argument("--rate-fraction", type=float, default=0.4,
                   help="all drives together get this fraction of the raw disk's (slower) bandwidth")
    p.add_argument("--dir", default="/tmp/stripe/bench", help="scratch directory on the disk under test")
    args = p.parse_args()
    ns = [int(x) for x in args.drives.split(",")]
    if os.geteuid() != 0 or not os.path.isdir(BLKIO) or not shutil.which("losetup"):
        raise SystemExit("needs root, cgroup-v1 blkio (/sys/fs/cgroup/blkio) and losetup")
    os.makedirs(args.dir, exist_ok=True)
    load_before = os.getloadavg()
    raw_w, raw_r = raw_disk(args.dir, 512 * MiB)
    rate = int(args.rate_fraction * min(raw_w, raw_r) * 1e9 / max(ns))
    image = (args.mib + 2 * args.state_mib) * MiB // min(ns) + 256 * MiB
    print(f"raw disk: write {raw_w:.2f} GB/s, read {raw_r:.2f} GB/s -> {rate / 1e6:.0f} MB/s per drive "
          f"({max(ns)} x {rate / 1e6:.0f} = {max(ns) * rate / 1e9:.2f} GB/s <= {args.rate_fraction} x raw)", flush=True)
    drives = Drives(args.dir, max(ns), image)
    rounds: list[dict[int, dict[str, float]]] = []
    try:
        drives.throttle(rate)
        for r in range(args.rounds):
            order = ns if r % 2 == 0 else list(reversed(ns))
            figures = {}
            for n in order:
                figures[n] = measure(drives.mounts[:n], args, args.stripe_mib * MiB)
                print(f"round {r} N={n}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures[n].items()), flush=True)
            rounds.append(figures)
    finally:
        drives.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    records = []
    for n in ns:
        rec: dict = {"n": n}
        for key in ("write_GBps", "read_GBps", "step_s", "compute_s"):
            rec[key] = round(statistics.median(f[n][key] for f in rounds), 4)
        rec["scaling_write_spread"] = spread([f[n]["write_GBps"] / (n * f[1]["write_GBps"]) for f in rounds])
        rec["scaling_read_spread"] = spread([f[n]["read_GBps"] / (n * f[1]["read_GBps"]) for f in rounds])
        rec["step_vs_ideal_spread"] = spread([f[1]["step_s"] / (n * f[n]["step_s"]) for f in rounds])
        rec["scaling_write"] = rec["scaling_write_spread"]["median"]
        rec["scaling_read"] = rec["scaling_read_spread"]["median"]
        rec["step_vs_ideal"] = rec["step_vs_ideal_spread"]["median"]
        records.append(rec)
    print(json.dumps({"drives": records, "rate_MBps_per_drive": round(rate / 1e6, 1),
                      "raw_write_GBps": round(raw_w, 3), "raw_read_GBps": round(raw_r, 3),
                      "rounds": args.rounds, "mib": args.mib, "state_mib": args.state_mib,
                      "stripe_MiB": args.stripe_mib, "workers_per_drive": args.workers,
                      "load_before": [round(x, 2) for x in load_before],
                      "load_after": [round(x, 2) for x in os.getloadavg()],
                      "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}))


if __name__ == "__main__":
    main()
