"""What opening a one-file checkpoint costs: ``torch.load(path, mmap=True)`` time and resident memory (#36).

A checkpoint of ``nvme_offload`` is one torch zip whose optimizer state (and, with ``offload_params``, streamed
weights) are 4 KiB-aligned ``uint8`` records under ``checkpoint["lightning_nvme"]["records"]``. With ``mmap=True``
torch maps the file and builds each record's tensor over the mapping without reading it, so opening a checkpoint
of tens of GB should take about as long as unpickling Lightning's dict, and cost memory only for what is read
(the pickle, small records). This script measures that, in its own process, so the figure does not depend on what
the caller already holds in memory. ``lightning_nvme`` is imported first (before the baseline): with
``offload_params`` a checkpoint's streamed weights are references that ``weights_only=True`` accepts only once
``import lightning_nvme`` has registered them (``torch.serialization.add_safe_globals``).


  load_s              wall time of ``torch.load(path, mmap=True, weights_only=...)``
  rss_growth_bytes    ``VmRSS`` after the load minus before it (torch imported, nothing else)
  peak_growth_bytes   ``VmHWM`` after the load minus ``VmRSS`` before it (an upper bound on the load's peak: the
                      high-water mark may predate the load, e.g. torch's import)
  file_bytes          the checkpoint's size; records / record_bytes: the state records found inside it
  state_in_file       the ``records`` entry is present (the state is inside the one file, not beside it)

    python benchmarks/checkpoint_load.py run/checkpoints/last.ckpt

torch maps the file ``MAP_PRIVATE`` (copy on write) by default, which Linux's heuristic overcommit
(``vm.overcommit_memory=0``) charges as memory: a file larger than RAM + swap fails with ``ENOMEM``. That is
reported (``error``), not raised; ``--shared`` maps it ``MAP_SHARED`` instead (no charge; writes to a loaded
tensor would reach the file).

``benchmarks/checkpoint_stall.py`` runs it on each checkpoint it saves. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def _status(key: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _tensors(obj: object) -> list:
    import torch

    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def measure(path: str, weights_only: bool = True, shared: bool = False) -> dict:
    import gc
    import mmap

    import torch

    import lightning_nvme  # noqa: F401  (registers the streamed-weights reference as a safe global; see the docstring)

    gc.collect()
    before = _status("VmRSS")
    t0 = time.perf_counter()
    flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
    try:
        with torch.serialization.set_default_mmap_options(flags):
            ckpt = torch.load(path, mmap=True, weights_only=weights_only, map_location="cpu")
    except (RuntimeError, OSError) as e:  # e.g. ENOMEM: see the docstring
        return {"path": path, "error": f"{type(e).__name__}: {e}", "mmap_flags": "shared" if shared else "private",
                "file_bytes": os.path.getsize(path), "torch": torch.__version__}
    load_s = time.perf_counter() - t0
    rss, hwm = _status("VmRSS"), _status("VmHWM")
    entry = ckpt.get("lightning_nvme") if isinstance(ckpt, dict) else None
    records = entry.get("records") if isinstance(entry, dict) else None
    record_tensors = _tensors(records) if isinstance(records, dict) else []
    directory = os.path.dirname(os.path.abspath(path))
    return {
        "path": path, "load_s": round(load_s, 4), "rss_growth_bytes": rss - before, "peak_growth_bytes": hwm - before,
        "rss_before_bytes": before, "file_bytes": os.path.getsize(path),
        "file_allocated_bytes": os.stat(path).st_blocks * 512,
        "state_in_file": isinstance(records, dict), "records": sorted(records) if isinstance(records, dict) else [],
        "record_bytes": sum(t.untyped_storage().nbytes() for t in record_tensors),
        "tensors": len(_tensors(ckpt)), "weights_only": weights_only, "mmap": True,
        "mmap_flags": "shared" if shared else "private",
        "beside_the_file": sorted(n for n in os.listdir(directory) if n != os.path.basename(path)),
        "torch": torch.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a checkpoint file (one-file layout)")
    p.add_argument("--no-weights-only", dest="weights_only", action="store_false",
                   help="torch.load(..., weights_only=False) (default: True, torch's default)")
    p.add_argument("--shared", action="store_true", help="map with MAP_SHARED (torch.serialization."
                   "set_default_mmap_options): no commit charge, but a write to a loaded tensor writes the file")
    args = p.parse_args()
    out = measure(args.path, args.weights_only, args.shared)
    out["load_avg_1min"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
