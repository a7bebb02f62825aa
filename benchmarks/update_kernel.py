"""CPU time of one AdamW update with ``state_format="int8"``, ``master_format="bf16_sr"`` and bf16 params:
the one-pass kernel (``lightning_nvme/optim/formats/fused_update.py``) against the generic path it replaces (the
optimizer's own fused step on decoded fp32 state: decode both moments, widen param and gradient, AdamW,
encode both moments, round back; what ``RoundTripOptimizer`` and the chunk updater run without the kernel).

``--elems-m`` million elements (one piece, initialized state), ``--reps`` rounds, each timing generic then
kernel (A B A B...), so load drift hits both alike; the ratio is the median of per-round ratios with min-max.
Both results are compared bit for bit (params, codes, scales) every round. Also reported: ns per element
and the seconds a 6.74 B-parameter model's update would take at that rate.

    python benchmarks/update_kernel.py --elems-m 64 --reps 7

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARAMS_7B = 6_738_415_616


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elems-m", type=float, default=64.0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from lightning_nvme.optim.formats import fused_update
    from lightning_nvme.optim.formats.adamw_kernel import update_blocks
    from lightning_nvme.optim.formats.codec import as_numpy
    from lightning_nvme.optim.formats.int8 import Int8
    from lightning_nvme.optim.formats.masters import sr_key, stochastic_round_bf16

    torch.set_num_threads(args.threads)
    block = fused_update.BLOCK
    n = int(args.elems_m * (1 << 20)) // block * block
    torch.manual_seed(0)
    param = torch.randn(n).bfloat16()
    grad = (torch.randn(n) * 1e-3).bfloat16()
    codec = Int8()
    state0 = {}
    for key, values in (("exp_avg", torch.randn(n) * 1e-4), ("exp_avg_sq", torch.rand(n) * 1e-7)):
        raws = [torch.empty(c.count(n), dtype=c.dtype) for c in codec.components(key)]
        codec.encode(key, values, raws, "")
        state0[key] = raws
    decoded = {k: torch.empty(n) for k in state0}
    master, g32 = torch.empty(n), torch.empty(n)
    opt = torch.optim.AdamW([master], lr=1e-5, fused=True)
    assert fused_update.verified(), "the kernel does not reproduce this torch build's fused AdamW"

    def generic(p: torch.Tensor, state: dict) -> None:
        for k, raws in state.items():
            codec.decode(k, raws, decoded[k])
        master.copy_(p)
        master.grad = g32.copy_(grad)
        opt.state[master] = {"step": torch.tensor(4.0), **decoded}
        opt.step()
        for k, raws in state.items():
            codec.encode(k, opt.state[master][k], raws, "")
        stochastic_round_bf16(master, sr_key(4, 0), 0, out=p)

    def kernel(p: torch.Tensor, state: dict) -> None:
        (mc, ms), (vc, vs) = state["exp_avg"], state["exp_avg_sq"]
        update_blocks(as_numpy(p), as_numpy(grad), as_numpy(mc), as_numpy(ms), as_numpy(vc), as_numpy(vs), True,
                      fused_update.constants(opt.param_groups[0], 5.0), sr_key(4, 0), 0, n // block,
                      fused_update.threads(n))

    def fresh() -> tuple[torch.Tensor, dict]:
        return param.clone(), {k: [r.clone() for r in raws] for k, raws in state0.items()}

    for fn in (generic, kernel):
        fn(*fresh())  # warm-up: compiles (or loads numba's cache), touches the buffers
    times: dict[str, list[float]] = {"generic": [], "kernel": []}
    equal = True
    for _ in range(args.reps):
        outs = []
        for name, fn in (("generic", generic), ("kernel", kernel)):
            p, state = fresh()
            t = time.perf_counter()
            fn(p, state)
            times[name].append(time.perf_counter() - t)
            outs.append([p.view(torch.int16)] + [r.view(torch.uint8) for raws in state.values() for r in raws])
        equal = equal and all(torch.equal(a, b) for a, b in zip(*outs))
    ratios = [g / k for g, k in zip(times["generic"], times["kernel"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"elems": n, "threads": args.threads, "reps": args.reps, "load_avg": os.getloadavg()[0],
           "bitwise_equal": equal,
           "generic_ns_per_elem": med["generic"] / n * 1e9, "kernel_ns_per_elem": med["kernel"] / n * 1e9,
           "speedup_median": statistics.median(ratios), "speedup_min_max": [min(ratios), max(ratios)],
           "generic_s_at_7b": med["generic"] / n * PARAMS_7B, "kernel_s_at_7b": med["kernel"] / n * PARAMS_7B}
    print(f"generic {out['generic_ns_per_elem']:.2f} ns/elem, kernel {out['kernel_ns_per_elem']:.2f} ns/elem: "
          f"{out['speedup_median']:.1f}x ({min(ratios):.1f}-{max(ratios):.1f}); at 7 B: "
          f"{out['generic_s_at_7b']:.1f} s -> {out['kernel_s_at_7b']:.1f} s; bitwise equal: {equal}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
