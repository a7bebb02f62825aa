"""The weights of ``nvme_offload_fsdp``'s sharded blocks for what writes them out whole: checkpoints and exports.

Why its own object: gathering a block is a collective, so a writer on rank 0 (the checkpoint's weights record, the
Hub layout's shards) needs every other rank to take part in each gather it asks for, in its order; and a state dict
taken for such a writer holds references instead of gathering every block at once (``by_reference``). Both read
the engine (``ShardedParams``: its units, rank, world, group and gathers) and change nothing in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist

Unit = Any  # ``params.sharded.Unit`` (not imported: ``sharded`` composes this object)


class Engine(Protocol):
    """What of ``ShardedParams`` this reads."""

    rank: int
    world: int
    group: Any
    units: list[Any]
    io: Any


class ShardedWeights:
    """The blocks' weights of ``engine``, gathered one block at a time for a writer."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.referencing = False  # inside ``by_reference``: the blocks' state-dict hooks give references

    @contextmanager
    def by_reference(self) -> Iterator[None]:
        """Inside, ``state_dict()`` holds a ``BesideWeight`` per block parameter instead of gathering every block
        at once: a checkpoint then gathers them one block at a time as it writes them (``read_block``)."""
        self.referencing = True
        try:
            yield
        finally:
            self.referencing = False

    def read_block(self, u: Unit) -> dict[str, torch.Tensor]:
        """Block ``u``'s weights by parameter name, gathered from every rank's shard (a collective)."""
        # a block waiting for its update keeps only its owned window (``Unit.window``): gathered again, as every rank
        # whose copy is not whole does
        full = u.full if u.full is not None and u.window is None else self.engine.io.gathered(u)
        return {slot.name: u.flat.view(full, slot) for slot in u.flat.slots}

    def reads_led_by_rank0(self, work: Callable[[Callable[[Unit], dict[str, torch.Tensor]]], None]) -> None:
        """Rank 0 runs ``work(read_block)`` (an export writing files), asking for blocks in whatever order its
        writer needs them; every other rank takes part in each of those gathers, told by rank 0 which block comes
        next (a small broadcast per block), until rank 0 is done, and then raises if rank 0 failed. Every rank calls
        it. Why led, not mirrored: a writer's order (the Hub layout's shards) is its own, and a failure on rank 0
        must reach ranks that would otherwise wait in the next gather."""
        engine = self.engine
        src = dist.get_global_rank(engine.group, 0) if engine.world > 1 else 0

        def tell(message: Any) -> Any:
            box = [message]
            if engine.world > 1:
                dist.broadcast_object_list(box, src=src, group=engine.group)
            return box[0]

        if engine.rank == 0:
            def read(u: Unit) -> dict[str, torch.Tensor]:
                tell(u.index)
                return self.read_block(u)

            failure = None
            try:
                work(read)
            except BaseException as e:
                failure = f"{type(e).__name__}: {e}"
                raise
            finally:
                tell(("done", failure))
            return
        by_index = {u.index: u for u in engine.units}
        while True:
            message = tell(None)
            if not isinstance(message, tuple):
                self.read_block(by_index[message])
                continue
            if message[1] is not None:
                raise RuntimeError(f"nvme_offload_fsdp: rank 0 failed while writing what every rank gathered: "
                                   f"{message[1]}")
            return
