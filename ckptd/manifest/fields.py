"""Checks of a manifest's fields that every part of the reader shares (``parse``, ``rows``):
integers in range, names, data paths that stay inside the step. Each raises ``ValueError``
naming the value (the reader adds the file and tensor) or, for paths,
:class:`~ckptd.errors.CorruptCheckpoint` naming them. No torch here.
"""

from __future__ import annotations

import functools
import posixpath
import re
from typing import Any

from ckptd.errors import CorruptCheckpoint
from ckptd.manifest.envelope import MAX_INT


def integers(v: Any) -> tuple[int, ...]:
    """A short list of integers in [0, MAX_INT] (a box, a shape) as a tuple: ``integer`` of
    each, inlined (a thousand ranks' partials hold tens of thousands of boxes)."""
    if not isinstance(v, list):
        raise ValueError(f"expected a list of integers, got {v!r}")
    for x in v:
        if type(x) is not int or not 0 <= x <= MAX_INT:
            integer(x)  # raises, naming it
    return tuple(v)


def integer(v: Any, lo: int = 0, hi: int = MAX_INT) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{v} is outside [{lo}, {hi}]")
    return v


def plain_name(v: Any) -> str:
    if not isinstance(v, str) or not v or "\0" in v or "/" in v:
        raise ValueError(f"not a valid name: {v!r}")
    return v


_CONTROL = re.compile(r"[\x00-\x1f]")  # NUL and control characters


def safe_relpath(path: Any, where: str, tensor: str) -> str:
    """Data paths are relative and stay inside the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise CorruptCheckpoint(f"{where}: {tensor}: chunk file {path!r} is not a path")
    if not inside(path):
        raise CorruptCheckpoint(
            f"{where}: {tensor}: chunk file {path!r} escapes the checkpoint directory"
        )
    return path


@functools.lru_cache(maxsize=1 << 14)
def inside(path: str) -> bool:
    """Whether a data path stays inside the step (:func:`safe_relpath`'s test; cached: a
    manifest names the same few files and frame tables for thousands of tensors)."""
    norm = posixpath.normpath(path)
    return not (
        path.startswith("/")
        or "\\" in path
        or "://" in path
        or norm.startswith("..")
        or norm != path
        or not norm.startswith("data/")
        or _CONTROL.search(path)
    )
