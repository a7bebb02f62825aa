"""The budget planner: which store regions (parameter blocks, optimizer chunks) stay on the shelf (host RAM)
under ``host_memory_budget`` and which go to the SSD; which parameter blocks stay on the desk (GPU memory) under
``device_memory_budget``.

Why a plan and not "whatever fits": RAM is worth most where it saves most disk traffic per byte, so
regions are taken greedily by the I/O bytes a step spends on them per byte they hold (a trainable block:
read twice, its trainable tail written once; a frozen block: read twice; an optimizer chunk: read once and
written once; compressed formats count their stored bytes). A region on the shelf is never read from or
written to the disk during training (``lightning_nvme.store.shelf``). Pure bookkeeping: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning_nvme.constants import GiB, MiB
from lightning_nvme.memory import available_host_memory

# ``host_memory_budget="auto"``: this share of the memory available at setup, less a fixed headroom for
# the data loader, activations, gradients, the offload's own buffers and the OS (docs/shelf.md).
AUTO_SHARE = 0.6
AUTO_HEADROOM = 2 * GiB


@dataclass(frozen=True)
class Item:
    """One store region a step moves: ``nbytes`` held (what RAM would hold), read ``reads`` times whole and
    ``written`` bytes of it written back per step."""

    region: str
    nbytes: int
    reads: int
    written: int
    kind: str  # "block" (parameters) or "chunk" (optimizer state): for the summary

    @property
    def io_bytes(self) -> int:
        """Disk bytes one step spends on this region when it is on the SSD."""
        return self.reads * self.nbytes + self.written

    @property
    def density(self) -> float:
        return self.io_bytes / self.nbytes if self.nbytes else 0.0


def block_item(region: str, nbytes: int, writable_offset: int, trainable: bool) -> Item:
    """A parameter block: read in forward and in backward, its trainable tail written back after its update."""
    return Item(region, nbytes, 2, nbytes - writable_offset if trainable else 0, "block")


def desk_block_item(region: str, nbytes: int, trainable: bool) -> Item:
    """A parameter block as the GPU sees it (``device_memory_budget``): copied up for its forward and its
    backward, and after an update the whole device copy comes back down before the write-back."""
    return Item(region, nbytes, 2, nbytes if trainable else 0, "block")


def chunk_item(region: str, nbytes: int) -> Item:
    """An optimizer chunk (stored bytes): read and written once per step."""
    return Item(region, nbytes, 1, nbytes, "chunk")


@dataclass
class TierPlan:
    """A plan for one near tier of ``budget`` bytes: the regions kept there (``kept``), greedily by the bytes a
    step would otherwise move per byte they hold; the rest stream through the tier every step. The tiers
    (docs/shelf.md): the desk (GPU memory, ``DeskPlan``), the shelf (host RAM, ``ShelfPlan``), the warehouse (the
    SSD store)."""

    budget: int
    items: list[Item] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)

    @property
    def kept_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.region in self.kept)

    @property
    def streamed_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.region not in self.kept)

    @property
    def io_before(self) -> int:
        """Bytes moved per step with nothing kept (a budget of 0)."""
        return sum(i.io_bytes for i in self.items)

    @property
    def io_after(self) -> int:
        """Bytes moved per step with this plan."""
        return sum(i.io_bytes for i in self.items if i.region not in self.kept)

    def extend(self, items: Iterable[Item]) -> list[str]:
        """Add regions (parameters added mid-run, or planned after setup) and keep them greedily in what is
        left of the budget; returns the regions newly kept."""
        known = {i.region for i in self.items}
        new = [i for i in items if i.region not in known]
        self.items.extend(new)
        left = self.budget - self.kept_bytes
        placed: list[str] = []
        # densest first; stable on ties so the plan is the same on every run of one model
        for item in sorted(new, key=lambda i: -i.density):
            if 0 < item.nbytes <= left and item.io_bytes > 0:
                placed.append(item.region)
                left -= item.nbytes
        self.kept.update(placed)
        return placed

    def count(self, kind: str, kept: bool) -> int:
        return sum(1 for i in self.items if i.kind == kind and (i.region in self.kept) == kept)


class ShelfPlan(TierPlan):
    """``host_memory_budget``'s plan: the regions (blocks and chunks) kept on the shelf, in host RAM; the rest are
    read from and written to the SSD each step."""

    def as_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "shelf_bytes": self.kept_bytes, "ssd_bytes": self.streamed_bytes,
                "blocks_on_shelf": self.count("block", True), "blocks_on_ssd": self.count("block", False),
                "chunks_on_shelf": self.count("chunk", True), "chunks_on_ssd": self.count("chunk", False),
                "io_bytes_per_step_before": self.io_before, "io_bytes_per_step_after": self.io_after}

    def summary(self) -> str:
        d = self.as_dict()
        return (f"host_memory_budget={_shown(self.budget)}: {_shown(d['shelf_bytes'])} on the shelf in RAM ("
                f"{d['blocks_on_shelf']} blocks, {d['chunks_on_shelf']} chunks), {_shown(d['ssd_bytes'])} on the SSD "
                f"({d['blocks_on_ssd']} blocks, {d['chunks_on_ssd']} chunks); disk I/O per step "
                f"{_shown(self.io_before)} -> {_shown(self.io_after)}")


class DeskPlan(TierPlan):
    """``device_memory_budget``'s plan: the parameter blocks kept on the desk (GPU memory) by the same rule,
    host <-> device copy bytes saved per byte of device memory. A block kept there is copied up once and never
    again until the end of fit: when every block fits, the parameters never leave the device and only the
    optimizer state streams."""

    def as_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "desk_bytes": self.kept_bytes, "streamed_bytes": self.streamed_bytes,
                "blocks_on_desk": self.count("block", True), "blocks_streamed": self.count("block", False),
                "copy_bytes_per_step_before": self.io_before, "copy_bytes_per_step_after": self.io_after}

    def summary(self) -> str:
        d = self.as_dict()
        return (f"device_memory_budget={_shown(self.budget)}: {_shown(d['desk_bytes'])} of parameter blocks kept on "
                f"the desk (GPU memory; {d['blocks_on_desk']} blocks), {_shown(d['streamed_bytes'])} streamed "
                f"({d['blocks_streamed']} blocks); host <-> device copies per step {_shown(self.io_before)} -> "
                f"{_shown(self.io_after)}")


def plan_desk(items: Iterable[Item], budget: int) -> DeskPlan:
    """``plan_shelf`` for the GPU: blocks only (the optimizer state stays on the host and streams)."""
    plan = DeskPlan(budget)
    plan.extend(i for i in items if i.kind == "block")
    return plan


def _shown(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def plan_shelf(items: Iterable[Item], budget: int) -> ShelfPlan:
    """Greedy by I/O bytes saved per byte of RAM (the fractional knapsack's order; a region that no longer
    fits is skipped and smaller ones after it may still fit)."""
    plan = ShelfPlan(budget)
    plan.extend(items)
    return plan


def resolve_budget(value: int | str, available: int | None = None) -> int:
    """``host_memory_budget`` in bytes: an int as given; ``"auto"``: ``AUTO_SHARE`` of the available memory
    less ``AUTO_HEADROOM`` (never negative)."""
    if value != "auto":
        return int(value)
    free = available_host_memory() if available is None else available
    return max(0, int(free * AUTO_SHARE) - AUTO_HEADROOM)
