import os
import sys

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
