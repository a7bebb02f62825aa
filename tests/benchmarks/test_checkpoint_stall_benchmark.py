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
        assert c["load"]["state_in_file"] and c["checkpoint_dir_entries"] == ["last.ckpt"], c  # one file
        assert c["load"]["record_bytes"] >= c["state_bytes"] and c["load"]["load_s"] >= 0, c
    bg = configs["background"]
    assert bg["copy_bytes"] >= bg["state_bytes"] and bg["bytes_written"] >= bg["copy_bytes"]
    assert "stall_streamed_over_background" in result and "background_stall_over_step_max" in result
    assert result["state_in_file"] and "load_s_max" in result and "load_rss_growth_bytes_max" in result
    assert os.listdir(tmp_path) == []  # each run's directory is removed


def test_checkpoint_stall_save_ends_the_run(tmp_path):
    """``--after-steps 0`` (how the 2.52 B figures fit the disk: no copy on write after the save): the save is the
    run's last act, the summary has no after-save step figures, and the load check still runs."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "checkpoint_stall.py"), "--quick",
                          "--after-steps", "0", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for c in result["configs"]:
        assert c["steps_after_save_s"] == [] and "step_during_copy_s" not in c, c
        assert c["load"]["state_in_file"] and c["checkpoint_dir_entries"] == ["last.ckpt"], c
    assert "background_steps_after_save_over_step_max" not in result and result["state_in_file"]
