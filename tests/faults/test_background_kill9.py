"""kill -9 over background checkpoints (``checkpoint_copy="background"``): the crash suite's runs (``crash_worker``,
``ModelCheckpoint(save_top_k=1, save_last=True)`` every epoch) with each save copied by a thread after it returned.

The ``copy`` phase counts every ``pwrite`` of those copies (from the copy thread, or from a training write that had
to copy its region first), the ``commit`` phase every file-system call of the copy thread (the fsyncs, renames and
deletions of its commits and of the removals it runs after them); seeded kills land on them, and the
``checkpoint`` phase's kills on the save's own calls (layout, staged file). After each kill every visible
checkpoint equals the reference run's of its step bit for bit, a half-copied save is only hidden temps, and the chain
resumes to the reference's final parameters (the checks of ``test_crash_consistency``). The background reference
itself is checked against the streamed one first."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_worker as cw  # noqa: E402
from test_crash_consistency import (  # noqa: E402
    EPOCHS,
    FINAL_STEP,
    KILLED,
    STEPS,
    TRIALS,
    Reference,
    _log,
    _reference,
    checkpoint_state,
    jobs,  # noqa: F401 - the fork server fixture
    params_equal,
    reference,  # noqa: F401 - the streamed reference run
    run_chain,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def background_reference(jobs, tmp_path_factory) -> Reference:  # noqa: F811
    return _reference(jobs, str(tmp_path_factory.mktemp("background-reference")), copy="background")


def test_background_reference_equals_the_streamed_one(background_reference, reference):  # noqa: F811
    """Uninterrupted, every background last.ckpt equals the streamed run's of the same step, bit for bit."""
    assert sorted(background_reference.snapshots) == sorted(reference.snapshots)
    for step, path in background_reference.snapshots.items():
        assert verify_checkpoint(path, reference) == step
    assert params_equal(background_reference.final, reference.final)
    assert sum(background_reference.counts["copy"].values()) > 0, "no save took the background path"


@pytest.mark.parametrize("phase", ["copy", "commit", "checkpoint"])
def test_kill9_trials_over_background_saves_resume_bitwise(jobs, background_reference, tmp_path, phase):  # noqa: F811
    tally = run_chain(jobs, background_reference, str(tmp_path), phase, TRIALS, copy="background")
    assert tally.killed == TRIALS


def test_kill9_mid_copy_keeps_the_previous_checkpoints(jobs, background_reference, tmp_path):  # noqa: F811
    """Killed at the first copy write of epoch 1's top-k save: last.ckpt is epoch 0's, the top-k checkpoint that save
    would have replaced is still there (its removal waits for the commit), the half copy is hidden temps only, and
    the rerun ends bitwise equal to the reference."""
    copies = sum(background_reference.counts["copy"].values())
    per_save, rest = divmod(copies, 2 * EPOCHS)  # a top-k save and last.ckpt per epoch, one write per region
    assert per_save and not rest, background_reference.counts["copy"]
    root = str(tmp_path / "mid-copy")
    kill = {"phase": "copy", "at": 2 * per_save + 1, "torn": None}
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, kill=kill, copy="background"))
    assert rc == KILLED, _log(root)
    last, hidden = checkpoint_state(root, background_reference)
    assert last == STEPS and hidden >= 1
    assert f"epoch=0-step={STEPS}.ckpt" in os.listdir(cw.paths(root)["ckpts"])
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True, copy="background"))
    assert rc == 0, _log(root)
    assert params_equal(torch.load(cw.paths(root)["final"]), background_reference.final)
    assert checkpoint_state(root, background_reference) == (FINAL_STEP, 0)
