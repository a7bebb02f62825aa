"""kill -9 over reflink checkpoints: the crash suite's runs (``crash_worker``) with their store and checkpoints on a
loop-mounted XFS with reflinks (``xfs_dir``), so every save clones the store's chunks (``checkpoint.copy.reflink``).
Seeded kills at every file-system call of save and commit (each clone ``ioctl`` among them) and at the targeted
commit steps; after each, every visible checkpoint equals the uninterrupted reference run's bit for bit, and the
chain resumes to the reference's final parameters (checks of ``test_crash_consistency``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_worker as cw  # noqa: E402
from test_crash_consistency import (  # noqa: E402
    COMMIT_STEPS,
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
    kill_and_resume,
    params_equal,
    run_chain,
)

from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader  # noqa: E402
from lightning_nvme.checkpoint.state_files import is_padding  # noqa: E402


@pytest.fixture(scope="module")
def xfs_reference(jobs, xfs_dir) -> Reference:  # noqa: F811
    ref = _reference(jobs, str(xfs_dir / "kill9-reference"))
    last = cw.paths(ref.root)["last"]
    from ckpt_helpers import parts_dir

    reader = SafetensorsReader(os.path.join(parts_dir(last), "optimizer-0.safetensors"))
    reader.close()
    assert any(is_padding(n) for n in reader.entries), "the reference's saves did not take the reflink path"
    return ref


def test_kill9_mid_reflink_checkpoint_resumes_bitwise(jobs, xfs_reference, xfs_dir):  # noqa: F811
    tally = run_chain(jobs, xfs_reference, str(xfs_dir / "kill9-chain"), "checkpoint", TRIALS)
    assert tally.killed == TRIALS


@pytest.mark.parametrize("stripes", [1, 2])
@pytest.mark.parametrize("nth", [1, 2])
def test_kill9_mid_clone_leaves_the_previous_checkpoint(jobs, xfs_reference, xfs_dir, nth, stripes):  # noqa: F811
    """Killed at the ``nth`` clone (``ioctl(FICLONERANGE)``) of the first ``last.ckpt`` save: its optimizer file is a
    hidden temp, the top-k checkpoint committed just before stays complete and exact, and the rerun ends bitwise.
    ``stripes=2``: the store over two directories of the XFS, so one chunk is several clones, from both files."""
    assert any(sum(by.values()) for by in xfs_reference.counts.values())
    root = str(xfs_dir / f"kill9-clone-{nth}-stripes{stripes}")
    kill = {"event": "fcntl.ioctl", "match": "/last.ckpt.optim/.", "nth": nth, "during": "save_checkpoint"}
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, kill=kill, stripes=stripes))
    assert rc == KILLED, _log(root)
    last, hidden = checkpoint_state(root, xfs_reference)
    assert last is None and hidden >= 1
    assert "epoch=0-step=3.ckpt" in os.listdir(cw.paths(root)["ckpts"])
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True, stripes=stripes))
    assert rc == 0, _log(root)
    assert params_equal(torch.load(cw.paths(root)["final"]), xfs_reference.final)
    assert checkpoint_state(root, xfs_reference) == (FINAL_STEP, 0)


@COMMIT_STEPS
def test_kill9_at_each_reflink_commit_step(jobs, xfs_reference, xfs_dir, kill, expected_last):  # noqa: F811
    root = str(xfs_dir / f"kill9-{kill['event']}-{kill['nth']}-{len(kill['match'])}")
    kill_and_resume(jobs, xfs_reference, root, kill, expected_last)
