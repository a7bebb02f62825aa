"""``HookStack``: the offloader's pack/unpack hooks on autograd's stack of saved-tensor hooks.

Why a class of its own: the stack is shared with everyone else's ``saved_tensors_hooks`` (checkpoint's
among them) and may only be popped from the top. After an exception, hooks entered above ours may still
be there: checkpoint generators the exception left suspended are closed first (``boundary``), and if
foreign hooks remain, ours are left in place as an "orphan" (passing tensors through, since the offloader
is idle) and removed as soon as they are on top again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_nvme.activations.boundary import close_abandoned_checkpoints

log = logging.getLogger(__name__)


class HookStack:
    """Pushes ``pack``/``unpack`` as saved-tensor hooks for a forward, and takes them off again."""

    def __init__(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> None:
        self._pack = pack
        self._unpack = unpack
        self._hooks: saved_tensors_hooks | None = None
        self._orphan: saved_tensors_hooks | None = None  # ours, left under someone else's after an exception

    @property
    def installed(self) -> bool:
        return self._hooks is not None

    def push(self) -> None:
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def on_top(self, hooks: saved_tensors_hooks | None = None) -> bool:
        hooks = hooks or self._hooks
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return hooks is not None and top is not None and top[0] is hooks.pack_hook

    def pop(self, strict: bool = True) -> None:
        """Remove our hooks. ``strict``: raise if they are not on top (they stay recorded, so a later
        ``pop(strict=False)`` can still remove them); otherwise leave them as an orphan."""
        hooks = self._hooks
        if hooks is None:
            return
        if not self.on_top(hooks):
            if strict:
                raise RuntimeError("NVMe activation offload: the innermost saved_tensors_hooks are not ours; a "
                                   "saved_tensors_hooks context entered during forward was not exited before backward")
            # Someone else's hooks sit above ours. Ours now pass everything through (phase "idle");
            # they are removed as soon as they are on top again (next step or cleanup).
            self._orphan, self._hooks = hooks, None
            log.warning("NVMe activation offload: other saved_tensors_hooks are still active above ours after an "
                        "exception; ours pass tensors through until they can be removed")
            return
        self._hooks = None
        hooks.__exit__(None, None, None)

    def pop_after(self, exc: BaseException | None, *, strict: bool) -> None:
        """``pop`` at the end of a step, which ``exc`` (if any) may have cut short: first close the
        checkpoint regions it abandoned with their hooks above ours."""
        if self._hooks is None:
            return
        if not self.on_top():
            close_abandoned_checkpoints(exc)
        self.pop(strict=strict)

    def pop_orphan(self) -> None:
        if self._orphan is not None and self.on_top(self._orphan):
            self._orphan.__exit__(None, None, None)
            self._orphan = None
