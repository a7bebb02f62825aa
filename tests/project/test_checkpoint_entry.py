"""The strategies save through one entry point: ``checkpoint.Saver`` (and read back through ``checkpoint.Resume``).

Why a test: saving had no owner (the strategies drove the commit protocol themselves and made the clone-or-stream
decision twice, with about 40 names from ``checkpoint/``); a change to how checkpoints are written then touched
every strategy. This keeps the seam narrow.

How (``ast``, nothing imported or run): for each strategy module, the names it takes from ``lightning_nvme.checkpoint``
(or a module under it): every name imported from there, except that an imported *module* counts as each distinct
attribute the strategy reads from it (``weights.has_refs`` and ``weights.export`` are two names, not one), so
importing a module wholesale cannot hide what is used. At most ``LIMIT`` per module. And the clone-or-stream
decision (``copy/reflink.plan``, which asks ``copy/reflink.choose``) is called from exactly one place: ``Saver.decide``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import lightning_nvme

PACKAGE = pathlib.Path(lightning_nvme.__file__).parent
STRATEGIES = ["nvme_offload.py", "nvme_offload_ddp.py", "offload_strategy.py"]
LIMIT = 5


def _checkpoint_modules() -> set[str]:
    root = PACKAGE / "checkpoint"
    return {p.stem for p in root.rglob("*.py") if p.stem != "__init__"} | {
        str(p.relative_to(root)) for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def names_from_checkpoint(source: str) -> set[str]:
    """The names a module takes from ``lightning_nvme.checkpoint`` (modules counted by the attributes read)."""
    tree = ast.parse(source)
    modules = _checkpoint_modules()
    names: set[str] = set()
    module_aliases: dict[str, str] = {}  # local name -> what it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "lightning_nvme.checkpoint" or node.module.startswith("lightning_nvme.checkpoint.")):
            for alias in node.names:
                local = alias.asname or alias.name
                if node.module == "lightning_nvme.checkpoint" and alias.name in modules:
                    module_aliases[local] = alias.name
                else:
                    names.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "lightning_nvme":
            for alias in node.names:
                if alias.name == "checkpoint":
                    module_aliases[alias.asname or alias.name] = "checkpoint"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_nvme.checkpoint"):
                    module_aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases:
            names.add(f"{module_aliases[node.value.id]}.{node.attr}")
    return names


def test_counting_sees_through_module_imports() -> None:
    source = ("from lightning_nvme import checkpoint as ckpt\nfrom lightning_nvme.checkpoint import weights, Saver\n"
              "from lightning_nvme.checkpoint.copy.reflink import plan\nckpt.paired.save(1)\nweights.has_refs(2)\n"
              "weights.export(3)\nweights.has_refs(4)\n")
    assert names_from_checkpoint(source) == {"Saver", "plan", "checkpoint.paired", "weights.has_refs",
                                             "weights.export"}


@pytest.mark.parametrize("module", STRATEGIES)
def test_strategy_uses_few_checkpoint_names(module: str) -> None:
    names = names_from_checkpoint((PACKAGE / "strategies" / module).read_text())
    assert len(names) <= LIMIT, f"strategies/{module} uses {len(names)} names from lightning_nvme.checkpoint " \
                                f"({sorted(names)}); save through checkpoint.Saver, read through checkpoint.Resume"


def test_clone_or_stream_decided_once() -> None:
    """``copy/reflink.plan`` and ``choose`` (the clone-or-stream decision) have one caller in the package outside
    their module: ``Saver.decide``."""
    callers = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "checkpoint" / "copy" / "reflink.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for call in ast.walk(node):
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                            and call.func.attr in ("plan", "choose") and "reflink" in ast.unparse(call.func.value):
                        callers.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert callers == ["checkpoint/saver.py:decide"], callers
