"""On-disk records: the manifest of a committed step and the partial manifest of one rank.

The bytes on disk are the contract (documented in ``docs/format.md``); these frozen dataclasses
only give them types. Everything is JSON — never pickle — so reading a checkpoint cannot run code.

Commit rule: a step exists iff ``<step>/manifest.json`` exists. It is written last, after every
data file and every rank's partial manifest is durable, with one atomic step (temp file + rename
on a filesystem, a single PUT on an object store); readers ignore everything a manifest does not
name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd import dtypes
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import codecs
from ckptd.manifest.envelope import (
    FORMAT,
    MAX_INT,
    TENSORS_KEY,
    VERSION,
    parse_json,
    seal_in_place,
    split_doc,
    tail_field,
    unsealed_start,
)
from ckptd.manifest.frames import FrameRef, FrameSource, FrameTable, check_sizes
from ckptd.regions import Box

if TYPE_CHECKING:
    import torch

TensorDoc = tuple[str, str, list[int], list[dict[str, Any]]]  # name, dtype, shape, chunks

CHECKSUM = "xxh3_64"

def dtype_name(dtype: torch.dtype | str) -> str:
    return dtypes.name_of(dtype)


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """The torch dtype of a name in a manifest (CorruptCheckpoint naming ``where`` if none)."""
    return dtypes.torch_dtype(_checked_name(name, where))


def _checked_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or name not in dtypes.ITEMSIZE:
        raise CorruptCheckpoint(f"{where}: unknown dtype {name!r}")
    return name


@dataclass(frozen=True)
class Chunk:
    """``box`` of a logical tensor, stored row-major at ``file[offset : offset + length]``.

    The raw bytes are split into frames of ``frame_bytes`` (the last one shorter); ``codec``
    says how each frame is stored (``raw``, ``zstd`` or ``zstd-planes``, see ``manifest/codecs``).
    ``frames`` are their stored sizes and checksums; a chunk decoded from a manifest of format 3
    has only ``ref``, its slice of a rank's frame table (:meth:`Manifest.with_frames` reads it).
    """

    box: Box
    file: str
    offset: int
    length: int
    codec: str
    frame_bytes: int
    frames: FrameTable | None = field(hash=False)
    rank: int
    ref: FrameRef | None = field(default=None, compare=False)

    @property
    def n_frames(self) -> int:
        return -(-self.length // self.frame_bytes)

    @property
    def table(self) -> FrameTable:
        """``frames``, which a reader has (:meth:`Manifest.with_frames`) before it reads."""
        if self.frames is None:
            raise RuntimeError(f"the frames of the chunk at {self.file}+{self.offset} were "
                               "not read (Manifest.with_frames)")
        return self.frames

    def to_json(self, tables: dict[str, int]) -> dict[str, Any]:
        if self.ref is None:
            raise ValueError(f"chunk at {self.file}+{self.offset} has no frame table slice")
        return {
            "box": self.box.to_json(),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "codec": self.codec,
            "frame_bytes": self.frame_bytes,
            "frames": [tables[self.ref.table], self.ref.first, self.ref.count, self.ref.digest],
            "rank": self.rank,
        }


class TensorEntry:
    """A logical tensor: dtype, global shape and its chunks. The chunks of an entry decoded from
    a manifest of format 3 are parsed on first use, so a load pays only for what it asks for.
    The dtype is kept by name (``dtype_name``, ``itemsize``): ``dtype``, the torch dtype, is the
    only thing here that imports torch."""

    __slots__ = ("dtype_name", "shape", "_chunks", "_decode")

    def __init__(self, dtype: torch.dtype | str, shape: tuple[int, ...],
                 chunks: tuple[Chunk, ...] = (), *,
                 decode: Callable[[], tuple[Chunk, ...]] | None = None) -> None:
        self.dtype_name, self.shape = dtypes.name_of(dtype), tuple(shape)
        self._chunks: tuple[Chunk, ...] | None = None if decode is not None else tuple(chunks)
        self._decode = decode

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.torch_dtype(self.dtype_name)

    @property
    def itemsize(self) -> int:
        return dtypes.ITEMSIZE[self.dtype_name]

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        if self._chunks is None:
            assert self._decode is not None
            self._chunks, self._decode = self._decode(), None
        return self._chunks

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorEntry) and (self.dtype_name, self.shape, self.chunks)
                == (other.dtype_name, other.shape, other.chunks))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        chunks = "?" if self._chunks is None else str(len(self._chunks))
        return f"TensorEntry({self.dtype_name}, {list(self.shape)}, {chunks} chunks)"


@dataclass(frozen=True)
class Manifest:
    """A committed step (``manifest.json``) or one rank's share of it (a partial)."""

    step: int
    attempt: str
    world_size: int
    created: float
    tensors: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    locals: dict[str, dict[str, Any]] = field(default_factory=dict)  # rank (str) -> name -> value
    training: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None  # set on partials only
    generation: int = 0  # the committing run's generation (owner.json); 0 before generations
    # partials only: tensors the rank holds that another rank wrote (it lists what it wrote)
    holds: tuple[str, ...] = ()
    # where this manifest's frame tables are read from (set when it was read from storage)
    frames: FrameSource | None = field(default=None, compare=False, repr=False)
    # names of the tensors whose chunks were decoded (format 3 decodes them on first use)
    decoded: set[str] = field(default_factory=set, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(c.length for t in self.tensors.values() for c in t.chunks)

    def with_frames(self, items: Sequence[tuple[str, Chunk]]) -> list[Chunk]:
        """The chunks of ``(tensor, chunk)`` with their frames, read from the frame tables where
        this manifest has only references (one request per table file)."""
        todo = [(n, c.ref) for n, c in items if c.frames is None and c.ref is not None]
        tables: dict[FrameRef, FrameTable] = {}
        if todo:
            if self.frames is None:
                raise CorruptCheckpoint(f"step {self.step}: frame tables not available")
            tables = dict(zip((r for _, r in todo), self.frames.tables(todo), strict=True))
        out = []
        for name, c in items:
            if c.frames is not None:
                out.append(c)
                continue
            if c.ref is None:
                raise CorruptCheckpoint(f"{name}: chunk at {c.file}+{c.offset} has no frames")
            table = tables[c.ref]
            where = self.frames.where if self.frames is not None else ""
            problem = check_sizes(table, c.length, c.frame_bytes, c.codec == codecs.RAW)
            if problem is None and c.offset + table.total > MAX_INT:
                problem = f"offset {c.offset} + {table.total} stored bytes"
            if problem is not None:
                raise CorruptCheckpoint(f"{where}/{c.ref.table}: {name}: malformed frame table "
                                        f"({problem})")
            out.append(dataclasses.replace(c, frames=table))
        return out

    def to_json(self) -> dict[str, Any]:
        """The whole manifest as one JSON object (``ckptd inspect --json``)."""
        tables = _tables(self.tensors)
        out = self._head(tables)
        out["tensors"] = {name: {"dtype": dtype, "shape": shape, "chunks": chunks}
                          for name, dtype, shape, chunks in self._tensor_docs(tables)}
        return out

    def _tensor_docs(self, tables: dict[str, int]) -> Iterator[TensorDoc]:
        for k, v in sorted(self.tensors.items()):
            yield k, v.dtype_name, list(v.shape), [c.to_json(tables) for c in v.chunks]

    def _head(self, tables: dict[str, int]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "checksum": CHECKSUM,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "created": self.created,
            "values": self.values,
            "locals": self.locals,
            "training": self.training,
            "tables": list(tables),
        }
        if self.rank is not None:
            out["rank"] = self.rank
            if self.holds:
                out["holds"] = list(self.holds)
        else:
            out["generation"] = self.generation
        return out

    def encode(self) -> bytes:
        """The file's bytes (format 3): see :func:`encode_doc`. Each tensor's JSON form is made
        and encoded in turn (a manifest of 50,000 chunks never exists as one JSON object)."""
        tables = _tables(self.tensors)
        return _encode(self._head(tables), self._tensor_docs(tables))


def _tables(tensors: dict[str, TensorEntry]) -> dict[str, int]:
    names = sorted({c.ref.table for t in tensors.values() for c in t.chunks if c.ref})
    return {n: i for i, n in enumerate(names)}


def encode_doc(doc: dict[str, Any]) -> bytes:
    """A manifest file (format 3, ``docs/format.md``) from its whole JSON form (``to_json``):
    compact JSON whose first key is its own digest (:func:`seal`), then the length of its tail;
    the head holds an index of every tensor's dtype, shape and the byte range of its chunks in
    the tail, so that a reader parses the head and only the entries it needs."""
    head = {k: v for k, v in doc.items()
            if k not in ("digest", "tail", "index", "tensors", "nbytes")}
    return _encode(head, ((n, t["dtype"], t["shape"], t["chunks"])
                          for n, t in doc["tensors"].items()))


def _encode(head: dict[str, Any], tensors: Iterable[TensorDoc]) -> bytes:
    texts: list[bytes] = []
    index: dict[str, list[Any]] = {}
    nbytes = 0
    pos = 1  # inside the tensors object, after its "{"
    for name, dtype, shape, chunks in tensors:
        key = json.dumps(name).encode() + b":"
        body = json.dumps({"chunks": chunks}, separators=(",", ":")).encode()
        if texts:
            pos += 1  # the comma before it
        index[name] = [dtype, shape, pos + len(key), len(body)]
        texts.append(key + body)
        pos += len(key) + len(body)
        nbytes += sum(int(c["length"]) for c in chunks)
    head["nbytes"] = nbytes
    head["index"] = index
    head_json = json.dumps(head, separators=(",", ":"), allow_nan=True).encode()
    # seal(tail_field + head + tail) built in one buffer: each tensor's text is freed as it is
    # appended (the manifest of a 1024-rank reshard is ~10 MB; the texts, the joined tail, the
    # body, the unsealed and the sealed document were five copies of it)
    out = unsealed_start()
    out += tail_field(len(TENSORS_KEY) + pos + 2)[1:]  # tail: TENSORS_KEY{<texts>}}
    out += head_json[1:-1]
    out += TENSORS_KEY + b"{"
    texts.reverse()
    while texts:
        out += texts.pop()
        if texts:
            out += b","
    out += b"}}"
    return bytes(seal_in_place(out))


def whole_doc(raw: bytes, where: str) -> dict[str, Any]:
    """The whole JSON form of a manifest file of any format (what :func:`encode_doc` takes):
    for tools and tests; a reader decodes with :func:`decode`."""
    doc, tail_at = split_doc(raw, where)
    doc = {k: v for k, v in doc.items() if k not in ("digest", "tail", "nbytes")}
    if tail_at is not None:
        chunks = parse_json(raw[tail_at:-1], where)
        index = doc.pop("index")
        doc["tensors"] = {n: {"dtype": index[n][0], "shape": index[n][1],
                              "chunks": chunks[n]["chunks"]} for n in index}
    return doc


def decode(raw: bytes, where: str, frames: FrameSource | None = None, *,
           eager: bool = False) -> Manifest:
    """Parse and validate a manifest; any defect raises :class:`CorruptCheckpoint` naming
    ``where`` (the file) and, where it applies, the logical tensor. In format 3 the tensors'
    chunks are parsed (and checked) when first used, or all at once with ``eager`` (one JSON
    parse: the coordinator's merge uses every chunk of every partial); ``frames`` reads their
    frame tables."""
    doc, tail_at = split_doc(raw, where)
    try:
        decoded: set[str] = set()
        if tail_at is None:
            if not isinstance(doc["tensors"], dict):
                raise TypeError("'tensors' is not an object")
            tensors = {name: _tensor(name, t, where) for name, t in doc["tensors"].items()}
        else:
            tensors = _index(raw, tail_at, doc, where, decoded)
            if eager:
                tensors = _parsed(raw, tail_at, tensors, doc["tables"], where)
        return Manifest(
            step=_int(doc["step"]),
            attempt=_name(doc["attempt"]),
            world_size=_int(doc["world_size"], lo=1),
            created=float(doc["created"]),
            tensors=tensors,
            values=dict(doc.get("values", {})),
            locals={str(k): dict(v) for k, v in doc.get("locals", {}).items()},
            training=dict(doc.get("training", {})),
            rank=_int(doc["rank"]) if "rank" in doc else None,
            generation=_int(doc.get("generation", 0)),
            holds=tuple(_held(doc.get("holds", []))),
            frames=frames,
            decoded=decoded,
        )
    except CorruptCheckpoint:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CorruptCheckpoint(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e


def _index(raw: bytes, tail_at: int, doc: dict[str, Any], where: str, decoded: set[str],
           ) -> dict[str, TensorEntry]:
    """Format 3: the tensors of the head's index, each parsing its chunks on first use."""
    tables = doc["tables"]
    if not isinstance(tables, list):
        raise TypeError("'tables' is not a list")
    for t in tables:
        _safe_relpath(t, where, "frame table")
        if not t.endswith(".frames"):
            raise CorruptCheckpoint(f"{where}: frame table {t!r} is not a .frames file")
    index = doc["index"]
    if not isinstance(index, dict):
        raise TypeError("'index' is not an object")
    end = len(raw) - 2  # the tensors object's closing "}" and the document's
    out = {}
    for name, item in index.items():
        if not (isinstance(item, list) and len(item) == 4):
            raise ValueError(f"{name}: index entry {item!r} is not [dtype, shape, start, length]")
        dtype, shape, itemsize = _declared(name, item[0], item[1], where)
        start, length = tail_at + _int(item[2]), _int(item[3])
        if start + length > end:
            raise CorruptCheckpoint(f"{where}: {name}: index points past the manifest's end")
        out[name] = TensorEntry(dtype, shape, decode=functools.partial(
            _lazy_chunks, raw, start, length, name, shape, itemsize, tables, where, decoded))
    return out


def _parsed(raw: bytes, tail_at: int, index: dict[str, TensorEntry], tables: list[str],
            where: str) -> dict[str, TensorEntry]:
    """Every tensor of ``index`` with its chunks, from one parse of the tensors object."""
    body = parse_json(raw[tail_at:-1], where)
    if not isinstance(body, dict) or body.keys() != index.keys():
        raise CorruptCheckpoint(f"{where}: the tensors do not match the index")
    out = {}
    for name, e in index.items():
        items = body[name].get("chunks") if isinstance(body[name], dict) else None
        if not isinstance(items, list):
            raise CorruptCheckpoint(f"{where}: {name}: no list of chunks")
        out[name] = TensorEntry(e.dtype_name, e.shape, _chunks(
            name, items, Box.whole(e.shape), dtypes.ITEMSIZE[e.dtype_name], where, tables))
    return out


def _lazy_chunks(raw: bytes, start: int, length: int, name: str, shape: tuple[int, ...],
                 itemsize: int, tables: list[str], where: str, decoded: set[str],
                 ) -> tuple[Chunk, ...]:
    decoded.add(name)
    doc = parse_json(raw[start : start + length], f"{where}: {name}")
    items = doc.get("chunks") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise CorruptCheckpoint(f"{where}: {name}: the index does not point at its chunks")
    return _chunks(name, items, Box.whole(shape), itemsize, where, tables)


def _held(names: Any) -> list[str]:
    # the checks run in C: a partial at a thousand ranks names thousands of tensors
    if not isinstance(names, list) or (names and set(map(type, names)) != {str}) or "" in names:
        raise ValueError(f"'holds' is not a list of names: {names!r}")
    return names


def _ints(v: Any) -> tuple[int, ...]:
    """A short list of integers in [0, MAX_INT] (a box, a shape) as a tuple: ``_int`` of each,
    inlined (a thousand ranks' partials hold tens of thousands of boxes)."""
    if not isinstance(v, list):
        raise ValueError(f"expected a list of integers, got {v!r}")
    for x in v:
        if type(x) is not int or not 0 <= x <= MAX_INT:
            _int(x)  # raises, naming it
    return tuple(v)


def _int(v: Any, lo: int = 0, hi: int = MAX_INT) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{v} is outside [{lo}, {hi}]")
    return v


def _name(v: Any) -> str:
    if not isinstance(v, str) or not v or "\0" in v or "/" in v:
        raise ValueError(f"not a valid name: {v!r}")
    return v


_CONTROL = re.compile(r"[\x00-\x1f]")  # NUL and control characters


def _safe_relpath(path: Any, where: str, tensor: str) -> str:
    """Data paths are relative and stay inside the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise CorruptCheckpoint(f"{where}: {tensor}: chunk file {path!r} is not a path")
    if not _inside(path):
        raise CorruptCheckpoint(
            f"{where}: {tensor}: chunk file {path!r} escapes the checkpoint directory"
        )
    return path


@functools.lru_cache(maxsize=1 << 14)
def _inside(path: str) -> bool:
    """A manifest names the same few files (and frame tables) for thousands of tensors."""
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


def _declared(name: str, dtype_s: Any, shape_l: Any, where: str,
              ) -> tuple[str, tuple[int, ...], int]:
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptCheckpoint(f"{where}: tensor name {name!r} is not valid")
    if not isinstance(shape_l, list):
        raise ValueError(f"{name}: shape {shape_l!r} is not a list")
    dtype = _checked_name(dtype_s, f"{where}: {name}")
    shape = _ints(shape_l)
    itemsize = dtypes.ITEMSIZE[dtype]
    if math.prod(shape) * itemsize > MAX_INT:
        raise CorruptCheckpoint(f"{where}: {name}: shape {list(shape)} is impossibly large")
    return dtype, shape, itemsize


def _tensor(name: str, t: dict[str, Any], where: str) -> TensorEntry:
    """Formats 1 and 2: a tensor with its chunks and their frames inline."""
    dtype, shape, itemsize = _declared(name, t["dtype"], t["shape"], where)
    return TensorEntry(dtype, shape, _chunks(name, t["chunks"], Box.whole(shape), itemsize,
                                             where, None))


def _chunks(name: str, items: list[Any], whole: Box, itemsize: int, where: str,
            tables: list[str] | None) -> tuple[Chunk, ...]:
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
