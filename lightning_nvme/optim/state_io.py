"""The protocols through which an offloaded optimizer's state goes in and out (used by ``checkpoint/`` and
the parameter offload), and their in-memory implementations for torch's own ``state_dict`` format.

Why here: checkpoint code streams state piece by piece without ever holding it whole; it depends on these
small protocols, not on the optimizer's bookkeeping.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lightning_nvme.optim.chunk_views import flat
from lightning_nvme.optim.plan import Piece


class StateSource(Protocol):
    """Where ``import_state`` reads per-parameter state from (a dict, a checkpoint file...)."""

    def tensor(self, index: int, key: str, start: int, stop: int) -> torch.Tensor | None: ...

    def scalars(self, index: int, tensor_keys: set[str]) -> dict[str, Any]: ...


class StateSink(Protocol):
    """Where ``export_state`` writes per-parameter state to, one piece at a time. ``values`` start at
    element ``piece.start // per`` of the entry ``key`` (``per`` > 1: per-block scales of a compressed key)."""

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None: ...


class UpdateListener(Protocol):
    """Told around each chunk update (parameter offload: make the chunk's parameters resident first,
    write them back after). ``touched``: the chunk's parameters that have a gradient; ``finished``: those
    whose every piece is now updated in this step."""

    def before_update(self, touched: Sequence[torch.Tensor]) -> None: ...

    def after_update(self, touched: Sequence[torch.Tensor], finished: Sequence[torch.Tensor]) -> None: ...


class DictSource:
    """State from a ``{param index: {key: tensor or scalar}}`` dict (torch's format, indexed by position)."""

    def __init__(self, state: dict[int, dict[str, Any]]) -> None:
        self.state = state

    def tensor(self, index: int, key: str, start: int, stop: int) -> torch.Tensor | None:
        value = self.state.get(index, {}).get(key)
        return flat(value)[start:stop] if torch.is_tensor(value) else None

    def scalars(self, index: int, tensor_keys: set[str]) -> dict[str, Any]:
        return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.state.get(index, {}).items()
                if k not in tensor_keys}


class DictSink:
    """Collects exported pieces into full tensors shaped like their parameters."""

    def __init__(self) -> None:
        self.parts: defaultdict[int, defaultdict[str, list[tuple[int, torch.Tensor]]]] = defaultdict(
            lambda: defaultdict(list))

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None:
        self.parts[piece.index][key].append((piece.start // per, values.clone()))

    def full(self, params: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for index, keys in self.parts.items():
            shape = params[index].shape
            out[index] = {k: torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])]).view(shape)
                          for k, parts in keys.items()}
        return out
