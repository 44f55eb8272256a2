"""Tunables of read planning, reading and the offline reshard, with the measurements behind the
defaults (``benchmarks/load.py`` reproduces them; ``docs/loading.md`` has the numbers).

They follow :mod:`ckptd.config`'s convention: environment variable ``CKPTD_<NAME>`` (upper
case), :func:`override` for tests. They live here until ``ckptd/config.py`` adopts them.
The host-memory budget of a load is ``ckptd.config``'s ``load_budget_bytes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass
class ReadTunables:
    # Two byte ranges of one file are read as one when the gap between them is at most this
    # (the gap is read and dropped). On a local disk a separate request costs about as much as
    # reading ~128-512 KiB (measured: benchmarks/load.py --section gap); 256 KiB is the middle.
    gap_bytes: int = 256 << 10
    # The same for remote object stores (fsspec URLs), where a request costs ~20-50 ms of
    # latency, i.e. several MiB at 100+ MB/s per connection (not measured here: no real S3).
    remote_gap_bytes: int = 4 << 20
    # The largest single ranged read, and the largest decoded piece of a chunk held at once: big
    # enough to stream at disk speed (4-16 MiB reads reach the sequential bandwidth here), small
    # enough that several are in flight in parallel threads within the load budget.
    unit_bytes: int = 8 << 20
    # The read unit for remote storage (fsspec URLs: S3...), at most a quarter of the load
    # budget: fewer, larger requests. A remote range's buffer is exactly its length (counted
    # against the budget as such), and the S3 backend fetches it by concurrent GETs of
    # ``S3Transfer.read_part_bytes``. Measurements: docs/storage.md, "Tuning loads from S3".
    remote_unit_bytes: int = 128 << 20
    # Read-once: replicated destination pieces (the same box of a tensor on several ranks) are
    # read by one rank and broadcast, when torch.distributed is initialised. "off" | "on" |
    # "remote" (on for fsspec URLs only). Measured on one node with a local disk it loses (the
    # page cache already serves the second reader; docs/loading.md), so it is off by default.
    read_once: str = "off"
    # Between the verify pass and the copy pass a load keeps the data it read, up to the load
    # budget, when the storage is remote (no page cache: reading again costs the network). On
    # a local filesystem it keeps it only when all of it fits in this many bytes; otherwise the
    # copy pass reads the ranges again, from the page cache (~20 GB/s here), which is cheaper
    # than the page faults of holding fresh memory (~1 GB/s on this VM, as slow as the disk)
    # and keeps the load's memory at a few read units.
    local_hold_bytes: int = 64 << 20
    # Offline reshard: a replicated target piece of at most this many bytes is written into the
    # files of every target rank that holds it (each rank then reads one contiguous range);
    # larger ones are written once, by the holder with the fewest bytes so far.
    replicate_small_bytes: int = 1 << 20


_current = ReadTunables()


def _from_env() -> None:
    for field in dataclasses.fields(ReadTunables):
        raw = os.environ.get(f"CKPTD_{field.name.upper()}")
        if raw is None:
            continue
        value: Any = raw if isinstance(getattr(_current, field.name), str) else int(raw)
        setattr(_current, field.name, value)


_from_env()


def get() -> ReadTunables:
    return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[ReadTunables]:
    """Temporarily change read tunables (tests, benchmarks)."""
    old = dataclasses.replace(_current)
    for k, v in changes.items():
        if not hasattr(_current, k):
            raise AttributeError(f"unknown read tunable {k!r}")
        setattr(_current, k, v)
    try:
        yield _current
    finally:
        for f in dataclasses.fields(ReadTunables):
            setattr(_current, f.name, getattr(old, f.name))
