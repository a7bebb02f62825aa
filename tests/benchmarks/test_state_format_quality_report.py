"""benchmarks/state_format_quality.py --save / --report: runs saved step by step compare over the steps
every run completed, so a run cut short still yields its deviation from "exact" (no training here)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from state_format_quality import load_runs, summarize  # noqa: E402


def _save(path, losses, vals):
    with open(path, "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": i, "loss": loss}) + "\n")
            if i in vals:
                f.write(json.dumps({"step": i, "val_loss": vals[i]}) + "\n")


def test_cut_run_is_compared_over_the_common_prefix(tmp_path):
    _save(tmp_path / "quickstart-exact.jsonl", [4.0, 3.0, 2.0, 2.0], {2: 2.5, 4: 2.0})
    _save(tmp_path / "quickstart-int8.jsonl", [4.0, 3.3, 2.2], {2: 2.6})  # cut after step 3
    _save(tmp_path / "long-exact.jsonl", [1.0], {})                          # another configuration: ignored
    runs = load_runs(str(tmp_path), "quickstart")
    assert set(runs) == {"exact", "int8"}
    out = summarize(runs, 4)
    assert out["steps_compared"] == 3
    int8 = out["int8"]
    assert int8["val_step"] == 2 and int8["val_loss"] == 2.6
    assert abs(int8["val_loss_vs_exact"] - (2.6 / 2.5 - 1)) < 1e-12
    assert abs(int8["max_rel_dev_curve"] - 0.1) < 1e-12          # |2.2 - 2.0| / 2.0
    assert abs(int8["final_train_loss"] - (4.0 + 3.3 + 2.2) / 3) < 1e-12
    assert out["exact"]["val_loss_vs_exact"] == 0.0
