"""Small LightningModules for the conformance tests: what a user writes, trained once with the default
strategy and once with ``nvme_offload``, the results compared bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


def data(n: int = 64, dim: int = 16, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


class Net(LightningModule):
    """``backbone`` + ``head``; ``make_optimizer(params) -> optimizer`` from the test (default plain SGD, as in
    Lightning's BoringModel). ``frozen_backbone``: the backbone starts frozen and out of the optimizer."""

    def __init__(self, make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, dim: int = 16,
                 hidden: int = 96, frozen_backbone: bool = False, in_optimizer: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.make_optimizer = make_optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
        self.backbone = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh())
        self.head = torch.nn.Linear(hidden, 2)
        self.frozen_backbone = frozen_backbone
        self.in_optimizer = in_optimizer
        if frozen_backbone:
            self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self):
        return DataLoader(data(), batch_size=8)

    def configure_optimizers(self):
        params = self.parameters() if self.in_optimizer else filter(lambda p: p.requires_grad, self.parameters())
        return self.make_optimizer(params)


def train(model: LightningModule, root, strategy: Any = "auto", *, steps: int = 12, epochs: int = -1,
          callbacks: list | None = None, ckpt_path: str | None = None, **trainer_kwargs: Any) -> Trainer:
    trainer = Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                      max_epochs=epochs, callbacks=callbacks or [], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def assert_same_params(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    for (name, p), q in zip(expected.named_parameters(), actual.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs from the default strategy's"


def assert_same_state(expected: dict, actual: dict) -> None:
    assert expected["param_groups"] == actual["param_groups"]
    assert expected["state"].keys() == actual["state"].keys()
    for index, state in expected["state"].items():
        assert state.keys() == actual["state"][index].keys(), f"param {index}"
        for key, value in state.items():
            other = actual["state"][index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, f"param {index} {key}"
