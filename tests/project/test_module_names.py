"""Two modules of the package share a file name only where they have the same role (issue #32 item 4).

Why a test: ``offload.py``, ``layout.py``, ``buffers.py``, ``settings.py`` each existed twice, and a reader who
opened the wrong one (or a traceback that names only the file) was misled. A duplicate file name is allowed only
if it is listed here with the role its modules share (CONTRIBUTING.md "Words" says the same); a new one fails
until it is renamed or listed with its reason.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import lightning_nvme

PACKAGE = Path(lightning_nvme.__file__).parent
# file name -> the role every module of that name has
SHARED_ROLES = {
    "__init__.py": "a package's public names (Python's own)",
    "__main__.py": "a package's `python -m` entry point (`lightning_nvme`, `lightning_nvme.doctor`)",
    "layout.py": "where bytes live in the store: regions in files (`store/`), parameters in block regions (`params/`)",
    "reflink.py": "cloning file ranges: the file system's call (`fs/`) and the `checkpoint_copy='reflink'` mode built "
                  "on it (`checkpoint/copy/`, named by the setting's word)",
    "settings.py": "a feature's settings: the strategies' (top level) and the activation offload's (`activations/`)",
}


def _by_name() -> dict[str, list[str]]:
    found: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        found[path.name].append(path.relative_to(PACKAGE).as_posix())
    return {name: paths for name, paths in found.items() if len(paths) > 1}


def test_duplicate_file_names_share_a_listed_role() -> None:
    unlisted = {name: paths for name, paths in _by_name().items() if name not in SHARED_ROLES}
    assert not unlisted, (f"modules share a file name: {unlisted}; rename one for what it holds, or (same role) list "
                          f"the name in SHARED_ROLES with that role")


def test_every_listed_name_is_still_shared() -> None:
    """The list does not outlive the duplicates it allows."""
    stale = sorted(set(SHARED_ROLES) - set(_by_name()))
    assert not stale, f"{stale} no longer name two modules: remove them from SHARED_ROLES"
