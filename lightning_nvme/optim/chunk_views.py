"""Typed views of one piece's state inside a chunk buffer, and its conversion to and from the optimizer's view.

Why a module: the per-chunk update and the state import/export both read and write a piece's keys as the
state format stores them (``Piece.components``: the values, or codes plus per-block scales) in the same
chunk buffer; the offsets and the codec calls live here once.
"""

from __future__ import annotations

import math

import torch

from lightning_nvme.optim.buffers import ChunkBuffer, DecodeArena
from lightning_nvme.optim.formats.state_format import StateFormat
from lightning_nvme.optim.plan import Piece


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 1-D (a view when contiguous)."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def view(buf: ChunkBuffer, piece: Piece, key: str, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The stored tensor ``key`` of ``piece`` in ``buf`` (its bytes at the piece's slot), as ``dtype`` and ``shape``."""
    size = torch.empty((), dtype=dtype).element_size()
    off = piece.slots[key]
    return buf.data[off:off + math.prod(shape) * size].view(dtype).view(shape)


def raws(buf: ChunkBuffer, piece: Piece, key: str) -> list[torch.Tensor]:
    """The stored components of ``key`` (1-D each), as the state format's codecs take them."""
    return [view(buf, piece, c.name, c.dtype, (c.count(piece.numel),)) for c in piece.components[key]]


def load(fmt: StateFormat, buf: ChunkBuffer, piece: Piece, key: str, dtype: torch.dtype,
         arena: DecodeArena | None = None) -> torch.Tensor:
    """Key ``key`` of ``piece`` as the optimizer sees it (1-D; a view into ``buf`` when stored as is,
    else decoded into ``arena`` or a new tensor)."""
    out = arena.take(piece.numel, dtype) if arena is not None and fmt.compresses(key, dtype) else None
    return fmt.decode(key, dtype, raws(buf, piece, key), out)


def store(fmt: StateFormat, buf: ChunkBuffer, piece: Piece, key: str, value: torch.Tensor) -> None:
    """Encode the optimizer's ``value`` of ``key`` into ``piece``'s bytes in ``buf``."""
    fmt.encode(key, flat(value), raws(buf, piece, key), f" of parameter {piece.index}")
