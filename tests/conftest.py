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
