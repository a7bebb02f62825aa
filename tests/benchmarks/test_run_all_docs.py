"""benchmarks/run_all.py keeps docs/performance.md current: each benchmark's block (date, load, command,
median (min–max) of every figure) is rebuilt from its JSON line, the rest of the page is kept, and a
failed benchmark leaves its previous figures. Fake JSON lines only: no benchmark runs here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # wherever tests/ puts this file
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402

OPTIMIZER_RESULT = {  # the keys optimizer_offload.py's last line carries for run_all's figures
    "train_step_ratio_spread": {"median": 1.08, "min": 1.02, "max": 1.15, "pairs": [1.02, 1.08, 1.15, 1.07, 1.1]},
    "train_step_ratio_step_mode_spread": {"median": 1.2, "min": 1.1, "max": 1.3, "pairs": [1.1, 1.2, 1.3]},
    "io_bound_vs_backward": 0.42, "raw_write_GBps": 1.3, "raw_read_GBps": 0.8,
}

PAGE = """# Performance

Text before the section.

<!-- run_all:begin -->
<!-- run_all:optimizer_offload:begin -->
#### `optimizer_offload`: 2020-01-01 00:00 UTC, 2 cores, load average 9.0–9.9
| old | 9.99 (9.00–9.99) |
<!-- run_all:optimizer_offload:end -->

<!-- run_all:ddp_offload:begin -->
#### `ddp_offload`: 2020-01-01 00:00 UTC, keep me
<!-- run_all:ddp_offload:end -->
<!-- run_all:end -->

Text after the section.
"""


def _line(results: dict) -> dict:
    """run_all's last JSON line for a run of ``results`` (as main() writes it)."""
    return {"date": "2026-12-02T10:00:00+00:00", "load_avg_1min": [0.4, 0.9, 1.3], "cpu_count": 2,
            "benchmarks": {name: {"date": "2026-12-02T10:05:00+00:00", "load_avg_1min": [0.4, 0.9]} for name in results},
            "results": results}


def test_a_benchmark_block_gives_date_load_command_and_each_figure_with_its_spread():
    bench = next(b for b in run_all.BENCHMARKS if b.name == "optimizer_offload")
    text = run_all.doc_block(bench, OPTIMIZER_RESULT, "2026-12-02 10:05 UTC", "0.4–0.9", 2)
    lines = text.splitlines()
    assert lines[0] == "<!-- run_all:optimizer_offload:begin -->" and lines[-1] == "<!-- run_all:optimizer_offload:end -->"
    assert "2026-12-02 10:05 UTC" in text and "2 cores" in text and "load average 0.4–0.9" in text
    assert f"`{bench.command}`" in text
    backward = next(ln for ln in lines if 'overlap="backward"' in ln)
    assert "| 1.08 (1.02–1.15) | ≤ 1.10 | 5 |" in backward
    assert "I/O lower bound 0.42× backward" in backward and "disk 1.30/0.80 GB/s w/r" in backward
    step = next(ln for ln in lines if 'overlap="step"' in ln)
    assert "| 1.20 (1.10–1.30) | — | 3 |" in step


def test_update_replaces_only_the_rerun_benchmark_and_keeps_the_rest_of_the_page():
    blocks = run_all.docs_blocks(_line({"optimizer_offload": OPTIMIZER_RESULT}))
    assert list(blocks) == ["optimizer_offload"]
    new = run_all.update_page(PAGE, blocks)
    assert "9.99 (9.00–9.99)" not in new and "2020-01-01 00:00 UTC, 2 cores" not in new  # the old figures are gone
    assert "| 1.08 (1.02–1.15) |" in new and "2026-12-02 10:05 UTC, 2 cores, load average 0.4–0.9" in new
    assert "2020-01-01 00:00 UTC, keep me" in new  # ddp_offload did not run: its block stays
    before, after = PAGE.split("<!-- run_all:optimizer_offload:begin -->")[0], PAGE.split("<!-- run_all:ddp_offload:begin -->")[1]
    assert new.startswith(before) and new.endswith(after)
    assert run_all.update_page(new, blocks) == new  # regenerating twice changes nothing


def test_a_failed_benchmark_keeps_its_previous_block_and_a_new_one_is_added_to_the_section():
    activation = {"step_ratio_spread": {"median": 1.03, "min": 0.95, "max": 1.08, "pairs": [1.0] * 6},
                  "io_vs_backward": 0.19, "prefetch_misses": 0, "raw_write_GBps": 1.42, "raw_read_GBps": 1.2}
    new = run_all.update_page(PAGE, run_all.docs_blocks(_line({"optimizer_offload": None, "activation_offload": activation})))
    assert "9.99 (9.00–9.99)" in new  # failed: the old figures stay, with their old date
    section = new.split("<!-- run_all:begin -->")[1].split("<!-- run_all:end -->")[0]
    assert "<!-- run_all:activation_offload:begin -->" in section
    assert "| 1.03 (0.95–1.08) | ≤ 1.05 | 6 | activation I/O 0.19× backward" in section


def test_a_page_without_the_section_is_refused_naming_the_markers():
    with pytest.raises(ValueError, match="run_all:begin"):
        run_all.update_page("# no section\n", {"x": "y"})


def test_docs_from_a_saved_line_rewrites_the_page_without_running_anything(tmp_path: Path):
    page = tmp_path / "performance.md"
    page.write_text(PAGE, encoding="utf-8")
    saved = tmp_path / "run.out"
    saved.write_text("| a table |\n" + json.dumps(_line({"optimizer_offload": OPTIMIZER_RESULT})) + "\n", encoding="utf-8")
    assert run_all.main(["--docs-from", str(saved), "--docs", str(page), "--log-dir", os.fspath(tmp_path / "logs")]) == 0
    assert "| 1.08 (1.02–1.15) |" in page.read_text(encoding="utf-8")
    assert not (tmp_path / "logs").exists()  # nothing ran


def test_the_repository_page_has_a_block_for_every_benchmark_run_all_runs():
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    section = text.split(run_all.SECTION_BEGIN)[1].split(run_all.SECTION_END)[0]
    for bench in run_all.BENCHMARKS:
        begin, end = run_all.block_markers(bench.name)
        assert begin in section and end in section, bench.name
        assert f"`{bench.command}`" in section  # the command the figures came from is the one run_all runs
