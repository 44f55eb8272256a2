"""On-disk records: the manifest of a committed step and the partial manifest of one rank.

The bytes on disk are the contract (documented in ``docs/format.md``); these frozen dataclasses
only give them types, and ``encode`` writes them. Everything is JSON — never pickle — so reading a
checkpoint cannot run code; :mod:`ckptd.manifest.parse` reads them back, checking every field.

Commit rule: a step exists iff ``<step>/manifest.json`` exists. It is written last, after every
data file and every rank's partial manifest is durable, with one atomic step (temp file + rename
on a filesystem, a single PUT on an object store); readers ignore everything a manifest does not
name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ckptd import dtypes
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import codecs
from ckptd.manifest import values as typed
from ckptd.manifest.encode import TensorDoc, encode_file
from ckptd.manifest.envelope import FORMAT, MAX_INT, VERSION
from ckptd.manifest.frames import FrameRef, FrameTable, TableSource, check_sizes
from ckptd.regions import Box

if TYPE_CHECKING:
    import torch

    from ckptd.manifest.entries import RangedTail

LOCAL_PREFIX = "__local__"  # ckptd.sharding.LOCAL_PREFIX: per-rank values' names

CHECKSUM = "xxh3_64"
# A partial's own version, under the key "partial" (absent: 1). 1: the tensors a rank holds but
# a replica wrote are named in "holds"; 2: they are summed up per replica set ("replicated",
# :class:`ReplicaSet`), so a partial grows with what its rank wrote, not with the model; 3 (in
# a manifest of version 5): chunk rows, and no index (the coordinator parses a partial whole),
# each tensor ``[dtype, shape, rows]`` in the tail.
PARTIAL_VERSION = 3


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtypes.name_of(dtype)


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """The torch dtype of a name in a manifest (CorruptCheckpoint naming ``where`` if none)."""
    return dtypes.torch_dtype(checked_dtype_name(name, where))


def checked_dtype_name(name: Any, where: str) -> str:
    """``name`` if it names a dtype ckptd stores (CorruptCheckpoint naming ``where`` if not)."""
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

    def to_row(self, keys: Keys) -> list[Any]:
        """The chunk's row (``ckptd.manifest.rows``, which reads it back): ``length`` and the
        frame count are left out, a reader derives them from the box and ``frame_bytes``."""
        ref = self.ref
        if ref is None:
            raise ValueError(f"chunk at {self.file}+{self.offset} has no frame table slice")
        return [list(self.box.offsets), list(self.box.sizes), keys.files[self.file, self.rank],
                self.offset, keys.codecs[self.codec], self.frame_bytes, keys.tables[ref.table],
                ref.first, ref.digest]


@dataclass(frozen=True)
class Keys:
    """What the rows of a manifest index: its ``[file, rank]`` pairs, codecs and frame tables,
    each numbered in sorted order (the head's ``files``, ``codecs`` and ``tables``)."""

    files: dict[tuple[str, int], int]
    codecs: dict[str, int]
    tables: dict[str, int]

    @classmethod
    def of(cls, tensors: dict[str, TensorEntry]) -> Keys:
        files: set[tuple[str, int]] = set()
        names: set[str] = set()
        tables: set[str] = set()
        for t in tensors.values():
            for c in t.chunks:
                files.add((c.file, c.rank))
                names.add(c.codec)
                if c.ref is not None:
                    tables.add(c.ref.table)
        return cls({f: i for i, f in enumerate(sorted(files))},
                   {n: i for i, n in enumerate(sorted(names))},
                   {n: i for i, n in enumerate(sorted(tables))})

    def to_json(self) -> dict[str, list[Any]]:
        return {"tables": list(self.tables), "files": [list(f) for f in self.files],
                "codecs": list(self.codecs)}


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


def names_digest(names: Sequence[str]) -> str:
    """The digest of a sorted list of tensor names (a :class:`ReplicaSet`'s)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(list(names), separators=(",", ":")).encode())


@dataclass(frozen=True)
class ReplicaSet:
    """In a partial (version 2): the tensors a rank declared with ``replicas`` copies, summed
    up: how many (``count``) and the digest of their sorted names (:func:`names_digest`),
    and by name only those the rank ``wrote``. Every rank holding a copy of these tensors
    declares the same set, so the coordinator checks that the union of what its members
    wrote has ``count`` names — without the names of what each rank merely holds."""

    replicas: int
    count: int
    digest: str
    wrote: tuple[str, ...]

    @property
    def key(self) -> tuple[int, int, str]:
        return self.replicas, self.count, self.digest

    def to_json(self) -> list[Any]:
        return [self.replicas, self.count, self.digest, list(self.wrote)]


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
    # partials only: tensors the rank holds that another rank wrote (it lists what it wrote):
    # by name (version 1, and a writer that knows no replica counts), or per replica set
    holds: tuple[str, ...] = ()
    replicated: tuple[ReplicaSet, ...] = ()
    partial: int = PARTIAL_VERSION  # a partial's version (PARTIAL_VERSION), as read
    # where this manifest's frame tables are read from (set when it was read from storage)
    frames: TableSource | None = field(default=None, compare=False, repr=False)
    # names of the tensors whose chunks were decoded (format 3 decodes them on first use)
    decoded: set[str] = field(default_factory=set, compare=False, repr=False)
    # paths of the tuples whose elements are in ``values`` (``manifest/values.py``)
    tuples: frozenset[str] = frozenset()
    # where the entries are read from when only the head was read (format 5)
    entries: RangedTail | None = field(default=None, compare=False, repr=False)

    def prefetch(self, names: Iterable[str]) -> None:
        """Read the entries of the tensors ``names`` together, where this manifest's head alone
        was read (format 5: entries that lie close together in one request, each checked);
        otherwise, and for the entries of other tensors, each is read when first used."""
        if self.entries is not None:
            self.entries.prefetch(names)

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
        """The whole manifest as one JSON object (``ckptd inspect --json``), its chunks as
        rows."""
        keys = Keys.of(self.tensors)
        out = self._head(keys)
        out["tensors"] = {name: {"dtype": dtype, "shape": shape, "chunks": chunks}
                          for name, dtype, shape, chunks in self._tensor_docs(keys)}
        return out

    def _tensor_docs(self, keys: Keys) -> Iterator[TensorDoc]:
        for k, v in sorted(self.tensors.items()):
            yield k, v.dtype_name, list(v.shape), [c.to_row(keys) for c in v.chunks]

    def _head(self, keys: Keys) -> dict[str, Any]:
        values, locals_, types = typed.encode(self.values, self.tuples, self.locals,
                                              LOCAL_PREFIX)
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "checksum": CHECKSUM,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "created": self.created,
            "values": values,
            "locals": locals_,
            "types": types,
            "training": self.training,
            **keys.to_json(),
        }
        if self.rank is not None:
            out["rank"] = self.rank
            out["partial"] = PARTIAL_VERSION
            if self.holds:
                out["holds"] = list(self.holds)
            if self.replicated:
                out["replicated"] = [s.to_json() for s in self.replicated]
        else:
            out["generation"] = self.generation
        return out

    def encode(self) -> bytes:
        """The file's bytes (format 3 on): see :func:`encode_doc`. Each tensor's JSON form is
        made and encoded in turn (a manifest of 50,000 chunks never exists as one JSON
        object)."""
        keys = Keys.of(self.tensors)
        return encode_file(self._head(keys), self._tensor_docs(keys))
