"""Where a finetuning set's rows come from: local files (JSON, JSONL, CSV, Parquet, text, a directory or glob
of them), a ``datasets`` dataset (``source="hf"``), or the instruction set shipped with the package.

Why one module: every data group reads rows the same way and reports a bad one the same way, as
``ConfigError(key, "file:line: what is wrong. Fix: ...")``, so a malformed line costs one message, not a
traceback from the middle of a tokenizer. Rows are streamed (a JSONL line, a CSV record, a Parquet batch at
a time) so a file bigger than memory is read at flat memory.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lightning_nvme.checks import ConfigError

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".md")
TEXT_SUFFIXES = (".txt", ".md")
SAMPLE_MODULE, SAMPLE_FILE = "lightning_nvme.data", "sample_instructions.jsonl"


@dataclass(frozen=True)
class Row:
    """One record and where it came from (``file:line`` for messages)."""

    where: str
    fields: dict[str, Any]


def sample_path() -> str:
    """The instruction set shipped with the package (questions and answers about lightning_nvme itself)."""
    return str(resources.files(SAMPLE_MODULE).joinpath(SAMPLE_FILE))


def resolve_files(path: str, key: str = "data.path", suffixes: tuple[str, ...] = SUFFIXES) -> list[str]:
    """``path`` (a file, a directory, or a glob) -> the sorted data files it names; ConfigError if none."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(f) and f.endswith(suffixes))
        where = f"directory {path!r} holds no {'/'.join(suffixes)} file"
    elif any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        where = f"the glob {path!r} matches no file"
    elif os.path.isfile(path):
        files = [path]
        where = ""
    else:
        raise ConfigError(key, f"{path!r} does not exist. Fix: {key}=<a .jsonl/.json/.csv/.parquet/.txt file, a "
                          f"directory or a glob of them> (relative paths are relative to where you launch)")
    if not files:
        raise ConfigError(key, f"{where}. Fix: {key}=<a directory or glob with data files>")
    bad = [f for f in files if not f.endswith(suffixes)]
    if bad:
        raise ConfigError(key, f"{bad[0]!r}: unsupported file type; this data group reads {', '.join(suffixes)}. "
                          f"Fix: convert it, or data.source=hf to read it with the datasets library")
    return files


def fingerprint(files: list[str]) -> list[tuple[str, int, int]]:
    """(absolute path, size, mtime in ns) per file: the cache key's part that changes when a file does."""
    out = []
    for f in files:
        st = os.stat(f)
        out.append((os.path.abspath(f), st.st_size, st.st_mtime_ns))
    return out


def total_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def read_rows(files: list[str], on_bytes: Any = None) -> Iterator[Row]:
    """Every row of every file, in order; ``on_bytes(n)`` is told how many bytes were consumed (progress)."""
    for f in files:
        if f.endswith(".jsonl"):
            yield from _jsonl(f, on_bytes)
        elif f.endswith(".json"):
            yield from _json(f, on_bytes)
        elif f.endswith(".csv"):
            yield from _csv(f, on_bytes)
        elif f.endswith(".parquet"):
            yield from _parquet(f, on_bytes)
        else:  # .txt / .md: the whole file is one document
            with open(f, encoding="utf-8", errors="strict") as fh:
                try:
                    text = fh.read()
                except UnicodeDecodeError as e:
                    raise ConfigError("data.path", f"{f}: not UTF-8 text ({e.reason} at byte {e.start}). "
                                      "Fix: re-encode the file as UTF-8") from None
            if on_bytes:
                on_bytes(os.path.getsize(f))
            yield Row(f, {"text": text})


def _jsonl(f: str, on_bytes: Any) -> Iterator[Row]:
    with open(f, "rb") as fh:
        for n, raw in enumerate(fh, start=1):
            if on_bytes:
                on_bytes(len(raw))
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError("data.path", f"{f}:{n}: malformed JSON line ({e}). Fix: each line of a .jsonl file "
                                  "must be one JSON object, e.g. {\"instruction\": ..., \"output\": ...}") from None
            if not isinstance(value, dict):
                raise ConfigError("data.path", f"{f}:{n}: a JSON {type(value).__name__}, not an object. Fix: each "
                                  "line must be one JSON object with the columns as keys")
            yield Row(f"{f}:{n}", value)


def _json(f: str, on_bytes: Any) -> Iterator[Row]:
    with open(f, "rb") as fh:
        try:
            value = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            line = getattr(e, "lineno", "?")
            raise ConfigError("data.path", f"{f}:{line}: malformed JSON ({e}). Fix: a .json file holds a list of "
                              "objects (one per example); use .jsonl for one object per line") from None
    if on_bytes:
        on_bytes(os.path.getsize(f))
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list):
        value = next(iter(value.values()))  # {"data": [...]}
    if not isinstance(value, list):
        raise ConfigError("data.path", f"{f}: a JSON {type(value).__name__}, not a list of examples. Fix: write "
                          "[{...}, {...}] (or one object per line in a .jsonl file)")
    for n, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError("data.path", f"{f}: item {n} is a {type(item).__name__}, not an object. Fix: every "
                              "example must be an object with the columns as keys")
        yield Row(f"{f}[{n}]", item)


def _csv(f: str, on_bytes: Any) -> Iterator[Row]:
    if on_bytes:
        on_bytes(os.path.getsize(f))
    with open(f, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        for record in reader:
            if None in record or any(v is None for v in record.values()):
                raise ConfigError("data.path", f"{f}:{reader.line_num}: {len([v for v in record.values() if v is not None])}"
                                  f" fields where the header has {len(reader.fieldnames or [])}. Fix: quote fields "
                                  "that contain commas or line breaks")
            yield Row(f"{f}:{reader.line_num}", dict(record))


def _parquet(f: str, on_bytes: Any) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises its own types for a damaged file
        raise ConfigError("data.path", f"{f}: not a readable Parquet file ({e}). Fix: rewrite it "
                          "(e.g. pandas.DataFrame.to_parquet)") from None
    n = 0
    for batch in table.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield Row(f"{f}: row {n}", record)
            n += 1
    if on_bytes:
        on_bytes(os.path.getsize(f))


def hf_dataset(path: str, data_files: str | list[str] | None, split: str) -> Any:
    """A ``datasets`` dataset, offline: ``load_from_disk`` for a directory saved with ``save_to_disk``, else
    ``load_dataset(path, data_files=..., split=...)`` (a builder name such as ``json`` or a local script)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source", "source=hf needs the datasets library. Fix: pip install "
                          "'lightning-nvme[data]', or data.source=files") from None
    try:
        if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_info.json"))
                                    or os.path.isfile(os.path.join(path, "state.json"))
                                    or os.path.isfile(os.path.join(path, "dataset_dict.json"))):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError("data.split", f"{path} has splits {sorted(ds)}, not {split!r}. "
                                      f"Fix: data.split=<one of them>")
                ds = ds[split]
            return ds
        return datasets.load_dataset(path, data_files=data_files, split=split)
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError...)
        raise ConfigError("data.path", f"datasets could not load {path!r} (data_files={data_files!r}, split={split!r}) "
                          f"offline: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Fix: a directory "
                          "saved with save_to_disk, or data.path=json data.data_files=<your files>") from None


def hf_rows(ds: Any, name: str) -> Iterator[Row]:
    for n, record in enumerate(ds):
        yield Row(f"{name}: row {n}", dict(record))
