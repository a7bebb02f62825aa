"""What a checkpoint costs the training run: reflink snapshot, background copy and streamed copy (#22),
offload_params + AdamW.

One GPT (``--layers`` blocks at ``--width``; 7 x 2560 is ~0.55 B params) trains with ``NVMeOffloadStrategy(
offload_params=True, overlap="backward", inline_weights_bytes=0)``. ``reflink`` (``checkpoint_copy="auto"``) and
``streamed`` run on an XFS with reflinks (``--dir``; by default a sparse image made with ``mkfs.xfs -m reflink=1``
and loop-mounted, root needed); ``background`` (``checkpoint_copy="background"``) runs on ``--background-dir``
(default: ``--scratch``, on the root filesystem: ext4 here), where reflinks are impossible. After ``--warmup`` steps
and one timed plain step, the run saves a checkpoint beside its store, then runs ``--after-steps`` more steps. Each
configuration is a fresh process; the paths (``--paths``) rotate their order from one round to the next (``--pairs``).

Per configuration:
  stall_s             wall time inside ``trainer.save_checkpoint`` (training is blocked for all of it)
  bytes_written       the process's ``write_bytes`` (``/proc/self/io``) during the save, the checkpoint file included;
                      for ``background`` plus the bytes its copy wrote after the save returned (``copy_bytes``)
  state_bytes         optimizer state + offloaded weights in the store (what a streamed save copies)
  extra_disk_bytes    the filesystem's used bytes after the save minus before it
  extra_disk_after_step_bytes   the same after the first step that follows (copy on write of the rewritten regions;
                      for ``background`` the files filled by the copy so far)
  step_s              a plain step (start to start); step_during_copy_s: the first step after the save, through a
                      durable fence (a reflink save's first rewrites of shared extents allocate new ones; a background
                      save's copy runs beside it and training's first write of each region copies it first; for
                      ``streamed`` it is just the next step); steps_after_save_s: each step after the save
  copy_s              ``background``: save to commit; copy_in_flight_after_step: whether it outlived that first step
  load                after the run, ``benchmarks/checkpoint_load.py`` on the checkpoint, in its own process:
                      ``torch.load(path, mmap=True)`` time, RSS growth, whether the state records are inside the file;
                      checkpoint_dir_entries: what the checkpoint directory holds (the one file); load_shared:
                      the same mapped MAP_SHARED, where torch's default (private) mapping failed (``load_errors``)

    sudo python benchmarks/checkpoint_stall.py                         # 0.55 B, 2 rounds (~15 min)
    sudo python benchmarks/checkpoint_stall.py --layers 32 --paths reflink --pairs 1 --after-steps 0 --image-gib 40
                                                                       # 2.52 B, reflink only: ~32 GB of disk
    sudo python benchmarks/checkpoint_stall.py --layers 2 --width 256 --pairs 1   # a smoke run
    python benchmarks/checkpoint_stall.py --quick --dir /tmp/x         # seconds: background vs streamed, no XFS

Progress goes to stderr; the last line of stdout is one JSON object ``{"configs": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import GiB, spread  # noqa: E402

PATHS = {"reflink": "auto", "streamed": "streamed", "background": "background"}


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def child(args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nvme.models import GPTLightningModule
    from lightning_nvme.strategies import NVMeOffloadStrategy

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, ((args.warmup + 2 + args.after_steps) * args.batch, args.seq + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    model = GPTLightningModule(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                               n_embd=args.width, activation_checkpointing=True, empty_init=True,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    strategy = NVMeOffloadStrategy(os.path.join(args.dir, "store"), offload_params=True, overlap="backward",
                                   restore_params=False, inline_weights_bytes=0, min_free_bytes=0,
                                   checkpoint_copy=PATHS[args.child])
    starts: list[float] = []
    marks: dict[str, float] = {}
    out: dict = {"path": args.child}
    w = args.warmup  # steps 0..w-1 create the state; step w is timed; the save follows step w+1; then steps w+2...
    ends: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
            starts.append(time.perf_counter())
            print(f"  {args.child}: step {len(starts) - 1} starts", file=sys.stderr, flush=True)

        def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
            step = len(starts) - 1
            ends.append(time.perf_counter())
            if step == w + 1:
                used, written, t0 = _used(args.dir), _write_bytes(), time.perf_counter()
                trainer.save_checkpoint(os.path.join(args.dir, "ckpts", "last.ckpt"))
                marks["saved"] = time.perf_counter()
                out["stall_s"] = marks["saved"] - t0
                out["bytes_written"] = _write_bytes() - written
                out["extra_disk_bytes"] = _used(args.dir) - used
                marks["used"] = used
                record = trainer.strategy.checkpoint_saves[-1]  # type: ignore[attr-defined]
                out.update(record_path=record.path, record_bytes_written=record.bytes_written,
                           bytes_cloned=record.bytes_cloned, reason=record.reason)
            if step == w + 2:  # through a durable fence: its write-backs (copy on write) are part of it
                trainer.strategy.nvme_store.fence(durable=True)  # type: ignore[attr-defined]
                out["step_during_copy_s"] = time.perf_counter() - marks["saved"]
                out["extra_disk_after_step_bytes"] = _used(args.dir) - marks["used"]
                copy = getattr(trainer.strategy, "_background", None)
                out["copy_in_flight_after_step"] = bool(copy is not None and copy.in_flight)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=w + 2 + args.after_steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=data)  # its teardown waits for a background copy to commit
    out["step_s"] = starts[w + 1] - starts[w]
    out["steps_after_save_s"] = [round(ends[i] - starts[i], 4) for i in range(w + 2, len(starts))]
    copy = getattr(strategy, "_background", None)
    if copy is not None:
        if copy.error is not None:
            raise SystemExit(f"the background copy failed: {copy.error}")
        out.update(copy_s=copy.seconds, copy_bytes=copy.bytes_copied, copied_before_a_write=len(copy.copied_by_barrier),
                   regions=len(copy.targets))
        out["bytes_written"] += copy.bytes_copied
        out["extra_disk_after_copy_bytes"] = _used(args.dir) - marks["used"]
    ckpt = os.path.join(args.dir, "ckpts", "last.ckpt")
    out["checkpoint_dir_entries"] = sorted(os.listdir(os.path.dirname(ckpt)))  # the one file, nothing beside it
    for key, flags in (("load", []), ("load_shared", ["--shared"])):
        res = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "checkpoint_load.py"), ckpt, *flags],
                             stdout=subprocess.PIPE, stderr=None, text=True)  # its own process: its own RSS
        if res.returncode != 0:
            raise SystemExit(f"checkpoint_load.py {ckpt} failed with exit code {res.returncode}")
        out[key] = json.loads(res.stdout.strip().splitlines()[-1])
        if "error" not in out[key]:  # torch's default mapping worked: no need for the shared one
            break
    out["params"] = sum(p.numel() for p in model.parameters())
    assert strategy.param_offload is not None
    out["state_bytes"] = sum(o.state_bytes for o in strategy.offloaded) + strategy.param_offload.layout.offloaded_bytes
    return out


def _run_child(args: argparse.Namespace, path: str, directory: str) -> dict:
    with tempfile.TemporaryDirectory(dir=directory, prefix=f"{path}-") as run_dir:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", path, f"--dir={run_dir}"] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("layers", "width", "heads", "seq", "batch", "warmup", "after_steps")]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    if res.returncode != 0:
        raise SystemExit(f"child {path} failed with exit code {res.returncode}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _mount_xfs(scratch: str, size: int) -> tuple[str, str]:
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        raise SystemExit("no --dir given and cannot make an XFS image (needs root and xfsprogs); pass --dir on an "
                         "XFS made with mkfs.xfs -m reflink=1")
    os.makedirs(scratch, exist_ok=True)
    image, mount = os.path.join(scratch, "xfs.img"), os.path.join(scratch, "mnt")
    os.makedirs(mount, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", image], check=True)
    subprocess.run(["mount", "-o", "loop", image, mount], check=True)
    return image, mount


def _ratios(configs: list[dict], num: str, den: str, key: str) -> dict | None:
    """``key`` of path ``num`` over path ``den``, per round (the rounds alternate their order)."""
    a, b = ([c[key] for c in configs if c["path"] == p] for p in (num, den))
    pairs = [x / y for x, y in zip(a, b) if y]
    return spread(pairs) if pairs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--width", type=int, default=2560)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (optimizer state created)")
    p.add_argument("--after-steps", type=int, default=None,
                   help="steps after the save (default 2; a background copy runs beside); 0: the save ends the run "
                   "(no copy on write after it: the disk needs the store + a little, not twice the state)")
    p.add_argument("--pairs", type=int, default=2, help="rounds of every path in --paths")
    p.add_argument("--paths", default="reflink,streamed,background", help="comma-separated, of " + ", ".join(PATHS))
    p.add_argument("--dir", default=None, help="a directory on an XFS/btrfs with reflinks (reflink and streamed)")
    p.add_argument("--background-dir", default=None, help="where the background path runs (default: --scratch)")
    p.add_argument("--scratch", default="/tmp/checkpoint_stall", help="where the XFS image goes without --dir")
    p.add_argument("--image-gib", type=int, default=24, help="sparse XFS image size without --dir")
    p.add_argument("--quick", action="store_true", help="a tiny GPT, one round of background and streamed, all in "
                   "--dir (no XFS): checks the script runs (tests/benchmarks), measures nothing")
    p.add_argument("--child", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    paths = [x for x in args.paths.split(",") if x]
    args.after_steps = 2 if args.after_steps is None else args.after_steps
    if args.quick:
        if args.dir is None:
            raise SystemExit("--quick needs --dir (any filesystem)")
        args.layers, args.width, args.heads, args.seq, args.pairs = 2, 64, 2, 16, 1
        paths = ["background", "streamed"]
        args.background_dir = args.background_dir or args.dir
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"unknown --paths {unknown}; choose from {sorted(PATHS)}")
    image = mount = None
    if args.dir is None and set(paths) & {"reflink", "streamed"}:
        image, mount = _mount_xfs(args.scratch, args.image_gib * GiB)
        args.dir = mount
    background_dir = args.background_dir or args.scratch
    os.makedirs(background_dir, exist_ok=True)
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    configs = []
    try:
        for pair in range(args.pairs):
            shift = pair % len(paths)
            for path in paths[shift:] + paths[:shift]:
                print(f"round {pair}: {path}", file=sys.stderr, flush=True)
                r = _run_child(args, path, background_dir if path == "background" else args.dir)
                r["filesystem"] = _fs_type(background_dir if path == "background" else args.dir)
                configs.append(r)
                load.append(os.getloadavg()[0])
                print(f"  stall {r['stall_s']:.2f} s, wrote {r['bytes_written'] / GiB:.3f} GiB of "
                      f"{r['state_bytes'] / GiB:.2f} GiB state, step {r['step_s']:.1f} s, after save "
                      f"{r.get('step_during_copy_s', float('nan')):.1f} s; torch.load(mmap=True) {r['load'].get('load_s')} s, "
                      f"RSS +{r['load'].get('rss_growth_bytes', 0) / 2**20:.1f} MiB {r['load'].get('error', '')}",
                      file=sys.stderr, flush=True)
    finally:
        if mount is not None:
            subprocess.run(["umount", mount], check=False)
            os.unlink(image)  # type: ignore[arg-type]
    out: dict = {"configs": configs}
    for path in ("reflink", "background"):
        mine = [c for c in configs if c["path"] == path]
        if mine and "streamed" in paths:
            out[f"stall_streamed_over_{path}"] = _ratios(configs, "streamed", path, "stall_s")
        if mine:
            out[f"{path}_stall_s_max"] = max(c["stall_s"] for c in mine)
            out[f"{path}_stall_over_step_max"] = max(c["stall_s"] / c["step_s"] for c in mine)
            if all(c["steps_after_save_s"] for c in mine):
                out[f"{path}_steps_after_save_over_step_max"] = max(max(c["steps_after_save_s"]) / c["step_s"]
                                                                    for c in mine)
    loads = [c.get("load_shared", c["load"]) if "error" in c["load"] else c["load"] for c in configs]
    out["load_errors"] = [c["load"]["error"] for c in configs if "error" in c["load"]]  # torch's default mapping
    loaded = [x for x in loads if "error" not in x]
    if loaded:
        out["load_mmap_flags"] = sorted({x["mmap_flags"] for x in loaded})
        out["load_s_max"] = max(x["load_s"] for x in loaded)
        out["load_rss_growth_bytes_max"] = max(x["rss_growth_bytes"] for x in loaded)
        out["load_peak_growth_bytes_max"] = max(x["peak_growth_bytes"] for x in loaded)
    out["state_in_file"] = len(loaded) == len(configs) and all(
        x["state_in_file"] for x in loaded) and all(c["checkpoint_dir_entries"] == ["last.ckpt"] for c in configs)
    reflink = [c for c in configs if c["path"] == "reflink"]
    if reflink:
        out["reflink_written_fraction_max"] = max(c["bytes_written"] / c["state_bytes"] for c in reflink)
    out.update({
        "preconditions": {"filesystems": sorted({c["filesystem"] for c in configs}),
                          "xfs image": bool(image), "layers": args.layers, "width": args.width, "seq": args.seq,
                          "batch": args.batch, "optimizer": "AdamW fp32", "offload_params": True},
        "load_avg_1min": {"min": min(load), "max": max(load), "samples": [round(x, 2) for x in load]},
        "median_step_s": statistics.median(c["step_s"] for c in configs),
        "wall_s": round(time.perf_counter() - t0, 1),
    })
    print(json.dumps(out))


def _fs_type(path: str) -> str:
    """The filesystem type of ``path`` (``/proc/mounts``' longest mount point that contains it)."""
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fields[2]
    return kind


if __name__ == "__main__":
    main()
