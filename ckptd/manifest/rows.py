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

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ckptd import dtypes
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import codecs
from ckptd.manifest.envelope import MAX_INT
from ckptd.manifest.fields import inside, integer, integers, safe_relpath
from ckptd.manifest.frames import FrameRef
from ckptd.manifest.schema import Chunk, TensorEntry
from ckptd.regions import Box

# the fields of a row, in order (tests and tools edit rows by these names)
FIELDS = ("offsets", "sizes", "file", "offset", "codec", "frame_bytes", "table", "first",
          "digest")
AT = {f: i for i, f in enumerate(FIELDS)}
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX16S = re.compile(r"(?:[0-9a-f]{16})*")  # the digests of a tensor's rows, joined


@dataclass(slots=True)
class Lists:
    """The head's lists that rows index, and what decoding the rows has found so far. ``files``
    are checked for their form here and each path when a tensor's rows use it (so that a bad
    one is reported with the tensor)."""

    files: list[tuple[str, int]]
    codecs: list[str]
    tables: list[str]
    # for :func:`_quick`: whether each codec is known; the files whose paths were found to stay
    # inside the step so far (checked when a row first uses them)
    known: list[bool] = field(compare=False)
    inside: set[int] = field(default_factory=set, compare=False)
    # the boxes made so far, by the tensor's shape and then the row's offsets and sizes (the
    # chunks of a rank's tensors of one shape have the same few boxes)
    boxes: dict[tuple[int, ...], dict[tuple[int, ...], Box]] = field(default_factory=dict,
                                                                     compare=False)


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
    return Lists([(p, r) for p, r in files], names, tables, [n in codecs.CODECS for n in names])


def decode(name: str, items: Any, whole: Box, itemsize: int, where: str, lists: Lists,
           ) -> tuple[Chunk, ...]:
    """The chunks of tensor ``name`` (of box ``whole``) from its rows: a CorruptCheckpoint
    naming ``where`` and ``name`` at the first field that is wrong."""
    if not isinstance(items, list):
        raise CorruptCheckpoint(f"{where}: {name}: no list of chunks")
    digests: list[str] = []
    quick = _quick(items, whole, itemsize, lists, digests)
    if quick is not None and _HEX16S.fullmatch("".join(digests)):
        return quick
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


def quick_tensors(body: dict[str, Any], lists: Lists) -> dict[str, TensorEntry] | None:
    """The tensors of a partial's tail (``name: [dtype, shape, rows]``, a partial of version 3)
    when every one passes every check that ``ckptd.manifest.parse`` makes of it, in few Python
    operations a tensor; None at the first thing that is off (the reader's own checks then
    say what)."""
    out = {}
    declared: dict[tuple[Any, ...], tuple[int, Box]] = {}  # (dtype, *shape) -> itemsize, box
    digests: list[str] = []
    for name, entry in body.items():
        if not (type(entry) is list and len(entry) == 3 and name and "\0" not in name):
            return None
        dtype, shape, items = entry
        if not (type(dtype) is str and type(shape) is list and type(items) is list):
            return None
        for x in shape:  # True == 1 and 1.0 == 1 as keys: the types first
            if type(x) is not int:
                return None
        key = (dtype, *shape)
        known = declared.get(key)
        if known is None:
            itemsize = dtypes.ITEMSIZE.get(dtype, 0)
            if not (itemsize and min(shape, default=0) >= 0
                    and max(shape, default=0) <= MAX_INT  # (a dimension of 0 hides the rest)
                    and math.prod(shape) * itemsize <= MAX_INT):
                return None
            known = declared[key] = itemsize, Box.whole(tuple(shape))
        itemsize, whole = known
        chunks = _quick(items, whole, itemsize, lists, digests)
        if chunks is None:
            return None
        out[name] = TensorEntry(dtype, whole.sizes, chunks)
    if not _HEX16S.fullmatch("".join(digests)):
        return None
    return out


def _quick(items: list[Any], whole: Box, itemsize: int, lists: Lists, digests: list[str],
           ) -> tuple[Chunk, ...] | None:
    """What :func:`_row` makes of each row, and :func:`decode` checks of their files, for rows
    that pass every check — in few Python operations a row (a coordinator decodes every row of
    every partial each save) — or None at the first thing that is off: :func:`_row` then says
    what. The rows' digests are added to ``digests``, for the caller to check (with
    :data:`_HEX16S`: one match for many)."""
    files, names, tables, known, inside_ = (lists.files, lists.codecs, lists.tables,
                                            lists.known, lists.inside)
    shape = whole.sizes
    ndim = len(shape)
    boxes = lists.boxes.get(shape)
    if boxes is None:
        boxes = lists.boxes[shape] = {}
    out = []
    for r in items:
        if type(r) is not list or len(r) != 9:
            return None
        offs, sizes, file, offset, codec_i, frame_bytes, table, first, digest = r
        if not (type(offs) is list and type(sizes) is list and len(offs) == ndim == len(sizes)
                and type(file) is int and 0 <= file < len(files)
                and type(offset) is int and 0 <= offset <= MAX_INT
                and type(codec_i) is int and 0 <= codec_i < len(names) and known[codec_i]
                and type(frame_bytes) is int and 0 < frame_bytes <= MAX_INT
                and not frame_bytes % itemsize
                and type(table) is int and 0 <= table < len(tables)
                and type(first) is int and 0 <= first <= MAX_INT
                and type(digest) is str and len(digest) == 16):
            return None
        key = (*offs, *sizes)
        for x in key:  # True == 1 and 1.0 == 1 as keys: the types first
            if type(x) is not int:
                return None
        box = boxes.get(key)
        if box is None:
            ends = tuple(map(int.__add__, offs, sizes))
            if min(key, default=0) < 0 or not all(map(int.__le__, ends, shape)):
                return None  # (inside the shape, each is <= MAX_INT)
            box = boxes[key] = Box._of(tuple(offs), tuple(sizes), ends)
        path, rank = files[file]
        if file not in inside_:
            if not (path and inside(path)):
                return None
            inside_.add(file)
        digests.append(digest)
        length = box.numel * itemsize
        # the constructors, not a __dict__ assigned whole: that shares no keys with the other
        # chunks' (twice the memory of each)
        out.append(Chunk(box, path, offset, length, names[codec_i], frame_bytes, None, rank,
                         FrameRef(tables[table], first, -(-length // frame_bytes), digest)))
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
