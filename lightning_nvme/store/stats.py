"""Counters the store keeps for telemetry: bytes moved, time the disk was busy, time callers waited."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass
class IOStats:
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    read_seconds: float = 0.0  # summed over requests, submit -> done
    write_seconds: float = 0.0
    wait_seconds: float = 0.0  # time callers spent blocked in wait()/fence(): I/O the overlap failed to hide
    fsyncs: int = 0

    def copy(self) -> IOStats:
        return IOStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: IOStats) -> IOStats:
        return IOStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


class StatsRecorder:
    def __init__(self) -> None:
        self._stats = IOStats()
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def read(self) -> IOStats:
        """A copy of the counters, consistent (taken under the lock the I/O threads add under)."""
        with self._lock:
            return self._stats.copy()
