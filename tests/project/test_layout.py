"""The tests mirror the package: a test module sits in the folder of what it tests (CONTRIBUTING.md "Tests").

Why a test: a file at ``tests/`` root tells a reader nothing about the module it covers, and the layout only
stays if adding a root file fails. The folders that are not packages all go on ``sys.path``
(``tests/conftest.py``), so two test modules of one name would shadow each other: names are unique.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning_nvme

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = Path(lightning_nvme.__file__).parent
# folders that test something other than one subpackage of lightning_nvme/
OTHER_FOLDERS = {
    "toplevel": "the top-level modules (settings, memory, checks)",
    "project": "the repository as a whole: import layers, docs, packaging, this layout",
    "benchmarks": "the scripts of benchmarks/",
    "conformance": "Lightning's habits through both strategies, bitwise against strategy='auto'",
    "faults": "kills, full disks, I/O errors, hangs",
}


def _test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_no_test_module_at_the_root() -> None:
    root = [p.name for p in TESTS.glob("test_*.py")]
    assert not root, f"move {root} into the tests/ folder of the module it tests (CONTRIBUTING.md 'Tests')"


def test_every_folder_mirrors_a_subpackage_or_is_named() -> None:
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.relative_to(TESTS).parts[0] for p in _test_modules() if p.parent != TESTS}
    unknown = folders - subpackages - set(OTHER_FOLDERS)
    assert not unknown, f"tests/{sorted(unknown)} mirror no package of lightning_nvme/ ({sorted(subpackages)})"


def test_test_module_names_are_unique() -> None:
    twice = [name for name, n in Counter(p.name for p in _test_modules()).items() if n > 1]
    assert not twice, f"{twice}: test modules share a name, so one would shadow the other on sys.path"
