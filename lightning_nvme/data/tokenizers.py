"""Tokenizers for the embedded corpus: bytes (no dependency) or a local Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from typing import Any

import torch

_HF_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")
# What identifies a tokenizer for the tokenized-set cache: the files that define its ids and its chat template.
_IDENTITY_FILES = (*_HF_TOKENIZER_FILES, "merges.txt", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json")


class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, lossless, nothing to download."""

    vocab_size = 256
    eos_id: int | None = 0  # NUL never occurs in text: the document separator of the text data group
    chat_template: str | None = None  # no chat rendering: data=chat needs a Hugging Face tokenizer
    identity = "byte"

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer saved next to a local checkpoint (needs the ``hf`` extra)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)
        self.eos_id: int | None = self._tok.eos_token_id
        digest = hashlib.sha256(type(self._tok).__name__.encode())
        for name in _IDENTITY_FILES:
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file, "rb") as f:
                    digest.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        self.identity = digest.hexdigest()  # the cache key's part: same files, same ids

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (chat templates, offsets)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._tok(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self._tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        text = self._tok.decode(ids.tolist())
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text


def make_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"``, or a checkpoint directory: its Hugging Face tokenizer when it has one and transformers is
    installed, bytes otherwise (so a GPT-2 checkpoint without tokenizer files still trains)."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"data.tokenizer={spec!r} is neither 'byte' nor a directory")
    has_files = any(os.path.exists(os.path.join(spec, f)) for f in _HF_TOKENIZER_FILES)
    if has_files and importlib.util.find_spec("transformers"):
        return HFTokenizer(spec)
    return ByteTokenizer()
