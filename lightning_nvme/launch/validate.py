"""Check a composed config before anything is built: every key must be an argument of its ``_target_``,
every value of the argument's type, required values set and store directories usable.

Why: a typo in an override should cost one line of output, not a traceback after the model was built
(or, worse, be silently ignored). Each error names the config key and the fix; the CLI exits with 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import inspect
import os
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import PurePath
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

from lightning_nvme.checks import ConfigError
from lightning_nvme.preflight import resources

_HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_convert_", "_recursive_"}
STORE_DIR_KEYS = ("store_dir",)
_SCALARS = (str, int, float, bool, type(None))


def validate(cfg: DictConfig) -> dict[str, Any]:
    """Resolve ``cfg`` and check it; returns the resolved plain container. Raises ``ConfigError``."""
    resolved = _resolve(cfg)
    for key, node in _target_nodes(resolved):
        _check_node(key, node)
    ensure_output_dir(resolved)
    for key, path in _store_dirs(resolved):
        check_store_dir(key, path)
    _check_model_path(resolved.get("model") or {})
    _check_packed(resolved.get("data") or {}, resolved.get("model") or {})
    return resolved


def _resolve(cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except MissingMandatoryValue as e:
        key = e.full_key or "config"
        raise ConfigError(key, f"required but not set: add {key}=<value> to the command line"
                          + (" (a directory with config.json + model.safetensors)" if key == "model.path" else "")) from None
    except InterpolationResolutionError as e:
        raise ConfigError(e.full_key or "config", f"refers to a value that does not exist ({e.msg}). "
                          f"Set {e.full_key} explicitly, or set the key it refers to.") from None
    except OmegaConfBaseException as e:
        raise ConfigError(str(getattr(e, "full_key", "config")), str(getattr(e, "msg", e))) from None


def _target_nodes(tree: Any, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(tree, Mapping):
        if "_target_" in tree:
            yield prefix, dict(tree)
        for k, v in tree.items():
            if k not in _HYDRA_KEYS:
                yield from _target_nodes(v, f"{prefix}.{k}" if prefix else str(k))


def _check_node(key: str, node: dict[str, Any]) -> None:
    target = node["_target_"]
    try:
        obj = import_target(target)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}._target_", f"cannot import {target} ({type(e).__name__}: {e}).") from None
    params, takes_kwargs, hints = signature_of(obj)
    if params is None:
        return
    for arg, value in node.items():
        if arg in _HYDRA_KEYS or arg.startswith("_"):
            continue
        full = f"{key}.{arg}"
        if arg not in params:
            if takes_kwargs:
                continue
            close = difflib.get_close_matches(arg, list(params), n=1)
            hint = f" (did you mean '{key}.{close[0]}'?)" if close else ""
            raise ConfigError(full, f"unknown config key{hint}: {target} takes {', '.join(params)}. "
                              f"Fix the spelling or remove the key.")
        annotation = hints.get(arg, inspect.Parameter.empty)
        if accepts(value, annotation) is False:
            want = _describe(annotation)
            fix = f"{full}=<{want}>" if len(want) <= 40 else f"{full}=<one of the values above>"
            raise ConfigError(full, f"must be {want}, got {value!r} ({type(value).__name__}). Fix: {fix}")
    _check_settings(key, obj, node)


def _check_settings(key: str, obj: Any, node: dict[str, Any]) -> None:
    """A target whose arguments are a settings dataclass (``with_settings``: the strategies, the activation
    callback) is checked by those definitions."""
    settings_class = getattr(obj, "settings_class", None)
    if not (isinstance(settings_class, type) and dataclasses.is_dataclass(settings_class)):
        return
    names = settings_class.__dataclass_fields__
    try:
        settings_class(**{k: v for k, v in node.items() if k in names})
    except ConfigError as e:
        raise ConfigError(f"{key}.{e.key}", e.message) from None


def import_target(target: str) -> Any:
    """``a.b.C`` -> the object, importing the longest importable module prefix."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not ".".join(parts[:i]).startswith(e.name):
                raise  # a dependency of the module is missing: report that
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    return importlib.import_module(target)


def signature_of(obj: Any) -> tuple[list[str] | None, bool, dict[str, Any]]:
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, True, {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: check names only
        hints = {}
    params = [n for n, p in sig.parameters.items()
              if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return params, takes_kwargs, hints


def accepts(value: Any, annotation: Any) -> bool | None:
    """Whether ``value`` (plain YAML data) fits ``annotation``; ``None`` when the annotation is not checkable."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    if annotation is None or annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        results = [accepts(value, a) for a in typing.get_args(annotation)]
        return True if True in results else (None if None in results else False)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(annotation))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple) or annotation in (list, tuple) or origin is Sequence:
        return isinstance(value, (list, tuple))
    if origin is dict or annotation is dict or origin is Mapping:
        return isinstance(value, Mapping)
    if inspect.isclass(annotation) and issubclass(annotation, (PurePath, os.PathLike)):
        return isinstance(value, str) or None
    if inspect.isclass(annotation) and not issubclass(annotation, enum.Enum) and isinstance(value, _SCALARS):
        return isinstance(value, annotation)  # e.g. a string where a Tensor is expected
    return None  # a nested object (Hydra builds it) or an enum the target converts: not checked


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _store_dirs(resolved: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, node in _target_nodes(resolved):
        for arg in STORE_DIR_KEYS:
            if arg in node:
                yield f"{key}.{arg}", node[arg]


def check_store_dir(key: str, path: Any) -> None:
    """A store directory must be usable before training starts; the rules (created if missing, except
    directly in a mount root such as ``/mnt`` where a missing directory means an unmounted disk; writable;
    warnings for RAM-backed or network filesystems) are ``lightning_nvme.preflight.resources``'s, the same the
    strategy applies at setup. ``None`` is left to the component: it picks its own default."""
    if path is None:
        return
    paths = [path] if isinstance(path, (str, os.PathLike)) or not isinstance(path, Sequence) else list(path)
    try:
        for p in paths:  # a list: the disks of a striped store, each checked
            resources.check_store_dir(os.path.expanduser(str(p)), 0, key=key)
    except ConfigError as e:
        raise ConfigError(e.key, e.message) from None


def ensure_output_dir(resolved: Mapping[str, Any]) -> None:
    """Create ``paths.output_dir`` (logs, checkpoints, default store parent) or say why it cannot be."""
    out = (resolved.get("paths") or {}).get("output_dir")
    if not out:
        return
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError("paths.output_dir", f"{out} cannot be created ({e.strerror}). "
                          f"Fix: paths.output_dir=<a writable directory>") from None


def _check_model_path(model: Mapping[str, Any]) -> None:
    path = model.get("path")
    if not isinstance(path, str) or "HFCausalLM" not in str(model.get("_target_", "")):
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("model.path", f"{path!r} has no config.json. Fix: model.path=<a directory saved with "
                          f"save_pretrained: config.json + model.safetensors>")


def _check_packed(data: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """``data.packed=true`` needs attention that stops at sample boundaries: transformers builds it from the
    restarting position ids; the built-in GPT (and GPT-2 through it) has only a causal mask."""
    if not data.get("packed"):
        return
    target = str(model.get("_target_", ""))
    native = "GPTLightningModule" in target
    path = model.get("path")
    if "HFCausalLM" in target and model.get("backend") != "transformers" and isinstance(path, str):
        import json

        try:
            with open(os.path.join(path, "config.json")) as f:
                native = json.load(f).get("model_type") == "gpt2"
        except (OSError, ValueError):
            return
    if native:
        raise ConfigError("data.packed", "packed samples need attention that does not cross sample boundaries, which the "
                          "built-in GPT does not have. Fix: data.packed=false (padding to the longest in the batch), or "
                          "a transformers model (model=hf_local, model.backend=transformers)")
