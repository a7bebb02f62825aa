"""Training with the store striped over 2 and 3 directories is bitwise equal to one directory and to
in-memory Lightning: optimizer offload, parameter offload, a checkpoint saved after fit (the striped store
reopened) and resumed in a new process over striped directories."""

from __future__ import annotations

import os
import warnings

import pytest
from models import MLP
from test_checkpoint import assert_params_equal, resume_in_new_process
from test_checkpoint import trainer as ckpt_trainer
from test_param_offload import assert_same_params, fit, reference

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.preflight.resources import PreflightWarning

STRIPE = 4 << 10  # every 16 KiB optimizer chunk spans all the disks


def _dirs(root, n: int) -> list[str]:
    return [str(root / f"disk{i}") for i in range(n)]


def _fit_mlp(root, store_dir, epochs: int, quiet: bool = True) -> tuple[MLP, object]:
    model = MLP()
    strategy = NVMeOffloadStrategy(store_dir=store_dir, chunk_bytes=16 << 10, stripe_bytes=STRIPE, min_free_bytes=0)
    t = ckpt_trainer(root, strategy, epochs, enable_checkpointing=False)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", PreflightWarning)  # the "disks" of this test share one device
        t.fit(model)
    return model, t


@pytest.fixture(scope="module")
def one_directory(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    return _fit_mlp(root, str(root / "store"), 2)[0]


@pytest.mark.parametrize("n", [2, 3])
def test_optimizer_offload_over_n_directories_equals_one(tmp_path, one_directory, n):
    dirs = _dirs(tmp_path, n)
    model, t = _fit_mlp(tmp_path, dirs, 2)
    assert_params_equal(one_directory, dict(model.named_parameters()))
    sizes = [os.path.getsize(os.path.join(d, "store-rank0.bin")) for d in dirs]
    assert min(sizes) > 4 * STRIPE, sizes  # the state really is spread over every directory


def test_checkpoint_of_striped_store_resumes_bitwise_over_striped_directories(tmp_path, one_directory):
    _, t = _fit_mlp(tmp_path, _dirs(tmp_path / "a", 3), 1)
    ckpt = tmp_path / "epoch1.ckpt"
    t.save_checkpoint(ckpt)  # after fit: the striped store is reopened over its three directories
    dirs = _dirs(tmp_path / "b", 2)
    params = resume_in_new_process(
        tmp_path, ckpt, tmp_path / "p.pt",
        f"NVMeOffloadStrategy(store_dir={dirs!r}, chunk_bytes=16 << 10, stripe_bytes={STRIPE}, min_free_bytes=0)")
    assert_params_equal(one_directory, params)


def test_parameter_offload_over_three_directories_equals_in_memory(tmp_path, tmp_path_factory):
    ref, _ = reference(tmp_path_factory)
    strategy = NVMeOffloadStrategy(store_dir=_dirs(tmp_path, 3), chunk_bytes=64 << 10, offload_params=True,
                                   overlap="backward", stripe_bytes=STRIPE, min_free_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreflightWarning)
        off, t = fit(tmp_path / "off", strategy)
    assert_same_params(ref, off)
    assert len(t.strategy.param_offload.blocks) == 4


def test_shared_device_is_warned_naming_the_stripes(tmp_path):
    dirs = _dirs(tmp_path, 2)
    with pytest.warns(PreflightWarning, match=f"store_dir stripe 1 \\({dirs[0]}\\) and store_dir stripe 2 "
                                              f"\\({dirs[1]}\\) are on the same device"):
        _fit_mlp(tmp_path, dirs, 1, quiet=False)


def test_store_dir_list_is_checked():
    from lightning_nvme.checks import ConfigError

    with pytest.raises(ConfigError, match="store_dir: lists /x twice"):
        NVMeOffloadStrategy(store_dir=["/x", "/y", "/x"])
    with pytest.raises(ConfigError, match="store_dir: must be a path or a non-empty list"):
        NVMeOffloadStrategy(store_dir=[])
    with pytest.raises(ConfigError, match="stripe_bytes: must be a multiple of 4096"):
        NVMeOffloadStrategy(stripe_bytes=5000)


@pytest.mark.parametrize("own", [None, "same", "other", "striped"])
def test_activations_get_a_disk_of_their_own_when_asked(tmp_path, own):
    """The activation callback shares the strategy's store unless its store_dir names other directories; then it
    opens its own store there (one directory or striped), and warns when that is the same device after all."""
    from types import SimpleNamespace

    from lightning_nvme.callbacks import NVMeActivationOffload
    from lightning_nvme.store import FlatStore

    main = FlatStore(str(tmp_path / "main"))
    asked = {None: None, "same": str(tmp_path / "main"), "other": str(tmp_path / "act"),
             "striped": _dirs(tmp_path / "act", 2)}[own]
    cb = NVMeActivationOffload(store_dir=asked)
    trainer = SimpleNamespace(strategy=SimpleNamespace(nvme_store=main), default_root_dir=str(tmp_path),
                              global_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb._connect(trainer)
    try:
        if own in (None, "same"):
            assert cb.nvme_store is main and not caught
        else:
            assert cb.nvme_store is not main
            assert cb.nvme_store.directories == ([asked] if isinstance(asked, str) else asked)
            shared = [str(w.message) for w in caught if issubclass(w.category, PreflightWarning)]
            assert shared and "NVMeActivationOffload store_dir" in shared[0] and "same device" in shared[0]
    finally:
        cb._disconnect(clean=True)
        main.close(delete=True)


def test_preflight_names_every_role_on_one_device(tmp_path):
    from lightning_nvme.preflight.resources import check_store_dirs

    dirs, ckpts = _dirs(tmp_path, 2), str(tmp_path / "ckpts")
    with pytest.warns(PreflightWarning) as caught:
        reports = check_store_dirs(dirs, 64 << 20, 8 << 20, roles={"checkpoints": [ckpts]})
    assert [r.path for r in reports] == dirs and all(r.needed_bytes == (32 << 20) + (8 << 20) + 4096 for r in reports)
    text = str(caught[0].message)
    assert f"store_dir stripe 1 ({dirs[0]}) and store_dir stripe 2 ({dirs[1]}) and checkpoints ({ckpts})" in text


def test_save_after_fit_refuses_a_store_missing_a_stripe_naming_it(tmp_path):
    """After fit the store is reopened to stream the optimizer state: a stripe directory that lost its file (a
    disk not mounted, or wiped) is refused naming it, and no checkpoint is written."""
    from lightning_nvme.store import StoreFormatError

    dirs = _dirs(tmp_path, 3)
    _, t = _fit_mlp(tmp_path, dirs, 1)
    os.rename(dirs[1], dirs[1] + "-unmounted")
    os.makedirs(dirs[1])  # the empty mount point
    with pytest.raises(StoreFormatError, match=f"does not exist \\(directory {dirs[1]}\\)"):
        t.save_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
