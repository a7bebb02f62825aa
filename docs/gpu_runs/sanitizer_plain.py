"""The sanitizer diagnosis of 2026-12-04 (docs/params.md, "Accelerators"): plain Lightning (strategy auto, no
offload) under TORCH_CUDA_SANITIZER=1, checkpoint early stop on or off. On a GPU, from the repository root:

    TORCH_CUDA_SANITIZER=1 PYTHONPATH=. python docs/gpu_runs/sanitizer_plain.py on   # or off

Prints one JSON line: ``ok`` false with the error where the run failed."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import gpu_check as g  # noqa: E402


def main(mode: str) -> None:
    args = g.parser().parse_args(["--steps", "2", "--layers", "4"] + (["--no-early-stop"] if mode == "off" else []))
    torch.cuda.init()
    torch.manual_seed(0)
    model = g.AdamGPT(vocab=256, d=args.d_model, heads=8, layers=args.layers, mlp=4)
    try:
        g.train(model, args, g.Tokens(1, args.batch, args.seq, 256), tempfile.mkdtemp())
        print(json.dumps({"mode": mode, "ok": True}))
    except Exception as e:  # noqa: BLE001  (the finding is the error itself)
        print(json.dumps({"mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}))


if __name__ == "__main__":
    main(sys.argv[1])
