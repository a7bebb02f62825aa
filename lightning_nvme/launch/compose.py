"""Compose a run's config with Hydra's compose API from the packaged configs and a recipe.

Why the compose API rather than ``@hydra.main``: the CLI owns argument parsing (``train``/``bench``/
``doctor``), must validate before anything starts, and must not change the working directory.

Both trees are found through the import system, so a wheel works the same as a source checkout: the
config groups are the package ``lightning_nvme.conf`` (``conf/`` in the repository) and each recipe in
``lightning_nvme.recipes`` (``recipes/``) is registered as an option of the ``recipes`` group.
"""

from __future__ import annotations

import difflib
import re
from importlib import resources

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from lightning_nvme.checks import ConfigError, default_store_dir
from lightning_nvme.launch.validate import import_target, signature_of

CONF_MODULE = "lightning_nvme.conf"
RECIPES_MODULE = "lightning_nvme.recipes"
RECIPES_GROUP = "recipes"
STORE_DIR_RESOLVER = "lightning_nvme.default_store_dir"


def _recipe_files() -> dict[str, resources.abc.Traversable]:
    return {f.name.removesuffix(".yaml"): f for f in resources.files(RECIPES_MODULE).iterdir()
            if f.name.endswith(".yaml")}


def list_recipes() -> list[str]:
    return sorted(_recipe_files())


def recipe_text(name: str) -> str:
    return _recipe_files()[name].read_text()


def recipe_header(name: str) -> str:
    """The first comment line of a recipe (what it shows)."""
    for line in recipe_text(name).splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").strip()
    return ""


def _register_recipes() -> None:
    """Each recipe becomes an option of the ``recipes`` group; recipes are global (``# @package _global_``):
    they set keys of every group and override group choices in their defaults list."""
    store = ConfigStore.instance()
    for name in list_recipes():
        store.store(name=name, group=RECIPES_GROUP, package="_global_", node=OmegaConf.create(recipe_text(name)))


def _register_resolvers() -> None:
    """``${lightning_nvme.default_store_dir:ROOT}`` (``conf/paths``): the store directory rule of the code itself."""
    if not OmegaConf.has_resolver(STORE_DIR_RESOLVER):
        OmegaConf.register_new_resolver(STORE_DIR_RESOLVER, default_store_dir)


def _compose(overrides: list[str]) -> DictConfig:
    _register_recipes()
    _register_resolvers()
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3", job_name="lightning_nvme"):
        return compose("config", overrides=overrides)


def compose_config(recipe: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """The composed config: ``conf/config.yaml`` <- recipe ``recipe`` <- ``overrides`` (Hydra syntax).

    Raises ``ConfigError`` naming the offending key or recipe and the fix.
    """
    overrides = list(overrides or [])
    if recipe is not None and recipe not in list_recipes():
        raise ConfigError("recipe", f"unknown recipe {recipe!r}. Available: {', '.join(list_recipes())}"
                          + _did_you_mean(recipe, list_recipes()))
    full = ([f"{RECIPES_GROUP}={recipe}"] if recipe else []) + overrides
    try:
        return _compose(full)
    except (HydraException, OverrideParseException) as exc:
        error = _explain(exc, recipe, overrides)
    raise error


def _explain(exc: Exception, recipe: str | None, overrides: list[str]) -> ConfigError:
    """Turn Hydra's composition error into one actionable message."""
    text = str(exc)
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        return ConfigError(key, f"'+{key}' adds a key, but '{key}' already exists: set it with '{key}=...' "
                           f"(or '++{key}=...' to add-or-set)")
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        key = m.group(1)
        parent, _, leaf = key.rpartition(".")
        known, target = _keys_at(recipe, parent)
        if target and leaf in _arguments_of(target):
            return ConfigError(key, f"an argument of {target} that this config does not set: "
                               f"add it with '+{key}=...'")
        hint = _did_you_mean(leaf, known, prefix=parent + "." if parent else "")
        return ConfigError(key, f"unknown config key{hint}. Fix the spelling, or add a new key "
                           f"deliberately with '+{key}=...'. Keys under '{parent or '<root>'}': {', '.join(known)}")
    if isinstance(exc, MissingConfigException):
        m = re.search(r"Could not find '([^']+)'", text)
        group, _, option = (m.group(1) if m else "").rpartition("/")
        opts = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return ConfigError(group, f"no option '{option}' in config group '{group}'. Available: {', '.join(opts)}"
                           + _did_you_mean(option, opts))
    if isinstance(exc, OverrideParseException):
        return ConfigError("overrides", f"cannot parse the overrides {overrides}: {text.splitlines()[0]}. "
                           f"Use key=value (e.g. trainer.max_steps=100).")
    return ConfigError("config", text.strip().splitlines()[0] if text.strip() else repr(exc))


def _keys_at(recipe: str | None, parent: str) -> tuple[list[str], str | None]:
    """The keys the config has at ``parent`` (without the user's overrides), and the node's ``_target_``."""
    cfg = _compose([f"{RECIPES_GROUP}={recipe}"] if recipe else [])
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return [], None
    return sorted(str(k) for k in node.keys()), node.get("_target_")


def _arguments_of(target: str) -> list[str]:
    try:
        params, _, _ = signature_of(import_target(target))
    except (ImportError, AttributeError):
        return []
    return params or []


def _did_you_mean(word: str, options: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""
