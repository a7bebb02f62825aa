"""Small deterministic LightningModules shared by the strategy tests."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    # torch's one-pass CPU kernel: the update the offloaded step runs fastest with (benchmarks use it)
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "centered": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "sgd_plain": (torch.optim.SGD, {"lr": 0.05}),  # no per-element state: resident params
}


def fp32_master_step(trainable, masters, opt) -> None:
    """The in-memory reference of half-precision training with fp32 master weights: move the gradients
    to the masters, step the optimizer on them, cast back into the parameters."""
    for p in trainable:
        masters[p].grad = p.grad.float() if p.grad is not None else None
        p.grad = None
    opt.step()
    with torch.no_grad():
        for p in trainable:
            p.copy_(masters[p])


def dataset(n: int = 256, dim: int = 32, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x, y)


class MLP(LightningModule):
    """Two param groups (decay / no decay), an LR scheduler, a frozen layer and an unused parameter.
    ``ref_state_format``/``ref_master_format``: wrap the optimizer in the in-memory ``RoundTripOptimizer``
    of that format (the reference an offloaded run with that format must equal)."""

    def __init__(self, optimizer: str = "adamw", dim: int = 32, hidden: int = 96, scheduler: bool = True,
                 batch_size: int = 8, ref_state_format: str | None = None, ref_master_format: str = "fp32") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ref_format = (ref_state_format, ref_master_format) if ref_state_format else None
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.batch_size = batch_size
        self.frozen = torch.nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
                                        torch.nn.GELU())
        self.head = torch.nn.Linear(hidden, 2)
        self.unused = torch.nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.frozen(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        cls, kwargs = OPTIMIZERS[self.optimizer_name]
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay}, {"params": no_decay, "lr": kwargs["lr"] * 0.5}]
        if "weight_decay" in kwargs:
            groups[1]["weight_decay"] = 0.0
        opt = cls(groups, **kwargs)
        if self.ref_format:
            from lightning_nvme.optim.formats.state_format import RoundTripOptimizer, StateFormat

            RoundTripOptimizer(opt, StateFormat(*self.ref_format))
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)


class TwoOptimizers(LightningModule):
    """Manual optimization with two optimizers (AdamW and SGD-momentum) on two halves of the model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 2)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        if batch_idx % 2 == 0:
            opt_b.step()
        return loss

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.a.parameters(), lr=1e-2),
                torch.optim.SGD(self.b.parameters(), lr=0.05, momentum=0.9)]

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8, shuffle=False)


class NoOptimizer(LightningModule):
    """``configure_optimizers`` returns None: Lightning warns and steps its ``_MockOptimizer`` (a no-op).
    ``manual=True``: manual optimization without an optimizer, the parameters updated by hand from their
    (data-parallel: all-reduced) gradients; else nothing changes the parameters."""

    def __init__(self, manual: bool = False, batch_size: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = not manual
        self.batch_size = batch_size
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)
        if self.automatic_optimization:
            return loss
        self.manual_backward(loss)
        with torch.no_grad():
            for p in self.parameters():
                p -= 0.05 * p.grad
                p.grad = None
        return loss

    def configure_optimizers(self):
        return None

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)
