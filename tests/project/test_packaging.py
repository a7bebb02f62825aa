"""The project installs like a library: the wheel carries the package, its configs and recipes, and
``lightning-nvme train`` runs the default recipe (optimizer state on the SSD) from an unrelated directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # tests/project/ -> the repository
SOURCES = ("pyproject.toml", "README.md", "lightning_nvme", "conf", "recipes")


def test_packaging_lists_every_package() -> None:
    """pyproject's explicit package list (needed for the conf/ and recipes/ mapping) misses no subpackage."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lightning_nvme").rglob("__init__.py")}
    # conf/'s groups are YAML-only folders: each must be listed, or setuptools warns "Package would be ignored"
    groups = {"lightning_nvme.conf." + d.name for d in (ROOT / "conf").iterdir() if d.is_dir() and any(d.glob("*.yaml"))}
    assert found | {"lightning_nvme.conf", "lightning_nvme.recipes"} | groups == listed
    assert resources.files("lightning_nvme.conf").joinpath("config.yaml").is_file()
    assert resources.files("lightning_nvme.recipes").joinpath("quickstart.yaml").is_file()


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built (verbosely) from a copy of the sources, and the build's output."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels = tmp / "src", tmp / "wheels"
    src.mkdir()
    for name in SOURCES:  # a copy: building in the checkout would leave build/ and *.egg-info there
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    proc = subprocess.run([*PIP, "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = wheels.glob("lightning_nvme-*.whl")
    return wheel, proc.stdout + proc.stderr


@pytest.mark.wheel
def test_wheel_builds_cleanly_and_carries_every_yaml(built_wheel: tuple[Path, str]) -> None:
    """Every YAML of conf/ and recipes/ is in the wheel at its package path, and setuptools says nothing about
    ignored packages or the license's form (both were deprecation warnings before)."""
    wheel, log = built_wheel
    for warning in ("Package would be ignored", "project.license", "License classifiers are deprecated"):
        assert warning not in log, f"the build warns {warning!r}:\n{log[-3000:]}"
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"lightning_nvme/{p.relative_to(ROOT).as_posix()}" for d in ("conf", "recipes") for p in (ROOT / d).rglob("*.yaml")}
    assert len(expected) > 20 and not expected - names, sorted(expected - names)


@pytest.mark.wheel
def test_wheel_trains_the_default_recipe_from_outside_the_checkout(tmp_path: Path, built_wheel: tuple[Path, str]) -> None:
    """Install the wheel built from a copy of the sources (not editable) into a fresh directory, and run
    its console script from an unrelated directory with the current interpreter's dependencies."""
    site, work = tmp_path / "site", tmp_path / "work"
    wheel, _ = built_wheel
    subprocess.run([*PIP, "-q", "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_NVME_", "PL_"))}
    env["PYTHONPATH"] = str(site)

    probe = ("import lightning_nvme, lightning_nvme.conf as c, lightning_nvme.recipes as r; "
             "print(lightning_nvme.__file__, c.__file__, r.__file__)")
    where = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True, check=True)
    for path in where.stdout.split():
        assert Path(path).is_relative_to(site), f"imported {path}, not the installed wheel"

    proc = subprocess.run([str(site / "bin" / "lightning-nvme"), "train", "trainer.max_steps=20",
                           "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NVMeOffloadStrategy:" in proc.stdout  # the telemetry table names the strategy's store
    assert "I/O telemetry summary" in proc.stdout and "finished default: 20 steps" in proc.stdout
    assert list((work / "outputs" / "default").glob("logs/version_*/io_telemetry.png"))
