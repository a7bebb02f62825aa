"""A live process's store is never touched by a second opener; the lock left by a kill -9'd
process is recognised as stale and the store reopens."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_nvme.store import FlatStore, StoreLockedError

MiB = 1 << 20

HOLDER = textwrap.dedent("""
    import sys, time, torch
    from lightning_nvme.store import FlatStore
    s = FlatStore(sys.argv[1], io_chunk_bytes=1 << 20, staging_bytes=1 << 20)
    s.add_region("w", 1 << 20)
    s.write("w", torch.full((1 << 20,), 7, dtype=torch.uint8))
    s.fence(durable=True)
    print("ready", flush=True)
    time.sleep(120)
""")


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_live_store_refused_then_stale_lock_taken_over(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "ready" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "ready" in line, "holder process did not start"
        path = str(tmp_path / "store-rank0.bin")
        before = _digest(path), os.stat(path).st_mtime_ns
        for reopen in (False, True):
            with pytest.raises(StoreLockedError) as ei:
                FlatStore(tmp_path, io_chunk_bytes=MiB, staging_bytes=MiB, reopen=reopen)
            assert f"pid {proc.pid}" in str(ei.value) and "store_dir" in str(ei.value)
        assert (_digest(path), os.stat(path).st_mtime_ns) == before  # the live store was not touched
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        store = FlatStore(tmp_path, io_chunk_bytes=MiB, staging_bytes=MiB, reopen=True)
        assert store._lock.took_over_stale and "w" in store
        store.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
