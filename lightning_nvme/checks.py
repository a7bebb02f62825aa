"""The error a bad configuration value raises, and the checks that find it.

Why a module of its own: every layer that defines arguments (the strategies' settings, the callbacks)
checks them the same way and raises the same ``ConfigError(key, message)``, and none of them should have
to import another's settings for that. It imports nothing of the package but ``constants``.

A check takes a value and returns why it is invalid and the fix, or ``None`` when it is valid;
``setting(default, doc, check)`` declares one dataclass field with its default, its one-line doc and its
check (see ``lightning_nvme.settings``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from lightning_nvme.constants import ALIGN, STORE_DIR_ENV, align_up

T = TypeVar("T")
Check = Callable[[Any], "str | None"]  # returns why the value is invalid (and the fix), None when it is valid


class ConfigError(ValueError):
    """A configuration value that cannot work. ``key`` names the setting; the message says the fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def setting(default: T, doc: str, check: Check | None = None) -> T:
    """One argument: its default, its one-line doc and its check (``None``: any value of its type)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


def reject_unknown(owner: str, names: Iterable[str], known: Sequence[str]) -> None:
    """``TypeError`` for the first of ``names`` that ``owner`` does not take, with the closest known name."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{owner}: unexpected argument {name!r}{hint}; it takes {', '.join(known)}")


def check_fields(obj: Any) -> None:
    """Run the check of every ``setting`` field of the dataclass instance ``obj``; raise the first problem."""
    for f in dataclasses.fields(obj):
        check = f.metadata.get("check")
        problem = check(getattr(obj, f.name)) if check else None
        if problem:
            raise ConfigError(f.name, problem)


# ---- checks: each returns the problem and the fix, or None ------------------------------------------------
def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is not a byte count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def count(minimum: int, typical: str) -> Check:
    def check(value: Any) -> str | None:
        if not is_int(value) or value < minimum:
            return f"must be an integer >= {minimum}, got {value!r}. Fix: use {typical}."
        return None
    return check


def nbytes(minimum: int = 1, *, aligned: bool = False, typical: str = "") -> Check:
    def check(value: Any) -> str | None:
        if not is_int(value) or value < minimum:
            return f"must be an integer number of bytes >= {minimum}, got {value!r}." + (
                f" Fix: use {typical}." if typical else "")
        if aligned and value % ALIGN:
            return f"must be a multiple of {ALIGN} (O_DIRECT alignment), got {value}. Fix: use {align_up(value)}."
        return None
    return check


def one_of(*values: str) -> Check:
    def check(value: Any) -> str | None:
        return None if value in values else f"must be one of {', '.join(map(repr, values))}, got {value!r}."
    return check


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}."


def directory(value: Any) -> str | None:
    """A path (or ``None``: the caller's default); whether it exists is checked before training (preflight)."""
    return None if value is None or isinstance(value, (str, os.PathLike)) else f"must be a path, got {value!r}."


def directories(value: Any) -> str | None:
    """A path, a non-empty list of distinct paths (one per disk: the store is striped over them), or ``None``."""
    if directory(value) is None:
        return None
    if (isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) > 0
            and all(isinstance(v, (str, os.PathLike)) for v in value)):
        resolved = [os.path.abspath(os.fspath(v)) for v in value]
        twice = sorted({d for d in resolved if resolved.count(d) > 1})
        if twice:
            return f"lists {twice[0]} twice; each directory (disk) may hold one stripe. Fix: list it once."
        return None
    return f"must be a path or a non-empty list of paths (one per disk, e.g. [/mnt/a, /mnt/b]), got {value!r}."


def default_store_dir(default_root_dir: str) -> str:
    """Where a store goes when no ``store_dir`` is given: ``$LIGHTNING_NVME_STORE_DIR``, else
    ``<default_root_dir>/nvme_store``. The one home of this rule: the strategies, the activation callback and
    the Hydra config (``conf/paths``, through the ``lightning_nvme.default_store_dir`` resolver) all use it."""
    return os.environ.get(STORE_DIR_ENV) or os.path.join(default_root_dir, "nvme_store")


def resolve_store_dir(store_dir: str | os.PathLike[str] | None, default_root_dir: str) -> str:
    """``store_dir`` if given, else ``default_store_dir(default_root_dir)``, as an absolute path."""
    return os.path.abspath(store_dir or default_store_dir(default_root_dir))


def resolve_store_dirs(store_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
                       default_root_dir: str) -> list[str]:
    """``resolve_store_dir`` for a setting that may list several directories (a striped store): absolute paths."""
    if store_dir is None or isinstance(store_dir, (str, os.PathLike)):
        return [resolve_store_dir(store_dir, default_root_dir)]
    return [os.path.abspath(os.fspath(d)) for d in store_dir]
