"""Read throughput of frozen weights served in place (``frozen_weights="in_place"``) against raw ``O_DIRECT``.

A bf16 safetensors file of Llama-shaped blocks (``--hidden``, ``--intermediate``, ``--layers``: each block's seven
projections and two norms, in the order ``save_file`` writes them: sorted by name) is written once with a header
whose length leaves the data off any 4 KiB boundary, as real checkpoints do. Then, alternating in pairs on the same
file (A B A B ...):

  in_place   ``lightning_nvme.params.frozen_files.FrozenFiles``: every block's frozen head read as fit reads it
             (aligned ``O_DIRECT`` requests of ``read_bytes`` from ``readers`` threads, bytes copied to their slots)
  raw        the file read sequentially with ``O_DIRECT`` in 8 MiB requests from 4 threads (``_disk.raw_read``)
  reader     (``--with-reader``) the safetensors reader the streamed evaluation used before (one ``preadv`` per
             tensor, buffered, page cache dropped before)

Each figure is GB/s of tensor bytes; ``in_place_vs_raw`` is the median of per-pair ratios. Progress goes to stderr;
the last line of stdout is one JSON object.

    python benchmarks/frozen_read.py --dir /work/scratch/x --layers 8      # ~1.6 GB at the 7 B's block shape
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import GiB, drop_file_cache, gbps, raw_read, spread  # noqa: E402


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def block_shapes(hidden: int, intermediate: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("input_layernorm.weight", (hidden,)), ("mlp.down_proj.weight", (hidden, intermediate)),
            ("mlp.gate_proj.weight", (intermediate, hidden)), ("mlp.up_proj.weight", (intermediate, hidden)),
            ("post_attention_layernorm.weight", (hidden,)), ("self_attn.k_proj.weight", (hidden, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)), ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.v_proj.weight", (hidden, hidden))]


def write_file(path: str, layers: int, hidden: int, intermediate: int) -> int:
    """A bf16 safetensors file, written tensor by tensor (memory: one tensor); returns its size."""
    import torch

    from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter

    entries = [(f"model.layers.{i}.{n}", torch.bfloat16, s) for i in range(layers) for n, s in block_shapes(hidden, intermediate)]
    entries.sort(key=lambda e: e[0])
    writer = SafetensorsWriter(path, entries, {"format": "pt"})
    g = torch.Generator().manual_seed(0)
    for name, dtype, shape in entries:
        writer.write(name, 0, torch.empty(shape).normal_(0, 0.02, generator=g).to(dtype).reshape(-1))
    writer.close()
    return os.path.getsize(path)


def blocks_of(path: str, layers: int, hidden: int, intermediate: int) -> list:
    """The model's blocks as ``plan_layout`` lays them out (frozen: every parameter in the head)."""
    import torch
    from torch import nn

    from lightning_nvme.params.layout import PARAM_SLOT_ALIGN, BlockLayout, ParamSlot
    from lightning_nvme.store import align_up

    blocks = []
    for i in range(layers):
        block = BlockLayout(i, f"model.layers.{i}", nn.Module(), f"params/block{i}")
        for name, shape in block_shapes(hidden, intermediate):
            p = nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="meta"), requires_grad=False)
            n = p.numel() * 2
            block.slots.append(ParamSlot(f"model.layers.{i}.{name}", p, p.shape, p.dtype, block.nbytes, n))
            block.nbytes = align_up(block.nbytes + n, PARAM_SLOT_ALIGN)
        block.writable_offset = block.nbytes
        blocks.append(block)
    return blocks


def read_in_place(path: str, blocks: list, read_bytes: int, readers: int) -> tuple[float, int, dict]:
    """Seconds to read every block's head as fit does (one block buffer reused), and the tensor bytes."""
    from lightning_nvme.params.frozen_files import FrozenFiles
    from lightning_nvme.store import aligned_empty

    frozen = FrozenFiles(read_bytes=read_bytes, readers=readers)
    try:
        heads = frozen.plan(blocks, lambda name: (path, name))
        buf = aligned_empty(max(b.nbytes for b in blocks) + 4096)
        buf.fill_(0)  # touched before the clock starts
        t0 = time.perf_counter()
        pending = None
        for block in blocks:  # one read ahead, as param_prefetch=1 does: the next block's read overlaps this one's copy
            read = frozen.read(heads[block.index], buf)
            if pending is not None:
                pending.wait()
            pending = read
        assert pending is not None
        pending.wait()
        seconds = time.perf_counter() - t0
        stats = frozen.stats
        direct = all(f.direct_fd >= 0 for f in frozen.files.values())
        return seconds, stats.bytes_served, {"requests": stats.requests, "direct": direct,
                                             "bytes_requested": stats.bytes_read}
    finally:
        frozen.close()


def read_with_reader(path: str) -> tuple[float, int]:
    """The per-tensor buffered reader (``SafetensorsReader.read``), cold."""
    from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader

    drop_file_cache(path)
    reader = SafetensorsReader(path)
    total = 0
    t0 = time.perf_counter()
    for name in reader.entries:
        t = reader.read(name)
        total += t.numel() * t.element_size()
        del t
    seconds = time.perf_counter() - t0
    reader.close()
    return seconds, total


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where the file goes (default: a temp dir beside the checkout)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--read-bytes", type=int, default=None, help="FrozenFiles' request size (default: its own)")
    p.add_argument("--readers", type=int, default=None, help="FrozenFiles' reader threads (default: its own)")
    p.add_argument("--with-reader", action="store_true", help="also time the per-tensor buffered reader")
    args = p.parse_args()
    from lightning_nvme.params import frozen_files

    read_bytes = args.read_bytes or frozen_files.READ_BYTES
    readers = args.readers or frozen_files.READERS
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-frozen-read-") as tmp:
        path = os.path.join(tmp, "model.safetensors")
        t0 = time.perf_counter()
        size = write_file(path, args.layers, args.hidden, args.intermediate)
        _log(f"wrote {path}: {size / GiB:.2f} GiB in {time.perf_counter() - t0:.1f} s")
        blocks = blocks_of(path, args.layers, args.hidden, args.intermediate)
        subject, raw, reader = [], [], []
        info: dict = {}
        for i in range(args.pairs):
            s, served, info = read_in_place(path, blocks, read_bytes, readers)
            subject.append(gbps(served, s))
            whole = size - size % 4096  # O_DIRECT reads whole 4 KiB blocks; the tail's few bytes left out
            raw.append(gbps(whole, raw_read(path, whole)))
            msg = f"pair {i}: in_place {subject[-1]:.2f} GB/s, raw O_DIRECT {raw[-1]:.2f} GB/s"
            if args.with_reader:
                rs, rb = read_with_reader(path)
                reader.append(gbps(rb, rs))
                msg += f", per-tensor reader {reader[-1]:.2f} GB/s"
            _log(msg)
            load.append(os.getloadavg()[0])
    out = {
        "file_bytes": size, "tensor_bytes": served, "layers": args.layers, "hidden": args.hidden,
        "intermediate": args.intermediate, "read_bytes": read_bytes, "readers": readers, **info,
        "in_place_GBps": [round(x, 3) for x in subject], "raw_GBps": [round(x, 3) for x in raw],
        "in_place_vs_raw": spread([a / b for a, b in zip(subject, raw)]),
        "in_place_GBps_median": round(statistics.median(subject), 3), "raw_GBps_median": round(statistics.median(raw), 3),
        "cpu": cpu_name(), "cpus": os.cpu_count(),
        "load_avg_1min": {"min": min(load), "max": max(load), "samples": [round(x, 2) for x in load]},
    }
    if reader:
        out.update({"reader_GBps": [round(x, 3) for x in reader],
                    "reader_vs_raw": spread([a / b for a, b in zip(reader, raw)])})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
