"""Reading a manifest back — the one reader, three depths:

- :func:`decode`: the whole record (:class:`~ckptd.manifest.schema.Manifest`), every field
  checked as it goes — types, ranges, names, paths that stay inside the step, chunks that fit
  their tensor — so that a damaged or hostile file raises
  :class:`~ckptd.errors.CorruptCheckpoint` naming the file and the tensor, never anything else.
  In format 3 the chunks of a tensor are parsed when first used.
- :func:`head`: what listings show (:class:`Head`: step, attempt, generation, world size, time,
  tensors' dtypes and shapes, bytes, training metadata), from the head alone, with the same
  checks; the digest of the whole file is checked, no chunk is decoded.
- :func:`ckptd.manifest.lead.lead`: which step, attempt and generation a committed manifest
  names, from its first bytes alone (``docs/format.md``, *The lead*).

The fields of a tensor and of its chunks (formats 1 to 4) are checked by
:mod:`ckptd.manifest.chunk_fields`, format 5's chunk rows by :mod:`ckptd.manifest.rows`.

:func:`decode` also takes the head alone of a committed manifest of format 5, with a function
that reads the file's byte ranges: its entries are then read, and checked, as they are used
(:mod:`ckptd.manifest.entries`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from ckptd import dtypes
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import rows
from ckptd.manifest import values as typed
from ckptd.manifest.chunk_fields import chunks, declared, inline_tensor
from ckptd.manifest.entries import RangedTail, RangeRead, Tail, WholeTail, check_head
from ckptd.manifest.envelope import (
    TENSORS_KEY,
    parse_json,
    split_doc,
)
from ckptd.manifest.fields import integer as _int
from ckptd.manifest.fields import plain_name as _name
from ckptd.manifest.fields import safe_relpath as _safe_relpath
from ckptd.manifest.frames import TableSource
from ckptd.manifest.lead import PREFIX_BYTES, parts
from ckptd.manifest.schema import (
    LOCAL_PREFIX,
    PARTIAL_VERSION,
    Chunk,
    Manifest,
    ReplicaSet,
    TensorEntry,
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
            tensors = {name: inline_tensor(name, t, where)
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
            tensors = {n: declared(n, t["dtype"], t["shape"], where)[:2]
                       for n, t in entries.items()}
            nbytes = sum(_int(c["length"]) for t in entries.values() for c in t["chunks"])
        else:
            tensors = {n: declared(n, e[0], e[1], where)[:2]
                       for n, e in _index_entries(doc).items()}
            nbytes = _int(doc["nbytes"])
        return Head(step=_int(doc["step"]), attempt=_name(doc["attempt"]),
                    generation=_int(doc.get("generation", 0)),
                    world_size=_int(doc["world_size"], lo=1), created=float(doc["created"]),
                    tensors=tensors, nbytes=nbytes, training=dict(doc.get("training", {})))


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
        dtype, shape, itemsize = declared(name, entry[0], entry[1], where)
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
        dtype, shape, itemsize = declared(name, item[0], item[1], where)
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
        out[name] = TensorEntry(e.dtype_name, e.shape, chunks(
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
    return chunks(name, items, Box.whole(shape), itemsize, where, tables)


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
