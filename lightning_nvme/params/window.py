"""``LayerMajorWindow``: streamed evaluation that reads each block once per window of batches, not once per batch.

Why (FlexGen's zig-zag schedule): a block read from disk costs the same whether one batch or many pass through
it; with ``eval_window=W`` the W batches of a window pass through block *i* before block *i+1* is read, so the bytes
read per scored token fall by W. What it needs from the model, checked rather than assumed:

1. *capture*: each batch's step runs until its first block is called; the block's arguments are kept (the hidden
   state entering block 0 and the keyword arguments every block receives: masks, position embeddings) and the step
   is abandoned there. The code before the first block (embedding) must have no side effects (it runs twice).
2. *compute*: block by block, each read once (``ForwardStream.bind``), every batch's hidden state goes through it
   with the captured arguments; the activations between blocks stay in RAM, within ``eval_activation_bytes``
   (refused by name above it: fewer batches per window fit).
3. *serve*: the loop then runs each batch's step for real; its blocks return what was computed (the last block the
   final hidden state, the others their input, passed through) after checking that the model calls them exactly as
   captured: block 0 with equal arguments, block *i+1* with block *i*'s output itself, the same keyword arguments.
   A model that does anything else between its blocks is refused by name (``eval_window=1`` serves it), never served
   numbers computed for other inputs. Each block runs the same operations on the same inputs as in the batch-by-batch
   forward, so the outputs are bitwise the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_nvme.checks import ConfigError
from lightning_nvme.params.stream import ForwardStream

NOT_SEQUENTIAL = ("eval_window={window}: {what}. The layer-major window serves models that call their blocks one "
                  "after the other, each on the previous block's output with the same other arguments. Fix: "
                  "eval_window=1 (each batch through every block).")


class _Captured(Exception):
    """Raised by the first block during a capture: the step stops there."""


@dataclass
class _Call:
    args: tuple
    kwargs: dict


def same(a: Any, b: Any) -> bool:
    """Equal values (tensors bitwise, containers element-wise, other objects by ``==``)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    try:
        return a is b or bool(a == b)
    except Exception:  # an object without a usable ==: only itself is equal
        return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class LayerMajorWindow:
    """Args:
        stream: the evaluation's ``ForwardStream`` (its reads are counted there).
        window: batches per window (``eval_window``).
        budget: bytes the window's activations between blocks may occupy (``eval_activation_bytes``).
    """

    def __init__(self, stream: ForwardStream, window: int, budget: int) -> None:
        self.stream = stream
        self.window = window
        self.budget = budget
        self.windows = 0  # windows computed
        self.peak_activation_bytes = 0
        self.compute_s = 0.0  # seconds in the blocks' forwards (what a window costs without its reads)
        self.read_wait_s = 0.0  # seconds waiting for a block's read (the rest overlaps the compute)
        self._calls: list[_Call] = []
        self._final: list[Any] = []
        self._rest: list[tuple[Any, list[Any]]] = []  # per block: its output's structure and non-tensor leaves
        self._served = 0  # batches of the window whose step has run
        self._next = 0  # block expected next in the step being served
        self._last: Any = None  # what the previous block returned in that step

    @property
    def serving(self) -> bool:
        return self._served < len(self._final)

    # ---- 1. capture ---------------------------------------------------------------------------------------
    def capture(self, run: Callable[[], Any]) -> None:
        """Run a batch's step up to its first block; keep that call's arguments."""
        got: list[_Call] = []

        def first(*args: Any, **kwargs: Any) -> Any:
            got.append(_Call(args, kwargs))
            raise _Captured

        with self._forwards({0: first}), self.stream.paused():
            try:
                run()
            except _Captured:
                pass
        if not got:
            raise ConfigError("eval_window", NOT_SEQUENTIAL.format(
                window=self.window, what=f"the step never called the first block {self.stream.blocks[0].name}"))
        if not got[0].args or not torch.is_tensor(got[0].args[0]):
            raise ConfigError("eval_window", NOT_SEQUENTIAL.format(
                window=self.window, what=f"{self.stream.blocks[0].name} is not called with the hidden state as its "
                                         "first positional argument"))
        self._calls.append(got[0])

    # ---- 2. compute ---------------------------------------------------------------------------------------
    def compute(self) -> None:
        """Every captured batch through every block, each block read once."""
        hidden = [c.args[0] for c in self._calls]
        blocks = self.stream.blocks
        self._rest = []
        outputs: list[Any] = []
        for block in blocks:
            t0 = time.perf_counter()
            self.stream.bind(block)
            for ahead in blocks[block.index + 1:block.index + 1 + self.stream.prefetch]:
                self.stream.request(ahead)
            t1 = time.perf_counter()
            outputs = []
            with self.stream.paused():
                for h, call in zip(hidden, self._calls):
                    outputs.append(block.module(h, *call.args[1:], **call.kwargs))
            self.read_wait_s += t1 - t0
            self.compute_s += time.perf_counter() - t1
            self.stream.unbind(block)
            self.stream.stats.forwards += len(outputs)
            leaves, spec = tree_flatten(outputs[0])
            others = leaves[1:]
            if not leaves or not torch.is_tensor(leaves[0]) or any(torch.is_tensor(x) for x in others):
                raise ConfigError("eval_window", NOT_SEQUENTIAL.format(
                    window=self.window, what=f"{block.name} returns {type(outputs[0]).__name__} with more than one "
                                             "tensor (only a hidden state can be passed on)"))
            self._rest.append((spec, others))
            hidden = [tree_flatten(o)[0][0] for o in outputs]
            held = 2 * sum(_nbytes(h) for h in hidden) + sum(_nbytes(c.args[0]) for c in self._calls)
            self.peak_activation_bytes = max(self.peak_activation_bytes, held)
            if held > self.budget:
                raise ConfigError("eval_window", f"eval_window={self.window}: the window's activations between "
                                  f"blocks take {held} bytes, more than eval_activation_bytes={self.budget}. Fix: a "
                                  "smaller eval_window (or smaller batches), or a larger eval_activation_bytes.")
        self._final = outputs
        self._served, self._next = 0, 0
        self.windows += 1

    # ---- 3. serve -----------------------------------------------------------------------------------------
    @contextmanager
    def serve(self) -> Iterator[None]:
        """Inside, the blocks return what ``compute`` computed, for the window's batches in order."""
        with self._forwards({b.index: self._replay(b.index) for b in self.stream.blocks}), self.stream.paused():
            yield

    def finish_step(self) -> None:
        """One batch's step is over: it must have gone through every block."""
        if self._next != 0:
            raise ConfigError("eval_window", NOT_SEQUENTIAL.format(
                window=self.window, what=f"the step stopped after block {self.stream.blocks[self._next - 1].name}"))

    def clear(self) -> None:
        self._calls, self._final, self._rest, self._last = [], [], [], None
        self._served, self._next = 0, 0

    def _replay(self, index: int) -> Callable[..., Any]:
        name = self.stream.blocks[index].name
        last = len(self.stream.blocks) - 1

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._served >= len(self._final) or index != self._next:
                raise ConfigError("eval_window", NOT_SEQUENTIAL.format(
                    window=self.window, what=f"{name} was called out of order"))
            call = self._calls[self._served]
            if index == 0:
                ok = same(args, call.args) and same(kwargs, call.kwargs)
            else:
                ok = bool(args) and args[0] is self._last and same(args[1:], call.args[1:]) and same(kwargs, call.kwargs)
            if not ok:
                raise ConfigError("eval_window", NOT_SEQUENTIAL.format(
                    window=self.window, what=f"{name} was called with other arguments than when its window was "
                                             "computed"))
            if index == last:
                out = self._final[self._served]
                self._served += 1
                self._next = 0
                self._last = None
                return out
            spec, others = self._rest[index]
            out = tree_unflatten([args[0], *others], spec)
            self._last = args[0]
            self._next = index + 1
            return out
        return forward

    @contextmanager
    def _forwards(self, replace: dict[int, Callable[..., Any]]) -> Iterator[None]:
        """The blocks' ``forward`` replaced (an instance attribute; the class's comes back after)."""
        modules = [(self.stream.blocks[i].module, fn) for i, fn in replace.items()]
        own = [m.__dict__.get("forward") for m, _ in modules]  # a forward set on the instance before us
        for module, fn in modules:
            module.forward = fn
        try:
            yield
        finally:
            for (module, _), before in zip(modules, own):
                if before is None:
                    del module.forward
                else:
                    module.forward = before
