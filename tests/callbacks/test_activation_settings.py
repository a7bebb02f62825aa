"""NVMeActivationOffload's arguments are defined once (ActivationSettings + ActivationOffloadSettings): its
signature, the Hydra callback configs and the validator agree with that definition, every bad value is one
ConfigError naming the key, and the default store directory has one home (lightning_nvme.checks)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_settings import defaults

from lightning_nvme.callbacks import NVMeActivationOffload
from lightning_nvme.callbacks.activation_offload import ActivationOffloadSettings
from lightning_nvme.checks import ConfigError, default_store_dir, resolve_store_dir

CALLBACK_CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "callbacks").glob("*.yaml"))
# As for the strategies: the store directory follows the run's paths group (itself default_store_dir).
YAML_INTERPOLATED = {"store_dir": "${paths.store_dir}"}


def test_signature_lists_every_setting_with_its_default_and_type() -> None:
    params = inspect.signature(NVMeActivationOffload).parameters
    assert list(params)[0] == "store_dir"  # positional, as before: NVMeActivationOffload("/mnt/nvme/run")
    for f in dataclasses.fields(ActivationOffloadSettings):
        assert params[f.name].default == f.default, f.name
        assert params[f.name].annotation == f.type, f.name
        assert f.metadata["doc"] and f"{f.name}: " in NVMeActivationOffload.__doc__


def test_constructor_stores_the_settings() -> None:
    cb = NVMeActivationOffload("/tmp/x", scope="all", prefetch_bytes=1 << 20)
    assert cb.config == ActivationOffloadSettings(store_dir="/tmp/x", scope="all", prefetch_bytes=1 << 20)


@pytest.mark.parametrize("option", CALLBACK_CONFIGS)
def test_callback_yaml_has_every_key_with_the_constructors_default(option: str) -> None:
    """Every callback entry whose target defines its arguments as settings (``settings_class``) lists exactly
    those keys with their defaults; the other entries only name arguments their target takes."""
    from lightning_nvme.launch import compose_config
    from lightning_nvme.launch.validate import import_target, signature_of

    node = OmegaConf.to_container(compose_config(None, [f"callbacks={option}"]).callbacks, resolve=False)
    for name, entry in (node or {}).items():
        target = import_target(entry.pop("_target_"))
        settings = getattr(target, "settings_class", None)
        if settings is not None:
            expected = {**defaults(settings), **YAML_INTERPOLATED}
            assert entry == expected, f"conf/callbacks/{option}.yaml: {name} disagrees with {settings.__name__}"
        else:
            params, takes_kwargs, _ = signature_of(target)
            assert takes_kwargs or set(entry) <= set(params or []), f"conf/callbacks/{option}.yaml: {name}"


def test_the_activation_offload_yaml_is_one_of_those_checked() -> None:
    from lightning_nvme.launch import compose_config
    from lightning_nvme.launch.validate import import_target

    cfg = compose_config(None, ["callbacks=activation_offload"]).callbacks
    assert import_target(cfg.activation_offload._target_).settings_class is ActivationOffloadSettings


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("scope", "everything", "'checkpoint', 'all'"),
    ("min_bytes", -1, ">= 0"),
    ("min_bytes", 1.5, "integer"),
    ("keep_last", -1, ">= 0"),
    ("prefetch_depth", -1, ">= 0"),
    ("write_inflight_bytes", 0, ">= 1"),
    ("prefetch_bytes", 0, ">= 1"),
    ("min_segment_bytes", 0, ">= 1"),
    ("io_workers", 0, ">= 1"),
    ("io_chunk_bytes", 5000, "multiple of 4096"),
    ("staging_bytes", 0, ">= 1"),
    ("min_free_bytes", -1, ">= 0"),
    ("enabled", "yes", "true or false"),
    ("store_dir", 3, "path"),
])
def test_each_bad_value_is_one_config_error_naming_the_key(key: str, value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        NVMeActivationOffload(**{key: value})
    assert ei.value.key == key and str(ei.value).startswith(f"{key}: ") and needle in str(ei.value)


def test_unknown_argument_names_the_closest_setting() -> None:
    with pytest.raises(TypeError, match="NVMeActivationOffload: unexpected argument 'prefetch_byte' "
                                        r"\(did you mean 'prefetch_bytes'\?\)"):
        NVMeActivationOffload(prefetch_byte=1 << 20)


def test_validator_names_the_config_key_of_a_bad_callback_value() -> None:
    from lightning_nvme.launch import compose_config, validate

    cfg = compose_config(None, ["callbacks=offload", "callbacks.activation_offload.keep_last=-1"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg)
    assert ei.value.key == "callbacks.activation_offload.keep_last" and ">= 0" in ei.value.message


def test_default_store_dir_is_the_same_for_the_code_and_the_hydra_config(monkeypatch, tmp_path) -> None:
    from lightning_nvme.launch import compose_config

    monkeypatch.delenv("LIGHTNING_NVME_STORE_DIR", raising=False)
    paths = compose_config(None, []).paths
    assert paths.store_dir == default_store_dir(paths.output_dir) == os.path.join(paths.output_dir, "nvme_store")
    assert resolve_store_dir(None, "root") == os.path.abspath(os.path.join("root", "nvme_store"))
    assert resolve_store_dir(str(tmp_path / "given"), "root") == str(tmp_path / "given")

    monkeypatch.setenv("LIGHTNING_NVME_STORE_DIR", str(tmp_path / "env"))
    paths = compose_config(None, []).paths
    assert paths.store_dir == default_store_dir(paths.output_dir) == str(tmp_path / "env")
    assert resolve_store_dir(None, "root") == str(tmp_path / "env")
