"""Step-overhead tooling (#14): chunk temporaries reuse heap pages, the profiling counters attribute
CPU to the right threads, and run_all prints docs/performance.md's figures table from the benchmarks' results."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


_FAULTS_SCRIPT = """
import resource, torch
from lightning_nvme.memory import keep_freed_heap, release_freed_memory, temporaries_on_heap

WARM, MEASURED = 4, 8

def minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def update_like():  # what AdamW's single-tensor update allocates per 16 MiB piece: sqrt and division
    a = torch.ones(4 << 20)
    b = a.sqrt() / 2.0
    del a, b

assert release_freed_memory(8 << 20)
update_like()
f0 = minflt()
for _ in range(MEASURED):
    update_like()  # three 16 MiB temporaries each: fresh mmaps above the fixed 8 MiB threshold
outside = minflt() - f0
with keep_freed_heap():
    for _ in range(WARM):  # the heap settles: up to three updates still grow it, depending on what it held before
        with temporaries_on_heap():
            update_like()
    f0 = minflt()
    for _ in range(MEASURED):
        with temporaries_on_heap():
            update_like()
    inside = minflt() - f0
print(outside, inside)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_update_temporaries_reuse_heap_pages_instead_of_faulting_fresh_mmaps():
    # In a fresh process: the count must not depend on what earlier tests left in this one's heap. The heap needs a
    # few updates to settle (its free chunks before the first one vary with the process's address-space layout:
    # with `ulimit -s unlimited`, i.e. the legacy mmap layout, or 1 process in ~10 under ASLR, the second and fourth
    # updates still grew it; a CI run on 2026-12-04 measured right after one warm-up and failed all three attempts),
    # so four are left out and the next eight counted. Up to three processes; every attempt is shown.
    attempts = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stderr
        outside, inside = map(int, out.stdout.split())
        assert outside > 8 * 3 * 4096 // 2, (outside, inside)  # outside, (most of) every page is faulted in
        attempts.append((inside, outside))
        if inside < outside / 4:
            return
    raise AssertionError(f"(inside, outside) page faults per attempt: {attempts}")


def test_counters_attribute_cpu_to_the_io_threads_and_count_store_waits(tmp_path):
    from _profile import Counters

    from lightning_nvme.store import FlatStore

    spun, leave = threading.Event(), threading.Event()

    def spin(seconds: float) -> None:  # like an I/O worker: busy, then still alive when the window closes
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        spun.set()
        leave.wait()

    with FlatStore(tmp_path, io_chunk_bytes=1 << 20, staging_bytes=1 << 20, io_workers=1) as store:
        store.add_region("r", 1 << 20)
        counters = Counters(stores=[store])
        with counters:
            worker = threading.Thread(target=spin, args=(0.3,), name="lightning-nvme-io-test")
            worker.start()
            spun.wait()
            store.wait(store.write("r", store.aligned_empty(1 << 20)))
        leave.set()
        worker.join()
        d = counters.as_dict()
    assert d["cpu_io_s"] >= 0.25
    assert d["cpu_main_s"] < d["cpu_io_s"]
    assert d["store_writes"] == 1 and d["store_bytes_written"] == 1 << 20
    assert d["wall_s"] > 0 and d["minflt"] >= 0


def test_run_all_table_quotes_median_min_max_with_precondition_and_command():
    import run_all

    results = {
        "optimizer_offload": {
            "train_step_ratio_spread": {"median": 1.08, "min": 1.02, "max": 1.15, "pairs": [1.02, 1.08, 1.15, 1.07, 1.1]},
            "train_step_ratio_step_mode_spread": {"median": 1.2, "min": 1.1, "max": 1.3, "pairs": [1.1, 1.2, 1.3]},
            "io_bound_vs_backward": 0.42, "raw_write_GBps": 1.3, "raw_read_GBps": 0.8},
        "ddp_offload": None,
    }
    text = run_all.table(results, "2026-12-01 14:00 UTC", "0.5–0.9")
    assert "2026-12-01 14:00 UTC" in text and "load average 0.5–0.9" in text
    row = next(line for line in text.splitlines() if 'overlap="backward"' in line)
    assert "| 1.08 (1.02–1.15) | ≤ 1.10 | 5 |" in row
    assert "I/O lower bound 0.42× backward" in row and "disk 1.30/0.80 GB/s" in row
    assert "`python benchmarks/optimizer_offload.py --params-m 50" in row
    assert "failed (see .bench-logs/ddp_offload.log)" in text
    assert "activation" not in text.lower()  # not run: no row


def test_bench_command_runs_run_all_from_a_source_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture[str]):
    from lightning_nvme.cli import main

    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "run_all.py").write_text("import json\nprint('| table |')\nprint(json.dumps({'results': {}}))\n")
    (bench / "other.py").write_text("raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["bench"]) == 0  # run_all only, not every script
    out = capfd.readouterr().out
    assert "| table |" in out and json.loads(out.strip().splitlines()[-1]) == {"results": {}}


def test_a_dependency_free_read_is_served_before_queued_writes_and_a_dependent_read_after(tmp_path):
    from lightning_nvme.store import FlatStore

    with FlatStore(tmp_path, io_chunk_bytes=1 << 20, staging_bytes=1 << 20, io_workers=1) as store:
        store.add_regions([(f"w{i}", 4 << 20) for i in range(4)] + [("r", 1 << 20)])
        src = store.aligned_empty(4 << 20)
        src.fill_(7)
        writes = [store.write(f"w{i}", src) for i in range(4)]  # 16 chunk jobs queued on one worker
        free_read = store.read("r", store.aligned_empty(1 << 20))  # nothing pending on "r": jumps the queue
        out = store.aligned_empty(4 << 20)
        dependent = store.read("w3", out)  # must wait for the write it overlaps
        store.wait(free_read)
        assert not writes[-1].done()
        store.wait(dependent)
        assert writes[-1].done() and bool((out == 7).all())
