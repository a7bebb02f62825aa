"""``lightning-nvme doctor PATH``: is this directory a good home for the store, and how should the
store be tuned for it? (``doctor DIR DIR ...``: the disks of a striped store, see ``striped``.)

Reports the filesystem and mount options, O_DIRECT support, free space against a planned store,
swap on the same disk, reflink support, the checkpoints planned against the free space, a short measured
sequential bandwidth and the tuned I/O profile (``disk``), as text or JSON, with the fix for each problem.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from dataclasses import asdict

from lightning_nvme.checks import ConfigError
from lightning_nvme.constants import GiB, MiB
from lightning_nvme.doctor import striped
from lightning_nvme.doctor.disk import DEFAULT_SETTING, measure_bandwidth, tune
from lightning_nvme.doctor.profile import SLOWEST_DISK_FIX
from lightning_nvme.fs import fsinfo, reflink
from lightning_nvme.preflight.resources import CheckpointPlan, check_checkpoint_space, check_store_dir, check_writable, ensure_dir
from lightning_nvme.settings import OffloadSettings
from lightning_nvme.store import StoreError


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-nvme doctor",
                                description="Check a directory as a home for the NVMe store and tune the I/O profile.")
    p.add_argument("path", nargs="+", help="the store directory to check (created if its parent exists); several: "
                                           "the disks of a striped store, measured each and together")
    p.add_argument("--plan-bytes", type=int, default=None, help="planned store size in bytes, checked against free space")
    p.add_argument("--min-free-bytes", type=int, default=OffloadSettings.min_free_bytes,
                   help=f"safety margin kept free (default {_size(OffloadSettings.min_free_bytes)})")
    p.add_argument("--checkpoints", type=int, default=0,
                   help="checkpoints kept at once (save_top_k + last); with --checkpoint-bytes, planned with the store")
    p.add_argument("--checkpoint-bytes", type=int, default=0, help="bytes of one checkpoint (optimizer state + weights)")
    p.add_argument("--write-profile", metavar="FILE", default=None, help="write the tuned I/O profile as JSON")
    p.add_argument("--seconds", type=float, default=10.0, help="rough time budget for the measurements (default 10)")
    p.add_argument("--bench-bytes", type=int, default=256 * MiB, help="bytes for the sequential bandwidth test")
    p.add_argument("--tune-bytes", type=int, default=64 * MiB, help="bytes per tuning trial")
    p.add_argument("--no-tune", action="store_true", help="skip tuning (and writing a profile)")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object on the last line")
    return p


class Findings:
    """What the doctor found: printed as it goes (or collected for ``--json``), problems set the exit code."""

    def __init__(self, path: str, as_json: bool) -> None:
        self.as_json = as_json
        self.data: dict = {"path": path, "problems": [], "advice": []}

    def say(self, label: str, text: str) -> None:
        if not self.as_json:
            print(f"  {label:<12} {text}")

    def problem(self, text: str) -> None:
        self.data["problems"].append(text)
        self.say("PROBLEM", text)

    def advise(self, label: str, text: str) -> None:
        self.data["advice"].append(text)
        self.say(label, text)

    def finish(self) -> int:
        rc = 1 if self.data["problems"] else 0
        self.data["ok"] = rc == 0
        if self.as_json:
            print(json.dumps(self.data))
        else:
            print(f"  {'verdict':<12} {'OK' if rc == 0 else 'PROBLEMS FOUND (' + str(len(self.data['problems'])) + ')'}")
        return rc


def _check_filesystem(path: str, info: fsinfo.FsInfo, args: argparse.Namespace, f: Findings) -> None:
    m = info.mount
    f.data.update(fs_type=m.fs_type if m else None, mount_point=m.mount_point if m else None,
                  mount_options=list(m.options) if m else [], disk=info.disk, direct_io=info.direct_io,
                  free_bytes=info.free_bytes, total_bytes=info.total_bytes,
                  swap_same_disk=[asdict(s) for s in info.swap_same_disk])
    if m:
        f.say("filesystem", f"{m.fs_type} on {m.device} at {m.mount_point} (disk {info.disk or 'none: virtual'})")
        f.say("mount opts", ",".join(m.options))
        if not m.noatime:
            f.advise("noatime", "absent: add noatime to the mount options (reads then never update access times; "
                                "minor for one preallocated store file)")
        if m.is_memory:
            f.problem(f"{m.fs_type} lives in RAM: a store there saves no memory; use a local SSD")
        if m.is_network:
            f.advise("WARNING", f"{m.fs_type} is a network/FUSE filesystem: slow, weaker durability; use a local SSD")
    f.say("O_DIRECT", ("supported" if info.direct_io else "NOT supported (buffered I/O + fadvise instead)")
          + f": {info.direct_io_detail}")

    line = f"{_size(info.free_bytes)} free of {_size(info.total_bytes)}"
    if args.plan_bytes is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tmpfs/network were reported above
                rep = check_store_dir(path, args.plan_bytes, min_free_bytes=args.min_free_bytes, key="PATH")
            line += (f"; plan {_size(args.plan_bytes)} + margin {_size(args.min_free_bytes)}: fits "
                     f"({_size(rep.spare_bytes)} to spare)")
        except ConfigError as e:
            f.data["problems"].append(str(e))
            line += f"; PROBLEM: {e}"
    f.say("free space", line)
    if args.checkpoints and args.checkpoint_bytes:
        plan = CheckpointPlan(path, args.checkpoints + 1, args.checkpoint_bytes)  # + the save that replaces one
        try:
            needed = check_checkpoint_space(path, args.plan_bytes or 0, [plan], min_free_bytes=args.min_free_bytes,
                                            key="PATH")
            f.say("checkpoints", f"{plan.kept} x {_size(plan.bytes_each)} (kept + one being saved) with the store: "
                                 f"fits ({_size(sum(needed.values()))} needed)")
        except ConfigError as e:
            f.problem(str(e))
    support = reflink.probe(path)
    f.data["reflink"] = support.supported
    f.say("reflink", ("supported: checkpoints saved on this filesystem clone the store instead of copying it "
                      "(docs/checkpoints.md)") if support.supported else f"not supported: checkpoints stream a full "
          f"copy of the optimizer state ({support.reason})")

    if info.swap_same_disk:
        names = ", ".join(f"{s.filename} ({_size(s.size_bytes)}, {_size(s.used_bytes)} used)"
                          for s in info.swap_same_disk)
        f.advise("swap", f"on the same disk {info.disk}: {names}; it competes with the store when the host swaps")
    else:
        f.say("swap", f"none on this disk ({len(fsinfo.read_swaps())} swap area(s) in total)")


def _measure_and_tune(path: str, info: fsinfo.FsInfo, args: argparse.Namespace, f: Findings) -> None:
    budget = max(0, info.free_bytes - args.min_free_bytes) // 2  # never fill the disk to measure it
    bench_bytes = min(args.bench_bytes, budget) // (8 * MiB) * (8 * MiB)
    tune_bytes = min(args.tune_bytes, budget) // MiB * MiB
    if bench_bytes >= 8 * MiB:
        bw = measure_bandwidth(path, bench_bytes, args.seconds * 0.4)
        f.data["bandwidth"] = asdict(bw)
        f.say("bandwidth", f"sequential write {bw.write_mib_s:.0f} MiB/s (through fsync), read {bw.read_mib_s:.0f} "
                           f"MiB/s, {_size(bw.nbytes)}, {'O_DIRECT' if bw.direct else 'buffered, cache dropped'}, "
                           f"one stream of 8 MiB requests")
    else:
        f.say("bandwidth", "skipped: not enough free space for a measurement")
    if args.no_tune or tune_bytes < MiB:
        return
    profile = tune(path, nbytes=tune_bytes, seconds=args.seconds * 0.45)
    f.data["profile"] = asdict(profile)
    f.say("tuning", f"{len(profile.trials)} settings x {profile.trials[0]['rounds']} rounds of {_size(tune_bytes)} "
                    f"through FlatStore (median combined read+write MiB/s):")
    if not f.as_json:
        for t in sorted(profile.trials, key=lambda t: -t["ratio_to_default"])[:6]:
            print(f"    chunk {t['io_chunk_bytes'] // MiB:>3} MiB x {t['io_workers']} workers: "
                  f"{t['combined_mib_s']:>7.0f} MiB/s, {t['ratio_to_default']:.2f}x default "
                  f"(write {t['write_mib_s']:.0f}, read {t['read_mib_s']:.0f})")
    kept = (profile.io_chunk_bytes, profile.io_workers) == DEFAULT_SETTING
    f.say("profile", f"io_chunk_bytes={profile.io_chunk_bytes} ({profile.io_chunk_bytes // MiB} MiB), io_workers="
                     f"{profile.io_workers}: " + ("the default; no setting beat it by 5% when re-measured in "
                     "alternating pairs" if kept else f"{profile.speedup_vs_default:.2f}x the default ({_size(DEFAULT_SETTING[0])} x "
                     f"{DEFAULT_SETTING[1]}), "
                     "median of re-measured alternating pairs"))
    if args.write_profile:
        profile.save(args.write_profile)
        f.data["profile_file"] = os.path.abspath(args.write_profile)
        f.say("written", f"{args.write_profile}; use it with NVMeOffloadStrategy(io_profile={args.write_profile!r})")


def _stripes(paths: list[str], args: argparse.Namespace, f: Findings) -> None:
    """Several directories: each checked, then measured alone and striped together; tuned on the striped store."""
    f.data.update(paths=paths, dirs={})
    for path in paths:
        f.say("directory", path)
        try:
            ensure_dir(path, "DIR")
            check_writable(path, "DIR")
        except ConfigError as e:
            f.problem(str(e))
            continue
        one = Findings(path, True)  # collected, then printed under this directory
        one.as_json = f.as_json
        plan = args.plan_bytes
        args.plan_bytes = None if plan is None else -(-plan // len(paths)) + OffloadSettings.stripe_bytes
        _check_filesystem(path, fsinfo.inspect(path), args, one)
        args.plan_bytes = plan
        f.data["dirs"][path] = one.data
        f.data["problems"] += one.data["problems"]
        f.data["advice"] += one.data["advice"]
    if f.data["problems"]:
        return
    for warning in striped.device_warnings(paths):
        f.advise("WARNING", warning)
    free = min(shutil.disk_usage(p).free for p in paths) - args.min_free_bytes
    nbytes = min(args.tune_bytes, max(0, free) // 2) // MiB * MiB
    if nbytes < MiB:
        f.say("bandwidth", "skipped: not enough free space for a measurement")
        return
    report = striped.measure(paths, nbytes)
    f.data["each"] = [{"path": p, "write_mib_s": round(w, 1), "read_mib_s": round(r, 1)}
                      for p, (w, r) in zip(paths, report.each)]
    f.data["together"] = {"write_mib_s": round(report.together[0], 1), "read_mib_s": round(report.together[1], 1),
                          "scaling": round(report.scaling, 3)}
    for p, (w, r) in zip(paths, report.each):
        f.say("alone", f"{p}: write {w:.0f} MiB/s (through fsync), read {r:.0f} MiB/s")
    f.say("striped", f"all {len(paths)}: write {report.together[0]:.0f} MiB/s, read {report.together[1]:.0f} MiB/s "
                     f"({report.scaling:.2f} of the sum of the disks alone; medians of {report.rounds} alternating "
                     f"rounds of {_size(nbytes)} per disk through FlatStore)")
    i, cost = report.slowest()
    f.data["slowest"] = {"path": paths[i], "cost": round(cost, 3)}
    if cost > 0.1:
        f.advise("slowest", report.slowest_text(paths) + SLOWEST_DISK_FIX)
    else:
        f.say("slowest", report.slowest_text(paths))
    if args.no_tune:
        return
    profile = striped.tune(paths, nbytes=nbytes, seconds=args.seconds * 0.5)
    profile.disks = f.data["each"]  # what the strategy says at setup about the slowest disk
    f.data["profile"] = asdict(profile)
    f.say("profile", f"stripe_bytes={profile.stripe_bytes} ({(profile.stripe_bytes or 0) // MiB} MiB), io_workers="
                     f"{profile.io_workers} per disk: {profile.speedup_vs_default:.2f}x the default "
                     f"({_size(striped.DEFAULT_STRIPING[0])} x {striped.DEFAULT_STRIPING[1]}), "
                     f"median of {profile.trials[0]['rounds']} rounds")
    if args.write_profile:
        profile.save(args.write_profile)
        f.data["profile_file"] = os.path.abspath(args.write_profile)
        f.say("written", f"{args.write_profile}; use it with NVMeOffloadStrategy(store_dir={paths!r}, "
                         f"io_profile={args.write_profile!r})")


def main(argv: list[str] | None = None) -> int:
    """Run the doctor; returns 0 when the directory is usable for the plan, 1 when it is not."""
    args = _parser().parse_args(argv)
    paths = [os.path.abspath(p) for p in args.path]
    if len(paths) > 1:
        f = Findings(paths[0], args.json)
        if not args.json:
            print(f"lightning-nvme doctor: {len(paths)} directories (a striped store)")
        try:
            _stripes(paths, args, f)
        except (OSError, StoreError) as e:
            f.problem(f"I/O on {paths} failed during the measurements: {e}")
        return f.finish()
    path = paths[0]
    f = Findings(path, args.json)
    if not args.json:
        print(f"lightning-nvme doctor: {path}")
    try:
        ensure_dir(path, "PATH")
        check_writable(path, "PATH")
    except ConfigError as e:
        f.problem(str(e))
        return f.finish()
    info = fsinfo.inspect(path)
    _check_filesystem(path, info, args, f)
    try:
        _measure_and_tune(path, info, args, f)
    except (OSError, StoreError) as e:  # a failing disk is a finding, not a crash of the doctor
        f.problem(f"I/O on {path} failed during the measurements: {e}")
    return f.finish()


if __name__ == "__main__":
    sys.exit(main())
