"""Reading a manifest back — the one reader, three depths:

- :func:`decode`: the whole record (:class:`~ckptd.manifest.schema.Manifest`), every field
  checked as it goes — types, ranges, names, paths that stay inside the step, chunks that fit
  their tensor — so that a damaged or hostile file raises
  :class:`~ckptd.errors.CorruptCheckpoint` naming the file and the tensor, never anything else.
  In format 3 the chunks of a tensor are parsed when first used.
- :func:`head`: what listings show (:class:`Head`: step, attempt, generation, world size, time,
  tensors' dtypes and shapes, bytes, training metadata), from the head alone, with the same
  checks; the digest of the whole file is checked, no chunk is decoded.
- :func:`lead`: which step, attempt and generation a committed manifest names, from its first
  :data:`PREFIX_BYTES` alone (``docs/format.md``, *The lead*).

:func:`decode` also takes the head alone of a committed manifest of format 5, with a function
that reads the file's byte ranges: its entries are then read, and checked, as they are used
(:mod:`ckptd.manifest.entries`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ckptd import dtypes
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import codecs, rows
from ckptd.manifest import values as typed
from ckptd.manifest.entries import Parts, RangedTail, RangeRead, Tail, WholeTail, check_head
from ckptd.manifest.envelope import (
    MAX_INT,
    TENSORS_KEY,
    check_version,
    lead_digest,
    parse_json,
    split_doc,
)
from ckptd.manifest.fields import integer as _int
from ckptd.manifest.fields import integers as _ints
from ckptd.manifest.fields import plain_name as _name
from ckptd.manifest.fields import safe_relpath as _safe_relpath
from ckptd.manifest.frames import FrameRef, FrameTable, TableSource
from ckptd.manifest.schema import (
    LOCAL_PREFIX,
    PARTIAL_VERSION,
    Chunk,
    Manifest,
    ReplicaSet,
    TensorEntry,
    checked_dtype_name,
)
from ckptd.regions import Box


def whole_doc(raw: bytes, where: str) -> dict[str, Any]:
    """The whole JSON form of a manifest file of any format (what :func:`encode_doc` takes):
    for tools and tests; a reader decodes with :func:`decode`."""
    doc, tail_at = split_doc(raw, where)
    doc = {k: v for k, v in doc.items()
           if k not in ("digest", "tail", "head", "lead", "head_digest", "nbytes")}
    if tail_at is not None:
        chunks = parse_json(raw[tail_at:-1], where)
        if "index" not in doc:  # a partial of version 3: [dtype, shape, chunks] in the tail
            doc["tensors"] = {n: {"dtype": e[0], "shape": e[1], "chunks": e[2]}
                              for n, e in chunks.items()}
            return doc
        index = doc.pop("index")
        doc["tensors"] = {n: {"dtype": index[n][0], "shape": index[n][1],
                              "chunks": chunks[n]["chunks"]} for n in index}
    return doc


class _Fields:
    """A field of the wrong type or out of range: a CorruptCheckpoint naming ``where``. (A
    class: a generator's context manager costs a coordinator ~1 us a partial.)"""

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: object) -> None:
        if isinstance(e, (KeyError, TypeError, ValueError, AttributeError, OverflowError)
                      ) and not isinstance(e, CorruptCheckpoint):
            raise CorruptCheckpoint(
                f"{self.where}: malformed manifest ({type(e).__name__}: {e})") from e


def decode(raw: bytes, where: str, frames: TableSource | None = None, *,
           eager: bool = False, read: RangeRead | None = None) -> Manifest:
    """Parse and validate a manifest; any defect raises :class:`CorruptCheckpoint` naming
    ``where`` (the file) and, where it applies, the logical tensor. In format 3 the tensors'
    chunks are parsed (and checked) when first used, or all at once with ``eager`` (one JSON
    parse: the coordinator's merge uses every chunk of every partial; a partial of version 3
    has no index, and is always parsed whole); ``frames`` reads their frame tables. With
    ``read``, ``raw`` may be the head alone of a committed manifest of format 5 (:func:`parts`):
    its head digest is checked, and ``read`` fetches the entries the reader uses, each checked
    against its digest (:meth:`Manifest.prefetch`)."""
    doc, tail = _open(raw, where, read)
    with _Fields(where):
        decoded: set[str] = set()
        if tail is None:
            tensors = {name: _tensor(name, t, where)
                       for name, t in _object(doc["tensors"], "tensors").items()}
        elif _indexless(doc):
            tensors = _whole_partial(raw, tail.at, doc, where)
        else:
            tensors = _index(tail, doc, where, decoded)
            if eager:
                assert isinstance(tail, WholeTail)
                tensors = _parsed(raw, tail.at, tensors, _refs(doc, where), where)
        values, tuples, locals_ = _values(doc, where)
        return Manifest(
            step=_int(doc["step"]),
            attempt=_name(doc["attempt"]),
            world_size=_int(doc["world_size"], lo=1),
            created=float(doc["created"]),
            tensors=tensors,
            values=values,
            locals=locals_,
            training=dict(doc.get("training", {})),
            rank=_int(doc["rank"]) if "rank" in doc else None,
            generation=_int(doc.get("generation", 0)),
            holds=tuple(_held(doc.get("holds", []))),
            replicated=_replicated(doc, tensors) if "rank" in doc else (),
            partial=doc.get("partial", 1) if "rank" in doc else PARTIAL_VERSION,
            frames=frames,
            decoded=decoded,
            entries=tail if isinstance(tail, RangedTail) else None,
            tuples=tuples,
        )


def _values(doc: dict[str, Any], where: str,
            ) -> tuple[dict[str, Any], frozenset[str], dict[str, dict[str, Any]]]:
    """The values, the paths of tuples, and each rank's locals (:func:`typed.decode`)."""
    values, locals_, types = doc.get("values", {}), doc.get("locals", {}), doc.get("types", {})
    if values == {} and locals_ == {} and types == {}:  # a partial of a state of tensors
        return {}, frozenset(), {}
    return typed.decode(dict(values), {str(k): dict(v) for k, v in locals_.items()},
                        typed.checked_types(types, where), LOCAL_PREFIX, where)


def _open(raw: bytes, where: str, read: RangeRead | None) -> tuple[dict[str, Any], Tail | None]:
    """The document's head and its entries' source: the head alone of a manifest of format 5
    (with ``read``), else the whole file (formats 1 and 2: no tail)."""
    if read is not None:
        split = parts(raw[:PREFIX_BYTES], where)
        if split is not None and len(raw) == split.head:
            return check_head(raw, split, where), RangedTail(read, split, where)
    doc, tail_at = split_doc(raw, where)
    if tail_at is None:
        return doc, None
    if "head" in doc and doc["head"] != f"{tail_at - len(TENSORS_KEY):016x}":
        raise CorruptCheckpoint(f"{where}: the head length does not point at the tensors")
    return doc, WholeTail(raw, tail_at)


@dataclass(frozen=True)
class Head:
    """A committed step as listings show it, read without decoding a chunk."""

    step: int
    attempt: str
    generation: int  # 0 before generations (format 1)
    world_size: int
    created: float
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, global shape)
    nbytes: int  # raw bytes of every chunk, replicas included
    training: dict[str, Any]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (_, shape) in self.tensors.items()}


def head(raw: bytes, where: str) -> Head:
    """The :class:`Head` of a manifest of any format, its fields checked as :func:`decode`
    checks them (format 3: from the head's index and ``nbytes``; formats 1 and 2, which have
    no index, from each tensor's entry, adding up its chunks' lengths)."""
    doc, tail_at = split_doc(raw, where)
    with _Fields(where):
        if tail_at is None:
            entries = _object(doc["tensors"], "tensors")
            tensors = {n: _declared(n, t["dtype"], t["shape"], where)[:2]
                       for n, t in entries.items()}
            nbytes = sum(_int(c["length"]) for t in entries.values() for c in t["chunks"])
        else:
            tensors = {n: _declared(n, e[0], e[1], where)[:2]
                       for n, e in _index_entries(doc).items()}
            nbytes = _int(doc["nbytes"])
        return Head(step=_int(doc["step"]), attempt=_name(doc["attempt"]),
                    generation=_int(doc.get("generation", 0)),
                    world_size=_int(doc["world_size"], lo=1), created=float(doc["created"]),
                    tensors=tensors, nbytes=nbytes, training=dict(doc.get("training", {})))


# What a reader of the lead fetches: the lead's fixed part is at most ~230 bytes, leaving room for
# an attempt id of ~280 (one that names files is at most 255: a file name's limit)
PREFIX_BYTES = 512

# A committed manifest's lead as the writer makes it (schema.LEAD_KEYS); one of format 3 written
# before the lead seal stops after the attempt. Integers are bounded by their digits, the
# attempt by PREFIX_BYTES (a longer one leaves the lead unread: read the head).
_LEAD = re.compile(
    rb'\{"digest":"xxh3_64:[0-9a-f]{16}","tail":"(?P<tail>[0-9a-f]{16})"'
    rb'(?:,"head":"(?P<head>[0-9a-f]{16})")?,"format":"ckptd",'
    rb'"version":(?P<version>\d{1,9}),"checksum":"xxh3_64","step":(?P<step>\d{1,19}),'
    rb'"attempt":(?P<attempt>"(?:[^"\\]|\\.)*")'
    rb'(?:,"generation":(?P<generation>\d{1,19}),"lead":"xxh3_64:(?P<seal>[0-9a-f]{16})")?')


@dataclass(frozen=True)
class Lead:
    """What a committed manifest's first bytes name. ``generation`` is None where they have no
    lead seal (format 3 written before it): step and attempt unchecked, read the head to check."""

    step: int
    attempt: str
    generation: int | None


def lead(prefix: bytes, where: str) -> Lead | None:
    """The :class:`Lead` in the first :data:`PREFIX_BYTES` of a manifest, or None when they do
    not have the writer's form (formats 1 and 2, a foreign or damaged file, an attempt id too
    long for the prefix): then read the head. A sealed lead whose seal does not match its bytes
    is a :class:`CorruptCheckpoint` naming ``where``; so is a version newer than this reader's.
    The rest of the file is not checked here: a reader of the head or of the tensors checks
    the file's digest."""
    m = _LEAD.match(prefix)
    if m is None:
        return None
    if m["seal"] is not None and m["seal"].decode() != lead_digest(prefix, m.end()):
        raise CorruptCheckpoint(f"{where}: the manifest's lead does not match its seal "
                                "(damaged or edited)")
    check_version(int(m["version"]), where)
    try:
        attempt = _name(json.loads(m["attempt"]))
        step = _int(int(m["step"]))
        generation = None if m["generation"] is None else _int(int(m["generation"]))
    except ValueError:
        return None  # sealed by no writer of ckptd: the head says what is wrong
    return Lead(step, attempt, generation)


def parts(prefix: bytes, where: str) -> Parts | None:
    """Where a committed manifest of format 5 splits into head and tail, from the sealed lead
    in its first bytes (:func:`lead` checks it); None for any other manifest, which is read
    whole."""
    found = lead(prefix, where)
    m = _LEAD.match(prefix)
    if found is None or found.generation is None or m is None or m["head"] is None:
        return None
    head, tail = int(m["head"], 16), int(m["tail"], 16)
    if not (m.end() < head <= MAX_INT and tail <= MAX_INT):
        raise CorruptCheckpoint(f"{where}: the head length {head} does not fit the manifest")
    return Parts(head, tail, m.end())


def _object(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise TypeError(f"'{what}' is not an object")
    return v


def _index_entries(doc: dict[str, Any]) -> dict[str, list[Any]]:
    """Format 3: the head's index, each entry ``[dtype, shape, start, length]`` and, in a
    committed manifest of format 5, the entry's digest."""
    index = _object(doc["index"], "index")
    for name, item in index.items():
        if not (isinstance(item, list) and 4 <= len(item) <= 5):
            raise ValueError(f"{name}: index entry {item!r} is not [dtype, shape, start, length"
                             ", digest]")
    return index


_HEX16 = re.compile(r"[0-9a-f]{16}")


def _refs(doc: dict[str, Any], where: str) -> list[str] | rows.Lists:
    """What the chunks of a format-3 head refer to: its frame tables (versions 3 and 4), and
    from version 5 on (chunk rows) its files and codecs too."""
    tables = doc["tables"]
    if not isinstance(tables, list):
        raise TypeError("'tables' is not a list")
    for t in tables:
        _safe_relpath(t, where, "frame table")
        if not t.endswith(".frames"):
            raise CorruptCheckpoint(f"{where}: frame table {t!r} is not a .frames file")
    return rows.lists(doc, tables) if doc["version"] >= 5 else tables


def _partial_version(doc: dict[str, Any]) -> int:
    version = doc.get("partial", 1)
    if type(version) is not int or not 1 <= version <= PARTIAL_VERSION:
        raise ValueError(f"partial version {version!r}: this reader knows 1 to {PARTIAL_VERSION}"
                         " (written by a newer ckptd?)")
    return version


def _indexless(doc: dict[str, Any]) -> bool:
    """Whether ``doc`` is the head of a partial of version 3 (no index: :func:`_whole_partial`)."""
    version = _partial_version(doc) if "rank" in doc else 1
    if version < 3:
        return False
    if doc["version"] < 5 or "index" in doc:
        raise ValueError(f"a partial of version {version} in a manifest of version "
                         f"{doc['version']}{' with an index' if 'index' in doc else ''}")
    return True


def _whole_partial(raw: bytes, tail_at: int, doc: dict[str, Any], where: str,
                   ) -> dict[str, TensorEntry]:
    """A partial of version 3: every tensor ``[dtype, shape, rows]`` in the tail, parsed at
    once."""
    refs = _refs(doc, where)
    assert isinstance(refs, rows.Lists)  # a partial of version 3 is in a manifest of version 5
    body = parse_json(raw[tail_at:-1], where)
    if not isinstance(body, dict):
        raise CorruptCheckpoint(f"{where}: 'tensors' is not an object")
    quick = rows.quick_tensors(body, refs)
    if quick is not None:
        return quick
    out = {}
    for name, entry in body.items():
        if not (type(entry) is list and len(entry) == 3):
            shown = repr(entry) if len(repr(entry)) <= 200 else repr(entry)[:200] + "..."
            raise CorruptCheckpoint(f"{where}: {name}: a tensor is [dtype, shape, chunks], got "
                                    f"{shown}")
        dtype, shape, itemsize = _declared(name, entry[0], entry[1], where)
        out[name] = TensorEntry(dtype, shape, rows.decode(name, entry[2], Box.whole(shape),
                                                          itemsize, where, refs))
    return out


def _index(tail: Tail, doc: dict[str, Any], where: str, decoded: set[str],
           ) -> dict[str, TensorEntry]:
    """Format 3: the tensors of the head's index, each parsing its chunks on first use."""
    tables = _refs(doc, where)
    end, spans = tail.end, tail.spans
    out = {}
    for name, item in _index_entries(doc).items():
        dtype, shape, itemsize = _declared(name, item[0], item[1], where)
        start, length = tail.at + _int(item[2]), _int(item[3])
        if start + length > end:
            raise CorruptCheckpoint(f"{where}: {name}: index points past the manifest's end")
        digest = item[4] if len(item) == 5 else None
        if digest is not None and not (isinstance(digest, str) and _HEX16.fullmatch(digest)):
            raise ValueError(f"{name}: entry digest {digest!r} is not 16 hex digits")
        if spans is not None:
            spans[name] = (start, length, digest)
        out[name] = TensorEntry(dtype, shape, decode=functools.partial(
            _lazy_chunks, tail, start, length, digest, name, shape, itemsize, tables, where,
            decoded))
    return out


def _parsed(raw: bytes, tail_at: int, index: dict[str, TensorEntry],
            tables: list[str] | rows.Lists, where: str) -> dict[str, TensorEntry]:
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


def _lazy_chunks(tail: Tail, start: int, length: int, digest: str | None, name: str,
                 shape: tuple[int, ...], itemsize: int, tables: list[str] | rows.Lists,
                 where: str, decoded: set[str]) -> tuple[Chunk, ...]:
    decoded.add(name)
    doc = parse_json(tail.text(name, start, length, digest), f"{where}: {name}")
    items = doc.get("chunks") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise CorruptCheckpoint(f"{where}: {name}: the index does not point at its chunks")
    return _chunks(name, items, Box.whole(shape), itemsize, where, tables)


def _held(names: Any, key: str = "holds") -> list[str]:
    # the checks run in C: a partial at a thousand ranks names thousands of tensors
    if not isinstance(names, list) or (names and set(map(type, names)) != {str}) or "" in names:
        raise ValueError(f"'{key}' is not a list of names: {names!r}")
    return names


def _replicated(doc: dict[str, Any], tensors: dict[str, TensorEntry]) -> tuple[ReplicaSet, ...]:
    """A partial's replica sets (version 2 on; a partial of version 1 has none, its "holds"
    say the same by name). Each names only tensors of the partial, at most ``count`` of them."""
    _partial_version(doc)
    items = doc.get("replicated", [])
    if not isinstance(items, list):
        raise ValueError(f"'replicated' is not a list: {items!r}")
    out = []
    for item in items:
        if not isinstance(item, list) or len(item) != 4:
            raise ValueError(f"a replica set is not [replicas, count, digest, wrote]: {item!r}")
        replicas, count, digest, wrote = item
        wrote = _held(wrote, "replicated")
        if (not isinstance(digest, str) or len(digest) != 16
                or not set(digest) <= set("0123456789abcdef")):
            raise ValueError(f"replica set digest {digest!r}")
        strangers = [n for n in wrote if n not in tensors]
        if strangers:
            raise ValueError(f"replica set names {strangers[0]!r}, which the partial did not write")
        out.append(ReplicaSet(_int(replicas, lo=2), _int(count, lo=max(len(wrote), 1)), digest,
                              tuple(wrote)))
    return tuple(out)


def _declared(name: str, dtype_s: Any, shape_l: Any, where: str,
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


def _tensor(name: str, t: dict[str, Any], where: str) -> TensorEntry:
    """Formats 1 and 2: a tensor with its chunks and their frames inline."""
    dtype, shape, itemsize = _declared(name, t["dtype"], t["shape"], where)
    return TensorEntry(dtype, shape, _chunks(name, t["chunks"], Box.whole(shape), itemsize,
                                             where, None))


def _chunks(name: str, items: list[Any], whole: Box, itemsize: int, where: str,
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
