"""The weights of a model whose blocks live in the store: in a checkpoint (gathered inline, or references streamed
beside the file) and exported to safetensors (Lightning's names, or the Hugging Face / peft layout).

Why a module of functions: both read the ``ParamOffload`` whose blocks are in the store and a way to have the store
open (``readable``), which the strategy passes in; ``NVMeOffloadStrategy.lightning_module_state_dict`` and
``export_weights`` delegate here. Writing the files is ``checkpoint.weights``' and ``models.hub_export``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch

from lightning_nvme.checkpoint import weights
from lightning_nvme.models.hub_export import export_hf
from lightning_nvme.params import ParamOffload

Readable = Callable[[], AbstractContextManager[object]]


@contextmanager
def state_dict_scope(params: ParamOffload, inline_weights_bytes: int, readable: Readable) -> Iterator[None]:
    """Inside, ``state_dict()`` gives a checkpoint's weights: offloaded blocks above ``inline_weights_bytes`` as
    references (streamed beside the file by the save), smaller ones gathered from the store; frozen weights read in
    place as references to the user's files."""
    with ExitStack() as stack:
        stack.enter_context(params.referencing_base_files())
        stack.enter_context(params.by_reference() if params.layout.offloaded_bytes > inline_weights_bytes
                            else readable())
        yield


def check_layout(layout: str) -> None:
    if layout not in ("lightning", "hf"):
        raise ValueError(f"export_weights: layout must be 'lightning' or 'hf', got {layout!r}")


def export(path: str, module: torch.nn.Module, params: ParamOffload | None, readable: Readable, layout: str,
           max_shard_bytes: int, merge_adapters: bool) -> None:
    """``NVMeOffloadStrategy.export_weights``: offloaded blocks (``params``) streamed from the store one at a time."""
    check_layout(layout)
    with readable() if params is not None else nullcontext(), \
            params.by_reference() if params is not None else nullcontext():
        state = module.state_dict()
        write_export(path, module, state, params.read_block if params is not None else None, layout, max_shard_bytes,
                     merge_adapters)


def write_export(path: str, module: torch.nn.Module, state: dict[str, torch.Tensor],
                 read_block: Callable[[Any], dict[str, torch.Tensor]] | None, layout: str, max_shard_bytes: int,
                 merge_adapters: bool) -> None:
    """The export's files from ``state`` (a state dict whose offloaded weights are references ``read_block`` reads,
    one block at a time)."""
    if layout == "lightning":
        weights.export(path, state, read_block if read_block is not None else lambda source: {})
        return
    export_hf(path, module, state, read_block, max_shard_bytes, merge_adapters)
