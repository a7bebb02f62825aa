"""The activation offloader's arguments, each defined once: name, type, default, check and a one-line doc.

``ActivationOffloader`` reads them as ``config.<name>``; ``NVMeActivationOffload`` (the callback) takes them
as keyword arguments, adds those of its own store, and gets its signature and docstring from them
(``lightning_nvme.settings.with_settings``); ``conf/callbacks/activation_offload.yaml`` is checked against
them by a test. A bad value raises ``ConfigError(key, message)`` when the dataclass is built.
"""

from __future__ import annotations

import dataclasses

from lightning_nvme.checks import check_fields, count, nbytes, one_of, setting
from lightning_nvme.constants import MiB

SCOPES = ("checkpoint", "all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationSettings:
    """What is offloaded, and the memory budgets of the writes and reads in flight."""

    scope: str = setting(
        "checkpoint", "``\"checkpoint\"``: the inputs of ``torch.utils.checkpoint`` regions; ``\"all\"``: any saved "
                      "tensor of at least ``min_bytes``.", one_of(*SCOPES))
    min_bytes: int = setting(
        1 * MiB, "Smaller storages stay in memory (the I/O would cost more than it saves).",
        nbytes(0, typical=str(1 * MiB)))
    keep_last: int = setting(
        1, "The last N saved storages stay in memory: backward needs them first.", count(0, "1"))
    prefetch_depth: int = setting(
        2, "Reads issued ahead of backward, in reverse save order.", count(0, "2"))
    write_inflight_bytes: int = setting(
        256 * MiB, "Bytes of activations waiting for their write, at most; forward waits above it.",
        nbytes(1, typical=str(256 * MiB)))
    prefetch_bytes: int = setting(
        512 * MiB, "Bytes of read-ahead buffers, at most (one read is always allowed).",
        nbytes(1, typical=str(512 * MiB)))
    min_segment_bytes: int = setting(
        256 * MiB, "The activation area of the store grows by at least this much (``ActivationArena``).",
        nbytes(1, typical=str(256 * MiB)))

    def __post_init__(self) -> None:
        check_fields(self)
