"""Issue #33, item 8: an exception raised inside a training step with offloaded parameters (in a block's forward,
in its backward, inside an optimizer update) leaves no block held or resident, no host range registered with
CUDA and no device copy alive once Lightning has torn the run down. Checked on CPU through the fake CUDA
(``fake_cuda``: ``CudaTransfer``'s logic, registrations counted, device copies as CPU buffers it can count)."""

from __future__ import annotations

import gc

import pytest
import torch
from _param_offload_model import TinyGPT
from fake_cuda import fake_cuda_transfer
from lightning.pytorch import Callback
from test_param_offload import offload, trainer

from lightning_nvme.optim.chunk_update import ChunkUpdater


class Boom(RuntimeError):
    pass


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Boom("injected in backward")


class Inject(Callback):
    """At the second step: raise where asked, and keep the residency to look at after teardown."""

    def __init__(self, where: str, monkeypatch) -> None:
        self.where, self.monkeypatch, self.residency = where, monkeypatch, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.residency = trainer.strategy.param_offload.residency
        if batch_idx != 1:
            return
        block = pl_module.model.transformer.h[1]
        if self.where == "forward":
            def pre(module, args):  # after the scheduler's pre-hook: the block is held for its forward
                raise Boom("injected in forward")
            block.register_forward_pre_hook(pre)
        elif self.where == "backward":
            block.register_forward_hook(lambda module, args, out: _RaiseInBackward.apply(out))
        else:
            def fail(self, chunk, buf):
                raise Boom("injected in an update")
            self.monkeypatch.setattr(ChunkUpdater, "_run_inner_step", fail)


@pytest.mark.parametrize("where,overlap", [("forward", "backward"), ("backward", "backward"),
                                           ("update", "backward"), ("update", "step")])
def test_exception_in_a_step_leaves_nothing_held(tmp_path, monkeypatch, where, overlap):
    rt, made = fake_cuda_transfer(monkeypatch)
    inject = Inject(where, monkeypatch)
    t = trainer(tmp_path, offload(tmp_path, overlap=overlap), steps=4, callbacks=[inject])
    with pytest.raises(Boom):
        t.fit(TinyGPT(checkpointing=True))
    res = inject.residency
    assert res is not None and len(made) == 1
    gc.collect()
    assert [b.name for b in res.blocks if +res.holders(b)] == []  # no hold left
    assert res.resident_blocks == []  # no block in memory, its pool buffer returned
    assert rt.live == {}  # no host range still registered with CUDA
    for off in t.strategy.offloaded:  # every ring buffer back (a failed update gave its buffer back unwritten)
        assert len(off.ring._free) == off.ring.count
    if (where, overlap) == ("update", "backward"):
        # The update raised inside backward, during the recomputation of a checkpointed block: torch's
        # checkpoint frame still holds the recomputed weight views (a cycle through autograd's C++ nodes that
        # gc cannot collect, as without offload), so that one device copy stays allocated.
        assert made[0].ops.live_device_buffers() <= 1
    else:
        assert made[0].ops.live_device_buffers() == 0  # device memory back: no device copy alive
