"""Data for the recipes: an embedded corpus (Python's own sources, docstrings, or generated) and tokenizers."""

from lightning_nvme.data.corpus import load_corpus
from lightning_nvme.data.datamodule import EmbeddedTextDataModule, TokenWindows
from lightning_nvme.data.tokenizers import ByteTokenizer, make_tokenizer

__all__ = ["ByteTokenizer", "EmbeddedTextDataModule", "TokenWindows", "load_corpus", "make_tokenizer"]
