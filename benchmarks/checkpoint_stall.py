"""What a checkpoint costs the training run: reflink snapshot vs streamed copy (#22), offload_params + AdamW.

One GPT (``--layers`` blocks at ``--width``; 7 x 2560 is ~0.55 B params) trains with ``NVMeOffloadStrategy(
offload_params=True, overlap="backward", inline_weights_bytes=0)`` on an XFS with reflinks (``--dir``; by default a
sparse image made with ``mkfs.xfs -m reflink=1`` and loop-mounted, root needed). After ``--warmup`` steps and one
timed plain step, the run saves a checkpoint on the store's filesystem, then runs one more step. Each configuration
is a fresh process; ``reflink`` (``checkpoint_copy="auto"``) and ``streamed`` (``checkpoint_copy="streamed"``)
alternate (A B A B, ``--pairs``).

Per configuration:
  stall_s             wall time inside ``trainer.save_checkpoint`` (training is blocked for all of it)
  bytes_written       the process's ``write_bytes`` (``/proc/self/io``) during the save, the checkpoint file included
  state_bytes         optimizer state + offloaded weights in the store (what a streamed save copies)
  extra_disk_bytes    the filesystem's used bytes after the save minus before it
  extra_disk_after_step_bytes   the same after the step that follows (copy on write of the rewritten regions)
  step_s              a plain step (start to start); step_during_copy_s: the step right after the save, through a
                      durable fence (a reflink save's first rewrites of shared extents allocate new ones; there is
                      no background copy yet, so for ``streamed`` it is just the next step)

    sudo python benchmarks/checkpoint_stall.py                         # 0.55 B, 2 pairs (~10 min)
    sudo python benchmarks/checkpoint_stall.py --layers 2 --width 256 --pairs 1   # a smoke run

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

PATHS = {"reflink": "auto", "streamed": "streamed"}


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
    tokens = torch.randint(0, 256, ((args.warmup + 3) * args.batch, args.seq + 1))
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
    w = args.warmup  # steps 0..w-1 create the state; step w is timed; the save follows step w+1; then step w+2

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
            starts.append(time.perf_counter())
            print(f"  {args.child}: step {len(starts) - 1} starts", file=sys.stderr, flush=True)

        def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
            step = len(starts) - 1
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

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=w + 3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Clock()], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=data)
    out["step_s"] = starts[w + 1] - starts[w]
    out["params"] = sum(p.numel() for p in model.parameters())
    assert strategy.param_offload is not None
    out["state_bytes"] = sum(o.state_bytes for o in strategy.offloaded) + strategy.param_offload.layout.offloaded_bytes
    return out


def _run_child(args: argparse.Namespace, path: str) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=f"{path}-") as run_dir:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", path, f"--dir={run_dir}"] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("layers", "width", "heads", "seq", "batch", "warmup")]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--width", type=int, default=2560)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (optimizer state created)")
    p.add_argument("--pairs", type=int, default=2, help="reflink/streamed pairs")
    p.add_argument("--dir", default=None, help="a directory on an XFS/btrfs with reflinks")
    p.add_argument("--scratch", default="/tmp/checkpoint_stall", help="where the XFS image goes without --dir")
    p.add_argument("--image-gib", type=int, default=24, help="sparse XFS image size without --dir")
    p.add_argument("--child", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    image = mount = None
    if args.dir is None:
        image, mount = _mount_xfs(args.scratch, args.image_gib * GiB)
        args.dir = mount
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    configs, ratios = [], []
    try:
        for pair in range(args.pairs):
            row = {}
            for path in ("reflink", "streamed") if pair % 2 == 0 else ("streamed", "reflink"):
                print(f"pair {pair}: {path}", file=sys.stderr, flush=True)
                row[path] = _run_child(args, path)
                load.append(os.getloadavg()[0])
                r = row[path]
                print(f"  stall {r['stall_s']:.2f} s, wrote {r['bytes_written'] / GiB:.3f} GiB of "
                      f"{r['state_bytes'] / GiB:.2f} GiB state, step {r['step_s']:.1f} s, after save "
                      f"{r['step_during_copy_s']:.1f} s", file=sys.stderr, flush=True)
            configs += [row["reflink"], row["streamed"]]
            ratios.append(row["streamed"]["stall_s"] / row["reflink"]["stall_s"])
    finally:
        if mount is not None:
            subprocess.run(["umount", mount], check=False)
            os.unlink(image)  # type: ignore[arg-type]
    reflink = [c for c in configs if c["path"] == "reflink"]
    out = {
        "configs": configs,
        "stall_streamed_over_reflink": spread(ratios),
        "reflink_written_fraction_max": max(c["bytes_written"] / c["state_bytes"] for c in reflink),
        "reflink_stall_s_max": max(c["stall_s"] for c in reflink),
        "preconditions": {"filesystem": "xfs reflink=1 (loop image)" if image else args.dir,
                          "layers": args.layers, "width": args.width, "seq": args.seq, "batch": args.batch,
                          "optimizer": "AdamW fp32", "offload_params": True},
        "load_avg_1min": {"min": min(load), "max": max(load), "samples": [round(x, 2) for x in load]},
        "median_step_s": statistics.median(c["step_s"] for c in configs),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
