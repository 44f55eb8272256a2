"""Tunables in one place.

Every default is explained next to it. Tests override them through :func:`override`, and users
through the matching environment variable ``CKPTD_<NAME>`` (upper case).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass
class Tunables:
    # Raw bytes per checksummed (and, when compressed, independently decodable) frame. A partial
    # read rounds out to whole frames, so this bounds read amplification per range at 2 frames;
    # 1 MiB keeps manifests small (2048 frame entries for 2 GiB) and xxh3 costs ~0.04 ms a frame.
    frame_bytes: int = 1 << 20
    # Chunk start offsets in data files are aligned to this (O_DIRECT needs 4 KiB alignment).
    file_alignment: int = 4096
    # A rank's data is split into up to `io_threads` files written in parallel, but no file is
    # made smaller than this: many tiny files cost more in metadata than parallelism wins.
    min_file_bytes: int = 64 << 20
    # How long the coordinator waits for every rank's partial manifest before giving up. A rank
    # that died mid-save therefore fails the commit after this long, leaving `latest` unchanged.
    commit_timeout_s: float = 600.0
    # Polling interval bounds when waiting on storage for partials / the manifest (backs off
    # from the first to the second value).
    poll_min_s: float = 0.001
    poll_max_s: float = 0.05
    # Host memory a load may use for read buffers beyond the destination tensors. Loads needing
    # more than this verify in a first streaming pass and copy in a second (see docs/format.md).
    load_budget_bytes: int = 512 << 20
    # Threads for background writes and parallel reads (None: min(4, cpu count)).
    io_threads: int | None = None


_current = Tunables()


def _from_env() -> None:
    for field in dataclasses.fields(Tunables):
        raw = os.environ.get(f"CKPTD_{field.name.upper()}")
        if raw is None:
            continue
        kind = type(getattr(_current, field.name))
        value: Any = float(raw) if kind is float else int(raw)
        setattr(_current, field.name, value)


_from_env()


def get() -> Tunables:
    """The tunables in force."""
    return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Tunables]:
    """Temporarily change tunables (tests)."""
    old = dataclasses.replace(_current)
    for k, v in changes.items():
        if not hasattr(_current, k):
            raise AttributeError(f"unknown tunable {k!r}")
        setattr(_current, k, v)
    try:
        yield _current
    finally:
        for f in dataclasses.fields(Tunables):
            setattr(_current, f.name, getattr(old, f.name))


def io_threads() -> int:
    n = _current.io_threads
    return n if n else max(1, min(4, os.cpu_count() or 1))
