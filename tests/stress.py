"""Stress mode: run chosen tests N rounds, each in a fresh pytest process in a random order (``--shuffle``),
while CPU burners and a concurrent fsync'ing writer compete for the cores and the disk; report per test how
often it passed. A guarantee that holds only on a quiet machine is not one (issue #20).

    python tests/stress.py --rounds 20 --burners 2 --writer-dir /tmp/x -- tests/faults tests/store/test_store.py

Everything after ``--`` goes to pytest (paths, node ids, ``-k``). Prints a table (test, passed, failed,
error, skipped, rounds), then one JSON line with the same counts and the conditions (load average).
Exit status 0 only if every test that ran passed in every round it ran.
``python tests/stress.py --report DIR...`` prints the table of earlier runs' ``--out`` directories, summed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def burn(stop: mp.synchronize.Event) -> None:
    """A CPU burner: pure-Python arithmetic until told to stop."""
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x = (x * 31 + i) % 1_000_003


def write(stop: mp.synchronize.Event, directory: str, chunk_bytes: int, file_bytes: int) -> None:
    """Disk contention: rewrite a file in chunks, fdatasync after each, until told to stop."""
    path = os.path.join(directory, f"stress-writer-{os.getpid()}.bin")
    data = os.urandom(chunk_bytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        offset = 0
        while not stop.is_set():
            os.pwrite(fd, data, offset)
            os.fdatasync(fd)
            offset = (offset + chunk_bytes) % file_bytes
    finally:
        os.close(fd)
        os.remove(path)


def outcomes(junit: str) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from a JUnit XML report."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test_id = f"{module}.py::{case.get('name')}"
        tags = {child.tag for child in case}
        state = ("error" if "error" in tags else "failed" if "failure" in tags else
                 "skipped" if "skipped" in tags else "passed")
        if out.get(test_id) in ("failed", "error"):  # a teardown error after a pass: keep the worse one
            continue
        out[test_id] = state
    return out


def table(counts: dict[str, Counter]) -> bool:
    """Print the per-test table; True if nothing failed or errored."""
    width = max((len(t) for t in counts), default=10)
    print(f"\n| {'test':<{width}} | passed | failed | error | skipped | rounds |")
    print(f"|{'-' * (width + 2)}|-------:|-------:|------:|--------:|-------:|")
    for test in sorted(counts):
        c = counts[test]
        print(f"| {test:<{width}} | {c['passed']:>6} | {c['failed']:>6} | {c['error']:>5} | {c['skipped']:>7} | "
              f"{sum(c.values()):>6} |")
    return all(c["failed"] == 0 and c["error"] == 0 for c in counts.values())


def report(directories: list[str]) -> int:
    """The table of earlier runs (their ``--out`` directories), rounds summed."""
    counts: dict[str, Counter] = defaultdict(Counter)
    rounds = 0
    for d in directories:
        for name in sorted(os.listdir(d)):
            if name.startswith("round-") and name.endswith(".xml"):
                rounds += 1
                for test, state in outcomes(os.path.join(d, name)).items():
                    counts[test][state] += 1
    print(f"{rounds} round(s) from {directories}")
    return 0 if table(counts) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--report"]:
        return report(argv[1:])
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--burners", type=int, default=2, help="CPU burner processes (default 2)")
    ap.add_argument("--writer-dir", default=None, help="where the concurrent fsync writer writes (default: a temp dir)")
    ap.add_argument("--writer-chunk-mib", type=int, default=4)
    ap.add_argument("--writer-file-mib", type=int, default=256)
    ap.add_argument("--no-writer", action="store_true")
    ap.add_argument("--seed", type=int, default=None, help="base seed of the shuffles (default: random, printed)")
    ap.add_argument("--round-timeout", type=float, default=1800.0)
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="start no new round after this many minutes (the table counts the rounds that ran)")
    ap.add_argument("--out", default=None, help="directory for the per-round logs and reports (default: a temp dir)")
    args = ap.parse_args(ours)
    if not pytest_args:
        ap.error("name the tests after --")
    seed = random.randrange(1 << 30) if args.seed is None else args.seed
    out_dir = args.out or tempfile.mkdtemp(prefix="lightning-nvme-stress-")
    os.makedirs(out_dir, exist_ok=True)
    writer_dir = args.writer_dir or tempfile.mkdtemp(prefix="lightning-nvme-stress-writer-")
    os.makedirs(writer_dir, exist_ok=True)

    def interrupted(signum, frame):  # noqa: ANN001, ANN202 - SIGTERM/SIGINT: report the completed rounds
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):  # (a background job started by a shell ignores SIGINT)
        signal.signal(sig, interrupted)
    stop = mp.Event()
    procs = [mp.Process(target=burn, args=(stop,), daemon=True) for _ in range(args.burners)]
    if not args.no_writer:
        procs.append(mp.Process(target=write, args=(stop, writer_dir, args.writer_chunk_mib << 20,
                                                    args.writer_file_mib << 20), daemon=True))
    for p in procs:
        p.start()
    counts: dict[str, Counter] = defaultdict(Counter)
    seconds: list[float] = []
    loads: list[float] = []
    started = time.monotonic()
    rounds_run = 0
    try:
        for r in range(args.rounds):
            if args.max_minutes is not None and time.monotonic() - started > args.max_minutes * 60:
                print(f"--max-minutes {args.max_minutes:g} reached: stopping after {r} round(s)", flush=True)
                break
            junit = os.path.join(out_dir, f"round-{r}.xml")
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--shuffle={seed + r}",
                   f"--junitxml={junit}", *pytest_args]
            t0 = time.monotonic()
            with open(os.path.join(out_dir, f"round-{r}.log"), "w") as log:
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=args.round_timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = -1
            seconds.append(time.monotonic() - t0)
            loads.append(os.getloadavg()[0])
            got = outcomes(junit) if os.path.exists(junit) else {}
            for test, state in got.items():
                counts[test][state] += 1
            bad = sorted(t for t, s in got.items() if s in ("failed", "error"))
            print(f"round {r + 1}/{args.rounds}: seed {seed + r}, rc {rc}, {len(got)} tests, {seconds[-1]:.0f}s, "
                  f"load {loads[-1]:.1f}" + (f", FAILED: {bad}" if bad else ""), flush=True)
            if not got:
                counts["<round produced no report>"]["error"] += 1
            rounds_run += 1
    except KeyboardInterrupt:  # Ctrl-C / SIGINT / SIGTERM: report the rounds that completed
        print(f"interrupted: reporting {rounds_run} completed round(s)", flush=True)
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()

    ok = table(counts)
    if not seconds:
        seconds, loads = [0.0], [os.getloadavg()[0]]
    print(json.dumps({"rounds": rounds_run, "rounds_asked": args.rounds, "seed": seed, "burners": args.burners,
                      "writer": not args.no_writer,
                      "pytest_args": pytest_args, "round_seconds_median": sorted(seconds)[len(seconds) // 2],
                      "round_seconds_max": max(seconds), "load1_min": min(loads), "load1_max": max(loads),
                      "all_passed": ok, "out": out_dir,
                      "tests": {t: dict(c) for t, c in sorted(counts.items())}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
