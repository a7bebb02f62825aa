"""``lightning-nvme doctor DIR DIR ...``: several disks measured one by one and striped together, the stripe
unit and worker count tuned on the striped store, and what the slowest disk costs.

Why: a striped store's requests are cut round-robin, so every disk moves the same share of the bytes and the
slowest sets the pace: the set delivers about ``N x slowest``, not the sum. The doctor says how much that is
below the sum (the price of an unequal disk) and which disk it is, so the user can leave it out or accept it.
Two stripes on one device gain nothing; that is reported too (``preflight.resources.shared_devices``).
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_nvme.constants import MiB
from lightning_nvme.doctor.profile import IOProfile, combined, slowest_disk, slowest_disk_text
from lightning_nvme.fs import fsinfo
from lightning_nvme.preflight.resources import shared_devices
from lightning_nvme.settings import OffloadSettings
from lightning_nvme.store import FlatStore, aligned_empty

DEFAULT_STRIPING = (OffloadSettings.stripe_bytes, OffloadSettings.io_workers)
STRIPE_CANDIDATES = (1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
WORKER_CANDIDATES = (2, 4, 8)


def trial(dirs: Sequence[str], stripe_bytes: int, workers: int, nbytes: int, data: torch.Tensor, *,
          io_chunk_bytes: int = OffloadSettings.io_chunk_bytes, name: str = "doctor-stripes") -> tuple[float, float]:
    """Write ``nbytes`` through a fresh store over ``dirs`` (durable fence), read them back; MiB/s each way.
    (The doctor's one-directory tuning uses it too, with one directory.)"""
    store = FlatStore(list(dirs) if len(dirs) > 1 else dirs[0], io_chunk_bytes=io_chunk_bytes, io_workers=workers,
                      staging_bytes=io_chunk_bytes, stripe_bytes=stripe_bytes, name=name, io_timeout_s=120)
    try:
        store.add_region("bench", nbytes)
        t0 = time.perf_counter()
        store.write("bench", data)
        store.fence(durable=True)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.wait(store.read("bench", data))
        t_read = time.perf_counter() - t0
    finally:
        store.close(delete=True)
        for p in store.paths:
            with contextlib.suppress(OSError):
                os.remove(p + ".lock")
    return nbytes / MiB / t_write, nbytes / MiB / t_read


def random_rounds(candidates: list[tuple[int, int]], run: Callable[[tuple[int, int]], tuple[float, float]], *,
                  seconds: float, min_rounds: int, max_rounds: int, seed: int
                  ) -> list[dict[tuple[int, int], tuple[float, float]]]:
    """``run`` every candidate once per round, each round in a new random order (a disk drifts over minutes),
    until ``seconds`` are spent (at least ``min_rounds``, at most ``max_rounds``)."""
    rng = random.Random(seed)
    rounds: list[dict[tuple[int, int], tuple[float, float]]] = []
    t_start = time.perf_counter()
    while len(rounds) < max_rounds and (len(rounds) < min_rounds or time.perf_counter() - t_start < seconds):
        order = candidates[:]
        rng.shuffle(order)
        rounds.append({c: run(c) for c in order})
    return rounds


@dataclass
class StripeReport:
    each: list[tuple[float, float]]  # (write, read) MiB/s of each directory alone, medians
    together: tuple[float, float]  # of the striped store with the default unit and workers
    rounds: int

    def slowest(self) -> tuple[int, float]:
        """The directory with the lowest combined MiB/s, and what it costs (``profile.slowest_disk``)."""
        return slowest_disk(self.speeds)

    @property
    def speeds(self) -> list[float]:
        """Combined MiB/s of each directory alone."""
        return [combined(*e) for e in self.each]

    def slowest_text(self, dirs: Sequence[str]) -> str:
        return slowest_disk_text(dirs, self.speeds)

    @property
    def scaling(self) -> float:
        """Striped combined MiB/s over the sum of the disks alone (1.0: perfect)."""
        return combined(*self.together) / sum(combined(*e) for e in self.each)


def measure(dirs: Sequence[str], nbytes: int, rounds: int = 2) -> StripeReport:
    """Each directory alone and all striped, in alternating order per round (disks drift over minutes)."""
    data = _random(nbytes * len(dirs))  # page-aligned: moved in place, like the store's own buffers
    each: list[list[tuple[float, float]]] = [[] for _ in dirs]
    together: list[tuple[float, float]] = []
    for r in range(rounds):
        order = list(range(len(dirs) + 1))
        for k in order if r % 2 == 0 else reversed(order):
            if k == len(dirs):
                together.append(trial(dirs, *DEFAULT_STRIPING, nbytes * len(dirs), data))
            else:
                each[k].append(trial([dirs[k]], *DEFAULT_STRIPING, nbytes, data[:nbytes]))
    med = [(statistics.median(w for w, _ in e), statistics.median(r for _, r in e)) for e in each]
    return StripeReport(med, (statistics.median(w for w, _ in together), statistics.median(r for _, r in together)),
                        rounds)


def tune(dirs: Sequence[str], *, nbytes: int, seconds: float, min_rounds: int = 2, max_rounds: int = 4,
         stripes: tuple[int, ...] = STRIPE_CANDIDATES, workers: tuple[int, ...] = WORKER_CANDIDATES,
         min_gain: float = 0.05, seed: int = 0) -> IOProfile:
    """Every (stripe_bytes, io_workers) on the striped store, in rounds of new random order until ``seconds`` are
    spent; the pick is the best median per-round ratio to the default, kept only when it beats it by ``min_gain``
    (else the default: the difference is within the disks' noise)."""
    candidates = sorted({(s, w) for s in stripes for w in workers} | {DEFAULT_STRIPING})
    data = _random(nbytes)
    rounds = random_rounds(candidates, lambda c: trial(dirs, *c, nbytes, data), seconds=seconds,
                           min_rounds=min_rounds, max_rounds=max_rounds, seed=seed)
    ratio = {c: statistics.median(combined(*rd[c]) / combined(*rd[DEFAULT_STRIPING]) for rd in rounds)
             for c in candidates}
    best = max(candidates, key=lambda c: ratio[c])
    if ratio[best] < 1 + min_gain:
        best = DEFAULT_STRIPING
    trials = [{"stripe_bytes": s, "io_workers": w, "rounds": len(rounds), "ratio_to_default": round(ratio[(s, w)], 3),
               "write_mib_s": round(statistics.median(rd[(s, w)][0] for rd in rounds), 1),
               "read_mib_s": round(statistics.median(rd[(s, w)][1] for rd in rounds), 1)} for s, w in candidates]
    chosen = next(t for t in trials if (t["stripe_bytes"], t["io_workers"]) == best)
    return IOProfile(io_chunk_bytes=OffloadSettings.io_chunk_bytes, io_workers=best[1], stripe_bytes=best[0],
                     stripe_dirs=[os.path.abspath(d) for d in dirs], write_mib_s=chosen["write_mib_s"],
                     read_mib_s=chosen["read_mib_s"], speedup_vs_default=round(ratio[best], 3),
                     default={"stripe_bytes": DEFAULT_STRIPING[0], "io_workers": DEFAULT_STRIPING[1]},
                     path=os.path.abspath(dirs[0]), direct_io=all(fsinfo.probe_direct_io(d)[0] for d in dirs),
                     trials=trials)


def device_warnings(dirs: Sequence[str]) -> list[str]:
    return shared_devices({"DIR": list(dirs)})


def _random(n: int) -> torch.Tensor:
    t = aligned_empty(n)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    return t
