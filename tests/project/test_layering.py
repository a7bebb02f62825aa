"""Imports of ``lightning_nvme`` go one way: down the layers below, never in a circle.

Why a test: the package is read (and changed) layer by layer. A store change cannot break the optimizer's
imports if the store imports nothing above it, and a module can be understood from the ones below it alone.
Import cycles worked only through load order and in-function imports; this keeps them out.

How edges are counted (``ast``, no import is executed):

* every ``import``/``from ... import`` of ``lightning_nvme`` anywhere in a module, inside functions and
  ``if TYPE_CHECKING:`` blocks too, and the package ``__init__`` files as modules of their own;
* importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``: an edge to each, except to the importer's
  own enclosing packages (Python has run those before the importer) and to the root ``lightning_nvme``, which
  is the public entry point at the top (``import lightning_nvme`` registers the strategies: it imports
  everything, and every submodule import runs it first by Python's rules);
* ``from a.b import c`` is an edge to ``a.b`` and, where ``c`` is a module, to ``a.b.c``.

The map: ``LAYERS`` lists the units (top-level modules and packages of ``lightning_nvme``) from the bottom up.
A module may import modules of its own unit (without a cycle) or of a lower layer, never of its own layer's
other units or a higher layer.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import lightning_nvme

PACKAGE = "lightning_nvme"
ROOT = pathlib.Path(lightning_nvme.__file__).parent

# Bottom to top. Units of one layer are independent of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("constants",),  # units and shared names
    # the ConfigError and the value checks; file systems (atomic replacement, mounts, reflinks); host memory
    ("checks", "fs", "memory"),
    ("store",),  # the flat store: files, regions, asynchronous I/O
    ("optim",),  # optimizer state in the store, state formats
    ("checkpoint",),  # checkpoint files and the streamed optimizer state / weights beside them
    ("params",),  # parameter offload
    # the strategies' arguments (ask optim's state-format registry); the recipes' models and data (data raises ConfigError)
    ("settings", "models", "data"),
    ("preflight",),  # checks before training: directories, space, memory budgets, the checkpoints a run keeps
    ("doctor",),  # the disk check and the tuned I/O profile it writes (the strategies read it)
    # the Lightning strategies and their RAM/GPU placement plans; activation offload (independent of Lightning)
    ("strategies", "activations"),
    ("callbacks", "launch"),  # Lightning callbacks; recipes -> runs
    ("cli",),
    ("__main__",),
    ("",),  # lightning_nvme/__init__: the public API, registers the strategies
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def unit(module: str) -> str:
    """``lightning_nvme.optim.plan`` -> ``optim``; the root package -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imported(module: str, path: pathlib.Path) -> Iterator[tuple[str, int]]:
    """(imported module of the package, line) for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield source, node.lineno
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    yield f"{source}.{alias.name}", node.lineno


def edges() -> dict[str, dict[str, int]]:
    """module -> {module it depends on: first line}, as described in the module docstring."""
    out: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        deps: dict[str, int] = {}
        for name, line in _imported(module, path):
            if name != PACKAGE and not name.startswith(PACKAGE + "."):
                continue
            parts = name.split(".")
            for i in range(2, len(parts) + 1):  # the module and each enclosing package below the root
                target = ".".join(parts[:i])
                if target in MODULES and target != module and target not in own:
                    deps.setdefault(target, line)
        out[module] = deps
    return out


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_unit_has_a_layer() -> None:
    missing = sorted({unit(m) for m in MODULES} - set(LAYER_OF))
    assert not missing, f"place these modules/packages of lightning_nvme in LAYERS: {missing}"


def test_imports_point_down() -> None:
    upward = []
    for module, deps in edges().items():
        for target, line in deps.items():
            a, b = unit(module), unit(target)
            if a != b and LAYER_OF[b] >= LAYER_OF[a]:
                kind = "sideways" if LAYER_OF[b] == LAYER_OF[a] else "upward"
                upward.append(f"{module} (layer {LAYER_OF[a]}: {a}) imports {target} (layer {LAYER_OF[b]}: {b}) "
                              f"at {MODULES[module].relative_to(ROOT.parent)}:{line} [{kind}]")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    graph = edges()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_checker_sees_what_it_must() -> None:
    """The edge rules on the package itself: an in-function import and an implied package ``__init__`` count,
    an enclosing package does not."""
    graph = edges()
    # checkpoint/paired.py imports lightning_nvme.checkpoint.state_files: the module, not its own package
    assert "lightning_nvme.checkpoint.state_files" in graph["lightning_nvme.checkpoint.paired"]
    assert "lightning_nvme.checkpoint" not in graph["lightning_nvme.checkpoint.paired"]
    # strategies/offload_strategy.py imports lightning_nvme.store.layout...: the store package's __init__ runs too
    assert "lightning_nvme.store" in graph["lightning_nvme.strategies.offload_strategy"]
    # cli.py imports the launch package inside a function
    assert "lightning_nvme.launch" in graph["lightning_nvme.cli"]
    assert _cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}}) is None
