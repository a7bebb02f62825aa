"""Checkpoints of offloaded training: one file Lightning's loaders open, the optimizer state inside it.

The strategies use two objects: ``Saver`` (``saver``: writes a checkpoint, choosing how its state reaches the file,
and runs the commit protocol of ``paired``) and ``Resume`` (``load``: reads one back). Below them: the file and its
protocol (``paired``, ``onefile``), the optimizer state files' format and reading (``state_files``), how a save
fills them, one module per ``checkpoint_copy`` word (``copy/streamed``, ``copy/reflink``, ``copy/background``),
data-parallel shards, one file per rank (``rank_shards``), weights beside the dict (``weights``), the save record and space check
(``record``), conversion to and from plain Lightning checkpoints
(``convert``)."""

from lightning_nvme.checkpoint import paired, rank_shards
from lightning_nvme.checkpoint.load import Resume, load_checkpoint, open_checkpoint
from lightning_nvme.checkpoint.record import SaveRecord
from lightning_nvme.checkpoint.saver import DDP_BACKGROUND_REFUSAL, Saver
from lightning_nvme.checkpoint.state_files import OptimizerParts, format_entry, optimizer_placeholder, restore_optimizer
from lightning_nvme.checkpoint.weights import WeightReaders

__all__ = ["DDP_BACKGROUND_REFUSAL", "OptimizerParts", "Resume", "SaveRecord", "Saver", "WeightReaders",
           "format_entry", "load_checkpoint", "open_checkpoint", "optimizer_placeholder",
           "paired", "rank_shards", "restore_optimizer"]
