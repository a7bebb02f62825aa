"""The reflink probe runs in a checkpoint directory at the first save: a kill between its create and its
unlink must leave only what the next save sweeps (a dead writer's ``.NAME.tmp-PID``)."""

from __future__ import annotations

import os

from lightning_nvme.fs import atomic, reflink


def _dead_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_probe_leaves_no_file(tmp_path):
    reflink.probe(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_probe_killed_before_its_unlink_leaves_dead_temps_the_next_save_sweeps(tmp_path, monkeypatch):
    monkeypatch.setattr(reflink.os, "getpid", _dead_pid)  # the probing process, then gone
    monkeypatch.setattr(reflink.os, "unlink", lambda path: None)  # killed before it cleaned up
    reflink.probe(str(tmp_path))
    monkeypatch.undo()
    left = os.listdir(tmp_path)
    assert left and all(n.startswith(".") and atomic.is_dead_temp(str(tmp_path / n)) for n in left), left
    atomic.sweep_dead_temps(str(tmp_path))  # what every save's recover() runs in its directory
    assert os.listdir(tmp_path) == []
