"""The project installs like a library: the wheel carries the package, its configs and recipes, and
``lightning-nvme train`` runs the default recipe (optimizer state on the SSD) from an unrelated directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    assert found | {"lightning_nvme.conf", "lightning_nvme.recipes"} == listed
    assert resources.files("lightning_nvme.conf").joinpath("config.yaml").is_file()
    assert resources.files("lightning_nvme.recipes").joinpath("quickstart.yaml").is_file()


@pytest.mark.wheel
def test_wheel_trains_the_default_recipe_from_outside_the_checkout(tmp_path: Path) -> None:
    """Build the wheel from a copy of the sources, install it (not editable) into a fresh directory, and run
    its console script from an unrelated directory with the current interpreter's dependencies."""
    src, wheels, site, work = (tmp_path / d for d in ("src", "wheels", "site", "work"))
    src.mkdir()
    for name in SOURCES:  # a copy: building in the checkout would leave build/ and *.egg-info there
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   timeout=300)
    (wheel,) = wheels.glob("lightning_nvme-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
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
