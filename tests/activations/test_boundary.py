"""``saved_at_checkpoint_boundary`` on the torch versions whose non-reentrant checkpoint saves its inputs through a
no-op autograd Function (``torch.utils.checkpoint._NoopSaveInputs``, torch up to at least 2.11; later ones call
``_CheckpointFrame.save_inputs``). The first GPU run of ``benchmarks/gpu_check.py`` (torch 2.11) offloaded no
activation at all: that saver was not recognised. This torch may not have it, so a replica of it (its
``setup_context`` as torch 2.11 wrote it) stands in, registered as the module does when torch has one."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from lightning_nvme.activations import boundary


class _NoopSaveInputs(torch.autograd.Function):
    """torch 2.11's input saver: its forward returns an empty tensor, its context saves every tensor input."""

    @staticmethod
    def forward(*args: Any) -> torch.Tensor:
        return torch.empty((0,))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensor_indices, tensors = zip(*[(i, o) for i, o in enumerate(inputs) if isinstance(o, torch.Tensor)],
                                      strict=True)
        ctx.tensor_indices = tensor_indices
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        raise AssertionError("not reached")


class _OtherFunction(_NoopSaveInputs):
    """The same saving, from a Function that is no checkpoint's: not a boundary."""


def _boundary_flags(fn) -> list[bool]:
    flags: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        flags.append(boundary.saved_at_checkpoint_boundary())
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        fn()
    return flags


def test_inputs_saved_by_the_older_non_reentrant_saver_are_a_boundary(monkeypatch):
    monkeypatch.setattr(boundary, "_INPUT_SAVERS", (*boundary._INPUT_SAVERS, _NoopSaveInputs))
    x = torch.randn(4, 8, requires_grad=True)
    dummy = torch.empty((0,), requires_grad=True)
    assert _boundary_flags(lambda: _NoopSaveInputs.apply(dummy, {}, x * 1.0)) == [True, True]  # dummy and x
    assert _boundary_flags(lambda: _OtherFunction.apply(dummy, {}, x * 1.0)) == [False, False]


def test_this_torchs_checkpoint_inputs_are_a_boundary_and_the_ops_inside_are_not_ours():
    """Whatever saver this torch uses, a checkpoint's input reaches our hook as a boundary (both kinds); the
    tensors saved inside a non-reentrant region are caught by checkpoint's own hooks and never reach ours."""
    assert boundary.DETECTION_AVAILABLE
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    assert True in _boundary_flags(lambda: checkpoint(lambda a: torch.tanh(lin(a)), x * 1.0, use_reentrant=False))
    flags = _boundary_flags(lambda: checkpoint(lambda a: torch.tanh(lin(a)), x * 1.0, use_reentrant=True))
    assert flags and flags[0] is True
    outside = _boundary_flags(lambda: torch.tanh(lin(x * 1.0)))  # no checkpoint: saved, never a boundary
    assert outside and not any(outside)
