"""Turn a recipe into a Lightning run: ``compose_config`` (Hydra composition of ``lightning_nvme.conf`` and
``lightning_nvme.recipes``) -> ``validate`` (every key and value checked before anything is built) ->
``build``/``train`` (instantiation and ``fit``)."""

from lightning_nvme.launch.compose import compose_config, list_recipes
from lightning_nvme.launch.instantiate import Run, build, train
from lightning_nvme.launch.validate import ConfigError, validate

__all__ = ["ConfigError", "Run", "build", "compose_config", "list_recipes", "train", "validate"]
