"""``state_format="bf16"``: fp32 state stored as bfloat16, a round-to-nearest-even cast (NaN/inf stay per
element). Half the bytes of fp32 state, no side data."""

from __future__ import annotations

from typing import Any

import torch

from lightning_nvme.optim.formats.codec import Component


class Bf16:
    name = "bf16"
    lossless = False
    align = 1

    def record(self) -> dict[str, Any]:
        return {}

    def components(self, key: str) -> tuple[Component, ...]:
        return (Component(key, torch.bfloat16),)

    def encode(self, key: str, values: torch.Tensor, raws: list[torch.Tensor], where: str) -> None:
        raws[0].copy_(values)

    def decode(self, key: str, raws: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        return raws[0].to(torch.float32) if out is None else out.copy_(raws[0])
