"""``EmbeddedTextDataModule``: random fixed-length windows over an embedded corpus, nothing downloaded."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Subset
from typing_extensions import override

from lightning_nvme.data.corpus import load_corpus
from lightning_nvme.data.tokenizers import make_tokenizer


class TokenWindows(Dataset):
    """Every window of ``block_size + 1`` tokens: item ``i`` is ``tokens[i : i + block_size + 1]`` split into
    input and next-token target. Samplers choose which windows an epoch sees."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() <= block_size + 1:
            raise ValueError(f"corpus split has {tokens.numel()} tokens, fewer than block_size+1={block_size + 1}; "
                             f"raise data.max_bytes or lower data.block_size")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return self.tokens.numel() - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i:i + self.block_size + 1]
        return w[:-1], w[1:]


class EmbeddedTextDataModule(pl.LightningDataModule):
    """Next-token batches from text that ships with Python (or is generated).

    Args:
        source: ``"stdlib"`` (the standard library's .py sources), ``"docstrings"`` or ``"generated"``.
        max_bytes: corpus size cap; the last ``val_fraction`` of it is held out for validation.
        block_size: tokens per window (the model's context length).
        batch_size: windows per batch.
        steps_per_epoch: training batches per epoch (windows are random, so an epoch is just a length).
        val_batches: validation batches per validation run.
        tokenizer: ``"byte"`` or a checkpoint directory with a Hugging Face tokenizer.
        val_fraction: share of the corpus held out.
        num_workers: DataLoader workers (0: batches are cheap slices).
        seed: window positions and generated text.
    """

    def __init__(self, source: str = "stdlib", max_bytes: int = 4_000_000, block_size: int = 128,
                 batch_size: int = 16, steps_per_epoch: int = 100, val_batches: int = 8, tokenizer: str = "byte",
                 val_fraction: float = 0.1, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.source, self.max_bytes, self.block_size, self.batch_size = source, max_bytes, block_size, batch_size
        self.steps_per_epoch, self.val_batches, self.val_fraction = steps_per_epoch, val_batches, val_fraction
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer = make_tokenizer(tokenizer)
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        tokens = self.tokenizer.encode(load_corpus(self.source, self.max_bytes, self.seed))
        split = int(tokens.numel() * (1 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.block_size)
        self.val_set = TokenWindows(tokens[split:], self.block_size)

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        # Fresh random windows every epoch, reproducible from the seed.
        sampler = RandomSampler(self.train_set, replacement=True, num_samples=self.steps_per_epoch * self.batch_size,
                                generator=torch.Generator().manual_seed(self.seed))
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        # The same evenly spaced windows every time, so validation curves are comparable.
        n = min(len(self.val_set), self.val_batches * self.batch_size)
        picks = torch.linspace(0, len(self.val_set) - 1, n).long().tolist()
        return DataLoader(Subset(self.val_set, picks), batch_size=self.batch_size, num_workers=self.num_workers)
