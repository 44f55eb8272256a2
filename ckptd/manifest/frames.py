"""Frame tables: the stored size and checksum of every frame, as fixed-width integers.

A frame costs 16 bytes here — a little-endian ``uint64`` stored size and ``uint64`` xxh3
checksum — instead of a JSON pair and a Python object each: a 70B model at a thousand ranks has
over a million frames, and every rank used to decode all of them after every save and load.

Since format version 3 each rank writes one table file per save attempt,
``data/<attempt>/r<rank>.frames``: a 16-byte header (:data:`MAGIC`, then the frame count) and
the frames of all its chunks, chunk after chunk. A chunk in the manifest names its slice of a
table by ``[table, first, count, digest]``; the digest (xxh3 of the slice's bytes) lets a
reader fetch and check only the slices of the chunks it reads. No torch here.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, overload

import numpy as np
import xxhash

from ckptd.errors import CorruptCheckpoint

MAGIC = b"CKPTDFT1"
HEADER = 16  # MAGIC, then the frame count as uint64
ENTRY = 16  # stored size, checksum: two little-endian uint64
_DTYPE = np.dtype("<u8")


@dataclass(frozen=True)
class Frame:
    """One frame: its stored bytes and the checksum of those bytes (16 hex digits)."""

    stored: int
    checksum: str


class FrameTable:
    """The frames of one chunk (or a slice of them): ``stored`` and ``checksums`` arrays."""

    __slots__ = ("stored", "checksums", "_ends", "_bytes")

    def __init__(self, stored: np.ndarray, checksums: np.ndarray) -> None:
        self.stored = stored.astype(np.uint64, copy=False)
        self.checksums = checksums.astype(np.uint64, copy=False)
        self._ends: np.ndarray | None = None
        self._bytes: bytes | None = None  # to_bytes(), when made from them

    @classmethod
    def of(cls, frames: Sequence[tuple[int, int]]) -> FrameTable:
        """From ``(stored, checksum)`` pairs (checksums as integers). Packed as the table file
        stores them (a writer makes one per chunk: tens of thousands in a large reshard)."""
        return cls.split([v for pair in frames for v in pair], [0, len(frames)])[0]

    @classmethod
    def split(cls, pairs: Sequence[int], cuts: Sequence[int]) -> list[FrameTable]:
        """Tables of frames ``[cuts[i], cuts[i + 1])`` of the flat ``stored, checksum, ...``
        list ``pairs``, made as one array."""
        raw = struct.pack(f"<{len(pairs)}Q", *pairs)
        arr = np.frombuffer(raw, dtype=_DTYPE).reshape(-1, 2)
        out = []
        for a, b in itertools.pairwise(cuts):
            table = cls(arr[a:b, 0], arr[a:b, 1])
            table._bytes = raw[a * ENTRY : b * ENTRY]
            out.append(table)
        return out

    @classmethod
    def from_json(cls, pairs: Sequence[tuple[int, str]]) -> FrameTable:
        """From format 1/2's inline ``[stored, "hex"]`` pairs (already validated)."""
        return cls.of([(s, int(h, 16)) for s, h in pairs])

    def __len__(self) -> int:
        return len(self.stored)

    @overload
    def __getitem__(self, i: int) -> Frame: ...

    @overload
    def __getitem__(self, i: slice) -> FrameTable: ...

    def __getitem__(self, i: int | slice) -> Frame | FrameTable:
        if isinstance(i, slice):
            return FrameTable(self.stored[i], self.checksums[i])
        return Frame(int(self.stored[i]), f"{int(self.checksums[i]):016x}")

    def __iter__(self) -> Iterator[Frame]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FrameTable) and np.array_equal(self.stored, other.stored)
                and np.array_equal(self.checksums, other.checksums))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FrameTable({len(self)} frames, {self.total} bytes)"

    @property
    def total(self) -> int:
        """Stored bytes of all the frames."""
        return int(self.stored.sum()) if len(self) else 0

    def ends(self) -> np.ndarray:
        """``ends[i]``: stored bytes of frames ``[0, i)``; ``len + 1`` entries (int64)."""
        if self._ends is None:
            out = np.zeros(len(self) + 1, dtype=np.int64)
            np.cumsum(self.stored, out=out[1:])
            self._ends = out
        return self._ends

    def to_bytes(self) -> bytes:
        if self._bytes is not None:
            return self._bytes
        return np.stack([self.stored, self.checksums], axis=1).astype(_DTYPE).tobytes()

    def to_json(self) -> list[list[int | str]]:
        return [[f.stored, f.checksum] for f in self]


@dataclass(frozen=True)
class FrameRef:
    """A chunk's slice of a rank's table file: frames ``[first, first + count)``."""

    table: str  # the table file, relative to the step directory
    first: int
    count: int
    digest: str  # xxh3 of the slice's bytes, 16 hex digits

    @property
    def byte_range(self) -> tuple[int, int]:
        return HEADER + self.first * ENTRY, self.count * ENTRY


def table_file(tables: Sequence[FrameTable]) -> tuple[bytes, list[tuple[int, int, str]]]:
    """A table file holding ``tables`` one after another, and each one's ``(first, count,
    digest)``."""
    parts, refs, first = [], [], 0
    for t in tables:
        body = t.to_bytes()
        parts.append(body)
        refs.append((first, len(t), xxhash.xxh3_64_hexdigest(body)))
        first += len(t)
    return MAGIC + np.array([first], dtype=_DTYPE).tobytes() + b"".join(parts), refs


def parse_slice(raw: bytes | bytearray | memoryview, ref: FrameRef, where: str) -> FrameTable:
    """The frames of ``ref`` from its bytes in the table file, once their digest matches."""
    if len(raw) != ref.count * ENTRY:
        raise CorruptCheckpoint(f"{where}: frame table slice of {len(raw)} bytes, expected "
                                f"{ref.count} frames of {ENTRY}")
    if xxhash.xxh3_64_hexdigest(raw) != ref.digest:
        raise CorruptCheckpoint(f"{where}: frame table slice at frame {ref.first} does not "
                                "match its digest (damaged or edited)")
    arr = np.frombuffer(raw, dtype=_DTYPE).reshape(-1, 2)
    return FrameTable(arr[:, 0], arr[:, 1])


def check_sizes(table: FrameTable, length: int, frame_bytes: int, raw: bool) -> str | None:
    """Why ``table`` cannot be the frames of a chunk of ``length`` raw bytes in frames of
    ``frame_bytes`` (``raw``: stored uncompressed), or None. Vectorised: no object per frame."""
    n = len(table)
    if n != -(-length // frame_bytes):
        return f"{n} frames for {length} bytes in frames of {frame_bytes}"
    if n == 0:
        return None
    raw_len = np.full(n, frame_bytes, dtype=np.int64)
    raw_len[-1] = length - (n - 1) * frame_bytes
    huge = np.nonzero(table.stored > np.uint64(1 << 62))[0]
    if len(huge):
        return f"frame {int(huge[0])} stores {int(table.stored[huge[0]])} bytes"
    stored = table.stored.astype(np.int64)
    if raw:
        bad = np.nonzero(stored != raw_len)[0]
        if len(bad):
            i = int(bad[0])
            return f"raw frame {i} stores {int(table.stored[i])} bytes for {int(raw_len[i])}"
    bad = np.nonzero((stored == 0) | (stored > 2 * raw_len + 4096))[0]
    if len(bad):
        i = int(bad[0])
        return (f"frame {i} stores {int(stored[i])} bytes, outside "
                f"[1, {int(2 * raw_len[i] + 4096)}]")
    return None


class TableSource(Protocol):
    """Where a decoded manifest's frame tables are read from (``ckptd.catalog.FrameSource``:
    the step's directory in storage). The format says what a slice is, not how it is fetched."""

    where: str  # the step, for messages
    fetched_frames: int  # frames read from table files so far

    def tables(self, refs: Sequence[tuple[str, FrameRef]]) -> list[FrameTable]:
        """The frames of each ``(tensor, ref)``, in order, each checked against its digest."""
        ...
