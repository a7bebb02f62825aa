"""Run every overhead benchmark in sequence, print the figures table and keep docs/performance.md current.

Each benchmark runs in its own process with the settings below, chosen so the whole run takes about
12 minutes on a quiet 2-core machine (estimated from sized runs: optimizer ~6, activations ~4, DDP
~2.5), with >= 5 alternating pairs each and several timed steps per pair: the previous `--steps 2` of
the optimizer benchmark left its pair ratios 0.70-2.78 apart, 10 DDP steps 0.79-1.64 (both under
load; the load moves single steps, longer windows average it out). Its own output goes to
``.bench-logs/<name>.log``. Then one markdown table: each figure as "median (min–max)" of its
per-pair ratios, the precondition it was measured under, the raw disk speed of that run and the
command, with the date and load. The last line is one JSON object with every benchmark's result.

Each benchmark that succeeded also replaces its own block in the "Latest benchmark run" section of
docs/performance.md (between ``<!-- run_all:begin -->`` and ``<!-- run_all:end -->``): its date, the
load average around it, the command and each figure's median (min–max). Why per benchmark: ``--only``
re-measures one benchmark without erasing the others' figures, and each block keeps its own date, so the
page never passes an old figure off as new. A failed benchmark leaves its previous block as it was.

    python benchmarks/run_all.py                  # everything (also: lightning-nvme bench)
    python benchmarks/run_all.py --only optimizer_offload ddp_offload
    python benchmarks/run_all.py --no-docs        # print only; docs/performance.md untouched
    python benchmarks/run_all.py --docs-from run.json   # re-render the page from a saved last line, run nothing
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS_PAGE = os.path.join(ROOT, "docs", "performance.md")
SECTION_BEGIN, SECTION_END = "<!-- run_all:begin -->", "<!-- run_all:end -->"


@dataclass(frozen=True)
class Figure:
    """One row of the table: which ratio of which benchmark, against what target, under what precondition."""

    label: str
    key: str  # the benchmark's "<key>_spread" holds median/min/max of the per-pair ratios
    target: str
    precondition: Callable[[dict], str]


@dataclass(frozen=True)
class Bench:
    name: str
    args: list[str]
    figures: list[Figure]

    @property
    def command(self) -> str:
        return " ".join(["python", f"benchmarks/{self.name}.py", *self.args])


def _disk(r: dict) -> str:
    return f"disk {r['raw_write_GBps']:.2f}/{r['raw_read_GBps']:.2f} GB/s w/r"


BENCHMARKS = [
    Bench("optimizer_offload", ["--params-m", "50", "--tokens", "1536", "--steps", "4", "--pairs", "5"], [
        Figure('AdamW state offload, `overlap="backward"`: train step ÷ in-memory', "train_step_ratio", "≤ 1.10",
               lambda r: f"I/O lower bound {r['io_bound_vs_backward']:.2f}× backward (target needs ≤ 0.8); {_disk(r)}"),
        Figure('AdamW state offload, `overlap="step"`: train step ÷ in-memory', "train_step_ratio_step_mode", "—",
               lambda r: f"I/O lower bound {r['io_bound_vs_backward']:.2f}× backward; {_disk(r)}"),
    ]),
    Bench("activation_offload", ["--pairs", "6", "--batch", "5250"], [  # one ~10-15 s step per config and pair
        Figure("Activation offload: step ÷ in-memory", "step_ratio", "≤ 1.05",
               lambda r: f"activation I/O {r['io_vs_backward']:.2f}× backward (target needs ≤ 0.2), "
                         f"{r['prefetch_misses']} prefetch misses; {_disk(r)}"),
    ]),
    Bench("ddp_offload", ["--pairs", "7", "--steps", "30"], [
        Figure("`nvme_offload_ddp` (2 ranks): step ÷ plain DDP", "step_ratio_vs_ddp", "≤ 1.2",
               lambda r: f"{r['state_bytes_per_rank_max'] / 2**20:.0f} MiB state per rank; {_disk(r)}"),
    ]),
]


def fmt_spread(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def table(results: dict[str, dict | None], when: str, load: str) -> str:
    """The markdown table printed at the end of a run for ``results`` (benchmark name -> its last JSON line, or None)."""
    lines = [f"Measured {when} on {platform.node() or 'this machine'} ({os.cpu_count()} cores, load average {load}), "
             f"`python benchmarks/run_all.py`; figures are medians (min–max) of per-pair ratios.", "",
             "| figure | median (min–max) | target | pairs | measured under | command |",
             "|---|---|---|---|---|---|"]
    for bench in BENCHMARKS:
        if bench.name not in results:
            continue
        r = results[bench.name]
        for fig in bench.figures:
            if r is None:
                lines.append(f"| {fig.label} | failed (see .bench-logs/{bench.name}.log) | {fig.target} | | | "
                             f"`{bench.command}` |")
                continue
            s = r[f"{fig.key}_spread"]
            lines.append(f"| {fig.label} | {fmt_spread(s)} | {fig.target} | {len(s['pairs'])} | {fig.precondition(r)} "
                         f"| `{bench.command}` |")
    return "\n".join(lines)


def block_markers(name: str) -> tuple[str, str]:
    """The comments around one benchmark's block in docs/performance.md."""
    return f"<!-- run_all:{name}:begin -->", f"<!-- run_all:{name}:end -->"


def doc_block(bench: Bench, result: dict, when: str, load: str, cores: int | None) -> str:
    """One benchmark's block of docs/performance.md: when and under what load it ran, the command, and
    each figure as median (min–max) of its per-pair ratios with the precondition it was measured under."""
    begin, end = block_markers(bench.name)
    lines = [begin, f"#### `{bench.name}`: {when}, {cores or '?'} cores, load average {load}", "",
             f"`{bench.command}`", "",
             "| figure | median (min–max) | target | pairs | measured under |",
             "|---|---|---|---|---|"]
    for fig in bench.figures:
        s = result[f"{fig.key}_spread"]
        lines.append(f"| {fig.label} | {fmt_spread(s)} | {fig.target} | {len(s['pairs'])} | {fig.precondition(result)} |")
    lines.append(end)
    return "\n".join(lines)


def update_page(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each benchmark's block replaced by ``blocks[name]``; a benchmark with no block yet gets
    one at the end of the section. Everything else on the page is kept byte for byte."""
    if SECTION_BEGIN not in text or SECTION_END not in text:
        raise ValueError(f"the page has no {SECTION_BEGIN} ... {SECTION_END} section to regenerate")
    for name, new in blocks.items():
        begin, end = block_markers(name)
        start = text.find(begin)
        if start >= 0:
            stop = text.find(end, start)
            if stop < 0:
                raise ValueError(f"{begin} has no matching {end}")
            text = text[:start] + new + text[stop + len(end):]
        else:
            at = text.index(SECTION_END)
            text = text[:at] + new + "\n\n" + text[at:]
    return text


def docs_blocks(line: dict) -> dict[str, str]:
    """The blocks of every benchmark that succeeded in a run, from run_all's last JSON line."""
    blocks = {}
    for bench in BENCHMARKS:
        result = line["results"].get(bench.name)
        if result is None:
            continue
        meta = line.get("benchmarks", {}).get(bench.name, {})
        date = datetime.datetime.fromisoformat(meta.get("date", line["date"]))
        loads = meta.get("load_avg_1min", line.get("load_avg_1min", []))
        load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "not recorded"
        blocks[bench.name] = doc_block(bench, result, date.strftime("%Y-%m-%d %H:%M UTC"), load, line.get("cpu_count"))
    return blocks


def write_docs(line: dict, page: str) -> list[str]:
    """Regenerate the benchmarks' blocks of ``page`` from run_all's last JSON line; returns their names."""
    blocks = docs_blocks(line)
    if blocks:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        with open(page, "w", encoding="utf-8") as f:
            f.write(update_page(text, blocks))
    return list(blocks)


def run(bench: Bench, log_dir: str) -> dict | None:
    """Run one benchmark quietly (output to its log); its result is its last line that is a JSON object."""
    log = os.path.join(log_dir, f"{bench.name}.log")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, os.path.join(HERE, f"{bench.name}.py"), *bench.args],
                              stdout=subprocess.PIPE, stderr=f, text=True, cwd=ROOT)
        f.write(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=[b.name for b in BENCHMARKS], help="run only these")
    p.add_argument("--log-dir", default=os.path.join(ROOT, ".bench-logs"))
    p.add_argument("--docs", default=DOCS_PAGE, help="page whose run_all section is regenerated (default: %(default)s)")
    p.add_argument("--no-docs", action="store_true", help="print the table and the JSON line only")
    p.add_argument("--docs-from", metavar="JSON_FILE",
                   help="run nothing: regenerate the page from run_all's last line saved in this file")
    args = p.parse_args(argv)
    if args.docs_from:
        with open(args.docs_from, encoding="utf-8") as f:
            line = json.loads([ln for ln in f.read().splitlines() if ln.startswith("{")][-1])
        print(f"{args.docs}: regenerated {', '.join(write_docs(line, args.docs)) or 'nothing'}", file=sys.stderr)
        return 0
    os.makedirs(args.log_dir, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    loads = [os.getloadavg()[0]]
    results: dict[str, dict | None] = {}
    seconds: dict[str, float] = {}
    per_bench: dict[str, dict] = {}
    for bench in BENCHMARKS:
        if args.only and bench.name not in args.only:
            continue
        t0 = time.perf_counter()
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        load_before = os.getloadavg()[0]
        print(f"{bench.name}: running `{bench.command}` ...", file=sys.stderr, flush=True)
        results[bench.name] = run(bench, args.log_dir)
        seconds[bench.name] = round(time.perf_counter() - t0, 1)
        loads.append(os.getloadavg()[0])
        per_bench[bench.name] = {"date": date, "load_avg_1min": [load_before, loads[-1]]}
        print(f"{bench.name}: {'done' if results[bench.name] else 'FAILED'} in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    load = f"{min(loads):.1f}–{max(loads):.1f}"
    line = {"date": started.isoformat(timespec="seconds"), "load_avg_1min": loads, "seconds": seconds,
            "cpu_count": os.cpu_count(), "benchmarks": per_bench,
            "commands": {b.name: b.command for b in BENCHMARKS if b.name in results}, "results": results}
    if not args.no_docs:
        written = write_docs(line, args.docs)
        kept = [name for name, r in results.items() if r is None]
        print(f"{args.docs}: regenerated {', '.join(written) or 'nothing'}"
              + (f"; kept the previous figures of {', '.join(kept)} (failed)" if kept else ""), file=sys.stderr)
    print(table(results, started.strftime("%Y-%m-%d %H:%M UTC"), load))
    print(json.dumps(line))
    return 0 if all(r is not None for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
