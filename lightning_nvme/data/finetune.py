"""Finetuning on your own data: the ``text``, ``instruct`` and ``chat`` data groups.

Each is a ``LightningDataModule`` whose constructor reads and tokenizes the set (or finds it in the cache,
``lightning_nvme.data.cache``), so every bad input (a missing file, a malformed line, a missing column, an
empty set, a block size shorter than the template) is a ``ConfigError`` naming the key and the fix before
any model is loaded: ``launch.build`` instantiates the data before the model.

Batches are dicts: ``input_ids``, ``targets`` (the next token, -100 where there is no target: the prompt,
padding, a sample's end) and, with ``packed=True``, ``position_ids``. Without packing a batch is padded on
the right to its longest sample, and a length-grouped order keeps samples of similar length together (less
padding); with causal attention a right pad never changes a real token's logits, so no attention mask is
needed. With packing, samples are concatenated up to ``block_size`` input tokens, position ids restart at 0
for every sample, and transformers (>= 5, ``masking_utils``) turns restarting position ids into a
block-diagonal causal mask when no attention mask is passed: no token attends across a sample boundary
(tests/data/test_finetune.py: equal logits to the samples run one by one). The built-in GPT has no such
mask, so ``packed=True`` needs a transformers model (refused otherwise by ``launch.validate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, RandomSampler, Subset
from typing_extensions import override

from lightning_nvme.checks import ConfigError
from lightning_nvme.data import sources
from lightning_nvme.data.cache import Stats, TokenizedSet, default_cache_dir, load_or_build
from lightning_nvme.data.formats import ChatEncoder, Encoder, InstructEncoder, TextEncoder
from lightning_nvme.data.sources import Row
from lightning_nvme.data.tokenizers import ByteTokenizer, HFTokenizer, make_tokenizer

IGNORE = -100  # the label cross_entropy (and torchmetrics' Perplexity here) skips
GROUP_FACTOR = 64  # a length-grouped order sorts blocks of this many batches by length


def length_grouped(indices: np.ndarray, lengths: np.ndarray, batch_size: int, seed: int) -> np.ndarray:
    """``indices`` shuffled, then sorted by length within blocks of ``GROUP_FACTOR`` batches: consecutive
    ``batch_size`` samples have similar lengths, while the batches still come from all over the set."""
    order = np.random.default_rng(seed).permutation(indices)
    block = batch_size * GROUP_FACTOR
    for s in range(0, len(order), block):
        part = order[s:s + block]
        order[s:s + block] = part[np.argsort(-lengths[part], kind="stable")]
    return order


def pack(order: np.ndarray, lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Row boundaries (offsets into ``order``) of greedy packing: consecutive samples share a row while their
    inputs (length - 1 each, <= block_size) fit in ``block_size`` tokens."""
    offsets = [0]
    fill = 0
    for j, n in enumerate((lengths[order] - 1).tolist()):
        if fill + n > block_size and fill:
            offsets.append(j)
            fill = 0
        fill += n
    offsets.append(len(order))
    return np.asarray(offsets, dtype=np.int64)


class Batches(Dataset):
    """Item ``i`` is batch ``i``, already padded: ``batch_size`` rows, each one sample (or, packed, several)."""

    def __init__(self, data: TokenizedSet, order: np.ndarray | None, batch_size: int,
                 rows: np.ndarray | None = None) -> None:
        self.data, self.order, self.batch_size, self.rows = data, order, batch_size, rows
        self.n_rows = len(rows) - 1 if rows is not None else (len(order) if order is not None else len(data))

    def __len__(self) -> int:
        return math.ceil(self.n_rows / self.batch_size)

    def _samples(self, r: int) -> list[int]:
        if self.rows is not None:
            assert self.order is not None
            return self.order[self.rows[r]:self.rows[r + 1]].tolist()
        return [int(self.order[r]) if self.order is not None else r]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rows = []
        for r in range(i * self.batch_size, min(self.n_rows, (i + 1) * self.batch_size)):
            inputs, targets, positions = [], [], []
            for s in self._samples(r):
                ids, mask = self.data.sample(s)
                inputs.append(ids[:-1])
                targets.append(np.where(mask[1:], ids[1:], IGNORE) if mask is not None else ids[1:])
                positions.append(np.arange(len(ids) - 1))
            rows.append((np.concatenate(inputs), np.concatenate(targets), np.concatenate(positions)))
        width = max(len(x) for x, _, _ in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        y = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        pos = torch.zeros(len(rows), width, dtype=torch.long)
        for k, (a, b, p) in enumerate(rows):
            x[k, :len(a)], y[k, :len(b)] = torch.from_numpy(a), torch.from_numpy(b)
            pos[k, :len(p)] = torch.from_numpy(p)
            pos[k, len(p):] = torch.arange(width - len(p))  # the pad is a sequence of its own (packed)
        batch = {"input_ids": x, "targets": y}
        if self.rows is not None:
            batch["position_ids"] = pos
        return batch


class FinetuneDataModule(pl.LightningDataModule):
    """What the three data groups share: sources, the tokenized-set cache, the split, batching.

    Args:
        path: a file, a directory or a glob (``source=files``); a ``datasets`` directory or builder name
            (``source=hf``); ``None``: the instruction set shipped with the package.
        source: ``files`` or ``hf`` (the ``datasets`` library, offline).
        data_files: ``source=hf``: ``load_dataset``'s ``data_files``.
        split: ``source=hf``: the split to read.
        columns: this group's field -> your column name (e.g. ``{output: response}``).
        val_path: a validation set of its own (same format); otherwise ``val_fraction`` of the samples.
        val_fraction: share held out for validation when there is no ``val_path`` (0: no validation).
        block_size: the longest input (tokens); a longer sample is cut (counted and logged).
        batch_size: rows per batch.
        packed: concatenate samples into rows of ``block_size`` tokens (attention kept within each sample).
        tokenizer: ``"byte"`` or a directory with a Hugging Face tokenizer (the recipes pass ``model.path``).
        cache_dir: where tokenized sets are kept; ``None``: ``$LIGHTNING_NVME_DATA_CACHE`` or
            ``~/.cache/lightning_nvme/data``.
        steps_per_epoch: batches per epoch; ``None``: one pass over the training set.
        val_batches: validation batches per validation run; ``None``: the whole validation set.
        num_workers: DataLoader workers (each maps the set itself).
        seed: the split, the order and the packing.
    """

    group = ""

    def __init__(self, path: str | None = None, source: str = "files", data_files: str | list[str] | None = None,
                 split: str = "train", columns: dict[str, str] | None = None, val_path: str | None = None,
                 val_fraction: float = 0.05, block_size: int = 128, batch_size: int = 8, packed: bool = False,
                 tokenizer: str = "byte", cache_dir: str | None = None, steps_per_epoch: int | None = None,
                 val_batches: int | None = None, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        if source not in ("files", "hf"):
            raise ConfigError("data.source", f"must be 'files' or 'hf', got {source!r}. Fix: data.source=files")
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError("data.val_fraction", f"must be in [0, 1), got {val_fraction}. Fix: data.val_fraction=0.05")
        for key, value in (("block_size", block_size), ("batch_size", batch_size)):
            if value < 1:
                raise ConfigError(f"data.{key}", f"must be >= 1, got {value}")
        if source == "hf" and path is None:
            raise ConfigError("data.path", "source=hf needs a dataset. Fix: data.path=<a save_to_disk directory, or a "
                              "builder such as json with data.data_files=...>")
        self.path, self.source, self.data_files, self.split = path, source, data_files, split
        self.columns = dict(columns or {})
        self.block_size, self.batch_size, self.packed = block_size, batch_size, packed
        self.steps_per_epoch, self.val_batches, self.num_workers, self.seed = steps_per_epoch, val_batches, num_workers, seed
        self.cache_dir = cache_dir or default_cache_dir()
        try:
            self.tokenizer: ByteTokenizer | HFTokenizer = make_tokenizer(tokenizer)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise ConfigError("data.tokenizer", f"{e}. Fix: data.tokenizer=byte or a directory with tokenizer files "
                              "(tokenizer.json ...)") from None
        self.encoder = self._encoder()
        self._check_block_size()
        self.train_data, reused = self._tokenized(path, "data.path")
        self.reused = reused  # whether the training set came from the cache (the tests ask)
        self.val_data: TokenizedSet | None = None
        self.val_indices: np.ndarray | None = None
        n = len(self.train_data)
        self.train_indices = np.arange(n, dtype=np.int64)
        if val_path is not None:
            self.val_data, _ = self._tokenized(val_path, "data.val_path")
        elif val_fraction > 0 and n >= 2:
            n_val = min(n - 1, max(1, round(n * val_fraction)))
            if self.group == "text":  # windows of one stream: hold out its end (no window overlaps the other set)
                self.train_indices, self.val_indices = np.arange(n - n_val), np.arange(n - n_val, n)
            else:
                perm = np.random.default_rng(self.seed).permutation(n)
                self.val_indices, self.train_indices = np.sort(perm[:n_val]), np.sort(perm[n_val:])
            self.val_data = self.train_data
        self._log(self.train_data.stats, reused)

    # ---- what a group decides --------------------------------------------------------------------------------
    def _encoder(self) -> Encoder:
        raise NotImplementedError

    def _template_tokens(self) -> int:
        return 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    # ---- reading and tokenizing -----------------------------------------------------------------------------
    def _suffixes(self) -> tuple[str, ...]:
        return tuple(s for s in sources.SUFFIXES if s not in sources.TEXT_SUFFIXES)

    def _sample_rows(self, rows: Iterable[Row]) -> Iterable[Row]:
        """The shipped sample (instruction/input/output rows) in this group's columns."""
        return rows

    def _check_block_size(self) -> None:
        need = self._template_tokens()
        if need and need >= self.block_size:
            raise ConfigError("data.block_size", f"{self.block_size} tokens, but the {self.group} template alone takes "
                              f"{need} with this tokenizer: no room for an example. Fix: model.block_size (or "
                              f"data.block_size) > {need}, or a shorter data.prompt_template")

    def _tokenized(self, path: str | None, key: str) -> tuple[TokenizedSet, bool]:
        encode: Callable[[list[Row]], list[Any]] = self.encoder.encode
        if self.source == "hf":
            assert path is not None
            ds = sources.hf_dataset(path, self.data_files, self.split)
            fingerprint: Any = [getattr(ds, "_fingerprint", None), path, self.data_files, self.split]
            if fingerprint[0] is None:
                fingerprint.append(sources.fingerprint(sources.resolve_files(path, key)))
            what = path

            def rows(progress: Callable[[int], None]) -> Iterable[Row]:
                return sources.hf_rows(ds, path)
            total = None
        else:
            sample = path is None
            files = sources.resolve_files(sources.sample_path() if sample else str(path), key,
                                          suffixes=sources.SUFFIXES if self.group == "text" else self._suffixes())
            fingerprint = sources.fingerprint(files)
            what = files[0] if len(files) == 1 else f"{path} ({len(files)} files)"
            total = sources.total_bytes(files)

            def rows(progress: Callable[[int], None]) -> Iterable[Row]:
                found = sources.read_rows(files, progress)
                return self._sample_rows(found) if sample else found
        parts = {"files": fingerprint, "tokenizer": self.tokenizer.identity, "encoder": self.encoder.key()}
        return load_or_build(self.cache_dir, parts, rows, encode, block_size=self.block_size,
                             vocab_size=self.vocab_size, stream=self.group == "text", total_bytes=total, what=what)

    def _log(self, stats: Stats, reused: bool) -> None:
        rank_zero_info(
            f"data ({self.group}): {stats.samples} samples, {stats.tokens} tokens ({stats.target_tokens} targets) from "
            f"{stats.rows} rows; {stats.truncated} truncated to block_size+1={self.block_size + 1} tokens, "
            f"{stats.dropped} dropped (no target left); tokenized set {'reused from' if reused else 'written to'} "
            f"{self.train_data.directory}")

    # ---- batches ---------------------------------------------------------------------------------------------
    def _batches(self, data: TokenizedSet, indices: np.ndarray, train: bool) -> Batches:
        lengths = np.asarray(data.lengths)
        if self.group == "text":  # windows of equal length: nothing to group or pack
            return Batches(data, indices, self.batch_size)
        order = length_grouped(indices, lengths, self.batch_size, self.seed) if train else indices
        if self.packed:
            order = np.random.default_rng(self.seed).permutation(indices) if train else indices
            return Batches(data, order, self.batch_size, rows=pack(order, lengths, self.block_size))
        return Batches(data, order, self.batch_size)

    @override
    def train_dataloader(self) -> DataLoader:
        batches = self._batches(self.train_data, self.train_indices, train=True)
        # The batch order is shuffled every epoch (reproducibly); DDP replaces this sampler with a distributed one.
        sampler = RandomSampler(batches, num_samples=self.steps_per_epoch or len(batches),
                                generator=torch.Generator().manual_seed(self.seed))
        return DataLoader(batches, batch_size=None, sampler=sampler, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_data is None:
            return []
        indices = self.val_indices if self.val_indices is not None else np.arange(len(self.val_data), dtype=np.int64)
        batches: Dataset = self._batches(self.val_data, indices, train=False)
        if self.val_batches is not None:
            batches = Subset(batches, range(min(self.val_batches, len(batches))))  # type: ignore[arg-type]
        return DataLoader(batches, batch_size=None, num_workers=self.num_workers)


class TextDataModule(FinetuneDataModule):
    """``text``: documents (``.txt``/``.md`` files whole, or a ``text`` column of JSONL/JSON/CSV/Parquet rows)
    joined with the tokenizer's EOS and cut into ``block_size`` windows: continued pretraining on a corpus.
    Every token is a target; ``packed`` changes nothing (the windows are full). Without a path: the shipped
    sample as documents (question, then answer)."""

    group = "text"

    @override
    def _encoder(self) -> Encoder:
        return TextEncoder(self.tokenizer, {"text": "text", **self.columns})

    @override
    def _sample_rows(self, rows: Iterable[Row]) -> Iterable[Row]:
        column = self.columns.get("text", "text")
        for r in rows:
            yield Row(r.where, {column: f"{r.fields['instruction']}\n\n{r.fields['output']}"})


class InstructDataModule(FinetuneDataModule):
    """``instruct``: rows with an instruction, an optional input and an output (``columns`` maps them), each
    rendered by ``prompt_template`` (Alpaca's by default); the loss is on the output (and EOS) only, unless
    ``train_on_prompt``. Without a path: the instruction set shipped with the package.

    Args:
        prompt_template: ``"alpaca"`` or a string with ``{instruction}`` and ``{input}``.
        train_on_prompt: also train on the prompt's tokens.
        (the rest: ``FinetuneDataModule``)
    """

    group = "instruct"

    def __init__(self, path: str | None = None, source: str = "files", data_files: str | list[str] | None = None,
                 split: str = "train", columns: dict[str, str] | None = None, val_path: str | None = None,
                 val_fraction: float = 0.05, block_size: int = 128, batch_size: int = 8, packed: bool = False,
                 tokenizer: str = "byte", cache_dir: str | None = None, steps_per_epoch: int | None = None,
                 val_batches: int | None = None, num_workers: int = 0, seed: int = 0, prompt_template: str = "alpaca",
                 train_on_prompt: bool = False) -> None:
        self.prompt_template, self.train_on_prompt = prompt_template, train_on_prompt
        super().__init__(path, source, data_files, split, columns, val_path, val_fraction, block_size, batch_size,
                         packed, tokenizer, cache_dir, steps_per_epoch, val_batches, num_workers, seed)

    @override
    def _encoder(self) -> Encoder:
        self._instruct = InstructEncoder(self.tokenizer, {"instruction": "instruction", "input": "input",
                                                          "output": "output", **self.columns},
                                         self.prompt_template, self.train_on_prompt)
        return self._instruct

    @override
    def _template_tokens(self) -> int:
        return self._instruct.template_tokens()

    @override
    def _sample_rows(self, rows: Iterable[Row]) -> Iterable[Row]:
        names = {"instruction": "instruction", "input": "input", "output": "output", **self.columns}
        for r in rows:
            yield Row(r.where, {names[k]: v for k, v in r.fields.items() if k in names})


class ChatDataModule(FinetuneDataModule):
    """``chat``: rows with ``messages: [{role, content}, ...]`` rendered by the tokenizer's chat template
    (``apply_chat_template``); the loss is on the assistant turns only, unless ``train_on_prompt``. A tokenizer
    without a chat template is refused unless ``chat_template`` gives one. Without a path: the shipped
    sample as one user and one assistant turn per example.

    Args:
        chat_template: a Jinja template (or the path of a ``.jinja`` file) replacing the tokenizer's.
        train_on_prompt: also train on the user/system turns and the template's tokens.
        (the rest: ``FinetuneDataModule``)
    """

    group = "chat"

    def __init__(self, path: str | None = None, source: str = "files", data_files: str | list[str] | None = None,
                 split: str = "train", columns: dict[str, str] | None = None, val_path: str | None = None,
                 val_fraction: float = 0.05, block_size: int = 128, batch_size: int = 8, packed: bool = False,
                 tokenizer: str = "byte", cache_dir: str | None = None, steps_per_epoch: int | None = None,
                 val_batches: int | None = None, num_workers: int = 0, seed: int = 0, chat_template: str | None = None,
                 train_on_prompt: bool = False) -> None:
        self.chat_template, self.train_on_prompt = chat_template, train_on_prompt
        super().__init__(path, source, data_files, split, columns, val_path, val_fraction, block_size, batch_size,
                         packed, tokenizer, cache_dir, steps_per_epoch, val_batches, num_workers, seed)

    @override
    def _encoder(self) -> Encoder:
        self._chat = ChatEncoder(self.tokenizer, {"messages": "messages", **self.columns}, self.chat_template,
                                 self.train_on_prompt)
        return self._chat

    @override
    def _template_tokens(self) -> int:
        return self._chat.template_tokens()

    @override
    def _sample_rows(self, rows: Iterable[Row]) -> Iterable[Row]:
        column = self.columns.get("messages", "messages")
        for r in rows:
            user = r.fields["instruction"] + (f"\n\n{r.fields['input']}" if r.fields.get("input") else "")
            yield Row(r.where, {column: [{"role": "user", "content": user},
                                         {"role": "assistant", "content": r.fields["output"]}]})
