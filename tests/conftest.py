import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):
    monkeypatch.setenv("PL_DISABLE_FORK", "1")


@pytest.fixture(autouse=True)
def _no_global_state_leak(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Recipes call ``seed_everything``: restore the RNGs (torch, random, numpy) and drop the PL_* seed
    variables afterwards, so later tests in this process (and what they spawn) see the state they had."""
    import random

    import numpy as np

    for var in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(var, raising=False)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def _run(*cmd: str) -> str:
    import subprocess

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return "" if done.returncode == 0 else f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}"


@pytest.fixture(scope="session")
def xfs_dir(tmp_path_factory):
    """A directory on a fresh XFS with reflinks: a sparse image file made with ``mkfs.xfs -m reflink=1`` and
    loop-mounted (root and xfsprogs needed: ``.ci/run`` installs xfsprogs), unmounted at the end."""
    import shutil

    if os.geteuid() != 0:
        pytest.skip("XFS reflink tests mount a loop device: they need root (run as root, as .ci/run does)")
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is missing: install xfsprogs (apt-get install -y xfsprogs; .ci/run does)")
    base = tmp_path_factory.mktemp("xfs")
    image, mount = base / "xfs.img", base / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(2 << 30)  # sparse: blocks are used only as the tests write
    problem = _run("mkfs.xfs", "-q", "-m", "reflink=1", str(image)) or _run("mount", "-o", "loop", str(image), str(mount))
    if problem:
        image.unlink()
        pytest.skip(f"cannot make a loop-mounted XFS here: {problem}")
    try:
        yield mount
    finally:
        _run("umount", str(mount))  # -o loop: the loop device is detached with it
        image.unlink()
