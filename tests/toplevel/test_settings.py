"""Each strategy argument is defined once (lightning_nvme.settings); the strategies' signatures, the Hydra
strategy configs and README's argument table agree with that definition, and every bad value is refused with
one ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from lightning_nvme import NVMeOffloadDDPStrategy, NVMeOffloadFSDPStrategy, NVMeOffloadStrategy
from lightning_nvme.checks import ConfigError
from lightning_nvme.settings import DDPOffloadSettings, FSDPOffloadSettings, OffloadSettings, markdown_table

MiB = 1 << 20
STRATEGIES = [(NVMeOffloadStrategy, OffloadSettings, "nvme_offload"),
              (NVMeOffloadDDPStrategy, DDPOffloadSettings, "nvme_offload_ddp"),
              (NVMeOffloadFSDPStrategy, FSDPOffloadSettings, "nvme_offload_fsdp")]
# The one YAML value that is not the constructor's default: the store directory follows the run's paths group
# (which itself falls back to $LIGHTNING_NVME_STORE_DIR, as the constructor's None does).
YAML_INTERPOLATED = {"store_dir": "${paths.store_dir}"}


def defaults(settings: type) -> dict[str, Any]:
    """Each argument's default, as the settings class defines it (what the YAML must hold)."""
    return {f.name: f.default for f in dataclasses.fields(settings)}


@pytest.mark.parametrize(("strategy", "settings", "_"), STRATEGIES)
def test_signature_lists_every_setting_with_its_default_and_type(strategy, settings, _) -> None:
    params = inspect.signature(strategy).parameters
    for f in dataclasses.fields(settings):
        assert params[f.name].default == f.default, f.name
        assert params[f.name].annotation == f.type, f.name
        assert f.metadata["doc"] and f"{f.name}: " in strategy.__doc__  # documented in the Args section


@pytest.mark.parametrize(("strategy", "settings", "_"), STRATEGIES)
def test_constructor_stores_the_settings(strategy, settings, _) -> None:
    s = strategy("/tmp/x", chunk_bytes=MiB, overlap="backward")
    assert s.config == settings(store_dir="/tmp/x", chunk_bytes=MiB, overlap="backward")


@pytest.mark.parametrize(("_", "settings", "option"), STRATEGIES)
def test_yaml_config_has_every_key_with_the_constructors_default(_, settings, option) -> None:
    from lightning_nvme.launch import compose_config

    node = OmegaConf.to_container(compose_config(None, [f"strategy={option}"]).strategy, resolve=False)
    node.pop("_target_")  # test_yaml_configs_name_their_strategy
    expected = {**defaults(settings), **YAML_INTERPOLATED}
    assert node == expected, f"conf/strategy/{option}.yaml disagrees with lightning_nvme.settings.{settings.__name__}"


def test_yaml_configs_name_their_strategy() -> None:
    from lightning_nvme.launch import compose_config

    for strategy, _, option in STRATEGIES:
        target = compose_config(None, [f"strategy={option}"]).strategy._target_
        assert target == f"{strategy.__module__.rsplit('.', 1)[0]}.{strategy.__name__}"


def test_readme_argument_table_is_the_generated_one() -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    table = markdown_table()
    assert table in readme.read_text(), f"README.md must contain this argument table:\n{table}"


def test_default_strategy_of_the_cli_offloads() -> None:
    """``lightning-nvme train`` with no recipe keeps optimizer state on the SSD."""
    from lightning_nvme.launch import compose_config

    assert compose_config(None, []).strategy._target_ == "lightning_nvme.strategies.NVMeOffloadStrategy"


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("chunk_bytes", -4096, ">= 4096"),
    ("chunk_bytes", 0, ">= 4096"),
    ("chunk_bytes", True, "integer"),
    ("io_chunk_bytes", 5000, "multiple of 4096"),
    ("io_chunk_bytes", 5000, "Fix: use 8192"),
    ("staging_bytes", 1.5, "integer"),
    ("io_workers", 0, ">= 1"),
    ("prefetch_depth", 0, ">= 1"),
    ("min_free_bytes", -1, ">= 0"),
    ("overlap", "sometimes", "'step', 'backward'"),
    ("io_profile", "/nonexistent/profile.json", "lightning-nvme doctor"),
    ("malloc_mmap_threshold", 100, "or null"),
    ("malloc_mmap_threshold", "8MiB", "\"auto\""),
    ("broadcast_bucket_bytes", 0, ">= 4096"),
])
def test_each_bad_value_is_one_config_error_naming_the_key(key: str, value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        DDPOffloadSettings(**{key: value})
    assert ei.value.key == key and str(ei.value).startswith(f"{key}: ") and needle in str(ei.value)


def test_staging_must_hold_an_io_chunk_but_not_an_optimizer_chunk() -> None:
    with pytest.raises(ConfigError) as ei:
        OffloadSettings(io_chunk_bytes=8 * MiB, staging_bytes=4 * MiB)
    assert ei.value.key == "staging_bytes" and "io_chunk_bytes" in str(ei.value)
    OffloadSettings(chunk_bytes=128 * MiB, io_chunk_bytes=8 * MiB, staging_bytes=64 * MiB)


def test_unknown_argument_names_the_closest_setting() -> None:
    with pytest.raises(TypeError, match="did you mean 'io_workers'"):
        NVMeOffloadStrategy(io_worker=2)
