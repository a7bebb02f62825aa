"""``state_format="exact"`` (the default): per-element state stored as the optimizer holds it."""

from __future__ import annotations

from typing import Any

import torch

from lightning_nvme.optim.formats.codec import Component


class Exact:
    """Stores every key as is; ``StateFormat`` never calls the codec members of a lossless format."""

    name = "exact"
    lossless = True
    align = 1

    def record(self) -> dict[str, Any]:
        return {}

    def components(self, key: str) -> tuple[Component, ...]:
        return (Component(key, torch.float32),)

    def encode(self, key: str, values: torch.Tensor, raws: list[torch.Tensor], where: str) -> None:
        raws[0].copy_(values)

    def decode(self, key: str, raws: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        return raws[0] if out is None else out.copy_(raws[0])
