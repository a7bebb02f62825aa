import contextlib
import functools
import os
import sys
import threading

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
# The tests mirror the package in folders (tests/store/, tests/optim/, ...; see CONTRIBUTING.md). The shared
# helpers here (models.py, ckpt_helpers.py, _*_model.py) and the test modules of every folder import by plain
# name (`from test_ddp import launch`), whichever folder pytest collects first: every folder that is not a
# package goes on the path, so a test module's name must be unique across folders (tests/project/test_layout.py).
TEST_DIRS = [TESTS] + sorted(
    os.path.join(TESTS, d) for d in os.listdir(TESTS)
    if os.path.isdir(os.path.join(TESTS, d)) and not d.startswith((".", "_"))
    and not os.path.exists(os.path.join(TESTS, d, "__init__.py")))
sys.path[:0] = [d for d in TEST_DIRS if d not in sys.path]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run the modules in a random order and each module's tests in a random order (seeded); "
                          "modules stay contiguous so their module-scoped fixtures are built once (tests/stress.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle")
    if seed is None:
        return
    import random

    rng = random.Random(seed)
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules.values())
    rng.shuffle(order)
    for group in order:
        rng.shuffle(group)
    items[:] = [item for group in order for item in group]


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
        import gc

        gc.collect()  # e.g. tensors of safetensors.load_file map their file: a live one keeps the mount busy
        if _run("umount", str(mount)):  # -o loop: the loop device is detached with it
            # still busy (a failed test's traceback holding such a tensor): detach it from the tree now, freed
            # when its last user goes, rather than leave a mount behind
            _run("umount", "-l", str(mount))
        image.unlink()


IO_THREAD_PREFIX = "lightning-nvme-io"  # IOEngine's worker threads


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(IO_THREAD_PREFIX) and t.is_alive()]


@pytest.fixture(autouse=True)
def _no_leaked_io_threads(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Every store a test opens is closed when it ends, pass or fail, so one failure cannot cascade into the
    tests after it (issue #20: a failed test's store kept its I/O threads and failed two later tests that check
    for none). A test that leaves a store open or an I/O thread running is failed here, naming them."""
    from lightning_nvme.store import FlatStore

    before = set(io_threads())
    opened: list[FlatStore] = []
    init = FlatStore.__init__

    @functools.wraps(init)
    def tracked_init(self, *args, **kwargs):  # noqa: ANN001, ANN202
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(FlatStore, "__init__", tracked_init)
    yield
    monkeypatch.setattr(FlatStore, "__init__", init)
    left_open = [s.path for s in opened if not s._closed]
    for store in opened:
        if not store._closed:
            with contextlib.suppress(Exception):  # a failed store re-raises its I/O error: that is the test's
                store.close()
    leaked = [t.name for t in io_threads() if t not in before]
    if left_open or leaked:
        pytest.fail(f"this test left {len(left_open)} store(s) open {left_open} (closed now) and {len(leaked)} I/O "
                    f"thread(s) running {leaked}: close stores in a finalizer (fixture or try/finally)",
                    pytrace=False)
