"""Validated settings of parameter offload (``NVMeOffloadStrategy(offload_params=True, ...)``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSettings:
    """Args:
        offload_params: parameters of each block live in the store between uses.
        param_prefetch: blocks read ahead of need (forward order, then reverse order in backward).
        param_block_classes: module classes (or dotted import paths) that are blocks; ``None``: each
            child of the largest ``nn.ModuleList``/``nn.Sequential`` (a transformer's layer list).
        restore_params: at the end of fit, bring the weights back into the module (memory: the whole
            model); ``False`` keeps them in the store, and ``state_dict()`` after fit raises.
    """

    offload_params: bool = False
    param_prefetch: int = 1
    param_block_classes: Sequence[type | str] | None = None
    restore_params: bool = True

    def __post_init__(self) -> None:
        def fail(key: str, why: str) -> None:
            raise ValueError(f"nvme_offload: invalid {key}={getattr(self, key)!r}: {why}")

        if not isinstance(self.offload_params, bool):
            fail("offload_params", "must be True or False")
        if not isinstance(self.param_prefetch, int) or isinstance(self.param_prefetch, bool) or self.param_prefetch < 0:
            fail("param_prefetch", "must be an integer >= 0 (blocks read ahead of need)")
        if self.param_block_classes is not None and (isinstance(self.param_block_classes, str)
                                                     or not len(self.param_block_classes)):
            fail("param_block_classes", "must be a non-empty list of module classes or dotted paths, or None")
        if not isinstance(self.restore_params, bool):
            fail("restore_params", "must be True or False")
