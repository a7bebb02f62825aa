"""doctor and IOProfile: the report reflects the real directory, problems give exit code 1, the
tuned profile round-trips through JSON, and nothing is left behind in the checked directory."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.checks import ConfigError
from lightning_nvme.doctor import command, disk
from lightning_nvme.doctor.profile import IOProfile
from lightning_nvme.fs import fsinfo

MiB = 1 << 20
QUICK = ["--bench-bytes", str(16 * MiB), "--tune-bytes", str(2 * MiB), "--seconds", "0.5", "--min-free-bytes", "0"]


def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ---- IOProfile ----------------------------------------------------------------------------------
def test_profile_round_trip(tmp_path):
    p = IOProfile(io_chunk_bytes=4 * MiB, io_workers=2, write_mib_s=900.0, read_mib_s=1200.0, path="/x")
    f = tmp_path / "p.json"
    p.save(f)
    q = IOProfile.load(f)
    assert q == p
    # the profile's knobs are the strategy's arguments of the same names
    assert {"io_chunk_bytes", "io_workers"} <= set(inspect.signature(NVMeOffloadStrategy).parameters)
    assert os.listdir(tmp_path) == ["p.json"]  # no temp file left


def test_profile_ignores_unknown_fields(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"chunk_bytes": MiB, "num_workers": 3, "from_the_future": 1}))  # version 1 names
    assert IOProfile.load(f).io_workers == 3


@pytest.mark.parametrize("content,needle", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    (json.dumps({"num_workers": 2}), "lacks io_chunk_bytes"),
    (json.dumps({"chunk_bytes": 5000, "num_workers": 2}), "multiple of 4096"),
    (json.dumps({"chunk_bytes": MiB, "num_workers": 0}), ">= 1"),
])
def test_bad_profile_names_key_and_file(tmp_path, content, needle):
    f = tmp_path / "p.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError) as ei:
        IOProfile.load(f)
    assert ei.value.key == "io_profile" and str(f) in str(ei.value) and needle in str(ei.value)


# ---- measurements -------------------------------------------------------------------------------
def test_measure_bandwidth(tmp_path):
    bw = disk.measure_bandwidth(str(tmp_path), 16 * MiB, seconds=5)
    assert bw.write_mib_s > 0 and bw.read_mib_s > 0 and 0 < bw.nbytes <= 16 * MiB
    assert bw.direct == fsinfo.probe_direct_io(tmp_path)[0]
    assert os.listdir(tmp_path) == []


def test_tune_picks_a_measured_candidate_and_cleans_up(tmp_path):
    prof = disk.tune(str(tmp_path), nbytes=2 * MiB, seconds=0.0, chunks=(MiB, 2 * MiB), workers=(1, 2))
    measured = {(t["io_chunk_bytes"], t["io_workers"]) for t in prof.trials}
    assert measured == {(MiB, 1), (MiB, 2), (2 * MiB, 1), (2 * MiB, 2), disk.DEFAULT_SETTING}
    assert (prof.io_chunk_bytes, prof.io_workers) in measured
    assert all(t["rounds"] == 2 and t["combined_mib_s"] > 0 for t in prof.trials)
    if (prof.io_chunk_bytes, prof.io_workers) != disk.DEFAULT_SETTING:
        assert prof.speedup_vs_default >= 1.05  # only a confirmed gain replaces the default
    assert os.listdir(tmp_path) == []


# ---- main -----------------------------------------------------------------------------------------
def test_main_reports_this_directory(tmp_path, capsys):
    rc = command.main([str(tmp_path), "--no-tune", "--json", *QUICK])
    out = _json_out(capsys)
    assert rc == 0 and out["ok"] and out["path"] == str(tmp_path)
    assert out["fs_type"] == fsinfo.mount_of(tmp_path).fs_type
    assert out["direct_io"] == fsinfo.probe_direct_io(tmp_path)[0]
    assert out["free_bytes"] > 0 and out["bandwidth"]["write_mib_s"] > 0
    assert "profile" not in out and os.listdir(tmp_path) == []


def test_main_writes_loadable_profile(tmp_path, capsys):
    store_dir, prof = tmp_path / "store", tmp_path / "profile.json"
    rc = command.main([str(store_dir), "--write-profile", str(prof), *QUICK])
    text = capsys.readouterr().out
    assert rc == 0 and "verdict      OK" in text and "O_DIRECT" in text and "free space" in text
    loaded = IOProfile.load(prof)
    assert loaded.path == str(store_dir) and loaded.trials
    assert os.listdir(store_dir) == []


def test_main_plan_that_does_not_fit_fails(tmp_path, capsys):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    rc = command.main([str(tmp_path), "--no-tune", "--json", "--plan-bytes", str(free * 2), *QUICK])
    out = _json_out(capsys)
    assert rc == 1 and not out["ok"]
    assert str(free * 2) in out["problems"][0] and "free" in out["problems"][0]


def test_main_missing_mount_point_fails(tmp_path, monkeypatch, capsys):
    from lightning_nvme.preflight import resources

    monkeypatch.setattr(resources, "MOUNT_ROOTS", resources.MOUNT_ROOTS + (str(tmp_path),))
    rc = command.main([str(tmp_path / "no" / "such"), "--json"])
    assert rc == 1 and "does not exist" in _json_out(capsys)["problems"][0]


def test_main_flags_ram_disk_and_swap(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fsinfo, "mount_of", lambda p, f="/proc/mounts": fsinfo.MountInfo("/m", "tmpfs", "tmpfs", ("rw",)))
    swap = fsinfo.SwapEntry("/swapfile", "file", 8 << 30, 0, -2)
    monkeypatch.setattr(fsinfo, "swap_on_same_disk", lambda p, swaps=None: [swap])
    rc = command.main([str(tmp_path), "--no-tune", "--bench-bytes", "0"])
    text = capsys.readouterr().out
    assert rc == 1 and "saves no memory" in text and "/swapfile" in text and "noatime" in text


def test_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightning_nvme.doctor.command", str(tmp_path), "--no-tune", *QUICK],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "lightning-nvme doctor" in proc.stdout and "bandwidth" in proc.stdout


def test_main_reports_failing_disk_instead_of_crashing(tmp_path, monkeypatch, capsys):
    def eio(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(command, "measure_bandwidth", eio)
    rc = command.main([str(tmp_path), "--json", *QUICK])
    out = _json_out(capsys)
    assert rc == 1 and "Input/output error" in out["problems"][0] and str(tmp_path) in out["problems"][0]


# ---- several directories: a striped store ------------------------------------------------------------------
def test_main_several_directories_measures_each_and_together(tmp_path, capsys):
    dirs, prof = [str(tmp_path / "a"), str(tmp_path / "b")], tmp_path / "profile.json"
    rc = command.main([*dirs, "--json", "--write-profile", str(prof), *QUICK])
    out = _json_out(capsys)
    assert rc == 0 and out["paths"] == dirs and set(out["dirs"]) == set(dirs)
    assert [e["path"] for e in out["each"]] == dirs and all(e["write_mib_s"] > 0 for e in out["each"])
    assert out["together"]["read_mib_s"] > 0 and out["slowest"]["path"] in dirs
    assert any("are on the same device" in a and dirs[0] in a and dirs[1] in a for a in out["advice"])
    loaded = IOProfile.load(prof)
    assert loaded.stripe_dirs == dirs and loaded.disks == out["each"]
    assert (loaded.stripe_bytes, loaded.io_workers) in {(t["stripe_bytes"], t["io_workers"]) for t in loaded.trials}
    assert all(os.listdir(d) == [] for d in dirs)  # nothing left behind
    strategy = NVMeOffloadStrategy(store_dir=dirs, io_profile=str(prof))
    from lightning_nvme.doctor.profile import io_request

    assert io_request(strategy.config) == (loaded.io_chunk_bytes, loaded.io_workers, loaded.stripe_bytes)


def test_slowest_disk_cost_is_said_from_the_profile(tmp_path):
    from lightning_nvme.doctor.profile import slowest_disk_note

    dirs = [str(tmp_path / d) for d in "abc"]
    disks = [{"path": d, "write_mib_s": w, "read_mib_s": w} for d, w in zip(dirs, (1000.0, 1000.0, 500.0))]
    profile = IOProfile(io_chunk_bytes=8 * MiB, io_workers=4, stripe_bytes=8 * MiB, stripe_dirs=dirs, disks=disks)
    note = slowest_disk_note(profile, dirs)
    assert note is not None and f"the slowest disk {dirs[2]} (500 MiB/s" in note and "1500 MiB/s of the 2500" in note
    assert "40% lost" in note
    assert slowest_disk_note(profile, dirs[:2]) is None  # equal disks cost nothing
    assert slowest_disk_note(profile, [*dirs[:2], str(tmp_path / "other")]) is None  # not what was measured
