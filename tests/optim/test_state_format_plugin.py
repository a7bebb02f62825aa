"""A state format is a plug-in: this file defines a toy format (fp16 values with one fp32 scale per block of 64
elements), registers it with one line, and trains with it through the strategy's ``state_format`` setting,
bitwise equal to the in-memory ``RoundTripOptimizer`` of the same format. Nothing else in the package names it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from test_state_format import offload
from test_strategy import assert_same_params, fit

from lightning_nvme.optim import plan_chunks
from lightning_nvme.optim.formats import Component, register, state_format_names
from lightning_nvme.optim.formats.state_format import StateFormat

BLOCK = 64


class BlockFp16:
    """Values as fp16 of ``x / absmax`` per block, and the blocks' fp32 absmax beside them."""

    name = "toy_block_fp16"
    lossless = False
    align = BLOCK

    def record(self) -> dict[str, Any]:
        return {"block": BLOCK}

    def components(self, key: str) -> tuple[Component, ...]:
        return Component(key, torch.float16), Component(key + ".scale", torch.float32, BLOCK)

    def encode(self, key: str, values: torch.Tensor, raws: list[torch.Tensor], where: str) -> None:
        n = values.numel()
        blocks = F.pad(values, (0, -n % BLOCK)).view(-1, BLOCK)
        scale = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        raws[0].copy_((blocks / scale[:, None]).reshape(-1)[:n])
        raws[1].copy_(scale)

    def decode(self, key: str, raws: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        codes, scale = raws
        values = codes.float() * scale.repeat_interleave(BLOCK)[:codes.numel()]
        return values if out is None else out.copy_(values)


register(BlockFp16())


def test_a_registered_format_trains_bitwise_equal_to_its_round_trip(tmp_path):
    assert "toy_block_fp16" in state_format_names()
    ref, _ = fit(tmp_path / "ref", "auto", optimizer="adamw", ref_state_format="toy_block_fp16")
    off, t = fit(tmp_path / "off", offload(tmp_path, state_format="toy_block_fp16"), optimizer="adamw")
    assert t.global_step == 32
    assert_same_params(ref, off)
    stored = t.strategy.offloaded[0].state_bytes
    exact = sum(c.nbytes for c in plan_chunks(t.optimizers[0], 16 << 10, "probe").chunks)
    assert stored < exact * 0.6  # the store holds fp16 values and per-block scales, not fp32
    fmt = StateFormat("toy_block_fp16")
    assert fmt.to_dict() == {"state_format": "toy_block_fp16", "master_format": "fp32", "block": BLOCK}
    assert fmt.elements_per_value("exp_avg.scale") == BLOCK and fmt.align == BLOCK


def test_the_round_trip_changes_the_state():
    """The reference is not trivially exact: the toy format loses precision like a real one."""
    x = torch.randn(3 * BLOCK + 5)
    y = StateFormat("toy_block_fp16").round_trip("exp_avg", x)
    assert y.shape == x.shape and not torch.equal(x, y)
    assert float((x - y).abs().max()) <= float(x.abs().max()) * 1e-3
