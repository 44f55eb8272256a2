"""The fields of a tensor's entry and of its chunks, checked as they are read: a declared
dtype and shape (every format), and chunks as formats 1 to 4 write them, one JSON object each
with its frames inline (1, 2) or a reference into a frame table (3, 4). Format 5 stores chunks
as rows (:mod:`ckptd.manifest.rows`). A bad chunk raises a
:class:`~ckptd.errors.CorruptCheckpoint` naming the file and the tensor; a bad dtype or shape
raises one, or a ``ValueError`` naming the tensor that the reader
(:mod:`ckptd.manifest.parse`) turns into one naming the file.
"""

from __future__ import annotations

import math
from typing import Any

from ckptd import dtypes
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import codecs, rows
from ckptd.manifest.envelope import MAX_INT
from ckptd.manifest.fields import integer as _int
from ckptd.manifest.fields import integers as _ints
from ckptd.manifest.fields import safe_relpath as _safe_relpath
from ckptd.manifest.frames import FrameRef, FrameTable
from ckptd.manifest.schema import Chunk, TensorEntry, checked_dtype_name
from ckptd.regions import Box


def declared(name: str, dtype_s: Any, shape_l: Any, where: str,
              ) -> tuple[str, tuple[int, ...], int]:
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptCheckpoint(f"{where}: tensor name {name!r} is not valid")
    if not isinstance(shape_l, list):
        raise ValueError(f"{name}: shape {shape_l!r} is not a list")
    dtype = checked_dtype_name(dtype_s, f"{where}: {name}")
    shape = _ints(shape_l)
    itemsize = dtypes.ITEMSIZE[dtype]
    if math.prod(shape) * itemsize > MAX_INT:
        raise CorruptCheckpoint(f"{where}: {name}: shape {list(shape)} is impossibly large")
    return dtype, shape, itemsize


def inline_tensor(name: str, t: dict[str, Any], where: str) -> TensorEntry:
    """Formats 1 and 2: a tensor with its chunks and their frames inline."""
    dtype, shape, itemsize = declared(name, t["dtype"], t["shape"], where)
    return TensorEntry(dtype, shape, chunks(name, t["chunks"], Box.whole(shape), itemsize,
                                             where, None))


def chunks(name: str, items: list[Any], whole: Box, itemsize: int, where: str,
            tables: list[str] | rows.Lists | None) -> tuple[Chunk, ...]:
    if isinstance(tables, rows.Lists):  # version 5
        return rows.decode(name, items, whole, itemsize, where, tables)
    chunks = []
    for c in items:
        try:
            chunks.append(_chunk(c, whole, itemsize, tables))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise CorruptCheckpoint(
                f"{where}: {name}: malformed chunk ({type(e).__name__}: {e})"
            ) from e
    for file in {ch.file for ch in chunks}:  # chunks of a tensor share few files
        _safe_relpath(file, where, name)
    return tuple(chunks)


def _chunk(c: dict[str, Any], whole: Box, itemsize: int, tables: list[str] | None) -> Chunk:
    """One chunk. Inline frames (formats 1, 2) are validated completely here; a reference to a
    frame table (format 3) is checked for its count here and for its sizes when it is read
    (:meth:`Manifest.with_frames`). A reader may then trust that the frames tile the chunk (raw
    frames have exactly their raw length) and stay inside 2^62 bytes."""
    raw_box = c["box"]
    if not (isinstance(raw_box, list) and len(raw_box) == 2):
        raise ValueError(f"a box is [offsets, sizes], got {raw_box!r}")
    offsets, sizes = _ints(raw_box[0]), _ints(raw_box[1])
    ends = tuple(map(int.__add__, offsets, sizes))
    if not (len(offsets) == len(sizes) == whole.ndim
            and all(map(int.__le__, ends, whole.sizes))):
        raise ValueError(f"box {raw_box} outside shape {list(whole.sizes)}")
    box = Box._of(offsets, sizes, ends)  # checked just above
    length = _int(c["length"])
    if length != box.numel * itemsize:
        raise ValueError(f"a chunk of {box.numel} elements claims {length} bytes")
    codec = c["codec"]
    if codec not in codecs.CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    frame_bytes = _int(c["frame_bytes"], lo=1)
    if frame_bytes % itemsize:
        raise ValueError(f"frame size {frame_bytes} is not a multiple of the item size")
    offset = _int(c["offset"])
    n = -(-length // frame_bytes)
    table = c["frames"]
    frames: FrameTable | None = None
    ref: FrameRef | None = None
    if tables is not None:
        if not (isinstance(table, list) and len(table) == 4 and isinstance(table[3], str)
                and len(table[3]) == 16):
            raise ValueError(f"frames {table!r} are not [table, first, count, 16-hex digest]")
        t, first, count = _int(table[0], hi=len(tables) - 1), _int(table[1]), _int(table[2])
        if count != n:
            raise ValueError(f"{count} frames for {length} bytes in frames of {frame_bytes}")
        ref = FrameRef(tables[t], first, count, table[3])
    else:
        if not isinstance(table, list) or len(table) != n:
            raise ValueError(
                f"{len(table) if isinstance(table, list) else table!r} frames for {length} "
                f"bytes in frames of {frame_bytes}"
            )
        pairs = []
        for i, f in enumerate(table):
            if not (isinstance(f, list) and len(f) == 2 and isinstance(f[1], str)
                    and len(f[1]) == 16):
                raise ValueError(f"frame {i} is not [stored bytes, 16-hex-digit checksum]: {f!r}")
            raw_len = min(frame_bytes, length - i * frame_bytes)
            stored = _int(f[0], lo=1, hi=2 * raw_len + 4096)
            if codec == codecs.RAW and stored != raw_len:
                raise ValueError(f"raw frame {i} stores {stored} bytes for {raw_len}")
            pairs.append((stored, f[1]))
        frames = FrameTable.from_json(pairs)
        _int(offset + frames.total)
    return Chunk(
        box=box,
        file=c["file"] if isinstance(c["file"], str) else "",
        offset=offset,
        length=length,
        codec=codec,
        frame_bytes=frame_bytes,
        frames=frames,
        rank=_int(c["rank"]),
        ref=ref,
    )


__all__ = ["chunks", "declared", "inline_tensor"]
