"""Text that is already on every machine: Python's own standard library, its docstrings, or generated text.

Why: the embedded recipe must train with no network. The stdlib sources are megabytes of real, varied
text shipped with the interpreter; ``docstrings`` works even where the ``.py`` sources were stripped;
``generated`` is fully deterministic and tiny (used by the tests).
"""

from __future__ import annotations

import glob
import os
import random
import sys
import sysconfig

SOURCES = ("stdlib", "docstrings", "generated")


def load_corpus(source: str, max_bytes: int, seed: int = 0) -> str:
    """The corpus text for ``source``, at most about ``max_bytes`` of UTF-8."""
    if source == "stdlib":
        return _stdlib_sources(max_bytes)
    if source == "docstrings":
        return _docstrings(max_bytes)
    if source == "generated":
        return _generated(max_bytes, seed)
    raise ValueError(f"data.source must be one of {SOURCES}, got {source!r}")


def _stdlib_sources(max_bytes: int) -> str:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:  # some distributions ship only .pyc
        return _docstrings(max_bytes)
    parts, size = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f"# ---- {os.path.basename(path)} ----\n{f.read()}\n"
        parts.append(text)
        size += len(text.encode())
        if size >= max_bytes:
            break
    return "".join(parts)


def _docstrings(max_bytes: int) -> str:
    import builtins
    import importlib

    parts, size = [], 0
    names = sorted(set(sys.builtin_module_names) | {"os", "json", "math", "re", "collections", "functools"})
    for objs in ([builtins], (importlib.import_module(n) for n in names)):
        for mod in objs:
            for name in sorted(dir(mod)):
                doc = getattr(getattr(mod, name, None), "__doc__", None)
                if isinstance(doc, str) and len(doc) > 40:
                    parts.append(f"{mod.__name__}.{name}:\n{doc}\n\n")
                    size += len(parts[-1])
                    if size >= max_bytes:
                        return "".join(parts)
    return "".join(parts)


def _generated(max_bytes: int, seed: int) -> str:
    """Simple arithmetic and list statements: learnable structure, so loss falls quickly."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "store", "chunk", "fence", "block", "layer", "state"]
    lines, size = [], 0
    while size < max_bytes:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        kind = rng.random()
        if kind < 0.5:
            line = f"{a} + {b} = {a + b}\n"
        elif kind < 0.8:
            w = rng.choice(words)
            line = f"{w}[{a}] = {w}[{b}] * 2\n"
        else:
            line = f"def {rng.choice(words)}_{a}(x):\n    return x + {b}\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)
