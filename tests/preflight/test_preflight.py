"""Preflight: every bad store directory or size setting fails before training with one message that
names the config key and the fix; RAM-backed and network filesystems warn."""

from __future__ import annotations

import re
import shutil

import pytest

from lightning_nvme.fs import fsinfo
from lightning_nvme.preflight import resources
from lightning_nvme.preflight.resources import ConfigError, PreflightWarning, check_store_dir

MiB = 1 << 20


def test_good_dir_returns_report(tmp_path):
    report = check_store_dir(tmp_path, 16 * MiB)
    assert report.path == str(tmp_path)
    assert report.free_bytes > 16 * MiB
    assert report.fs_type  # read from /proc/mounts
    assert isinstance(report.direct_io, bool) and report.direct_io_detail
    assert report.spare_bytes == report.free_bytes - 16 * MiB


def test_creates_missing_store_dir_under_existing_parent(tmp_path):
    target = tmp_path / "run1"
    check_store_dir(target, 0)
    assert target.is_dir()


def test_creates_missing_nested_dirs_under_an_ordinary_directory(tmp_path):
    target = tmp_path / "runs" / "exp1" / "nvme_store"  # e.g. <default_root_dir>/nvme_store on a fresh run
    check_store_dir(target, 0)
    assert target.is_dir()


def test_missing_mount_point_is_refused_and_not_created(tmp_path, monkeypatch):
    """/mnt/nvme0 missing means the disk is not mounted: refuse rather than fill the root disk."""
    from lightning_nvme.preflight import resources

    monkeypatch.setattr(resources, "MOUNT_ROOTS", resources.MOUNT_ROOTS + (str(tmp_path),))
    target = tmp_path / "not-mounted" / "run1"
    with pytest.raises(ConfigError) as ei:
        check_store_dir(target, 0, key="store_dir")
    assert ei.value.key == "store_dir"
    msg = str(ei.value)
    assert str(tmp_path / "not-mounted") in msg and "mkdir -p" in msg and "mounted" in msg
    assert not (tmp_path / "not-mounted").exists()


def test_file_instead_of_dir(tmp_path):
    f = tmp_path / "afile"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        check_store_dir(f, 0)


def test_empty_path_names_key():
    with pytest.raises(ConfigError) as ei:
        check_store_dir(None, 0, key="activation_store_dir")
    assert ei.value.key == "activation_store_dir" and "activation_store_dir" in str(ei.value)


def test_unwritable_dir_is_refused(tmp_path, monkeypatch):
    real_mkstemp = resources.tempfile.mkstemp

    def refuse(*args, dir=None, **kw):  # what a read-only mount answers, even to root
        if dir == str(tmp_path):
            raise OSError(30, "Read-only file system")
        return real_mkstemp(*args, dir=dir, **kw)

    monkeypatch.setattr(resources.tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError) as ei:
        check_store_dir(tmp_path, 0)
    assert "not writable" in str(ei.value) and "Read-only" in str(ei.value) and str(tmp_path) in str(ei.value)


def _numbers(msg: str) -> list[int]:
    return [int(x) for x in re.findall(r"\b(\d+) bytes", msg)]


def test_refuses_store_larger_than_free_space(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    needed = free + (1 << 30)
    with pytest.raises(ConfigError) as ei:
        check_store_dir(tmp_path, needed)
    msg = str(ei.value)
    assert ei.value.key == "store_dir" and str(tmp_path) in msg
    assert str(needed) in msg and "are free" in msg and "Fix:" in msg
    reported_free = _numbers(msg.split("but only")[1])[0]
    assert abs(reported_free - free) < 256 * MiB  # other processes may write meanwhile


def test_safety_margin_counts(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    check_store_dir(tmp_path, free // 4, min_free_bytes=free // 4)
    with pytest.raises(ConfigError, match="min_free_bytes"):
        check_store_dir(tmp_path, free // 2, min_free_bytes=free)


def test_negative_margin_names_its_key(tmp_path):
    with pytest.raises(ConfigError) as ei:
        check_store_dir(tmp_path, 0, min_free_bytes=-1)
    assert ei.value.key == "min_free_bytes"


def _fake_mount(monkeypatch, fs_type: str) -> None:
    mount = fsinfo.MountInfo("/fake", "dev", fs_type, ("rw",))
    monkeypatch.setattr(fsinfo, "mount_of", lambda path, mounts_file="/proc/mounts": mount)


@pytest.mark.parametrize("fs_type", ["tmpfs", "ramfs"])
def test_memory_fs_warns_it_saves_no_memory(tmp_path, monkeypatch, fs_type):
    _fake_mount(monkeypatch, fs_type)
    with pytest.warns(PreflightWarning, match="saves no memory"):
        report = check_store_dir(tmp_path, 0)
    assert len(report.warnings) == 1 and fs_type in report.warnings[0]


@pytest.mark.parametrize("fs_type", ["nfs4", "cifs", "fuse.sshfs", "fuse"])
def test_network_fs_warns(tmp_path, monkeypatch, fs_type):
    _fake_mount(monkeypatch, fs_type)
    with pytest.warns(PreflightWarning, match="network"):
        check_store_dir(tmp_path, 0)


def test_local_ext4_does_not_warn(tmp_path, monkeypatch, recwarn):
    _fake_mount(monkeypatch, "ext4")
    assert check_store_dir(tmp_path, 0).warnings == []
    assert not [w for w in recwarn if issubclass(w.category, PreflightWarning)]


def test_two_ranks_one_dir_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    check_store_dir(a, 0, rank_dirs={0: str(a), 1: str(b)})
    with pytest.raises(ConfigError) as ei:
        check_store_dir(a, 0, rank_dirs=[str(a), str(tmp_path / "x" / ".." / "a")])
    assert "ranks 0 and 1" in str(ei.value) and ei.value.key == "store_dir"
    # the same path on two different hosts is two different disks
    check_store_dir(a, 0, rank_dirs=[("host1", str(a)), ("host2", str(a))])


def test_stale_store_space_counts_as_free_but_live_store_does_not(tmp_path):
    """A restart on a nearly full disk must not be refused because of the crashed run's own store."""
    from lightning_nvme.store import FlatStore

    live = FlatStore(tmp_path, io_chunk_bytes=MiB, staging_bytes=MiB)
    live.add_region("x", 8 * MiB)
    assert resources.stale_store_bytes(str(tmp_path)) == 0  # its lock is held
    live.close()
    stale = resources.stale_store_bytes(str(tmp_path))
    assert stale >= 8 * MiB
    free = shutil.disk_usage(tmp_path).free
    report = check_store_dir(tmp_path, free + stale // 2)  # fits only by replacing the stale store
    assert report.reclaimable_bytes == stale and report.spare_bytes >= 0
    (tmp_path / "other.json").write_text("{not a store")  # foreign files are ignored
    assert resources.stale_store_bytes(str(tmp_path)) == stale
