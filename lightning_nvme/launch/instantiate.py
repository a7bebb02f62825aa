"""Instantiate a validated config into a Lightning run: data, model (+ optimizer partial), strategy,
callbacks, loggers and the Trainer, each from its config group."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_nvme.checks import ConfigError
from lightning_nvme.launch.validate import validate


def lightning_strategy(name: str = "auto") -> str:
    """The ``strategy/default`` target: a plain Lightning strategy by its registry name."""
    return name


@dataclass
class Run:
    cfg: DictConfig
    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule


def _instantiate_group(node: Any) -> list[Any]:
    """A group holding named entries (callbacks, loggers) -> the list of instantiated entries."""
    if not node:
        return []
    return [instantiate(entry) for entry in node.values() if entry is not None and "_target_" in entry]


def build(cfg: DictConfig) -> Run:
    """Validate, then instantiate everything; raises ``ConfigError`` for problems the user can fix."""
    validate(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    # The data first: the finetuning groups read and tokenize the set here, so a bad file is refused before
    # any model is loaded (their ConfigError unwrapped from Hydra's InstantiationException).
    try:
        datamodule = instantiate(cfg.data)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise
    strategy = instantiate(cfg.strategy)
    callbacks = _instantiate_group(cfg.get("callbacks"))
    loggers = _instantiate_group(cfg.get("logger"))
    trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False)
    # A model whose weights all come from a checkpoint is built without a random init; with
    # offload_params=True it is built on the meta device and streamed into the store at setup.
    init_empty = getattr(get_class(cfg.model._target_), "init_empty", False)
    with trainer.init_module(empty_init=True) if init_empty else nullcontext():
        model = instantiate(cfg.model, optimizer=instantiate(cfg.optimizer))
    data_vocab, model_vocab = getattr(datamodule, "vocab_size", None), getattr(model, "vocab_size", None)
    if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
        raise ConfigError("model.vocab_size", f"data.tokenizer produces {data_vocab} token ids but the model's vocabulary has "
                          f"{model_vocab}: raise model.vocab_size to {data_vocab}, or use the checkpoint's tokenizer "
                          f"(data.tokenizer=<model dir>)")
    return Run(cfg, trainer, model, datamodule)


def train(cfg: DictConfig) -> Run:
    """Build and ``fit``."""
    run = build(cfg)
    with warnings.catch_warnings():
        # num_workers=0 is deliberate: batches are slices of an in-memory tensor.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        run.trainer.fit(run.model, datamodule=run.datamodule)
    return run


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=False)
