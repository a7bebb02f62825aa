"""The optimizer state's copies between the device and the pinned ring (issue #33, finding 3), run on CPU
through the fake CUDA (``tests/fake_cuda.fake_cuda_optimizer``).

Why: with the parameters on a device, the updated state goes back to the host once per key per piece, and with
``overlap="backward"`` inside autograd hooks. A blocking copy there stops the host until the device has finished
everything queued before it, so backward cannot run ahead. The copies are now queued on a side stream that
waits for the update's event, non-blocking, into the ring buffer; each device tensor is ``record_stream``-ed on
that stream; the store write is issued only after the copies' event has completed. ``FakeOps`` events complete
only when synchronized, so a write issued before its copies are known complete shows as a missing ``sync``.
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FAKE_DEVICE, fake_cuda_optimizer, fake_device, on_host, to_fake_device

from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.optim.formats.state_format import RoundTripOptimizer, StateFormat
from lightning_nvme.store import FlatStore

STEPS = 3


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 4)).to(dtype)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS,
           device: torch.device | None = None) -> None:
    torch.manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 32).to(dtype)
        x = x if device is None else x.to(device)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        opt.step(closure)


def _in(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    ptr = t.data_ptr()
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() for b in buffers)


def _run(tmp_path, monkeypatch, fmt: StateFormat, overlap: str, delay_s: float = 0.0):
    made = fake_cuda_optimizer(monkeypatch, delay_s)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    model = _model()
    off = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), store, chunk_bytes=8 << 10,
                             overlap=overlap, fmt=fmt)
    assert made, "the offloaded optimizer made no device-copy ops (no optim.buffers.copy_ops_for seam)"
    ops = made[-1]
    ring = [b.data for b in off.ring._free]  # every buffer of the ring (none is taken yet)
    real_write, real_copy = store.write, ops.copy
    ops.kinds = []  # (stream, dst in the ring, src on the host) of each copy, classified when it is queued

    def classified(dst, src):
        host = ring + [off.updater.arena._buf]  # what a copy to the device reads: the ring, or state decoded from it
        ops.kinds.append((ops.current().name, _in(dst, ring), _in(src, host)))
        real_copy(dst, src)

    ops.copy = classified

    def logged_write(region, data):
        ops.log.append(("write", region))
        return real_write(region, data)

    store.write = logged_write  # type: ignore[method-assign]
    _train(model, off.optimizer)
    off.close()
    store.close()
    return model, off, ops


def _reference(fmt: StateFormat, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = _model(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not fmt.exact:
        RoundTripOptimizer(opt, fmt)
    _train(model, opt)
    return model


@pytest.mark.parametrize("overlap", ["step", "backward"])
@pytest.mark.parametrize("state_format", ["exact", "int8"])
def test_state_copied_back_on_a_side_stream_written_after_its_event(tmp_path, monkeypatch, overlap, state_format):
    fmt = StateFormat(state_format)
    model, off, ops = _run(tmp_path, monkeypatch, fmt, overlap)
    back = [(stream, dst_in_ring) for stream, dst_in_ring, from_host in ops.kinds if not from_host]
    up = [stream for stream, _, from_host in ops.kinds if from_host]
    assert back, "no device -> host copy of the state went through the ops"
    assert {s for s, _ in back} == {"side0"}, f"state copied back on {sorted({s for s, _ in back})}, not a side stream"
    assert up and set(up) == {"compute"}  # the copies to the device: where the update reads them
    if fmt.exact:  # straight into the pinned ring buffer (a compressed key lands in a host tensor, encoded there)
        assert all(dst_in_ring for _, dst_in_ring in back)
    # every device tensor a copy back reads is known to the allocator on the side stream
    assert ops.unprotected_uses() == []
    assert ops.device_buffers and all("side0" in ops.recorded[id(b)] for b in ops.device_buffers)
    # ordering: the side stream waits for an event of the compute stream (the update) before its copies; each
    # store write comes after the synchronization of a side-stream event recorded after the copies
    stream_of = {n: s for kind, n, *rest in ops.log if kind == "record" for s in rest}
    waited, synced, writes = False, [], 0
    for entry in ops.log:
        if entry[0] == "wait" and entry[1] == "side0":
            assert stream_of[entry[2]] == "compute"
            waited = True
        elif entry[0] == "record" and entry[2] == "side0":
            assert waited, "copies back queued on the side stream before it waited for the update"
        elif entry[0] == "sync" and stream_of.get(entry[1]) == "side0":
            synced.append(entry[1])
        elif entry[0] == "write":
            assert synced, f"store write of {entry[1]} issued before its copies' event completed"
            synced.pop(0)
            writes += 1
    assert writes == STEPS * len(off.chunks)
    reference = _reference(fmt)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_delay_on_the_optimizer_ring_leaves_training_bitwise(tmp_path, monkeypatch):
    """``gpu_check``'s stress idea on the optimizer ring: 30 ms before every copy between the device and the
    ring (``FakeOps.delay_s``); the result is still the in-memory reference's, bit for bit."""
    model, off, ops = _run(tmp_path, monkeypatch, StateFormat("int8", "fp32"), "backward", delay_s=0.03)
    assert ops.delay_s == 0.03 and len(ops.copies) > 0
    reference = _reference(StateFormat("int8", "fp32"))
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_a_step_raising_after_backward_leaves_the_ring_whole(tmp_path, monkeypatch):
    """With ``overlap="backward"`` chunks are updated inside backward; a closure raising after it leaves the last
    one's copies back pending: ``close`` (end of fit) writes it and the ring has every buffer again."""
    fake_cuda_optimizer(monkeypatch)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    model = _model()
    off = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), store, chunk_bytes=8 << 10, overlap="backward")

    def closure() -> torch.Tensor:
        model(torch.randn(8, 32)).square().mean().backward()
        raise RuntimeError("after backward")

    with pytest.raises(RuntimeError, match="after backward"):
        off.optimizer.step(closure)
    assert len(off.writeback.pending) == 1  # its copies' event was never seen complete
    off.close()
    assert not off.writeback.pending and len(off.ring._free) == off.ring.count
    store.close()


@pytest.mark.parametrize("state_format, master_format, dtype", [("exact", "fp32", torch.float32),
                                                                 ("int8", "fp32", torch.float32),
                                                                 ("exact", "bf16_sr", torch.bfloat16),
                                                                 ("int8", "bf16_sr", torch.bfloat16)])
def test_no_synchronous_copy_to_the_host_during_a_backward_update(tmp_path, monkeypatch, state_format, master_format,
                                                                  dtype):
    """The blocking copy itself (finding 3), observed: the parameters live on ``fake_cuda.FakeDevice`` (a device type
    other than CPU, so the update takes its device path; autograd runs), which records every synchronous transfer
    between the device and the host (``.cpu()``, ``copy_`` without ``non_blocking``, ``.item()``). With
    ``overlap="backward"`` the update runs inside autograd hooks: none may happen there, in any state format or
    master policy (``bf16_sr`` rounds the parameter where it lives, not through the host). On c86d0a7 this fails
    with ``copy_to_host`` at ``chunk_update.py:219`` (exact: the encode's ``copy_`` into the ring), ``to_host`` at
    ``formats/int8.py:43`` (int8), and ``to_host`` + ``copy_to_device`` at ``formats/masters.py:62,69`` (``bf16_sr``'s
    round trip through the host, still there until 84f0e68).
    The result stays bitwise the in-memory reference's."""
    fmt = StateFormat(state_format, master_format)
    fake_cuda_optimizer(monkeypatch)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    with fake_device() as device:
        device.recording = False  # building the model and the optimizer is not the update
        model = to_fake_device(_model(dtype))
        off = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), store, chunk_bytes=8 << 10,
                                 overlap="backward", fmt=fmt)
        assert next(model.parameters()).device == FAKE_DEVICE
        device.recording = True
        _train(model, off.optimizer, device=FAKE_DEVICE)
        device.recording = False
        off.close()
    store.close()
    assert device.syncs == [], f"synchronous device <-> host transfers in the update: {device.syncs[:4]}"
    reference = _reference(fmt, dtype)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p, on_host(q))
