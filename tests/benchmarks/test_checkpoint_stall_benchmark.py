"""The checkpoint stall benchmark's quick mode runs end to end (background and streamed on the default filesystem, a
tiny GPT) and prints its JSON summary last with the fields docs/checkpoints.md quotes (so it cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_checkpoint_stall_quick_mode(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "checkpoint_stall.py"), "--quick",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    configs = {c["path"]: c for c in result["configs"]}
    assert sorted(configs) == ["background", "streamed"]
    for c in configs.values():
        for key in ("params", "state_bytes", "stall_s", "bytes_written", "extra_disk_bytes", "step_s",
                    "step_during_copy_s", "steps_after_save_s"):
            assert key in c, key
        assert c["record_path"] == c["path"], c  # each save took the path it names
    bg = configs["background"]
    assert bg["copy_bytes"] >= bg["state_bytes"] and bg["bytes_written"] >= bg["copy_bytes"]
    assert "stall_streamed_over_background" in result and "background_stall_over_step_max" in result
    assert os.listdir(tmp_path) == []  # each run's directory is removed
