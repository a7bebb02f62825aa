"""The tokenized set on disk: written once as flat arrays, read memory-mapped by every later run.

Why: tokenizing is the slow part of a finetuning set (a BPE tokenizer does a few MB/s per core), and a set
bigger than memory must not be held as Python lists. One pass streams the rows through the encoder and
appends the tokens to raw files; training maps them (``numpy.memmap``), so memory stays flat whatever the
set's size (the maps are reopened every ``REMAP_BYTES`` read, so mapped pages do not pile up in RSS).

The cache directory's name is a hash of everything the tokens depend on (the files' paths, sizes and
mtimes, the tokenizer's files, the template and options, the block size, this format's version): a changed
input gives a new name, so a stale set is never read. A set is written into a temporary directory and
renamed into place when complete: a killed run leaves no half set, and ranks racing to write the same set
keep the first.

Layout of one set: ``tokens.bin`` (uint16 when the vocabulary fits, else int32), ``mask.bin`` (uint8, 1 = a
training target; absent for the text group, where every token is), ``starts.bin`` (int64) and
``lengths.bin`` (int32) per sample, ``meta.json`` (counts, dtype, the key).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_nvme.checks import ConfigError
from lightning_nvme.data.formats import Encoded
from lightning_nvme.data.sources import Row

VERSION = 1
CACHE_ENV = "LIGHTNING_NVME_DATA_CACHE"
REMAP_BYTES = 64 << 20  # reopen the maps after about this many bytes of pages mapped: mapped pages leave RSS
# A page fault on a file map maps up to this much around it (Linux fault_around_bytes, 64 KiB by default): counted
# per array read, so RSS stays within REMAP_BYTES (measured: without remapping, 600 MiB more RSS after 30k batches).
FAULT_AROUND = 64 << 10
ENCODE_ROWS = 512  # rows per encoder call (a tokenizer's batch call is much faster than one row at a time)


def default_cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "lightning_nvme", "data")


def cache_key(parts: dict[str, Any]) -> str:
    blob = json.dumps({"version": VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass
class Stats:
    """What tokenizing did: the counts a user should see (logged at setup)."""

    samples: int = 0
    tokens: int = 0
    target_tokens: int = 0
    truncated: int = 0  # samples cut at block_size + 1 tokens
    dropped: int = 0  # samples with no target token left (empty, or the response truncated away)
    rows: int = 0


class TokenizedSet:
    """A tokenized set read memory-mapped: ``sample(i)`` -> (ids, mask) numpy arrays of at most block_size + 1."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        with open(os.path.join(directory, "meta.json")) as f:
            self.meta: dict[str, Any] = json.load(f)
        self.stats = Stats(**self.meta["stats"])
        self.dtype = np.dtype(self.meta["dtype"])
        self._maps: dict[str, np.ndarray] | None = None
        self._read = 0
        self.lengths = self._open()["lengths"]

    def _open(self) -> dict[str, np.ndarray]:
        if self._maps is None:
            def mm(name: str, dtype: Any) -> np.ndarray:
                path = os.path.join(self.directory, name)
                if os.path.getsize(path) == 0:
                    return np.zeros(0, dtype=dtype)
                return np.memmap(path, dtype=dtype, mode="r")
            self._maps = {"tokens": mm("tokens.bin", self.dtype), "starts": mm("starts.bin", np.int64),
                          "lengths": mm("lengths.bin", np.int32)}
            if self.meta["has_mask"]:
                self._maps["mask"] = mm("mask.bin", np.uint8)
            self._read = 0
        return self._maps

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the maps (never pickle their pages)
        state = dict(self.__dict__)
        state["_maps"] = None
        state["lengths"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lengths = self._open()["lengths"]

    def __len__(self) -> int:
        return int(self.meta["stats"]["samples"])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Sample ``i``'s tokens (copied out of the map) and its target mask (``None``: every token is one)."""
        maps = self._open()
        start, n = int(maps["starts"][i]), int(maps["lengths"][i])
        ids = np.array(maps["tokens"][start:start + n], dtype=np.int64)
        mask = np.array(maps["mask"][start:start + n], dtype=bool) if "mask" in maps else None
        self._read += n * (self.dtype.itemsize + 1) + 3 * FAULT_AROUND  # a fault maps its neighbours too
        if self._read > REMAP_BYTES:
            self._maps = None  # the next read maps afresh; the old map's pages are released with it
            self.lengths = self._open()["lengths"]
        return ids, mask


def load_or_build(cache_dir: str, key_parts: dict[str, Any], rows: Callable[[Callable[[int], None]], Iterable[Row]],
                  encode: Callable[[list[Row]], list[Encoded]], *, block_size: int, vocab_size: int, stream: bool,
                  total_bytes: int | None, what: str) -> tuple[TokenizedSet, bool]:
    """The cached set for ``key_parts`` (``reused=True``), or tokenize ``rows`` once and cache it.

    ``stream``: the text group: every row's tokens are appended to one stream cut into windows of
    ``block_size + 1`` tokens (consecutive windows share one token, so every token is a target once);
    otherwise each row is one sample, cut at ``block_size + 1`` tokens (counted) and dropped when it keeps no
    target token (counted).
    """
    key = cache_key({**key_parts, "block_size": block_size, "stream": stream})
    final = os.path.join(os.path.expanduser(cache_dir), key)
    if os.path.isfile(os.path.join(final, "meta.json")):
        return TokenizedSet(final), True
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
    except OSError as e:
        raise ConfigError("data.cache_dir", f"{cache_dir} cannot be created ({e.strerror}). "
                          "Fix: data.cache_dir=<a writable directory>") from None
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        stats = _write(tmp, rows, encode, block_size, vocab_size, stream, total_bytes, what)
        if stats.samples == 0:
            raise ConfigError("data.path", f"{what}: no training example left ({stats.rows} rows read, {stats.dropped} "
                              "without a target token after truncation). Fix: data.path=<a file with examples>, a "
                              "larger data.block_size, or check data.columns")
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"stats": stats.__dict__, "dtype": _dtype(vocab_size).name, "has_mask": not stream,
                       "block_size": block_size, "key": key_parts, "written": time.time()}, f, default=str)
        try:
            os.rename(tmp, final)
        except OSError:  # another rank or run finished the same set first: keep it
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TokenizedSet(final), False


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def _chunks(rows: Iterable[Row], n: int) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    for r in rows:
        chunk.append(r)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _write(directory: str, rows: Callable[[Callable[[int], None]], Iterable[Row]],
           encode: Callable[[list[Row]], list[Encoded]], block_size: int, vocab_size: int, stream: bool,
           total_bytes: int | None, what: str) -> Stats:
    from tqdm.auto import tqdm

    dtype = _dtype(vocab_size)
    stats = Stats()
    limit = block_size + 1
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizing {os.path.basename(what)}",
               disable=None, leave=False)
    files = {name: open(os.path.join(directory, name), "wb")
             for name in ("tokens.bin", "starts.bin", "lengths.bin", *(() if stream else ("mask.bin",)))}
    try:
        position = 0
        for chunk in _chunks(rows(bar.update), ENCODE_ROWS):
            stats.rows += len(chunk)
            encoded = encode(chunk)
            ids_out: list[int] = []
            mask_out: list[int] = []
            starts, lengths = [], []
            for ids, mask in encoded:
                if stream:
                    ids_out.extend(ids)
                    continue
                if len(ids) > limit:
                    stats.truncated += 1
                    ids, mask = ids[:limit], mask[:limit]
                targets = sum(mask[1:])  # the first token is never a target (nothing predicts it)
                if targets == 0 or len(ids) < 2:
                    stats.dropped += 1
                    continue
                starts.append(position + len(ids_out))
                lengths.append(len(ids))
                ids_out.extend(ids)
                mask_out.extend(mask)
                stats.target_tokens += targets
            if ids_out and max(ids_out) >= vocab_size:
                raise ConfigError("data.tokenizer", f"{what}: token id {max(ids_out)} >= the tokenizer's vocabulary "
                                  f"{vocab_size}. Fix: a consistent tokenizer directory")
            np.asarray(ids_out, dtype=dtype).tofile(files["tokens.bin"])
            position += len(ids_out)
            if not stream:
                np.asarray(mask_out, dtype=np.uint8).tofile(files["mask.bin"])
                np.asarray(starts, dtype=np.int64).tofile(files["starts.bin"])
                np.asarray(lengths, dtype=np.int32).tofile(files["lengths.bin"])
                stats.samples += len(starts)
        stats.tokens = position
        if stream:  # windows of block_size + 1 tokens, every block_size tokens; a last shorter one if >= 2 tokens
            full = max(0, (position - 1) // block_size)
            step = 1 << 20
            for first in range(0, full, step):
                w = np.arange(first, min(full, first + step), dtype=np.int64) * block_size
                w.tofile(files["starts.bin"])
                np.full(len(w), limit, dtype=np.int32).tofile(files["lengths.bin"])
            rest = position - full * block_size
            stats.samples = full
            if rest >= 2:
                np.asarray([full * block_size], dtype=np.int64).tofile(files["starts.bin"])
                np.asarray([rest], dtype=np.int32).tofile(files["lengths.bin"])
                stats.samples += 1
            stats.target_tokens = max(0, position - stats.samples)
    finally:
        for f in files.values():
            f.close()
        bar.close()
    return stats
