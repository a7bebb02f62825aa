"""Tokenizers for the embedded corpus: bytes (no dependency) or a local Hugging Face tokenizer."""

from __future__ import annotations

import importlib.util
import os

import torch

_HF_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")


class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, lossless, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer saved next to a local checkpoint (needs the ``hf`` extra)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)

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
