"""fsinfo: the filesystem facts preflight and doctor rely on, read from /proc files."""

from __future__ import annotations

import os

from lightning_nvme.fs import fsinfo


def test_mount_of_picks_longest_prefix_and_last_line(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "/dev/nvme0n1p1 /mnt/nvme ext4 rw,noatime 0 0\n"
        "server:/x /mnt/nvme/remote\\040dir nfs4 rw 0 0\n"
        "tmpfs /mnt/nvme tmpfs rw,size=1g 0 0\n")
    top = fsinfo.mount_of("/mnt/nvme/run", str(mounts))
    assert top.fs_type == "tmpfs" and top.is_memory  # mounted over the SSD: the later line hides it
    remote = fsinfo.mount_of("/mnt/nvme/remote dir/a", str(mounts))
    assert remote.fs_type == "nfs4" and remote.is_network and remote.mount_point == "/mnt/nvme/remote dir"
    root = fsinfo.mount_of("/home/u", str(mounts))
    assert root.mount_point == "/" and not root.noatime and not root.is_network
    assert not fsinfo.mount_of("/mnt/nvmeX", str(mounts)).is_memory  # prefix must end at a path separator


def test_fuse_counts_as_network():
    assert fsinfo.MountInfo("/m", "s3fs", "fuse.s3fs", ()).is_network
    assert not fsinfo.MountInfo("/m", "/dev/sda", "xfs", ("noatime",)).is_network


def test_mount_of_real_path():
    m = fsinfo.mount_of(os.getcwd())
    assert m is not None and m.fs_type


def test_read_swaps(tmp_path):
    swaps = tmp_path / "swaps"
    swaps.write_text("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
                     "/dev/nvme0n1p3                          partition\t8388604\t\t0\t\t-2\n"
                     "/swap\\040file                             file\t\t1048572\t\t512\t\t-3\n")
    entries = fsinfo.read_swaps(str(swaps))
    assert [e.kind for e in entries] == ["partition", "file"]
    assert entries[0].size_bytes == 8388604 * 1024 and entries[1].filename == "/swap file"
    assert entries[1].used_bytes == 512 * 1024


def test_swap_file_on_same_disk(tmp_path):
    swap = tmp_path / "swapfile"
    swap.write_bytes(b"")
    entry = fsinfo.SwapEntry(str(swap), "file", 0, 0, -2)
    same = fsinfo.swap_on_same_disk(tmp_path, [entry])
    assert same == ([entry] if fsinfo.disk_of_path(tmp_path) is not None else [])
    assert fsinfo.swap_on_same_disk(tmp_path, [fsinfo.SwapEntry("/nonexistent", "file", 0, 0, 0)]) == []


def test_virtual_fs_has_no_disk():
    assert fsinfo.disk_of_dev(os.makedev(0, 42)) is None


def test_existing_ancestor(tmp_path):
    assert fsinfo.existing_ancestor(tmp_path / "a" / "b") == str(tmp_path)


def test_probe_direct_io_leaves_no_file(tmp_path):
    ok, detail = fsinfo.probe_direct_io(tmp_path)
    assert isinstance(ok, bool) and detail
    assert list(tmp_path.iterdir()) == []


def test_inspect(tmp_path):
    info = fsinfo.inspect(tmp_path / "not-yet")
    assert info.free_bytes > 0 and info.total_bytes >= info.free_bytes and info.mount is not None
