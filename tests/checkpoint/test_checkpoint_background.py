"""Background checkpoints (``checkpoint_copy="background"``) on the default filesystem: the save returns after a
fence, the state is copied while training runs, and the checkpoint is still the state of the save, bit for bit.

The race is forced, not hoped for: the ``gate`` fixture holds the copy thread before its first region while the
test lets training steps run, so every region training rewrites meanwhile takes the copy-before-write path; the gate
is released by the test, never by a timer."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from models import MLP
from safetensors.torch import load_file
from snapshot_checks import (
    assert_saves_equal_the_instant,
    assert_snapshot_is_the_saved_state,
    assert_tiny_gpt_resumes_bitwise,
    optimizer_tensors,
    state_tensors,
)
from test_checkpoint import assert_params_equal, reference, resume_in_new_process, trainer  # noqa: F401

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadDDPStrategy, NVMeOffloadStrategy
from lightning_nvme.checkpoint.copy import background
from lightning_nvme.checkpoint.copy.background import BackgroundCopy, CheckpointCopyError
from lightning_nvme.checks import ConfigError
from lightning_nvme.fs import reflink


class Gate:
    """The copy thread waits here (each region it takes, before copying it: the fixture wraps
    ``BackgroundCopy._next``, the thread's only way to its next region) until ``release``."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.calls = 0
        self.armed = True  # False: copies pass

    def __call__(self, region: str) -> None:
        if not self.armed:
            return
        self.calls += 1
        assert self.open.wait(600), "the test never released the background copy"

    def release(self) -> None:
        self.open.set()


@pytest.fixture
def gate(monkeypatch):
    g = Gate()
    take = BackgroundCopy._next

    def gated(self: BackgroundCopy) -> str | None:
        name = take(self)
        if name is not None:
            g(name)
        return name

    monkeypatch.setattr(BackgroundCopy, "_next", gated)
    yield g
    g.release()  # a failed test must not leave a copy thread waiting


def background_strategy(tmp_path, **kw) -> NVMeOffloadStrategy:
    kw = {"chunk_bytes": 16 << 10, "checkpoint_copy": "background", **kw}
    return NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), **kw)


def _streamed_save(strategy, trainer_, path) -> None:
    """A streamed save of the same instant, for comparison (the run's setting swapped for one call)."""
    config = strategy.config
    strategy.config = dataclasses.replace(config, checkpoint_copy="streamed")
    try:
        trainer_.save_checkpoint(path)
    finally:
        strategy.config = config


class _SaveThenHold(Callback):
    """At the end of epoch 0: a streamed save (``b``), then a background save (``a``) whose copy the gate holds
    for ``steps`` optimizer steps of training; then checks the copy waited, and releases it."""

    def __init__(self, gate: Gate, a, b, steps: int = 2) -> None:
        self.gate, self.a, self.b, self.steps = gate, str(a), str(b) if b else None, steps
        self.saved_at: int | None = None
        self.copy: BackgroundCopy | None = None
        self.uncommitted_while_held = False

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            if self.b:
                _streamed_save(trainer.strategy, trainer, self.b)
            trainer.save_checkpoint(self.a)
            self.saved_at, self.copy = trainer.global_step, trainer.strategy._background
            assert trainer.strategy.checkpoint_saves[-1].path == "background"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.saved_at is not None and not self.gate.open.is_set() and trainer.global_step >= self.saved_at + self.steps:
            self.uncommitted_while_held = not os.path.exists(self.a) and self.copy is not None and self.copy.in_flight
            self.gate.release()


@pytest.mark.parametrize("state_format,budget", [("exact", 0), ("int8", 0), ("exact", 1 << 30)],
                         ids=["exact", "int8", "shelved"])
def test_background_snapshot_is_the_saved_state_while_training_overwrites_the_store(tmp_path, gate, state_format,
                                                                                    budget):
    """``int8``: codes and per-block scales; ``shelved``: every region kept in RAM (``host_memory_budget``), updated
    in place by training, so copied at the save. The copy buffer (4 KiB) is smaller than a region (16 KiB)."""
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    strategy = background_strategy(tmp_path, state_format=state_format, host_memory_budget=budget,
                                   checkpoint_copy_buffer_bytes=4096)
    hold = _SaveThenHold(gate, a, b)
    t = trainer(tmp_path, strategy, 3, enable_checkpointing=False, callbacks=[hold])
    t.fit(MLP())
    assert [r.path for r in strategy.checkpoint_saves] == ["streamed", "background"]
    copy = hold.copy
    assert copy is not None and copy.committed and copy.error is None
    if budget:  # every region was in RAM: copied inside the fence, nothing left for the thread or training
        assert copy.copied_by_barrier == [] and gate.calls == 0
    else:  # training rewrote every region while the thread was held: each was copied before its write
        assert hold.uncommitted_while_held, "the checkpoint committed before its copy was released"
        assert sorted(copy.copied_by_barrier) == sorted(copy.targets)
    t.save_checkpoint(tmp_path / "final.ckpt")
    assert_snapshot_is_the_saved_state(a, b, tmp_path / "final.ckpt", tmp_path)
    # every loader opens it: torch.load, load_from_checkpoint, safetensors on the state file, the converter (above)
    assert torch.load(a, weights_only=True)["global_step"] == torch.load(b, weights_only=True)["global_step"]
    for (name, p), q in zip(MLP.load_from_checkpoint(a).state_dict().items(),
                            MLP.load_from_checkpoint(b).state_dict().values()):
        assert torch.equal(p, q), name
    from ckpt_helpers import parts_dir

    assert not os.path.exists(str(a) + ".optim")  # one file
    raw = load_file(os.path.join(parts_dir(a), "optimizer-0.safetensors"))
    assert any(n.startswith("pad.") for n in raw) and any(n.startswith("state.") for n in raw)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "hidden temps left behind"


def test_background_checkpoint_resumes_bitwise_in_a_new_process(tmp_path, gate, reference):  # noqa: F811
    """Saved at the end of epoch 0, copied while epoch 1 rewrites the store: the run itself and a resume of the
    checkpoint in a new process both end bitwise equal to uninterrupted in-memory training."""
    ckpt = tmp_path / "epoch0.ckpt"
    strategy = background_strategy(tmp_path)
    hold = _SaveThenHold(gate, ckpt, None)
    model = MLP()
    t = trainer(tmp_path, strategy, 2, enable_checkpointing=False, callbacks=[hold])
    t.fit(model)
    assert hold.uncommitted_while_held and hold.copy is not None and hold.copy.committed
    assert_params_equal(reference, {n: p for n, p in model.named_parameters()})
    params = resume_in_new_process(tmp_path, ckpt, tmp_path / "p.pt",
                                   f"NVMeOffloadStrategy(store_dir={str(tmp_path / 'store2')!r}, chunk_bytes=16 << 10)")
    assert_params_equal(reference, params)


class _SaveTwice(Callback):
    """Two saves back to back at the end of epoch 0, then ``after()``."""

    def __init__(self, a, b, after=lambda: None) -> None:
        self.a, self.b, self.after = str(a), str(b), after
        self.in_flight_at_second: bool | None = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.a)
            copy = trainer.strategy._background
            self.in_flight_at_second = copy is not None and copy.in_flight
            trainer.save_checkpoint(self.b)
            self.after()


def test_second_save_waits_for_the_copy_in_flight(tmp_path, gate, monkeypatch):
    """``checkpoint_in_flight="wait"``: the second save waits (here its wait releases the gate, so the test needs
    no timing) and starts only once the first has committed."""
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    seen = []
    original = BackgroundCopy.wait

    def wait(self) -> None:
        seen.append((self.path, self.in_flight, os.path.exists(a)))
        gate.release()
        original(self)
        seen.append((self.path, self.in_flight, os.path.exists(a)))

    monkeypatch.setattr(BackgroundCopy, "wait", wait)
    strategy = background_strategy(tmp_path, checkpoint_in_flight="wait")
    saves = _SaveTwice(a, b)
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False, limit_train_batches=4, callbacks=[saves])
    t.fit(MLP())
    assert saves.in_flight_at_second
    assert seen[:2] == [(str(a), True, False), (str(a), False, True)]  # waited for a's commit, then saved b
    assert [r.path for r in strategy.checkpoint_saves] == ["background", "background"]
    assert os.path.exists(a) and os.path.exists(b)


class _SaveTwiceThenHold(_SaveThenHold):
    """``_SaveThenHold`` with a streamed save of the instant, then two background saves (``a``, ``a2``) back to back."""

    def __init__(self, gate: Gate, a, a2, b) -> None:
        super().__init__(gate, a, b)
        self.a2 = str(a2)
        self.joined: bool | None = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.a2)
            self.joined = trainer.strategy._background is self.copy and not os.path.exists(self.a)


def test_second_save_joins_the_copy_in_flight(tmp_path, gate, monkeypatch):
    """``checkpoint_in_flight="join"`` (the default; ModelCheckpoint's top-k and ``last`` saves of one instant): the
    second save returns while the first is still held, both are copied by one thread through one buffer (each region
    read once for both, before training's write), and both are the saved instant bit for bit."""
    allocated = []
    real_empty = background.aligned_empty
    monkeypatch.setattr(background, "aligned_empty", lambda n, *a, **k: allocated.append(n) or real_empty(n, *a, **k))
    a, a2, b = tmp_path / "a.ckpt", tmp_path / "a2.ckpt", tmp_path / "b.ckpt"
    strategy = background_strategy(tmp_path)
    hold = _SaveTwiceThenHold(gate, a, a2, b)
    trainer(tmp_path, strategy, 2, enable_checkpointing=False, callbacks=[hold]).fit(MLP())
    assert hold.joined and hold.uncommitted_while_held
    assert [r.path for r in strategy.checkpoint_saves] == ["streamed", "background", "background"]
    assert "joined to the copy in flight" in strategy.checkpoint_saves[-1].reason
    copy = hold.copy
    assert copy is not None and copy.committed and [job.path for job in copy.jobs] == [str(a), str(a2)]
    assert sorted(copy.copied_by_barrier) == sorted(copy.jobs[0].targets) == sorted(copy.jobs[1].targets)
    assert allocated == [64 << 20]  # one buffer for both
    copied = optimizer_tensors(b, tmp_path)
    for path in (a, a2):
        saved = optimizer_tensors(path, tmp_path)
        for i, k in state_tensors(copied):
            assert torch.equal(saved[0]["state"][i][k], copied[0]["state"][i][k]), (path, i, k)


def test_second_save_is_skipped_with_a_message(tmp_path, gate):
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    strategy = background_strategy(tmp_path, checkpoint_in_flight="skip")
    saves = _SaveTwice(a, b, after=gate.release)
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False, limit_train_batches=4, callbacks=[saves])
    with pytest.warns(UserWarning, match="b.ckpt skipped: the background copy of .*a.ckpt is still in flight"):
        t.fit(MLP())
    assert saves.in_flight_at_second
    assert [r.path for r in strategy.checkpoint_saves] == ["background", "skipped"]
    assert "checkpoint_in_flight='skip'" in strategy.checkpoint_saves[-1].reason
    assert os.path.exists(a) and not os.path.exists(b) and not os.path.exists(str(b) + ".optim")


class _FailSecondCopy(Callback):
    """The copies of saves after the first fail (ENOSPC). ``where="thread"``: the first batch after the failing save
    waits for its copy, so the failure is known before the next optimizer step, which must report it.
    ``"barrier"``: the copy thread is held at the gate, so the first training write after the save copies its region
    itself and fails there; that step completes (the failure is the checkpoint's, not the step's) and the next one
    reports it."""

    def __init__(self, monkeypatch, gate: Gate, where: str) -> None:
        self.monkeypatch, self.gate, self.where = monkeypatch, gate, where
        self.saved_at: int | None = None
        self.raised_at: int | None = None
        self.failed_in: set[str] = set()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        copy = trainer.strategy._background
        if trainer.current_epoch == 1:
            copy.wait()
            assert copy.committed

            def full(out, piece, offset, name):
                self.failed_in.add(threading.current_thread().name)
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            self.monkeypatch.setattr(BackgroundCopy, "_write", staticmethod(full))
            self.gate.armed = self.where == "barrier"
        if trainer.current_epoch == 2 and self.where == "thread":
            copy.wait()
            assert copy.error is not None and not copy.committed

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:  # before ModelCheckpoint's save (checkpoint callbacks run last)
            self.saved_at = trainer.global_step

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.raised_at = trainer.global_step
        self.gate.release()


@pytest.mark.parametrize("where", ["thread", "barrier"])
def test_copy_failure_is_reported_at_the_next_step_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, gate,
                                                                                      where):
    """ModelCheckpoint(save_top_k=1) removes the previous checkpoint after each save: with the new one's copy
    failing, that removal must not happen (the user would be left with nothing committed)."""
    ckpts = tmp_path / "ckpts"
    gate.armed = False
    fail = _FailSecondCopy(monkeypatch, gate, where)
    strategy = background_strategy(tmp_path)
    t = trainer(tmp_path, strategy, 4, callbacks=[fail, ModelCheckpoint(dirpath=ckpts, save_top_k=1, monitor=None,
                                                                        every_n_epochs=1)])
    with pytest.raises(CheckpointCopyError, match=r"epoch=1-step=\d+\.ckpt failed after its save returned.*"
                                                  "No space left.*previous checkpoint is intact"):
        t.fit(MLP())
    assert fail.failed_in == {"lightning-nvme-checkpoint-copy" if where == "thread" else "MainThread"}
    assert fail.saved_at is not None
    # reported at the first optimizer step after the failure (thread: the next one, or the removal of the older
    # checkpoint if it failed before; barrier: the one after the step whose write failed to copy)
    assert fail.raised_at == fail.saved_at + (where == "barrier")
    names = sorted(os.listdir(ckpts))
    (kept,) = [n for n in names if n.endswith(".ckpt")]
    assert kept.startswith("epoch=0-"), names  # epoch 1's failed; epoch 0's, which it would replace, stays
    assert not [n for n in names if n.startswith(".")], names
    assert state_tensors(optimizer_tensors(ckpts / kept, tmp_path))  # complete: the converter reads every tensor
    assert not [n for n in names if n.endswith(".optim")], names  # the failed save's temp state files are gone


def test_copy_buffer_bounds_the_copy_memory(tmp_path, monkeypatch):
    """Measured: every buffer the copy allocates, and every piece it moves, against checkpoint_copy_buffer_bytes
    (12 KiB: a 16 KiB region goes in two pieces)."""
    import weakref

    allocated, pieces, live, peak = [], [], [0], [0]
    real_empty, real_write = background.aligned_empty, BackgroundCopy._write

    def freed(nbytes):
        live[0] -= nbytes

    def empty(nbytes, *a, **k):
        allocated.append(nbytes)
        buffer = real_empty(nbytes, *a, **k)
        live[0] += nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(buffer, freed, nbytes)
        return buffer

    def write(out, piece, offset, name):
        pieces.append(piece.numel())
        return real_write(out, piece, offset, name)

    monkeypatch.setattr(background, "aligned_empty", empty)
    monkeypatch.setattr(BackgroundCopy, "_write", staticmethod(write))
    strategy = background_strategy(tmp_path, checkpoint_copy_buffer_bytes=12 << 10)
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False, limit_train_batches=4,
                callbacks=[_SaveTwice(tmp_path / "a.ckpt", tmp_path / "b.ckpt")])
    t.fit(MLP())
    copies = [r for r in strategy.checkpoint_saves if r.path == "background"]
    assert len(copies) == 2 and set(allocated) == {12 << 10}  # buffers of the configured size only
    assert peak[0] == 12 << 10  # ... and never two alive at once (one per copy; the second save joins or follows)
    assert max(pieces) == 12 << 10 and min(pieces) < 12 << 10  # pieces fill the buffer, never more
    state = sum(off.state_bytes for off in strategy.offloaded)
    assert sum(pieces) >= 2 * state  # ... and carried all the state


def test_cases_the_background_copy_does_not_cover_stream_and_say_why(tmp_path):
    """A striped store (``store_dir`` a list) streams under ``"background"``, saying why; under ``"auto"`` it takes
    the reflink path's choice (clones unit by unit where the filesystem has reflinks, tested on XFS in
    test_checkpoint_reflink_stripes.py; here, without them, streamed with the filesystem's reason); a save after fit
    streams (the store is reopened for it alone); data parallel refuses the setting by name."""
    for copy in ("background", "auto"):
        strategy = NVMeOffloadStrategy(store_dir=[str(tmp_path / copy / "s0"), str(tmp_path / copy / "s1")],
                                       chunk_bytes=16 << 10, stripe_bytes=4096, checkpoint_copy=copy)
        t = trainer(tmp_path / copy, strategy, 1, enable_checkpointing=False, limit_train_batches=2,
                    callbacks=[_SaveTwice(tmp_path / copy / "a.ckpt", tmp_path / copy / "b.ckpt")])
        t.fit(MLP())
        record = strategy.checkpoint_saves[0]
        if copy == "background":
            assert record.path == "streamed" and "striped over several files" in record.reason, record
        else:
            support = reflink.probe(str(tmp_path / copy))
            assert record.path == ("reflink" if support.supported else "streamed"), (record, support)
            assert support.supported or support.reason in record.reason, (record, support)
    strategy = background_strategy(tmp_path)
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False, limit_train_batches=2)
    t.fit(MLP())
    t.save_checkpoint(tmp_path / "after.ckpt")
    assert strategy.checkpoint_saves[-1].path == "streamed"
    assert "reopened for this save only" in strategy.checkpoint_saves[-1].reason
    with pytest.raises(ConfigError, match="checkpoint_copy.*single-device only"):
        NVMeOffloadDDPStrategy(checkpoint_copy="background")


def test_offload_params_weights_beside_the_file_are_copied_too_and_resume_bitwise(tmp_path, tmp_path_factory, gate):
    """``offload_params`` with the weights beside the file (``inline_weights_bytes=0``), saved at the end of epoch 0
    while epoch 1 rewrites the block regions: the weights file and the optimizer state equal a streamed save of that
    instant and in-memory Lightning's weights at that step; a resume in a new process is bitwise in-memory
    Lightning's resume of that instant."""
    from _param_offload_model import TinyGPT
    from test_param_offload import offload, resumed_in_memory
    from test_param_offload import reference as param_reference
    from test_param_offload import trainer as param_trainer

    _, snapshots = param_reference(tmp_path_factory)
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    strategy = offload(tmp_path, inline_weights_bytes=0, checkpoint_copy="background")
    hold = _SaveThenHold(gate, a, b, steps=3)
    param_trainer(tmp_path / "run", strategy, callbacks=[hold]).fit(TinyGPT())
    assert [r.path for r in strategy.checkpoint_saves] == ["streamed", "background"]
    copy = hold.copy
    assert hold.uncommitted_while_held and copy is not None and copy.committed
    assert any(name.startswith("params/") for name in copy.copied_by_barrier)  # block regions raced too
    assert "weights.safetensors" in strategy.checkpoint_saves[-1].files
    assert_saves_equal_the_instant(a, b, snapshots[16], tmp_path)
    assert_tiny_gpt_resumes_bitwise(a, tmp_path / "resume", tmp_path, resumed_in_memory(tmp_path), after_step=16)


def test_space_plan_counts_the_saves_of_one_instant_in_progress_together(tmp_path):
    """Joined background saves (top-k and ``last`` of one instant) both exist beside the checkpoints they replace
    until the copy commits: one more checkpoint than a save at a time."""
    from types import SimpleNamespace

    from lightning_nvme.preflight.checkpoint_space import checkpoint_plans

    trainer_ = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_top_k=1,
                                                                     save_last=True)])
    assert [p.kept for p in checkpoint_plans(trainer_, 100)[0]] == [3]  # top-k + last + the one in progress
    assert [p.kept for p in checkpoint_plans(trainer_, 100, together=True)[0]] == [4]
    trainer_.checkpoint_callbacks = [ModelCheckpoint(dirpath=str(tmp_path), save_top_k=3, monitor="step")]
    assert [p.kept for p in checkpoint_plans(trainer_, 100, together=True)[0]] == [4]


class _SecondSaveShort(_SaveThenHold):
    """The first background save's copy is held; the disk then has room for a second save's own bytes but not for
    those and the first copy's bytes still to come (its files are sparse until copied): the second is refused."""

    def __init__(self, gate: Gate, a, a2, monkeypatch) -> None:
        super().__init__(gate, a, None)
        self.a2, self.monkeypatch = str(a2), monkeypatch
        self.refused: str | None = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if trainer.current_epoch != 0:
            return
        import shutil
        from types import SimpleNamespace

        from lightning_nvme.checkpoint import record

        strategy = trainer.strategy
        own = sum(off.state_bytes for off in strategy.offloaded) + sum(
            p.numel() * p.element_size() for p in pl_module.state_dict().values())
        pending = self.copy.bytes_pending
        assert pending > 0 and self.copy.in_flight
        real = shutil.disk_usage(str(self.a2 + "x").rsplit("/", 1)[0])
        self.monkeypatch.setattr(record, "shutil", SimpleNamespace(
            disk_usage=lambda p: real._replace(free=own + pending - 1)))
        try:
            trainer.save_checkpoint(self.a2)
        except record.CheckpointSpaceError as e:
            self.refused = str(e)
        self.monkeypatch.setattr(record, "shutil", shutil)
        self.gate.release()  # the run ends here: let the first copy commit


def test_a_save_beside_a_copy_in_flight_counts_its_bytes_still_to_come(tmp_path, gate, monkeypatch):
    a, a2 = tmp_path / "a.ckpt", tmp_path / "a2.ckpt"
    strategy = background_strategy(tmp_path)
    hold = _SecondSaveShort(gate, a, a2, monkeypatch)
    trainer(tmp_path, strategy, 1, enable_checkpointing=False, callbacks=[hold]).fit(MLP())
    assert hold.refused is not None and "nothing was written" in hold.refused, hold.refused
    assert not os.path.exists(a2) and not os.path.exists(str(a2) + ".optim")
    assert os.path.exists(a) and hold.copy is not None and hold.copy.committed  # the first is untouched
