"""Nothing outside ``optim/`` walks an offloaded optimizer's chunks (issue #32: the optimizer composed, not mixed in).

Why a test: the strategies and the checkpoint code walked ``off.chunks`` / ``chunk.pieces`` to find the store
ranges of the state; every change of the chunk plan then touched them. They now ask the optimizer's public
``regions()`` (``optim/offloaded.py:StateRegion``: a region's name, bytes, parameters and the pieces with state in
it). The check is ``ast``-based: outside ``optim/``, an attribute ``.chunks`` may be read only off a chunk plan
(``Plan``, from ``plan_chunks``) named ``plan``, the one place a strategy sizes the store before any optimizer
exists; any other ``.chunks`` (``off.chunks``, ``self.offloaded[0].chunks``, ...) fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_nvme

PACKAGE = Path(lightning_nvme.__file__).parent
PLAN_NAMES = {"plan"}  # a ``Plan`` (``optim.plan.plan_chunks``), not an ``OffloadedOptimizer``


def _chunk_reads(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        if isinstance(node, ast.Attribute) and node.attr == "chunks":
            if not (isinstance(node.value, ast.Name) and node.value.id in PLAN_NAMES):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_chunk_walks_outside_optim() -> None:
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "optim"]
    walks = [hit for p in outside for hit in _chunk_reads(p.read_text(), p.relative_to(PACKAGE).as_posix())]
    assert not walks, f"read the optimizer's regions() (StateRegion) instead of its chunks: {walks}"


def test_the_check_sees_a_chunk_walk() -> None:
    """The check is not vacuous: an ``off.chunks`` walk is reported, a ``plan.chunks`` read is not."""
    source = "def f(off, plan):\n    return [c for c in off.chunks] + plan.chunks\n"
    assert _chunk_reads(source, "m.py") == ["m.py:2: off.chunks"]
