"""Recipes: YAML files in this directory (the ``recipes`` Hydra config group) and the code that turns one
into a validated, instantiated Lightning run: ``compose_config`` -> ``validate`` -> ``build``/``train``."""

from lightning_nvme.recipes.builder import Run, build, train
from lightning_nvme.recipes.compose import CONF_DIR, RECIPES_DIR, compose_config, list_recipes
from lightning_nvme.recipes.validate import ConfigError, validate

__all__ = ["CONF_DIR", "RECIPES_DIR", "ConfigError", "Run", "build", "compose_config", "list_recipes", "train",
           "validate"]
