"""Data for the recipes: an embedded corpus (Python's own sources, docstrings, or generated) and tokenizers;
finetuning on your own data (the ``text``, ``instruct`` and ``chat`` groups), tokenized once into a cache on disk."""

from lightning_nvme.data.corpus import load_corpus
from lightning_nvme.data.datamodule import EmbeddedTextDataModule, TokenWindows
from lightning_nvme.data.finetune import ChatDataModule, FinetuneDataModule, InstructDataModule, TextDataModule
from lightning_nvme.data.tokenizers import ByteTokenizer, make_tokenizer

__all__ = ["ByteTokenizer", "ChatDataModule", "EmbeddedTextDataModule", "FinetuneDataModule", "InstructDataModule",
           "TextDataModule", "TokenWindows", "load_corpus", "make_tokenizer"]
