"""A chunk as manifests of version 5 and partials of version 3 store it: one JSON array, a *row*

    [offsets, sizes, file, offset, codec, frame_bytes, table, first, digest]

``file``, ``codec`` and ``table`` index the head's lists ``"files"`` (``[path, rank]``: a
data file and the rank that wrote it), ``"codecs"`` and ``"tables"``; the chunk's raw length
(its box's elements × the item size) and its frame count (the length over ``frame_bytes``,
rounded up) follow from the other fields, so a row does not repeat them. ~50-70 bytes a chunk
where an object with named fields took ~180 (``docs/format.md``, *Chunk rows*).

Reading rows back, every field checked as :mod:`ckptd.manifest.parse` checks a chunk of an
older version; :class:`~ckptd.manifest.schema.Chunk` writes them (``Chunk.to_row``). No torch
here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import codecs
from ckptd.manifest.fields import integer, integers, safe_relpath
from ckptd.manifest.frames import FrameRef
from ckptd.manifest.schema import Chunk
from ckptd.regions import Box

# the fields of a row, in order (tests and tools edit rows by these names)
FIELDS = ("offsets", "sizes", "file", "offset", "codec", "frame_bytes", "table", "first",
          "digest")
AT = {f: i for i, f in enumerate(FIELDS)}
_HEX16 = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Lists:
    """The head's lists that rows index. ``files`` are checked for their form here and each
    path when a tensor's rows use it (so that a bad one is reported with the tensor)."""

    files: list[tuple[str, int]]
    codecs: list[str]
    tables: list[str]


def lists(doc: dict[str, Any], tables: list[str]) -> Lists:
    """The lists of a head of version 5 (``tables`` already checked); ValueError or TypeError
    naming what is wrong."""
    files, names = doc["files"], doc["codecs"]
    if not isinstance(files, list):
        raise TypeError("'files' is not a list")
    for i, f in enumerate(files):
        if not (type(f) is list and len(f) == 2 and type(f[0]) is str):
            raise ValueError(f"files[{i}] is not [path, rank]: {f!r}")
        integer(f[1])
    if not (isinstance(names, list) and all(type(n) is str for n in names)):
        raise ValueError(f"'codecs' is not a list of names: {names!r}")
    return Lists([(p, r) for p, r in files], names, tables)


def decode(name: str, items: Any, whole: Box, itemsize: int, where: str, lists: Lists,
           ) -> tuple[Chunk, ...]:
    """The chunks of tensor ``name`` (of box ``whole``) from its rows: a CorruptCheckpoint
    naming ``where`` and ``name`` at the first field that is wrong."""
    if not isinstance(items, list):
        raise CorruptCheckpoint(f"{where}: {name}: no list of chunks")
    out = []
    for i, r in enumerate(items):
        try:
            out.append(_row(r, whole, itemsize, lists))
        except (TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpoint(
                f"{where}: {name}: malformed chunk {i} ({type(e).__name__}: {e})") from e
    for file in {c.file for c in out}:  # the rows of a tensor name few files
        safe_relpath(file, where, name)
    return tuple(out)


def _row(r: Any, whole: Box, itemsize: int, lists: Lists) -> Chunk:
    if type(r) is not list or len(r) != len(FIELDS):
        shown = repr(r) if len(repr(r)) <= 200 else repr(r)[:200] + "..."
        raise ValueError(f"a chunk is [{', '.join(FIELDS)}], got {shown}")
    offs, sizes_, file, offset, codec_i, frame_bytes, table, first, digest = r
    offsets, sizes = integers(offs), integers(sizes_)
    ends = tuple(map(int.__add__, offsets, sizes))
    if not (len(offsets) == len(sizes) == whole.ndim
            and all(map(int.__le__, ends, whole.sizes))):
        raise ValueError(f"box {[offs, sizes_]} outside shape {list(whole.sizes)}")
    box = Box._of(offsets, sizes, ends)  # checked just above
    length = box.numel * itemsize  # at most the tensor's bytes, which are checked to fit
    path, rank = lists.files[_index(file, len(lists.files), "file")]
    codec = lists.codecs[_index(codec_i, len(lists.codecs), "codec")]
    if codec not in codecs.CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    frame_bytes = integer(frame_bytes, lo=1)
    if frame_bytes % itemsize:
        raise ValueError(f"frame size {frame_bytes} is not a multiple of the item size")
    ref_table = lists.tables[_index(table, len(lists.tables), "frame table")]
    if type(digest) is not str or not _HEX16.fullmatch(digest):
        raise ValueError(f"frames digest {digest!r} is not 16 hex digits")
    return Chunk(box, path, integer(offset), length, codec, frame_bytes, None, rank,
                 FrameRef(ref_table, integer(first), -(-length // frame_bytes), digest))


def _index(v: Any, n: int, what: str) -> int:
    i = integer(v)
    if i >= n:
        raise ValueError(f"{what} {i} is not in the manifest's {n} {what}s")
    return i
