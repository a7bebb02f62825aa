"""The protocols a state format implements (``StateCodec`` for per-element state, ``MasterPolicy`` for the
fp32 masters of half-precision params) and what their implementations share.

Why protocols: a new way to store optimizer state is one file implementing ``StateCodec`` plus one
``register`` line (``formats/__init__.py``); the optimizer, checkpoints, the converter and the settings
ask the registered object and never compare format names.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import torch


class StateFormatError(ValueError):
    """State that a format cannot store faithfully, or a checkpoint in another format."""


@dataclass(frozen=True)
class Component:
    """One stored tensor of a state key: the values (``per`` = 1) or e.g. per-block scales (``per`` = block)."""

    name: str
    dtype: torch.dtype
    per: int = 1

    def count(self, numel: int) -> int:
        return -(-numel // self.per)


class StateCodec(Protocol):
    """How a compressible state key (fp32, not a master) is stored. ``lossless``: stored as is (the default
    ``"exact"``); the other members are then never called. ``align``: element multiple every cut of a
    parameter into pieces or ranks must fall on (a block)."""

    name: str
    lossless: bool
    align: int

    def record(self) -> dict[str, Any]:
        """What a checkpoint records about the format besides its name (e.g. the block size)."""
        ...

    def components(self, key: str) -> tuple[Component, ...]:
        """The stored tensors of ``key``: the first holds the values (named ``key``), then any side data."""
        ...

    def encode(self, key: str, values: torch.Tensor, raws: list[torch.Tensor], where: str) -> None:
        """Store 1-D fp32 ``values`` into ``raws`` (one 1-D tensor per component); ``where`` names them in errors."""
        ...

    def decode(self, key: str, raws: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        """The 1-D fp32 values ``raws`` stand for, into ``out`` when given."""
        ...


class MasterPolicy(Protocol):
    """What a half-precision parameter's update runs on: a stored fp32 master, or an fp32 copy of the param
    rounded back (``rounds``)."""

    name: str
    keeps_masters: bool

    def rounds(self, param_dtype: torch.dtype) -> bool:
        """True where a param of this dtype keeps no stored fp32 master."""
        ...

    def write_param(self, dst: torch.Tensor, master: torch.Tensor, step: int, index: int, start: int) -> None:
        """Copy an updated fp32 ``master`` into the param elements ``dst`` (``start``: offset in the param)."""
        ...


def kernels() -> ModuleType:
    """The numba kernels, imported on first use: numba costs ~50 MiB of RSS, which runs in the default
    ``"exact"`` format should not pay."""
    from lightning_nvme.optim.formats import kernels as module

    return module


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a 1-D contiguous CPU tensor (bf16 as its int16 bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).detach().numpy()


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.device.type == "cpu" and t.is_contiguous() else t.detach().reshape(-1).cpu()
