"""``DeskCopies``: parameter blocks kept on the desk (the device tier, ``device_memory_budget``; docs/shelf.md).

A block kept on the desk is loaded like any other the first time; at its first eviction its device copy stays, its
parameters stay bound to it and its host buffer is recycled: from then on it is neither read, copied nor written
back until ``unkeep`` (the end of fit). Why its own object: ``BlockResidency`` decides when a block is let go; what
letting go of a desk block means (and its write-back at the end) is this object's, with its arguments explicit.
"""

from __future__ import annotations

from lightning_nvme.params.block_state import BlockBuffers, BlockState, ResidencyStats, placeholders
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.params.writeback import WriteBacks


class DeskCopies:
    """Makes and lets go of blocks' desk copies, on the per-block records ``BlockResidency`` hands it.

    Args:
        buffers: host buffers for a desk copy's write-back.
        writebacks: where that write-back goes.
        stats: the residency's counters (``kept_blocks``, ``kept_bytes``, ``bound_blocks``).
    """

    def __init__(self, buffers: BlockBuffers, writebacks: WriteBacks, stats: ResidencyStats) -> None:
        self.buffers = buffers
        self.writebacks = writebacks
        self.stats = stats

    def keep_bound(self, block: BlockLayout, st: BlockState) -> None:
        """The block's last holder let go: its device copy stays (parameters bound), its host buffer goes."""
        assert st.buffer is not None  # evicting a block in memory
        if not st.shelved and st.device is not st.buffer:
            self.buffers.transfer.recycle(st.buffer)
        self.stats.count_in_memory(block, st.base, -1)
        st.kept, st.buffer, st.read, st.uploaded, st.shelved = st.device, None, None, None, False
        st.refs.clear()
        self.stats.kept_blocks += 1
        self.stats.kept_bytes += block.nbytes

    def unkeep(self, block: BlockLayout, st: BlockState, write: bool = True) -> None:
        """Let go of the block's device copy (the end of fit), written back to the store first if it changed and
        ``write``; the parameters get placeholders."""
        st.desk = False
        if st.kept is None:
            return
        if +st.refs:
            raise RuntimeError(f"block {block.name} is held ({dict(st.refs)}); its device copy cannot go (a bug)")
        if write and st.dirty:
            buf = self.buffers.new(block)
            self.writebacks.add(block, buf, 0 if st.dirty_whole else block.writable_offset,
                                self.buffers.transfer.to_host(st.kept, buf))
        self.stats.kept_blocks -= 1
        self.stats.kept_bytes -= block.nbytes
        self.stats.count_bound(-1)
        st.kept, st.device, st.bound, st.dirty, st.dirty_whole = None, None, False, False, False
        placeholders(block)
