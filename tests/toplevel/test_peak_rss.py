"""``memory.peak_rss_bytes``: the peak of this process's own memory, not of the parent that started it
(``ru_maxrss`` carries the parent's RSS at the fork across exec: a benchmark child started by a parent that
had just written a 13 GB checkpoint reported 2.4 GiB for an empty process)."""

from __future__ import annotations

import json
import subprocess
import sys

from lightning_nvme.memory import peak_rss_bytes

CHILD = ("import json, resource; from lightning_nvme.memory import peak_rss_bytes; "
         "print(json.dumps([peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))")


def test_a_child_of_a_large_parent_reports_its_own_peak():
    ballast = bytearray(1536 << 20)  # 1.5 GiB resident in this (parent) process
    ballast[::4096] = b"x" * len(ballast[::4096])
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    own, inherited = json.loads(out)
    assert inherited >= 1536 << 20  # the quirk this function exists for
    assert own < 1024 << 20  # the child's own imports (torch, lightning) are ~0.4 GiB
    del ballast


def test_peak_covers_what_this_process_touched():
    block = bytearray(256 << 20)
    block[::4096] = b"x" * len(block[::4096])
    assert peak_rss_bytes() >= 256 << 20
    del block
