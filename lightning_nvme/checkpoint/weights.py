"""Parameter-offloaded weights streamed beside a checkpoint file, and how each loader gets them back.

With ``offload_params=True`` a block's weights live in the store. Gathering them into the checkpoint
file would hold the whole model in memory at once (what offloading avoids), so above
``inline_weights_bytes`` a save streams them block by block from the store into
``<file>.optim/<save id>/weights.safetensors`` (one tensor per state-dict key, written at its offset
by ``SafetensorsWriter``), committed with the optimizer files (``paired``). The file's ``state_dict``
then holds a ``BesideWeight`` for each such key: a few strings, pickled as a call of ``beside_weight``.

What each loader gets:

* ``torch.load`` / ``LightningModule.load_from_checkpoint`` / ``Trainer(strategy="auto")``: the call
  reads the tensor from the beside file (``safetensors.safe_open``): a complete model, read into
  memory as those loaders always do; of a one-file checkpoint under ``mmap=True``, mapped from the
  weights record, not read, like torch's own tensors. ``import lightning_nvme`` registers ``beside_weight`` with
  ``torch.serialization.add_safe_globals`` so ``weights_only=True`` loads work; a missing file or one of
  another save is an error that names it and the fix, never a model with random weights.
* the offload strategies load under ``deferred()``: the call returns the ``BesideWeight`` itself, and
  a resume streams each block from the beside file into the store (``WeightReaders``), one block in
  memory at a time.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from safetensors import safe_open

from lightning_nvme.checkpoint.safetensors_stream import CODES, DTYPES, SafetensorsReader, SafetensorsWriter, safetensors_size
from lightning_nvme.fs import atomic

WEIGHTS_FILE = "weights.safetensors"
CONVERT = "lightning-nvme convert to-lightning {src} plain.ckpt"

_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_nvme_deferred_weights", default=False)


@dataclass
class BesideWeight:
    """A state-dict entry whose tensor is in ``<directory>/weights.safetensors`` under ``key``."""

    key: str
    dtype: str  # safetensors dtype code ("F32", "BF16", ...)
    shape: tuple[int, ...]
    parts_dir: str = ""  # relative to the checkpoint file's directory: ``<name>.optim/<save id>``
    directory: str = ""  # absolute: where it was saved; on a strategy load, where it was found
    save_id: str = ""
    problem: str | None = None  # why it cannot be read (set on load when the directory is missing)
    record: Any = None  # one-file checkpoint: the weights file's record (a uint8 tensor), set on load
    source: Any = field(default=None, compare=False, repr=False)  # saving: where to read it (not pickled)
    # read by itself (``read()``), not from a beside file: ``base_file.FileWeight``, a tensor of the user's own file
    read_alone: ClassVar[bool] = False

    @classmethod
    def of(cls, key: str, tensor_like: torch.Tensor, source: Any) -> BesideWeight:
        return cls(key, DTYPES[tensor_like.dtype], tuple(tensor_like.shape), source=source)

    @property
    def torch_dtype(self) -> torch.dtype:
        return CODES[self.dtype]

    @property
    def path(self) -> str:
        return os.path.join(self.directory, WEIGHTS_FILE)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # a one-file save pickles the weights file's record with each reference (the record is a storage the file
        # holds once), so that unpickling can read the tensor before the checkpoint's ``lightning_nvme`` entry
        return beside_weight, (self.key, self.dtype, self.shape, self.parts_dir, self.directory, self.save_id,
                               self.record)

    def check_readable(self) -> None:
        if self.record is not None:
            return
        if self.problem is not None:
            raise RuntimeError(self.problem)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"checkpoint weight {self.key!r} is streamed beside its checkpoint file, in {self.path}, which does "
                f"not exist (the checkpoint was moved or copied without its {self.parts_dir} directory, or deleted). "
                f"Keep {self.parts_dir}/ beside the file, load it with lightning_nvme.checkpoint.load_checkpoint(path) "
                f"(finds it relative to the file wherever both are), or convert it into one plain Lightning "
                f"checkpoint: {CONVERT.format(src='CHECKPOINT')}")

    def read(self) -> torch.Tensor:
        """The tensor, read from the beside file (checked to belong to the same save)."""
        self.check_readable()
        if self.record is not None:
            # under torch.load(..., mmap=True) the weight is mapped from the file, not read (opening a checkpoint of
            # any size costs its pickle), as torch's own tensors are; a record in memory is copied from
            reader, tensor = SafetensorsReader(self.path, self.record), None
            try:
                _check_save(self.path, reader.metadata.get("save_id"), self.save_id)
                tensor = reader.mapped(self.key)
                return tensor.view(self.shape) if tensor is not None else reader.read(self.key).view(self.shape)
            finally:
                reader.close(drop_cache=tensor is None)
        with safe_open(self.path, framework="pt") as f:
            found = (f.metadata() or {}).get("save_id")
            _check_save(self.path, found, self.save_id)
            return f.get_tensor(self.key)


def beside_weight(key: str, dtype: str, shape: tuple[int, ...], parts_dir: str, directory: str,
                  save_id: str, record: torch.Tensor | None = None) -> torch.Tensor | BesideWeight:
    """Unpickling a ``BesideWeight``: the tensor, or (under ``deferred()``) the reference itself."""
    ref = BesideWeight(key, dtype, tuple(shape), parts_dir, directory, save_id, record=record)
    return ref if _deferred.get() else ref.read()


def is_deferred() -> bool:
    """Inside ``deferred()``: references stay references (``base_file.FileWeight`` asks too)."""
    return _deferred.get()


@contextmanager
def deferred() -> Iterator[None]:
    """Loads inside keep ``BesideWeight`` references instead of reading the tensors."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def _check_save(path: str, found: str | None, expected: str) -> None:
    if found != expected:
        raise ValueError(f"weights file {path} was written by save {found}, but the checkpoint file refers to save "
                         f"{expected}: the file and its weights come from different saves (copied separately?). "
                         "Refusing to mix them.")


def refs(state_dict: Mapping[str, Any]) -> dict[str, BesideWeight]:
    """The references a save streams beside the file (not those into the user's base files: ``read_alone``)."""
    return {k: v for k, v in state_dict.items() if isinstance(v, BesideWeight) and not v.read_alone}


def has_refs(checkpoint: Mapping[str, Any]) -> bool:
    return bool(refs(checkpoint.get("state_dict") or {}))


def bind(state_dict: Mapping[str, Any], path: str, save_id: str) -> None:
    """Tie the references of a save in progress to where its beside file will be once committed."""
    name = os.path.basename(path)
    for ref in refs(state_dict).values():
        ref.parts_dir = f"{name}.optim/{save_id}"
        ref.directory = os.path.join(os.path.dirname(os.path.abspath(path)), ref.parts_dir)
        ref.save_id = save_id


def resolve(state_dict: Mapping[str, Any], directory: str, problem: str | None,
            records: Mapping[str, Any] | None = None) -> None:
    """On load: point the references at the record inside a one-file checkpoint (``records``), or the directory
    found beside the file (or record why there is none)."""
    for ref in refs(state_dict).values():
        if records is not None:
            ref.record, ref.problem = records.get(WEIGHTS_FILE), None
            if ref.record is None:
                ref.problem = f"the checkpoint holds weight {ref.key!r} in a {WEIGHTS_FILE} record it does not have"
            continue
        ref.directory, ref.problem = (directory, None) if directory else (ref.directory, problem)


# ---- writing -------------------------------------------------------------------------------------------------
ReadSource = Callable[[Any], dict[str, torch.Tensor]]  # a reference's ``source`` -> values, one block at a time


def _entries(state_dict: Mapping[str, Any], include_tensors: bool
             ) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], dict[str, BesideWeight], dict[str, torch.Tensor]]:
    beside = refs(state_dict)
    tensors = {k: v for k, v in state_dict.items() if include_tensors and torch.is_tensor(v)}
    entries = [(k, v.torch_dtype, v.shape) for k, v in beside.items()]
    entries += [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    return entries, beside, tensors


def written_size(state_dict: Mapping[str, Any], metadata: Mapping[str, str]) -> int:
    """Bytes of the file ``write`` writes for ``state_dict``'s references (known before writing)."""
    return safetensors_size(_entries(state_dict, False)[0], dict(metadata))


def write(path: str, state_dict: Mapping[str, Any], read_source: ReadSource, metadata: Mapping[str, str],
          include_tensors: bool = False, fd: int | None = None, base: int = 0) -> None:
    """Stream the references of ``state_dict`` into the safetensors file ``path`` (fsynced), one source (a block)
    in memory at a time; with ``include_tensors``, its in-memory tensors too (a whole-model export). Given ``fd``,
    the same bytes go to offset ``base`` of that open file instead (its record in a one-file checkpoint)."""
    entries, beside, tensors = _entries(state_dict, include_tensors)
    writer = SafetensorsWriter(path, entries, dict(metadata), fd=fd, base=base)
    try:
        for key, t in tensors.items():
            writer.write(key, 0, t.detach().reshape(-1).cpu())
        by_source: dict[int, list[BesideWeight]] = {}
        for ref in beside.values():
            by_source.setdefault(id(ref.source[0]), []).append(ref)
        for group in by_source.values():
            values = read_source(group[0].source[0])
            for ref in group:
                writer.write(ref.key, 0, values[ref.source[1]].reshape(-1))
            del values
    finally:
        writer.close()


def export(path: str, state_dict: Mapping[str, Any], read_source: ReadSource) -> None:
    """A whole state dict (references streamed) to one safetensors file, switched in atomically."""
    tmp = atomic.temp_name(path)
    try:
        write(tmp, state_dict, read_source, {"format": "pt"}, include_tensors=True)
        atomic.commit(tmp, path)
    except BaseException:
        atomic.delete(tmp)
        raise


# ---- reading -------------------------------------------------------------------------------------------------
class WeightReaders:
    """Open beside files of one load, each checked once against its save id; closed together."""

    def __init__(self) -> None:
        self._open: dict[str, SafetensorsReader] = {}

    def read(self, ref: BesideWeight) -> torch.Tensor:
        if ref.read_alone:
            return ref.read()
        return self._reader(ref).read(ref.key).view(ref.shape)

    def read_range(self, ref: BesideWeight, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``ref``'s tensor flattened, in its stored dtype: only those bytes are read
        from a beside file (a sharded resume reads each rank's shard); a tensor of the user's own file
        (``read_alone``) is read whole and cut."""
        if ref.read_alone:
            return ref.read().reshape(-1)[start:stop]
        return self._reader(ref).read(ref.key, start, stop)

    def _reader(self, ref: BesideWeight) -> SafetensorsReader:
        """The open reader of ``ref``'s beside file (opened and checked against its save id once)."""
        reader = self._open.get(ref.path)
        if reader is None:
            ref.check_readable()
            reader = SafetensorsReader(ref.path, ref.record)
            self._open[ref.path] = reader
            _check_save(ref.path, reader.metadata.get("save_id"), ref.save_id)
        if ref.key not in reader:
            raise KeyError(f"{ref.path} holds no tensor {ref.key!r}: the checkpoint is damaged. Re-save it, or "
                           "resume from an older one.")
        return reader

    def read_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict`` with every reference read (for a model that is in memory anyway)."""
        return {k: self.read(v) if isinstance(v, BesideWeight) else v for k, v in state_dict.items()}

    def close(self) -> None:
        for reader in self._open.values():
            reader.close()
        self._open = {}

    def __enter__(self) -> WeightReaders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_all(checkpoint: dict[str, Any]) -> None:
    """Read every reference of ``checkpoint``'s state dict in place: the whole model in memory."""
    if "state_dict" in checkpoint:
        with WeightReaders() as readers:
            checkpoint["state_dict"] = readers.read_state_dict(checkpoint["state_dict"])
