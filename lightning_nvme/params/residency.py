"""``BlockResidency``: which blocks' parameters are in memory, and moving them to and from the store.

A block is resident while anyone holds a reference to it (its forward, its backward, an optimizer
update waiting for it); the last release writes it back if an update changed it and swaps its
parameters' ``.data`` for placeholders. Reads are issued ahead (``prefetch``) into page-aligned host
buffers; memory is bounded by the hold/prefetch rules of ``BlockScheduler`` plus ``max_pending_writes``
buffers whose write-back is still in flight. What the parameters point at while a block is bound is the
``Staging``'s business (``lightning_nvme.params.staging``): the host buffer itself on CPU, a device copy
on CUDA, written back through the host buffer once its copy has completed.

A block *kept* on the device (``keep``, ``device_memory_budget``) is loaded like any other the first time;
at its first eviction its device copy stays, its parameters stay bound to it and its host buffer is
recycled: from then on it is neither read, copied nor written back until ``unkeep`` (the end of fit).
Its device copy is then the truth (``read_values`` and ``in_store`` say so).

An optimizer update needs only a block's trainable tail (``BlockLayout.writable_offset`` on): acquired
with ``tail=True``, a block not in memory reads just that tail, its frozen parameters stay placeholders.
Why: a LoRA update otherwise read (or kept) every frozen weight of each block its adapters' chunk spans.

A block whose frozen head is read in place (``frozen``: ``lightning_nvme.params.frozen_files``) has a store region
holding only its trainable tail: its reads are split (head from the base files, tail from the store, one ``_Split``
handle), its writes start at the tail (a whole-block write, after a state dict was loaded, first checks the head
still equals the file's bytes: a base file is never written).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme.checks import ConfigError
from lightning_nvme.optim.plan import placeholder
from lightning_nvme.params.frozen_files import FrozenFiles, FrozenHead, HeadRead
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.params.staging import DONE, HostStaging, Ready, Staging, StagingStats
from lightning_nvme.store import FlatStore, IOHandle


@dataclass
class ResidencyStats:
    loads: int = 0  # block reads issued
    sync_loads: int = 0  # reads a forward/backward/update had to wait for from the start (not prefetched)
    tail_loads: int = 0  # reads of a block's trainable tail only, for an update (frozen head not read)
    writebacks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    resident_blocks: int = 0
    peak_resident_blocks: int = 0
    peak_resident_bytes: int = 0
    bound_blocks: int = 0  # blocks whose parameters point at their values (on an accelerator: device copies)
    peak_bound_blocks: int = 0
    early_uploads: int = 0  # device copies started once a read ahead completed, before the block was needed
    kept_blocks: int = 0  # blocks whose device copy stays bound between uses (``keep``)
    kept_bytes: int = 0
    staging: StagingStats = field(default_factory=StagingStats)


@dataclass
class _State:
    buffer: torch.Tensor | None = None  # uint8, page-aligned host buffer
    device: torch.Tensor | None = None  # what the parameters are views of while bound (CPU: ``buffer``)
    read: IOHandle | _Split | None = None
    bound: bool = False  # parameters point into ``device``
    dirty: bool = False
    dirty_whole: bool = False  # frozen parameters changed too (a state dict was loaded): write the whole block
    placed: bool = False  # its values are in the store
    shelved: bool = False  # ``buffer`` is the store's in-memory copy of the region (``FlatStore.shelved``)
    retained: bool = False  # at its last eviction, something (autograd) still held its device copy
    uploaded: Any = None  # a device copy started before the block is bound (``upload_ready``)
    desk: bool = False  # keep its device copy after use (``keep``)
    kept: torch.Tensor | None = None  # that copy once made: the parameters stay bound to it, ``buffer`` is None
    base: int = 0  # region offset of ``buffer[0]``: ``writable_offset`` when only the trainable tail is in memory
    refs: Counter = field(default_factory=Counter)


class _Split:
    """A block read in two parts: its frozen head from the base files, its tail from the store."""

    def __init__(self, tail: IOHandle | None, head: HeadRead | None) -> None:
        self.tail = tail
        self.head = head

    def done(self) -> bool:
        return (self.tail is None or self.tail.done()) and (self.head is None or self.head.done())


class BlockResidency:
    def __init__(self, store: FlatStore, blocks: list[BlockLayout], max_pending_writes: int = 2,
                 staging: Staging | None = None, frozen: FrozenFiles | None = None) -> None:
        self.store = store
        self.frozen = frozen
        self.blocks = blocks
        self.max_pending_writes = max_pending_writes
        self.staging = staging if staging is not None else HostStaging()
        self.stats = ResidencyStats(staging=self.staging.stats)
        self._state = [_State() for _ in blocks]
        # write-backs waiting for their device -> host copy, then in flight to the store (together bounded)
        self._copies: deque[tuple[BlockLayout, torch.Tensor, int, Ready, int]] = deque()
        self._writes: deque[tuple[IOHandle | None, torch.Tensor]] = deque()
        self._resident_bytes = 0

    # ---- first placement -----------------------------------------------------------------------------
    def place(self, block: BlockLayout, device: torch.device | None = None) -> None:
        """Copy the block's current values into the store and leave placeholders (setup), on ``device``
        (default: the parameters' own)."""
        buf = self._new_buffer(block)
        head = self._head(block)
        for slot in block.slots:
            if head is None or slot.offset >= head.nbytes:  # a head read in place: its values are the file's
                self._view(buf, slot).copy_(slot.param.detach())
        self._write(block, buf, head.nbytes if head is not None else 0)
        self._unbind(block, device)
        self._state[block.index].placed = True

    def placed(self, block: BlockLayout) -> bool:
        return self._state[block.index].placed

    def read_values(self, block: BlockLayout, copy: bool = True) -> dict[str, torch.Tensor]:
        """A block's true values (from memory if resident, else read from the store): copies, or with
        ``copy=False`` views of one buffer (the block's, or a fresh one read for the caller; one block of memory)."""
        st = self._state[block.index]
        if st.base and st.kept is None:  # only the trainable tail in memory: the frozen head from the store, the tail over it
            buf = self.staging.caller_buffer(self._capacity(block))
            self._issue_writes(of=block)
            self._wait_io(self._read(block, buf[:st.base]))
            self._wait_read(block)
            if st.device is not None and st.device is not st.buffer:
                self.staging.to_host(st.device, buf[st.base:]).synchronize()
            else:
                assert st.buffer is not None
                buf[st.base:].copy_(st.buffer)
            return {s.name: self._view(buf, s) for s in block.slots}
        if st.kept is not None:  # its device copy is the truth
            buf = self.staging.caller_buffer(self._capacity(block))
            self.staging.to_host(st.kept, buf).synchronize()
            copy = False
        elif st.buffer is not None:
            self._wait_read(block)
            buf = st.buffer
            if st.device is not None and st.device is not st.buffer:  # a device copy is the truth: fetch it
                buf = self.staging.caller_buffer(self._capacity(block))
                self.staging.to_host(st.device, buf).synchronize()
                copy = False  # the fresh buffer is the caller's already
            elif self.staging.reuses_buffers:
                copy = True  # the resident buffer goes back to a pool when evicted: the caller gets copies
        else:
            self._issue_writes(of=block)
            buf = self.staging.caller_buffer(self._capacity(block))
            self._wait_io(self._read(block, buf))
            copy = False  # the fresh buffer is the caller's already
        return {s.name: self._view(buf, s).clone() if copy else self._view(buf, s) for s in block.slots}

    def read_tail(self, block: BlockLayout) -> dict[str, torch.Tensor]:
        """The trainable parameters' values of a block whose head is read in place (a checkpoint of its adapters
        references the head in its file): from memory if resident, else only the tail is read from the store."""
        st = self._state[block.index]
        w = block.writable_offset
        if st.buffer is not None or st.kept is not None:
            values = self.read_values(block)
            return {s.name: values[s.name] for s in block.slots if s.offset >= w}
        self._issue_writes(of=block)
        buf = self.staging.caller_buffer(self.store.region(block.region).capacity)
        self._wait_io(self._read(block, buf, w))
        return {s.name: self._view(buf, s, w) for s in block.slots if s.offset >= w}

    # ---- residency ---------------------------------------------------------------------------------
    def is_resident(self, block: BlockLayout) -> bool:
        return self._state[block.index].buffer is not None

    def retained(self, block: BlockLayout) -> bool:
        """Its device copy outlived its last eviction (see ``Staging.retained``)."""
        return self._state[block.index].retained

    def holders(self, block: BlockLayout) -> Counter:
        return self._state[block.index].refs

    def prefetch(self, block: BlockLayout) -> None:
        st = self._state[block.index]
        if st.kept is not None:
            return
        self._issue_writes()
        if st.buffer is None:
            self._issue_writes(of=block)  # the read must see this block's last write-back
            shelved = self.store.shelved(block.region) if self._head(block) is None else None
            if shelved is not None:  # host_memory_budget: the block lives in memory, bound in place, never read
                st.buffer, st.shelved = shelved, True
            else:
                st.buffer = self._new_buffer(block)
                st.read = self._read(block, st.buffer)
                self.stats.loads += 1
                self.stats.bytes_read += block.nbytes
            self._count(block, +1)

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
            st.device, st.uploaded = self.staging.to_device(st.buffer, st.uploaded), None
            for slot in block.slots:
                if slot.offset >= st.base:
                    slot.param.data = self._view(st.device, slot, st.base)
            st.bound = True
            self._count_bound(+1)
        st.refs[why] += 1

    def _load_tail(self, block: BlockLayout) -> None:
        st = self._state[block.index]
        self._issue_writes(of=block)  # the read must see this block's last write-back
        st.base = block.writable_offset
        st.buffer = self.staging.host_buffer(self._capacity(block) - st.base)
        st.read = self._read(block, st.buffer, st.base)
        self.stats.tail_loads += 1
        self.stats.bytes_read += st.buffer.numel()
        self._count(block, +1)

    def upload_ready(self, but: BlockLayout | None = None) -> None:
        """Start the device copy of every block read ahead whose read has completed (none on CPU): it then
        overlaps the compute before the block is needed. Device memory: at most the blocks read ahead.

        Called at each block's pre- and post-forward, pre- and post-backward and at the top of ``acquire``
        (``but`` the block acquired: its copy is not early). Why so often: at ``param_prefetch=1`` the next
        block's read is issued at a block's pre-forward, just before the check there; the post-forward check
        finds it completed, one block's compute before it is needed."""
        if not self.staging.device_copies:
            return
        for block in self.blocks:
            st = self._state[block.index]
            if block is but or st.buffer is None or st.bound or st.uploaded is not None:
                continue
            if st.read is not None and not st.read.done():
                continue
            self._wait_read(block)  # completed: only collects it
            st.uploaded = self.staging.upload(st.buffer)
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
            self._keep_bound(block)
            return
        if st.shelved:  # the shelf is the block's storage: a device copy comes back into it, nothing else moves
            if st.dirty and st.device is not None:
                self.staging.to_host(st.device, st.buffer).synchronize()
        elif st.dirty:
            assert not (st.base and st.dirty_whole), "a whole-block write of a tail-only block (a bug)"
            start = 0 if st.dirty_whole else block.writable_offset
            ready = DONE
            if st.device is not None:  # only what is written back comes back (a LoRA block: its adapters, not its head)
                lo = max(start - st.base, 0)
                ready = self.staging.to_host(st.device[lo:], st.buffer[lo:])
            self._write(block, st.buffer, start, ready, st.base)
        else:
            self.staging.recycle(st.buffer)
        self._unbind(block)
        st.retained = st.device is not None and st.device is not st.buffer and self.staging.retained(st.device)
        if st.bound:
            self._count_bound(-1)
        self._count(block, -1)
        st.buffer, st.device, st.read, st.bound, st.dirty, st.dirty_whole = None, None, None, False, False, False
        st.shelved, st.base = False, 0
        st.uploaded = None  # an early copy never used: the allocator frees it after its stream's copy
        st.refs.clear()

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
        self._issue_writes()

    def issue_writes(self) -> None:
        """Issue every write-back still waiting for its device -> host copy (end of a step: a fence or a
        checkpoint after it must see them)."""
        self._issue_writes(force=True)

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
        ``write``; the parameters get placeholders."""
        st = self._state[block.index]
        st.desk = False
        if st.kept is None:
            return
        if +st.refs:
            raise RuntimeError(f"block {block.name} is held ({dict(st.refs)}); its device copy cannot go (a bug)")
        if write and st.dirty:
            buf = self._new_buffer(block)
            self._write(block, buf, 0 if st.dirty_whole else block.writable_offset, self.staging.to_host(st.kept, buf))
        self.stats.kept_blocks -= 1
        self.stats.kept_bytes -= block.nbytes
        self._count_bound(-1)
        st.kept, st.device, st.bound, st.dirty, st.dirty_whole = None, None, False, False, False
        self._unbind(block)

    def _keep_bound(self, block: BlockLayout) -> None:
        """The block's last holder let go: its device copy stays (parameters bound), its host buffer goes."""
        st = self._state[block.index]
        assert st.buffer is not None  # evicting a block in memory
        if not st.shelved and st.device is not st.buffer:
            self.staging.recycle(st.buffer)
        st.kept, st.buffer, st.read, st.uploaded, st.shelved = st.device, None, None, None, False
        st.refs.clear()
        self._count(block, -1)
        self.stats.kept_blocks += 1
        self.stats.kept_bytes += block.nbytes

    def drain(self) -> None:
        """Wait for every write-back in flight (their buffers are then freed)."""
        self._issue_writes(force=True)
        while self._writes:
            self._wait_oldest_write()

    @property
    def resident_blocks(self) -> list[BlockLayout]:
        return [b for b in self.blocks if self._state[b.index].buffer is not None]

    # ---- helpers -------------------------------------------------------------------------------------
    def _capacity(self, block: BlockLayout) -> int:
        """Bytes of a block buffer: its region's capacity, plus the head read in place (not in the region)."""
        head = self._head(block)
        return self.store.region(block.region).capacity + (head.nbytes if head is not None else 0)

    def _head(self, block: BlockLayout) -> FrozenHead | None:
        return self.frozen.heads.get(block.index) if self.frozen is not None else None

    def _read(self, block: BlockLayout, buf: torch.Tensor, offset: int = 0) -> IOHandle | _Split:
        """Read the block's bytes ``[offset, offset + len(buf))`` into ``buf``: from the store, or split between
        the base files (the frozen head) and the store (the tail, at ``offset - head`` in its region)."""
        head = self._head(block)
        if head is None:
            return self.store.read(block.region, buf, offset)
        assert self.frozen is not None
        w, end = head.nbytes, offset + buf.numel()
        tail = None
        hi = min(end, w + self.store.region(block.region).capacity)
        lo = max(offset, w)
        if hi > lo and block.nbytes > w:  # a block with no trainable tail has nothing in the store
            tail = self.store.read(block.region, buf[lo - offset:hi - offset], lo - w)
        if offset and offset < w:
            raise RuntimeError(f"block {block.name}: a read from byte {offset}, inside its frozen head (a bug)")
        return _Split(tail, self.frozen.read(head, buf) if offset < w else None)

    def _write_io(self, block: BlockLayout, data: torch.Tensor, offset: int) -> IOHandle | None:
        """Write ``data`` (the block's bytes from ``offset`` on) to the store; of a block whose head is read in
        place only the tail, after checking a head in ``data`` is still the file's (a loaded state dict)."""
        head = self._head(block)
        if head is None:
            return self.store.write(block.region, data, offset)
        assert self.frozen is not None
        w = head.nbytes
        if offset < w:
            if offset:
                raise RuntimeError(f"block {block.name}: a write from byte {offset}, inside its frozen head (a bug)")
            differ = self.frozen.same_as_file(head, data)
            if differ:
                files = sorted({p.file.path for p in head.pieces if p.name in differ})
                raise ConfigError("frozen_weights", f"{differ[:4]}{' ...' if len(differ) > 4 else ''}: frozen "
                                  f"parameters of block {block.name} are read in place from {files}, but the values "
                                  "loaded into them differ from that file's (a checkpoint or state dict of other "
                                  "weights). A base file is never written. Fix: frozen_weights='store' (the frozen "
                                  "weights copied into the store, then loaded), or load weights that match the file.")
            data, offset = data[w:], w
        if data.numel() == 0:
            return None
        return self.store.write(block.region, data, offset - w)

    def _wait_io(self, handle: IOHandle | _Split | None) -> None:
        if isinstance(handle, _Split):
            if handle.tail is not None:
                self.store.wait(handle.tail)
            if handle.head is not None:
                handle.head.wait()
        elif handle is not None:
            self.store.wait(handle)

    def _new_buffer(self, block: BlockLayout) -> torch.Tensor:
        """Page-aligned and as long as the region: the store moves it with O_DIRECT, no staging copy."""
        return self.staging.host_buffer(self._capacity(block))

    @staticmethod
    def _view(buf: torch.Tensor, slot, base: int = 0) -> torch.Tensor:
        """``slot``'s bytes in ``buf``, which holds the region from byte ``base`` on."""
        start = slot.offset - base
        return buf[start:start + slot.nbytes].view(slot.dtype).view(slot.shape)

    def _wait_read(self, block: BlockLayout) -> None:
        st = self._state[block.index]
        if st.read is not None:
            self._wait_io(st.read)
            st.read = None

    def _write(self, block: BlockLayout, buf: torch.Tensor, start: int = 0, ready: Ready = DONE, base: int = 0) -> None:
        """Write the region's bytes from ``start`` on (page-aligned), held in ``buf`` from region byte ``base``,
        once ``ready`` (the copy filling ``buf``) has completed."""
        start -= base
        if start >= buf.numel():  # nothing to write (unreachable today: a trainable tail is never empty)
            ready.synchronize()  # the device -> host copy may still write into the buffer
            self.staging.recycle(buf)
            return
        self._copies.append((block, buf, start, ready, base))
        self._issue_writes()

    def _issue_writes(self, force: bool = False, of: BlockLayout | None = None) -> None:
        """Hand write-backs whose copy has completed to the store, in order; with ``force`` (or ``of`` a
        block that has one waiting), all of them, waiting for their copies. Copies waiting plus writes in
        flight stay within ``max_pending_writes`` (the oldest is waited for)."""
        force = force or any(b is of for b, *_ in self._copies)
        while self._copies and (force or self._copies[0][3].query()
                                or len(self._copies) + len(self._writes) > self.max_pending_writes):
            block, buf, start, ready, base = self._copies.popleft()
            ready.synchronize()
            self._writes.append((self._write_io(block, buf[start:], base + start), buf))
            self.stats.writebacks += 1
            self.stats.bytes_written += buf.numel() - start
            while self._writes and len(self._writes) + len(self._copies) > self.max_pending_writes:
                self._wait_oldest_write()

    def _wait_oldest_write(self) -> None:
        handle, buf = self._writes.popleft()
        self._wait_io(handle)
        self.staging.recycle(buf)

    def unbind(self, block: BlockLayout, device: torch.device) -> None:
        """Give a block that is not resident placeholders on ``device`` (the end of fit: on the CPU)."""
        if self.is_resident(block):
            raise RuntimeError(f"block {block.name} is resident; it cannot be given placeholders (a bug)")
        self._unbind(block, device)

    def _unbind(self, block: BlockLayout, device: torch.device | None = None) -> None:
        for slot in block.slots:
            slot.param.data = placeholder(slot.shape, slot.dtype, device or slot.param.device)

    def _count_bound(self, sign: int) -> None:
        self.stats.bound_blocks += sign
        self.stats.peak_bound_blocks = max(self.stats.peak_bound_blocks, self.stats.bound_blocks)

    def _count(self, block: BlockLayout, sign: int) -> None:
        """Whole blocks in memory, and bytes in memory (whole blocks and trainable tails)."""
        st = self._state[block.index]
        if not st.base:
            self.stats.resident_blocks += sign
        self._resident_bytes += sign * (block.nbytes - st.base)
        self.stats.peak_resident_blocks = max(self.stats.peak_resident_blocks, self.stats.resident_blocks)
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self._resident_bytes)
