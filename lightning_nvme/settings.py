"""The offload strategies' arguments, each defined once: name, type, default, valid values and a one-line doc.

Each is one ``setting(default, doc, check)`` (``lightning_nvme.checks``, with ``ConfigError`` and the
checks). Everything else derives from or is checked against these dataclasses: the strategies' signatures and
docstrings (``with_settings``), validation (``__post_init__``: one ``ConfigError(key, message)`` per bad
value), the Hydra configs ``conf/strategy/nvme_offload*.yaml`` and README's argument table (both checked by
``tests/toplevel/test_settings.py``). To add an argument, add one ``setting(...)`` line to ``OffloadSettings`` (both
strategies) or ``DDPOffloadSettings`` (data parallel only), read it as ``self.config.<name>``, and add the
key to the YAML and README rows the test asks for.

Names mean one thing at every layer: ``io_chunk_bytes`` is the size of one disk request (strategy, I/O
profile, ``FlatStore``), ``chunk_bytes`` the optimizer-state chunk.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_nvme.checks import (
    ConfigError,
    boolean,
    check_fields,
    count,
    directories,
    is_int,
    nbytes,
    one_of,
    reject_unknown,
    resolve_store_dirs,
    setting,
)
from lightning_nvme.constants import ALIGN, STORE_DIR_ENV, GiB, MiB
from lightning_nvme.memory import HEAP_MMAP_THRESHOLD_MAX, OFF_HEAP_THRESHOLD
from lightning_nvme.optim import CHUNK_BYTES, OVERLAP_MODES, PREFETCH_DEPTH
from lightning_nvme.optim.formats import master_format_names, state_format_names
from lightning_nvme.optim.formats.state_format import StateFormat
from lightning_nvme.store.flat_store import IO_CHUNK_BYTES, IO_WORKERS, STAGING_BYTES
from lightning_nvme.store.stripes import STRIPE_BYTES

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")  # a settings dataclass


def _existing_file(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and os.path.isfile(value)):
        return None
    return (f"file {value!r} not found. Fix: create one with `lightning-nvme doctor STORE_DIR --write-profile "
            f"FILE`, or leave it null.")


def _block_classes(value: Any) -> str | None:
    if value is None or (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
                         and all(isinstance(v, (str, type)) for v in value)):
        return None
    return (f"must be a non-empty list of module classes or dotted import paths (e.g. "
            f"['transformers.models.gpt2.modeling_gpt2.GPT2Block']), or null for the default policy; got {value!r}.")


def _mmap_threshold(value: Any) -> str | None:
    if value is None or value == "auto" or (is_int(value) and value >= 4096):
        return None
    return (f"must be \"auto\", an integer number of bytes >= 4096 (e.g. 33554432) or null (leave glibc's "
            f"allocator alone), got {value!r}.")


def _budget(value: Any) -> str | None:
    if value == "auto" or (is_int(value) and value >= 0):
        return None
    return (f"must be an integer number of bytes >= 0 (0: nothing kept in memory) or \"auto\" (a share of the "
            f"memory available at setup, docs/shelf.md), got {value!r}. Fix: e.g. {8 * GiB} for 8 GiB.")


# ---- the arguments -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadSettings:
    """Arguments of both offload strategies (``nvme_offload`` and ``nvme_offload_ddp``)."""

    store_dir: str | list[str] | None = setting(
        None, f"Directory on a local SSD for the store file, or a list of directories on different SSDs to stripe "
              f"the store over (docs/striping.md); None: ``${STORE_DIR_ENV}``, else ``<default_root_dir>/nvme_store``.",
        directories)
    stripe_bytes: int = setting(
        STRIPE_BYTES, "With several ``store_dir``: bytes of one stripe unit, laid out round-robin over the disks; "
                      "overridden by ``io_profile``.", nbytes(ALIGN, aligned=True, typical=str(STRIPE_BYTES)))
    chunk_bytes: int = setting(
        CHUNK_BYTES, "Optimizer state per chunk, the unit that is read, updated and written back; resident "
                  "memory is ``(prefetch_depth + 2) x chunk_bytes``.", nbytes(ALIGN, typical="16-64 MiB"))
    io_chunk_bytes: int = setting(
        IO_CHUNK_BYTES, "Size of one disk request (``FlatStore(io_chunk_bytes=)``); overridden by ``io_profile``.",
        nbytes(ALIGN, aligned=True, typical=str(IO_CHUNK_BYTES)))
    staging_bytes: int = setting(
        STAGING_BYTES, "Pool of page-aligned buffers for tensors that cannot be read or written in place; holds "
                       "at least one ``io_chunk_bytes``.", nbytes(1, typical=str(STAGING_BYTES)))
    prefetch_depth: int = setting(
        PREFETCH_DEPTH, "Chunks read ahead of the one being updated.", count(1, "2 (prefetch the next chunk while one is in use)"))
    io_workers: int = setting(
        IO_WORKERS, "I/O threads per store (queue depth); overridden by ``io_profile``.", count(1, "1-8 (4 is a good default)"))
    overlap: str = setting(
        OVERLAP_MODES[0], "``\"step\"``: state I/O overlaps forward and backward; ``\"backward\"``: chunks are also updated "
                "during backward as their gradients become final.", one_of(*OVERLAP_MODES))
    io_profile: str | None = setting(
        None, "JSON written by ``lightning-nvme doctor PATH --write-profile FILE``: tuned ``io_chunk_bytes`` "
              "and ``io_workers`` for this disk.", _existing_file)
    min_free_bytes: int = setting(
        1 * GiB, "Free space that must remain on the SSD after the store is allocated (checked before training).",
        nbytes(0, typical="0 to disable the margin"))
    malloc_mmap_threshold: int | str | None = setting(
        "auto", "glibc's mmap threshold, fixed (not raised by glibc as it goes) so freed blocks above it return "
                "to the OS. ``\"auto\"``: 32 MiB, or 8 MiB with ``offload_params`` (memory flat in model size "
                "before page-fault cost); None leaves the allocator alone (lightning_nvme.memory).",
        _mmap_threshold)
    state_format: str = setting(
        "exact", "How per-element optimizer state (Adam's moments, momentum...) is stored: ``\"exact\"``, "
                 "``\"bf16\"`` or ``\"int8\"`` (blockwise 8-bit); see docs/state_format.md.",
        lambda value: one_of(*state_format_names())(value))  # the registered formats (optim/formats/)
    master_format: str = setting(
        "fp32", "``\"fp32\"`` masters of half-precision params, or ``\"bf16_sr\"``: none, the bf16 update is "
                "rounded stochastically (``precision=\"bf16-true\"``); see docs/state_format.md.",
        lambda value: one_of(*master_format_names())(value))
    offload_params: bool = setting(
        False, "Parameters of each block (e.g. a transformer layer) live in the store between uses and are "
               "loaded just in time (``nvme_offload`` only; see docs/params.md).", boolean)
    param_prefetch: int = setting(
        1, "With ``offload_params``: blocks read ahead of need (forward order, then reverse order in backward).",
        count(0, "1 (read the next block while one computes)"))
    param_block_classes: list[str] | None = setting(
        None, "With ``offload_params``: module classes (or dotted import paths) that are blocks; None: each child "
              "of the largest ``nn.ModuleList``/``nn.Sequential``.", _block_classes)
    frozen_weights: str = setting(
        "in_place", "With ``offload_params``: ``\"in_place\"``: frozen block parameters of a model built on the meta "
                    "device from a Hugging Face safetensors checkpoint (a LoRA base, frozen layers) are read from "
                    "those files at their offsets during fit (``O_DIRECT`` where the filesystem allows), not copied "
                    "into the store; checkpoints reference the files, which must not change (docs/params.md). "
                    "``\"store\"``: copied into the store.", one_of("in_place", "store"))
    restore_params: bool = setting(
        True, "With ``offload_params``: at the end of fit, bring the weights back into the module (memory: the "
              "whole model); false keeps them in the store (``strategy.export_weights(path)`` streams them to a "
              "safetensors file) and ``state_dict()`` after fit raises.", boolean)
    inline_weights_bytes: int = setting(
        1 * GiB, "With ``offload_params``: block weights up to this size are gathered into the checkpoint file (a "
                 "plain Lightning checkpoint; memory: that much); larger ones stream from the store into "
                 "a ``weights.safetensors`` record inside the checkpoint file, one block in memory at a time.",
        nbytes(0, typical="0 to always stream the weights beside the file"))
    eval_window: int = setting(
        1, "With ``offload_params`` outside fit: batches that pass through each block before the next block is read "
           "(layer-major, docs/params.md): each block is read once per window instead of once per batch.",
        count(1, "1 (batch by batch), or 8-64 to read each block once for that many batches"))
    eval_activation_bytes: int = setting(
        2 * GiB, "With ``eval_window`` > 1: bytes the window's activations between blocks may take in RAM; a "
                 "window needing more is refused by name.", nbytes(1, typical="2 GiB"))
    checkpoint_copy: str = setting(
        "auto", "How a checkpoint copies the optimizer state out of the store (each rank its shard): ``\"reflink\"`` "
                "clones the store's extents (XFS/btrfs, checkpoint on the store's filesystem; refused elsewhere), "
                "``\"streamed\"`` reads and writes every byte, ``\"background\"`` returns after a fence and copies "
                "while training continues (copy-before-write snapshot; any filesystem), ``\"auto\"`` reflinks where "
                "the filesystem allows, else streams; see docs/checkpoints.md.",
        one_of("auto", "reflink", "streamed", "background"))
    checkpoint_copy_buffer_bytes: int = setting(
        64 * MiB, "With ``checkpoint_copy=\"background\"``: the one buffer the copy moves the state through (the "
                  "copy's memory; a region larger than it is copied in pieces).",
        nbytes(ALIGN, aligned=True, typical=str(64 * MiB)))
    checkpoint_in_flight: str = setting(
        "join", "With ``checkpoint_copy=\"background\"``, a save while a copy is in flight: ``\"join\"`` returns "
                "after its fence and its copy joins the one in flight (same thread and buffer; a save of the same "
                "file waits), ``\"wait\"`` waits for that copy to commit, ``\"skip\"`` is skipped with a warning.",
        one_of("join", "wait", "skip"))
    host_memory_budget: int | str = setting(
        0, "Bytes of host RAM that parameter blocks and optimizer chunks may occupy instead of the SSD, chosen to "
           "save the most I/O per byte (docs/shelf.md); for the whole host (``nvme_offload_ddp`` splits it evenly "
           "among the host's ranks); ``\"auto\"``: 60% of the memory available at setup less 2 GiB; 0: everything "
           "streams.", _budget)
    device_memory_budget: int = setting(
        0, "With ``offload_params`` on CUDA: bytes of GPU memory that parameter blocks may keep occupying between "
           "uses, chosen by the same rule (host <-> device copies saved per byte); a block kept there is copied up "
           "once and stays, so with the whole model fitting only the optimizer state streams (docs/shelf.md); "
           "0: every block streams.", nbytes(0, typical="0, or bytes of GPU memory the model's blocks may keep"))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.store_dir is not None and not isinstance(self.store_dir, (str, os.PathLike)):
            object.__setattr__(self, "store_dir", [os.fspath(d) for d in self.store_dir])  # e.g. Hydra's ListConfig
        if self.staging_bytes < self.io_chunk_bytes:
            raise ConfigError("staging_bytes", f"staging_bytes={self.staging_bytes} cannot hold one io_chunk_bytes="
                                               f"{self.io_chunk_bytes}. Fix: set staging_bytes >= io_chunk_bytes.")
        if self.device_memory_budget and not self.offload_params:
            raise ConfigError("device_memory_budget", f"device_memory_budget={self.device_memory_budget} keeps "
                              "offloaded parameter blocks on the GPU, but offload_params=False: the parameters are "
                              "on the device already and the budget would be ignored. Fix: set offload_params=True, "
                              "or device_memory_budget=0.")

    @property
    def state_format_spec(self) -> StateFormat:
        """``state_format`` and ``master_format`` as the ``StateFormat`` that stores and decodes the state."""
        return StateFormat(self.state_format, self.master_format)

    def resolve_store_dirs(self, default_root_dir: str) -> list[str]:
        """``store_dir`` (one directory, or each of a striped store's), else ``$LIGHTNING_NVME_STORE_DIR``, else
        ``<default_root_dir>/nvme_store``."""
        return resolve_store_dirs(self.store_dir, default_root_dir)

    def mmap_threshold(self) -> int | None:
        """``malloc_mmap_threshold`` in bytes (``"auto"`` resolved), None: leave glibc alone."""
        if self.malloc_mmap_threshold != "auto":
            return self.malloc_mmap_threshold  # type: ignore[return-value]
        return OFF_HEAP_THRESHOLD if self.offload_params else HEAP_MMAP_THRESHOLD_MAX


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPOffloadSettings(OffloadSettings):
    """Arguments of ``nvme_offload_ddp`` beyond those of both strategies."""

    broadcast_bucket_bytes: int = setting(
        16 * MiB, "Most bytes of updated parameters one broadcast carries from their owner rank to the others.",
        nbytes(ALIGN, typical=str(16 * MiB)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDPOffloadSettings(DDPOffloadSettings):
    """Arguments of ``nvme_offload_fsdp``: those of ``nvme_offload_ddp``; only ``overlap``'s default differs (each
    block's gradient shard is consumed during its backward, docs/fsdp.md)."""

    overlap: str = setting(
        "backward", "``\"step\"``: state I/O overlaps forward and backward; ``\"backward\"``: chunks are also updated "
                    "during backward as their gradients become final.", one_of(*OVERLAP_MODES))
    reduce_order: str = setting(
        "rank", "Order of the gradient sums across ranks: ``\"rank\"`` adds every element's N partial gradients in "
                "rank order (an all-to-all, then a local sum: reproducible at any N, bitwise equal to DDP with "
                "``ordered_allreduce_hook``); ``\"backend\"``: the backend's reduce-scatter (its own order).",
        one_of("rank", "backend"))
    collectives: str = setting(
        "auto", "How the blocks' gathers and the gradients' all-to-alls move bytes between ranks: "
                "``\"shared_memory\"`` through an arena every rank of this host maps (memory speed, CPU tensors "
                "only); ``\"backend\"`` through the process group (Gloo's sockets, NCCL); ``\"auto\"``: shared "
                "memory when every rank runs on this host with CPU tensors, else the backend. The same bytes "
                "either way (bitwise the same training).", one_of("auto", "shared_memory", "backend"))
    collective_buffer_bytes: int = setting(
        128 * MiB, "With shared-memory collectives: bytes of the arena the ranks of a host share (resident in "
                   "each once touched; larger moves fewer chunks per collective, each chunk one barrier).",
                   nbytes(ALIGN, typical=str(128 * MiB)))


def check_values(**values: Any) -> None:
    """Check some settings on their own (e.g. those an I/O profile holds), by the checks defined above."""
    fields = {f.name: f for f in dataclasses.fields(DDPOffloadSettings)}
    for name, value in values.items():
        check = fields[name].metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise ConfigError(name, problem)


def from_arguments(settings: type[D], owner: str, arguments: dict[str, Any]) -> D:
    """Build the settings dataclass ``settings`` from keyword arguments, refusing an unknown name with the
    closest known one (``owner`` is named in the message)."""
    reject_unknown(owner, arguments, [f.name for f in dataclasses.fields(settings)])
    return settings(**arguments)


def docs(settings: type[DataclassInstance]) -> dict[str, str]:
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(settings)}


def with_settings(settings: type[DataclassInstance]) -> Callable[[type[T]], type[T]]:
    """Class decorator for a strategy whose ``__init__`` takes ``**settings``: its signature (what ``inspect``,
    ``help`` and the config validator see) lists every setting with its type and default, and its docstring's
    ``Args:`` section documents them, both from ``settings``."""

    def decorate(cls: type[T]) -> type[T]:
        init = cls.__init__
        own = inspect.signature(init)
        params = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD and p.name != "store_dir"]
        hints = {f.name: f.type for f in dataclasses.fields(settings)}
        added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                 for f in dataclasses.fields(settings) if f.name != "store_dir"]
        store_dir = inspect.Parameter("store_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                      annotation=hints["store_dir"])
        rest = [p for p in params[1:] if p.kind is not p.KEYWORD_ONLY]
        kw = [p for p in params[1:] if p.kind is p.KEYWORD_ONLY]
        var_kw = [p for p in own.parameters.values() if p.kind is p.VAR_KEYWORD and p.name != "settings"]
        setattr(init, "__signature__", own.replace(parameters=[params[0], store_dir, *rest, *added, *kw, *var_kw]))
        init.__annotations__ = {**hints, **init.__annotations__}  # what typing.get_type_hints reads
        lines = [textwrap.fill(f"{name}: {doc}", 110, initial_indent=" " * 8, subsequent_indent=" " * 12)
                 for name, doc in docs(settings).items()]
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Args:\n" + "\n".join(lines) + "\n"
        setattr(cls, "settings_class", settings)  # read by the config validator
        return cls

    return decorate


def _shown(value: Any) -> str:
    if is_int(value) and value >= MiB and value % MiB == 0:
        return f"`{value}` ({value // GiB} GiB)" if value % GiB == 0 else f"`{value}` ({value // MiB} MiB)"
    return "`null`" if value is None else f"`{value}`"


def markdown_table() -> str:
    """README's argument table; ``tests/toplevel/test_settings.py`` checks that README holds exactly this (and prints it)."""
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for settings, where in ((OffloadSettings, ""), (DDPOffloadSettings, " (`nvme_offload_ddp` only)"),
                            (FSDPOffloadSettings, " (`nvme_offload_fsdp` only)")):
        parent = settings.__mro__[1]
        own = [f for f in dataclasses.fields(settings) if f.name not in getattr(parent, "__dataclass_fields__", {})]
        rows += [f"| `{f.name}`{where} | {_shown(f.default)} | {f.metadata['doc']} |" for f in own]
    return "\n".join(rows)
