"""``BlockResidency``: which blocks' parameters are in memory, and moving them to and from the store.

A block is resident while anyone holds a reference to it (its forward, its backward, an optimizer
update waiting for it); the last release writes it back if an update changed it and swaps its
parameters' ``.data`` for placeholders. Reads are issued ahead (``prefetch``) into page-aligned host
buffers; memory is bounded by the hold/prefetch rules of ``BlockScheduler`` plus ``max_pending_writes``
buffers whose write-back is still in flight. What the parameters point at while a block is bound is the
``BlockTransfer``'s business (``lightning_nvme.params.transfer``): the host buffer itself on CPU, a device copy
on CUDA, written back through the host buffer once its copy has completed.

A block *kept* on the desk (the device tier: ``keep``, ``device_memory_budget``) is loaded like any other the
first time; at its first eviction its device copy stays, its parameters stay bound to it and its host buffer is
recycled: from then on it is neither read, copied nor written back until ``unkeep`` (the end of fit).
Its device copy is then the truth (``read_values`` and ``in_store`` say so).

Composed of parts with explicit arguments (FSDP2-style state objects, not mixins): the per-block records, counters
and buffer sizes (``params/block_state.py``), the bounded write-backs (``WriteBacks``, ``params/writeback.py``) and
the desk copies (``DeskCopies``, ``params/desk.py``); this class decides when a block is read, bound and let go.

An optimizer update needs only a block's trainable tail (``BlockLayout.writable_offset`` on): acquired
with ``tail=True``, a block not in memory reads just that tail, its frozen parameters stay placeholders.
Why: a LoRA update otherwise read (or kept) every frozen weight of each block its adapters' chunk spans.

A block whose frozen head is read in place (``frozen``: ``lightning_nvme.params.frozen_files``) has a store region
holding only its trainable tail: its reads are split (head from the base files, tail from the store, one ``SplitRead``
handle), its writes start at the tail (a whole-block write, after a state dict was loaded, first checks the head
still equals the file's bytes: a base file is never written).
"""

from __future__ import annotations

from collections import Counter

import torch

from lightning_nvme.params.block_state import BlockBuffers, BlockState, ResidencyStats, placeholders, view
from lightning_nvme.params.desk import DeskCopies
from lightning_nvme.params.frozen_files import FrozenFiles, split_read, wait_io
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.params.transfer import DONE, BlockTransfer, HostTransfer
from lightning_nvme.params.writeback import WriteBacks
from lightning_nvme.store import FlatStore

__all__ = ["BlockResidency", "ResidencyStats"]


class BlockResidency:
    def __init__(self, store: FlatStore, blocks: list[BlockLayout], max_pending_writes: int = 2,
                 transfer: BlockTransfer | None = None, frozen: FrozenFiles | None = None) -> None:
        self.store = store
        self.frozen = frozen
        self.blocks = blocks
        self.transfer = transfer if transfer is not None else HostTransfer()
        self.stats = ResidencyStats(transfer=self.transfer.stats)
        self.writebacks = WriteBacks(store, frozen, self.transfer, max_pending_writes, self.stats.count_written)
        self.buffers = BlockBuffers(store, frozen, self.transfer)
        self.desk = DeskCopies(self.buffers, self.writebacks, self.stats)
        self._state = [BlockState() for _ in blocks]

    # ---- first placement -----------------------------------------------------------------------------
    def place(self, block: BlockLayout, device: torch.device | None = None, tail: bool = False) -> None:
        """Copy the block's current values into the store and leave placeholders (setup), on ``device``
        (default: the parameters' own). ``tail``: only its bytes from ``writable_offset`` on are written (the
        rest is stored already and unchanged)."""
        buf = self.buffers.new(block)
        head = self.buffers.head(block)
        for slot in block.slots:
            if head is None or slot.offset >= head.nbytes:  # a head read in place: its values are the file's
                view(buf, slot).copy_(slot.param.detach())
        start = head.nbytes if head is not None else 0
        if tail:
            start = max(start, block.writable_offset if block.writable_offset < block.nbytes else buf.numel())
        self.writebacks.add(block, buf, start)
        placeholders(block, device)
        self._state[block.index].placed = True

    def placed(self, block: BlockLayout) -> bool:
        return self._state[block.index].placed

    def read_values(self, block: BlockLayout, copy: bool = True) -> dict[str, torch.Tensor]:
        """A block's true values (from memory if resident, else read from the store): copies, or with
        ``copy=False`` views of one buffer (the block's, or a fresh one read for the caller; one block of memory)."""
        st = self._state[block.index]
        if st.base and st.kept is None:  # only the trainable tail in memory: the frozen head from the store, the tail over it
            buf = self.transfer.caller_buffer(self.buffers.capacity(block))
            self.writebacks.issue(of=block)
            wait_io(self.store, split_read(self.store, self.frozen, block, buf[:st.base]))
            self._wait_read(block)
            if st.device is not None and st.copied:
                self.transfer.to_host(st.device, buf[st.base:]).synchronize()
            else:
                assert st.buffer is not None
                buf[st.base:].copy_(st.buffer)
            return {s.name: view(buf, s) for s in block.slots}
        if st.kept is not None:  # its device copy is the truth
            buf = self.transfer.caller_buffer(self.buffers.capacity(block))
            self.transfer.to_host(st.kept, buf).synchronize()
            copy = False
        elif st.buffer is not None:
            self._wait_read(block)
            buf = st.buffer
            if st.device is not None and st.copied:  # a device copy is the truth: fetch it
                buf = self.transfer.caller_buffer(self.buffers.capacity(block))
                self.transfer.to_host(st.device, buf).synchronize()
                copy = False  # the fresh buffer is the caller's already
            elif self.transfer.reuses_buffers:
                copy = True  # the resident buffer goes back to a pool when evicted: the caller gets copies
        else:
            self.writebacks.issue(of=block)
            buf = self.transfer.caller_buffer(self.buffers.capacity(block))
            wait_io(self.store, split_read(self.store, self.frozen, block, buf))
            copy = False  # the fresh buffer is the caller's already
        return {s.name: view(buf, s).clone() if copy else view(buf, s) for s in block.slots}

    # ---- residency ---------------------------------------------------------------------------------
    def is_resident(self, block: BlockLayout) -> bool:
        return self._state[block.index].buffer is not None

    def retained(self, block: BlockLayout) -> bool:
        """Its device copy outlived its last eviction (see ``BlockTransfer.retained``)."""
        return self._state[block.index].retained

    def holders(self, block: BlockLayout) -> Counter:
        return self._state[block.index].refs

    def prefetch(self, block: BlockLayout) -> None:
        st = self._state[block.index]
        if st.kept is not None:
            return
        self.writebacks.issue()
        if st.buffer is None:
            self.writebacks.issue(of=block)  # the read must see this block's last write-back
            shelved = self.store.shelved(block.region) if self.buffers.head(block) is None else None
            if shelved is not None:  # host_memory_budget: the block lives in memory, bound in place, never read
                st.buffer, st.shelved = shelved, True
            else:
                st.buffer = self.buffers.new(block)
                st.read = split_read(self.store, self.frozen, block, st.buffer)
                self.stats.loads += 1
                self.stats.bytes_read += block.nbytes
            self.stats.count_in_memory(block, st.base, +1)

    def acquire(self, block: BlockLayout, why: str, tail: bool = False) -> None:
        """Hold ``block`` in memory for ``why``; with ``tail``, only its trainable parameters are needed (an
        update): a block not in memory then reads only its trainable tail."""
        st = self._state[block.index]
        if st.kept is not None:  # bound already, nothing moves
            st.refs[why] += 1
            return
        self.upload_ready(but=block)  # reads ahead that completed meanwhile: their copies start before this wait
        if st.base and not tail:  # only the tail is in memory: write it back if changed, then read it all
            refs = Counter(st.refs)
            self.evict(block)
            st.refs.update(refs)
        if st.buffer is None:
            self.stats.sync_loads += 1
            if tail and 0 < block.writable_offset < block.nbytes and self.store.shelved(block.region) is None:
                self._load_tail(block)
            else:
                self.prefetch(block)
        self._wait_read(block)
        if not st.bound:
            assert st.buffer is not None  # loaded just above
            st.device, st.uploaded = self.transfer.to_device(st.buffer, st.uploaded), None
            for slot in block.slots:
                if slot.offset >= st.base:
                    slot.param.data = view(st.device, slot, st.base)
            st.bound = True
            self.stats.count_bound(+1)
        st.refs[why] += 1

    def _load_tail(self, block: BlockLayout) -> None:
        st = self._state[block.index]
        self.writebacks.issue(of=block)  # the read must see this block's last write-back
        st.base = block.writable_offset
        st.buffer = self.transfer.host_buffer(self.buffers.capacity(block) - st.base)
        st.read = split_read(self.store, self.frozen, block, st.buffer, st.base)
        self.stats.tail_loads += 1
        self.stats.bytes_read += st.buffer.numel()
        self.stats.count_in_memory(block, st.base, +1)

    def upload_ready(self, but: BlockLayout | None = None) -> None:
        """Start the device copy of every block read ahead whose read has completed (none on CPU): it then
        overlaps the compute before the block is needed. Device memory: at most the blocks read ahead.

        Called at each block's pre- and post-forward, pre- and post-backward and at the top of ``acquire``
        (``but`` the block acquired: its copy is not early). Why so often: at ``param_prefetch=1`` the next
        block's read is issued at a block's pre-forward, just before the check there; the post-forward check
        finds it completed, one block's compute before it is needed."""
        if not self.transfer.device_copies:
            return
        for block in self.blocks:
            st = self._state[block.index]
            if block is but or st.buffer is None or st.bound or st.uploaded is not None:
                continue
            if st.read is not None and not st.read.done():
                continue
            self._wait_read(block)  # completed: only collects it
            st.uploaded = self.transfer.upload(st.buffer)
            if st.uploaded is not None:
                self.stats.early_uploads += 1

    def release(self, block: BlockLayout, why: str) -> None:
        st = self._state[block.index]
        if st.refs[why] <= 0:
            raise RuntimeError(f"block {block.name}: release({why!r}) without a matching acquire (a bug)")
        st.refs[why] -= 1
        if not +st.refs:
            self.evict(block)

    def mark_dirty(self, block: BlockLayout, whole: bool = False) -> None:
        """Write back on eviction: the trainable tail (an update), or with ``whole`` the frozen part too."""
        st = self._state[block.index]
        st.dirty = True
        st.dirty_whole = st.dirty_whole or whole

    def evict(self, block: BlockLayout) -> None:
        """Write back if changed, then placeholders. A prefetched block never used is simply dropped."""
        st = self._state[block.index]
        if st.buffer is None:
            return
        self._wait_read(block)
        if st.desk and st.bound:
            self.desk.keep_bound(block, st)
            return
        if st.shelved and not (st.dirty and st.copied):
            pass  # the shelf is the block's storage: unchanged, or changed in place (CPU): nothing moves
        elif st.dirty:
            assert not (st.base and st.dirty_whole), "a whole-block write of a tail-only block (a bug)"
            start = 0 if st.dirty_whole else block.writable_offset
            buf = st.buffer
            if st.shelved:
                # A changed device copy of a shelved block comes back through a pool buffer (pinned on CUDA), not
                # into the shelf: a copy into pageable memory is synchronous, the host would wait for the GPU at
                # every eviction. The shelf gets the bytes as any write-back (``FlatStore.write``: a memory copy)
                # once the copy completed; the block's next ``prefetch`` issues it first.
                buf = self.buffers.new(block)
            ready = DONE
            if st.device is not None:  # only what is written back comes back (a LoRA block: its adapters, not its head)
                lo = max(start - st.base, 0)
                ready = self.transfer.to_host(st.device[lo:], buf[lo:])
            self.writebacks.add(block, buf, start, ready, st.base)
        else:
            self.transfer.recycle(st.buffer)
        placeholders(block)
        st.retained = st.device is not None and st.copied and self.transfer.retained(st.device)
        if st.bound:
            self.stats.count_bound(-1)
        self.stats.count_in_memory(block, st.base, -1)
        st.evicted()

    def release_all(self) -> list[str]:
        """Drop every hold and evict every block in memory (kept blocks stay kept, for ``unkeep``). For the end of
        fit after an exception inside a step: a forward, backward or update that raised never released its
        block, which would stay in memory with its pool buffer and device copy. Returns the blocks that were
        held. A changed block is written back as after any use: its values are what the module holds now."""
        held = []
        for block in self.blocks:
            st = self._state[block.index]
            if +st.refs:
                held.append(block.name)
                st.refs.clear()
            self.evict(block)
        return held

    def evict_unheld(self) -> None:
        """Drop prefetched blocks nobody holds (end of a pass whose order differed from the prediction)."""
        for block in self.blocks:
            if not +self._state[block.index].refs:
                self.evict(block)

    def poll_writes(self) -> None:
        """Hand the write-backs whose device -> host copy has completed to the store (waits for nothing beyond
        the ``max_pending_writes`` bound)."""
        self.writebacks.issue()

    def issue_writes(self) -> None:
        """Issue every write-back still waiting for its device -> host copy (end of a step: a fence or a
        checkpoint after it must see them)."""
        self.writebacks.issue(force=True)

    def in_store(self, block: BlockLayout) -> bool:
        """Whether the store holds the block's current values once the writes issued so far complete: not resident
        (its write-back is issued, see ``issue_writes``) or resident and unchanged. A checkpoint clones those."""
        st = self._state[block.index]
        return (st.buffer is None and st.kept is None) or not st.dirty

    # ---- blocks kept on the device (device_memory_budget) -------------------------------------------
    def keep(self, block: BlockLayout) -> None:
        """From now on, keep this block's device copy bound after use (made at once: loaded, bound, kept)."""
        st = self._state[block.index]
        st.desk = True
        if st.kept is None and not +st.refs:
            self.acquire(block, "keep")
            self.release(block, "keep")

    def kept(self, block: BlockLayout) -> bool:
        return self._state[block.index].kept is not None

    def unkeep(self, block: BlockLayout, write: bool = True) -> None:
        """Let go of the block's device copy (the end of fit), written back to the store first if it changed and
        ``write``; the parameters get placeholders (``DeskCopies.unkeep``)."""
        self.desk.unkeep(block, self._state[block.index], write)
    def drain(self) -> None:
        """Wait for every write-back in flight (their buffers are then freed)."""
        self.writebacks.drain()

    @property
    def resident_blocks(self) -> list[BlockLayout]:
        return [b for b in self.blocks if self._state[b.index].buffer is not None]

    # ---- helpers -------------------------------------------------------------------------------------
    def _wait_read(self, block: BlockLayout) -> None:
        st = self._state[block.index]
        if st.read is not None:
            wait_io(self.store, st.read)
            st.read = None

    def unbind(self, block: BlockLayout, device: torch.device) -> None:
        """Give a block that is not resident placeholders on ``device`` (the end of fit: on the CPU)."""
        if self.is_resident(block):
            raise RuntimeError(f"block {block.name} is resident; it cannot be given placeholders (a bug)")
        placeholders(block, device)
