"""Where a step's time goes: cheap counters every benchmark records, and the ``--profile`` tools.

Why counters beside the wall clock: on a shared 2-core machine a ratio of step times moves with the
neighbours' load, but CPU seconds per thread, page faults, context switches and the store's own
wait/busy seconds are properties of the code. ``Counters`` reads them around a timed window:

  cpu_main_s / cpu_io_s / cpu_other_s  CPU seconds of the main thread, the store's I/O workers
                                       (threads named lightning-nvme-io-*) and the rest (torch's
                                       intra-op pool, Python helper threads), from /proc/self/task
                                       (a thread that exits inside the window takes its time with it)
  runq_main_s                          time the main thread was runnable but not running (schedstat):
                                       cores taken by other threads or processes
  minflt / majflt                      page faults (getrusage): fresh mmap'd allocations fault per page
  nvcsw_main / ivcsw_main              voluntary (waits: GIL, futex, I/O) / involuntary context switches
  gc_s / gc_collections                time in and number of Python garbage collections (gc.callbacks)
  store.*                              deltas of ``FlatStore.stats``: wait_seconds is I/O the overlap
                                       failed to hide; read/write_seconds the disk's busy time

``--profile`` adds, per configuration: ``cProfile`` of one extra step (Python calls and their own
time: the per-chunk Python overhead), the torch profiler's top operators for the same step, and,
where ``py-spy`` is installed, a sampled profile of the whole child process with every thread
(``py-spy record --threads --idle --native``), summarized as the top leaf frames per thread.
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import resource
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")
IO_THREAD_PREFIX = "lightning-nvme-io"


def _thread_times() -> dict[int, tuple[float, float, int, int]]:
    """tid -> (cpu seconds, run-queue wait seconds, voluntary, involuntary context switches)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                run_ns, wait_ns, _ = (int(x) for x in f.read().split())
            with open(f"{base}/status") as f:
                status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except (OSError, ValueError):
            try:  # no schedstat in this kernel: utime+stime in clock ticks
                with open(f"{base}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                run_ns, wait_ns, status = (int(parts[11]) + int(parts[12])) * 1e9 / _TICK, 0, {}
            except OSError:
                continue  # the thread exited meanwhile
        out[int(tid)] = (run_ns / 1e9, wait_ns / 1e9, int(status.get("voluntary_ctxt_switches", 0)),
                         int(status.get("nonvoluntary_ctxt_switches", 0)))
    return out


def _group(tid: int, names: dict[int, str]) -> str:
    if tid == os.getpid():
        return "main"
    return "io" if names.get(tid, "").startswith(IO_THREAD_PREFIX) else "other"


@dataclass
class Counters:
    """Accumulates the counters over one or more ``with`` windows (e.g. the timed steps)."""

    stores: list[Any] = field(default_factory=list)  # FlatStores whose stats to difference
    cpu_main_s: float = 0.0
    cpu_io_s: float = 0.0
    cpu_other_s: float = 0.0
    runq_main_s: float = 0.0
    nvcsw_main: int = 0
    ivcsw_main: int = 0
    minflt: int = 0
    majflt: int = 0
    wall_s: float = 0.0
    gc_s: float = 0.0
    gc_collections: int = 0
    store: dict[str, float] = field(default_factory=dict)

    def _on_gc(self, phase: str, info: dict) -> None:
        import time

        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif getattr(self, "_gc_t0", None) is not None:
            self.gc_s += time.perf_counter() - self._gc_t0
            self.gc_collections += 1
            self._gc_t0 = None

    def __enter__(self) -> Counters:
        import time

        gc.callbacks.append(self._on_gc)
        self._t0 = time.perf_counter()
        self._threads = _thread_times()
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._stats = [s.stats for s in self.stores]
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        self.wall_s += time.perf_counter() - self._t0
        gc.callbacks.remove(self._on_gc)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.minflt += ru.ru_minflt - self._ru.ru_minflt
        self.majflt += ru.ru_majflt - self._ru.ru_majflt
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        for tid, (cpu, runq, vol, invol) in _thread_times().items():
            cpu0, runq0, vol0, invol0 = self._threads.get(tid, (0.0, 0.0, 0, 0))
            group = _group(tid, names)
            setattr(self, f"cpu_{group}_s", getattr(self, f"cpu_{group}_s") + cpu - cpu0)
            if group == "main":
                self.runq_main_s += runq - runq0
                self.nvcsw_main += vol - vol0
                self.ivcsw_main += invol - invol0
        for store, before in zip(self.stores, self._stats):
            delta = store.stats - before
            for f in fields(delta):
                self.store[f.name] = self.store.get(f.name, 0) + getattr(delta, f.name)

    def as_dict(self, per: int = 1) -> dict[str, float]:
        """The counters divided by ``per`` (e.g. the number of steps), rounded for printing."""
        out = {f.name: getattr(self, f.name) / per for f in fields(self) if f.name not in ("stores", "store")}
        out.update({f"store_{k}": v / per for k, v in self.store.items()})
        return {k: round(v, 4) for k, v in out.items()}


def python_profile(fn: Callable[[], Any], top: int = 15) -> str:
    """cProfile of one call of ``fn``: the functions with the most own time, with their call counts."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def torch_profile(fn: Callable[[], Any], top: int = 15) -> str:
    """The torch profiler's top CPU operators (own time) over one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def pyspy_command(out_path: str) -> list[str]:
    """Prefix that runs a command under ``py-spy record`` (every thread, idle and native frames), or []
    where py-spy is not installed (``pip install py-spy``)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return []
    return [exe, "record", "--threads", "--idle", "--native", "-r", "50", "-f", "raw", "-o", out_path, "--"]


def summarize_pyspy(raw_path: str, top: int = 12) -> str:
    """Top leaf frames per thread from a py-spy raw (collapsed stacks) file: where each thread's
    samples end, i.e. what it was doing (or waiting in)."""
    per_thread: dict[str, Counter] = {}
    try:
        with open(raw_path) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                frames = stack.split(";")
                heads = []
                for f in frames:  # [process ...;]* [thread ...]: the innermost process and its thread
                    if not f.startswith(("process ", "thread ")):
                        break
                    heads = [h for h in heads if not h.startswith("process ")] if f.startswith("process ") else heads
                    heads.append(f.split(":")[0] if f.startswith("process ") else f)
                thread = " ".join(heads) or "?"
                leaf = frames[-1]
                per_thread.setdefault(thread, Counter())[leaf] += int(count)
    except OSError as e:
        return f"(no py-spy profile: {e})"
    lines = []
    for thread, leaves in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(leaves.values())
        lines.append(f"{thread}: {total} samples")
        for leaf, n in leaves.most_common(top):
            lines.append(f"  {100 * n / total:5.1f}%  {leaf}")
    return "\n".join(lines)


def run_profiled(cmd: list[str], raw_path: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` under py-spy when available (its own messages go to stderr)."""
    return subprocess.run(pyspy_command(raw_path) + cmd, **kwargs)


class PhaseClock:
    """Where one training step's time goes, phase by phase: ``mark(name)`` closes the phase running so far and
    opens ``name``; each phase accumulates, over the steps marked, its wall time, the CPU seconds of the main
    thread, the store's I/O workers and the rest (torch's intra-op pool, numba's workers), and the store's
    bytes moved and time callers waited, split by what they waited for.

    Why split the wait: a step that is neither the disk's nor the CPU's length has lost its overlap somewhere,
    and ``FlatStore.wait`` is where the main thread sits when it is lost. ``classify(handle)`` names the
    request (e.g. a block's read, an optimizer chunk's read, a write-back); ``watch(store, classify)`` wraps the
    store's ``wait`` for that (``wait_<kind>_s`` and ``waits_<kind>`` per phase). ``timed(obj, name, what)``
    wraps a method the same way (``<what>_s`` and ``<what>_calls`` per phase: e.g. the optimizer's update)."""

    def __init__(self) -> None:
        self.stores: list[Any] = []
        self.phases: dict[str, Counter] = {}
        self._current: str | None = None
        self._t0 = 0.0
        self._snap: tuple[dict[int, tuple[float, float, int, int]], list[Any]] | None = None

    def watch(self, store: Any, classify: Callable[[Any], str]) -> None:
        import time

        self.stores.append(store)
        wait = store.wait

        def timed_wait(handle: Any) -> None:
            t = time.perf_counter()
            try:
                wait(handle)
            finally:
                self._add(f"wait_{classify(handle)}_s", time.perf_counter() - t)
                self._add(f"waits_{classify(handle)}", 1)
        store.wait = timed_wait

    def timed(self, obj: Any, name: str, what: str) -> None:
        import time

        method = getattr(obj, name)

        def timed_method(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._add(f"{what}_s", time.perf_counter() - t)
                self._add(f"{what}_calls", 1)
        setattr(obj, name, timed_method)

    def _add(self, key: str, value: float) -> None:
        if self._current is not None:
            self.phases.setdefault(self._current, Counter())[key] += value

    def mark(self, phase: str | None) -> None:
        """Close the running phase (if any) and open ``phase`` (``None``: none until the next mark)."""
        import time

        now = time.perf_counter()
        threads = _thread_times()
        stats = [s.stats for s in self.stores]
        if self._current is not None and self._snap is not None:
            before, stats0 = self._snap
            c = self.phases.setdefault(self._current, Counter())
            c["wall_s"] += now - self._t0
            c["steps"] += 1
            names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
            for tid, (cpu, _runq, _vol, _invol) in threads.items():
                c[f"cpu_{_group(tid, names)}_s"] += cpu - before.get(tid, (0.0, 0.0, 0, 0))[0]
            for s0, s1 in zip(stats0, stats):
                delta = s1 - s0
                c["store_wait_s"] += delta.wait_seconds
                c["bytes_read"] += delta.bytes_read
                c["bytes_written"] += delta.bytes_written
        self._current, self._t0, self._snap = phase, now, (threads, stats)

    def as_dict(self, per: int = 1) -> dict[str, dict[str, float]]:
        """Each phase's figures divided by ``per`` (e.g. the steps timed), rounded."""
        return {p: {k: round(v / per, 4) for k, v in sorted(c.items()) if k != "steps"} for p, c in self.phases.items()}
