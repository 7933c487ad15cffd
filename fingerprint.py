"""Fingerprints of code and libraries: what enters a key besides the settings.

A product's or a model's key holds a digest of the source that builds it (source_fingerprint):
editing that code, or a module-level helper it calls, makes a new key, while code it does not
reach leaves the key alone. library_versions adds the versions that can change the numbers.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import linecache
import platform
import re
import types
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["referenced_names", "source_objects", "source_fingerprint", "source_text", "class_block", "library_versions"]


def referenced_names(code: types.CodeType) -> set[str]:
    """Global names a code object and the functions nested in it refer to."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if inspect.iscode(constant):
            names |= referenced_names(constant)
    return names


def source_objects(objects: Sequence[object]) -> list[object]:
    """The given objects plus, for functions, the module-level functions they call, transitively."""
    found: list[object] = []
    pending = list(objects)
    while pending:
        obj = pending.pop(0)
        if any(obj is seen for seen in found):
            continue
        found.append(obj)
        if inspect.isfunction(obj):
            for name in sorted(referenced_names(obj.__code__)):
                helper = obj.__globals__.get(name)
                if inspect.isfunction(helper) and helper.__module__ == obj.__module__:
                    pending.append(helper)
    return found


@functools.cache
def source_fingerprint(*objects: object) -> str:
    """A digest of the source of the given modules, classes and functions and their helpers.

    A build function's own module-level helpers are followed, so editing the code that
    builds an artifact changes its key, while adding an unrelated metric does not.
    """
    hasher = hashlib.sha256()
    for obj in source_objects(objects):
        hasher.update(source_text(obj).encode())
    return hasher.hexdigest()


def source_text(obj: Any) -> str:
    """inspect.getsource(obj), the same text, found without parsing a class's whole module.

    For a class, Python 3.11 and 3.12 parse its entire module (tens of milliseconds per
    launch); an undecorated top-level class is found by its one `class Name` line instead.
    """
    path = inspect.getsourcefile(obj) if inspect.isclass(obj) and "." not in obj.__qualname__ else None
    if path is None:
        return inspect.getsource(obj)
    linecache.checkcache(path)  # as inspect does: a file edited since it was read is read again
    block = class_block(obj, path, linecache.getlines(path))
    return "".join(block) if block is not None else inspect.getsource(obj)


def class_block(cls: type, path: str, lines: list[str]) -> list[str] | None:
    """The lines of a class's one undecorated `class Name` block in the file `path`, or None when unsure."""
    header = re.compile(rf"class\s+{re.escape(cls.__name__)}\b")
    starts = [index for index, line in enumerate(lines) if header.match(line)]
    if len(starts) != 1:
        return None
    start = starts[0]
    # The nearest line above that is neither blank nor a comment: a decorator, or a statement
    # the class line continues, makes the block unsure.
    above = [line.strip() for line in lines[:start] if line.strip() and not line.strip().startswith("#")]
    if above and (above[-1].startswith("@") or above[-1].endswith(("\\", ",", "(", "[", "{"))):
        return None
    block = inspect.getblock(lines[start:])
    codes = [inspect.unwrap(f).__code__ for f in vars(cls).values() if inspect.isfunction(f)]
    methods = [code.co_firstlineno for code in codes if code.co_filename == path]
    if any(not start + 1 < line <= start + len(block) for line in methods):
        return None  # the methods lie elsewhere: not this block
    return block


def library_versions() -> dict[str, str]:
    """The versions of Python, torch and numpy that enter every recipe."""
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
