"""Compose a run's config with Hydra's compose API from the package's ``conf/`` and a recipe.

Why the compose API rather than ``@hydra.main``: the CLI owns argument parsing (``train``/``bench``/
``doctor``), must validate before anything starts, and must not change the working directory.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from lightning_nvme.recipes.validate import ConfigError, import_target, signature_of

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
RECIPES_DIR = Path(__file__).resolve().parent


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_header(name: str) -> str:
    """The first comment line of a recipe (what it shows)."""
    for line in (RECIPES_DIR / f"{name}.yaml").read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").strip()
    return ""


def compose_config(recipe: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """The composed config: ``conf/config.yaml`` <- recipe ``recipe`` <- ``overrides`` (Hydra syntax).

    Raises ``ConfigError`` naming the offending key or recipe and the fix.
    """
    overrides = list(overrides or [])
    if recipe is not None and recipe not in list_recipes():
        raise ConfigError(f"unknown recipe {recipe!r}. Available: {', '.join(list_recipes())}"
                          + _did_you_mean(recipe, list_recipes()))
    full = ([f"recipes={recipe}"] if recipe else []) + overrides
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="lightning_nvme"):
            return compose("config", overrides=full)
    except (HydraException, OverrideParseException) as exc:
        error = _explain(exc, recipe, overrides)
    raise error


def _explain(exc: Exception, recipe: str | None, overrides: list[str]) -> ConfigError:
    """Turn Hydra's composition error into one actionable message."""
    text = str(exc)
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        return ConfigError(f"'+{key}' adds a key, but '{key}' already exists: set it with '{key}=...' "
                           f"(or '++{key}=...' to add-or-set)")
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        key = m.group(1)
        parent, _, leaf = key.rpartition(".")
        known, target = _keys_at(recipe, parent)
        if target and leaf in _arguments_of(target):
            return ConfigError(f"'{key}' is an argument of {target} that this config does not set: "
                               f"add it with '+{key}=...'")
        hint = _did_you_mean(leaf, known, prefix=parent + "." if parent else "")
        return ConfigError(f"unknown config key '{key}'{hint}. Fix the spelling, or add a new key "
                           f"deliberately with '+{key}=...'. Keys under '{parent or '<root>'}': {', '.join(known)}")
    if isinstance(exc, MissingConfigException):
        m = re.search(r"Could not find '([^']+)'", text)
        group, _, option = (m.group(1) if m else "").rpartition("/")
        opts = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return ConfigError(f"no option '{option}' in config group '{group}'. Available: {', '.join(opts)}"
                           + _did_you_mean(option, opts))
    if isinstance(exc, OverrideParseException):
        return ConfigError(f"cannot parse the overrides {overrides}: {text.splitlines()[0]}. "
                           f"Use key=value (e.g. trainer.max_steps=100).")
    return ConfigError(text.strip().splitlines()[0] if text.strip() else repr(exc))


def _keys_at(recipe: str | None, parent: str) -> tuple[list[str], str | None]:
    """The keys the config has at ``parent`` (without the user's overrides), and the node's ``_target_``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="lightning_nvme"):
        cfg = compose("config", overrides=[f"recipes={recipe}"] if recipe else [])
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
