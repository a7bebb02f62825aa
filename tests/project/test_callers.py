"""Every public function and method of ``lightning_nvme`` has a caller outside the tests (vulture-style, by name).

Why a test: a function only a test calls is code the package carries, documents and type-checks for nothing; a test
that needs to look inside an object reads it itself (the helpers in ``tests/``), and code that lost its last caller
goes. Found once by hand (``set_runtime``, ``pending_io``, ``held_bytes``, ``BackgroundCopy.gate``, ``defaults``);
this keeps it so.

How (``ast``, nothing is imported or run): a public (no leading underscore) function or method defined in
``lightning_nvme/`` is called when its name is used anywhere in the package, in ``benchmarks/`` or in the Hydra
YAML (``conf/``, ``recipes/``: its ``_target_`` names) other than by its own definition: as a name, an attribute, an
imported name, a keyword or a string that is a (dotted) name (``__all__``, ``getattr``, ``_target_``); not
words in docstrings or messages. By name, so it errs towards "called"
(two methods of one name count for each other), never towards a false alarm. Not counted as needing a caller:
overrides (``@override``: Lightning and torch call them), dunders, and the entry points in ``ENTRY_POINTS``.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections import Counter

import lightning_nvme

DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
TARGET = re.compile(r"_target_:\s*([\w.]+)")
PACKAGE = pathlib.Path(lightning_nvme.__file__).parent
REPO = PACKAGE.parent

# Public names nobody in the package calls by design: a user or developer calls them (say where).
ENTRY_POINTS = {
    "markdown_table": "CONTRIBUTING.md: prints README's argument table (`python -c ... markdown_table()`)",
    "ordered_allreduce_hook": "docs/fsdp.md: a user registers it on plain DDP (`register_comm_hook`) to sum in rank "
                              "order, as nvme_offload_fsdp does (tests/strategies/test_fsdp.py)",
}


def _uses(tree: ast.AST, counts: Counter[str]) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            counts[node.id] += 1
        elif isinstance(node, ast.Attribute):
            counts[node.attr] += 1
        elif isinstance(node, ast.alias):
            counts[(node.asname or node.name).rpartition(".")[2]] += 1
            counts[node.name.rpartition(".")[2]] += 1
        elif isinstance(node, ast.keyword) and node.arg:
            counts[node.arg] += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            counts[node.value.rpartition(".")[2]] += 1  # a name as data: __all__, getattr, a Hydra _target_


def _definitions(tree: ast.Module) -> list[tuple[str, int, list[str]]]:
    """(qualified name, line, decorators) of the module's public functions and its classes' public methods."""
    found = []
    for node in tree.body:
        members = [(node, "")]
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            members += [(n, node.name + ".") for n in node.body]
        for member, owner in members:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not member.name.startswith("_"):
                decorators = [ast.unparse(d).rpartition(".")[2] for d in member.decorator_list]
                found.append((owner + member.name, member.lineno, decorators))
    return found


def callerless() -> list[str]:
    counts: Counter[str] = Counter()
    definitions = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        _uses(tree, counts)
        definitions += [(path, *d) for d in _definitions(tree)]
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        _uses(ast.parse(path.read_text(), filename=str(path)), counts)
    for folder in ("conf", "recipes"):
        for path in sorted((REPO / folder).rglob("*.yaml")):
            for target in TARGET.findall(path.read_text()):
                counts[target.rpartition(".")[2]] += 1
    lonely = []
    for path, name, line, decorators in definitions:
        short = name.rpartition(".")[2]
        if "override" in decorators or short in ENTRY_POINTS or counts[short]:
            continue
        lonely.append(f"{path.relative_to(REPO)}:{line} {name}")
    return lonely


def test_every_public_function_has_a_caller() -> None:
    lonely = callerless()
    assert not lonely, ("public functions no code of the package, benchmarks/ or the YAML calls: remove them, move "
                        "them into the tests that use them, or (an entry point) add them to ENTRY_POINTS with "
                        "who calls them:\n" + "\n".join(lonely))


def test_the_check_sees_a_function_without_a_caller(tmp_path) -> None:
    """The rules on a small tree: a use by attribute or string counts, a definition alone does not."""
    tree = ast.parse("def used(): pass\ndef alone(): pass\nclass C:\n    def m(self): pass\n"
                     "    def n(self): pass\nC().m()\n__all__ = ['used']\n")
    counts: Counter[str] = Counter()
    _uses(tree, counts)
    assert [name for name, _, _ in _definitions(tree) if not counts[name.rpartition(".")[2]]] == ["alone", "C.n"]
