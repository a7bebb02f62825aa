"""Run every overhead benchmark in sequence and print the README's figures table.

Each benchmark runs in its own process with the settings below, chosen so the whole run takes about
12 minutes on a quiet 2-core machine (estimated from sized runs: optimizer ~6, activations ~4, DDP
~2.5), with >= 5 alternating pairs each and several timed steps per pair: the previous `--steps 2` of
the optimizer benchmark left its pair ratios 0.70-2.78 apart, 10 DDP steps 0.79-1.64 (both under
load; the load moves single steps, longer windows average it out). Its own output goes to
``.bench-logs/<name>.log``. Then one markdown table: each figure as "median (min–max)" of its
per-pair ratios, the precondition it was measured under, the raw disk speed of that run and the
command, with the date and load. The last line is one JSON object with every benchmark's result.

    python benchmarks/run_all.py                  # everything (also: lightning-nvme bench)
    python benchmarks/run_all.py --only optimizer_offload ddp_offload
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
    """The README's markdown table for ``results`` (benchmark name -> its last JSON line, or None)."""
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
    args = p.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    loads = [os.getloadavg()[0]]
    results: dict[str, dict | None] = {}
    seconds: dict[str, float] = {}
    for bench in BENCHMARKS:
        if args.only and bench.name not in args.only:
            continue
        t0 = time.perf_counter()
        print(f"{bench.name}: running `{bench.command}` ...", file=sys.stderr, flush=True)
        results[bench.name] = run(bench, args.log_dir)
        seconds[bench.name] = round(time.perf_counter() - t0, 1)
        loads.append(os.getloadavg()[0])
        print(f"{bench.name}: {'done' if results[bench.name] else 'FAILED'} in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    load = f"{min(loads):.1f}–{max(loads):.1f}"
    print(table(results, started.strftime("%Y-%m-%d %H:%M UTC"), load))
    print(json.dumps({"date": started.isoformat(timespec="seconds"), "load_avg_1min": loads, "seconds": seconds,
                      "commands": {b.name: b.command for b in BENCHMARKS if b.name in results}, "results": results}))
    return 0 if all(r is not None for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
