"""A manifest's bytes: the encoder of committed manifests (format 3 on) and partials, from
their JSON form (``docs/format.md``). :class:`ckptd.manifest.schema.Manifest` gives it its
fields; :mod:`ckptd.manifest.parse` reads the bytes back."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import xxhash

from ckptd import dtypes
from ckptd.manifest.envelope import (
    HEAD_DIGEST_MARK,
    LEAD_MARK,
    TENSORS_KEY,
    seal_head,
    seal_in_place,
    seal_lead,
    tail_field,
    unsealed_start,
)

TensorDoc = tuple[str, str, list[int], list[Any]]  # name, dtype, shape, chunks (rows)


def encode_doc(doc: dict[str, Any]) -> bytes:
    """A manifest file (format 3 on, ``docs/format.md``) from its whole JSON form
    (``to_json``): compact JSON whose first key is its own digest (:func:`seal`), then the
    length of its tail; the head holds an index of every tensor's dtype, shape and the byte
    range of its chunks in the tail, so that a reader parses the head and only the entries it
    needs. A partial of version 3 has no index: its tail holds each tensor's dtype, shape and
    chunks (the coordinator parses it whole)."""
    head = {k: v for k, v in doc.items() if k not in (
        "digest", "tail", "head", "lead", "head_digest", "index", "tensors", "nbytes")}
    return encode_file(head, ((n, t["dtype"], t["shape"], t["chunks"])
                          for n, t in doc["tensors"].items()))


def _entries(head: dict[str, Any], tensors: Iterable[TensorDoc]) -> tuple[list[bytes], int]:
    """Each tensor's ``"name":{"chunks":[...]}`` and the length of the tensors object before
    its closing brace; ``head`` gets their index (where each entry is, and in a committed
    manifest of format 5 its digest, so that a load reads and checks only the entries it
    needs: ckptd.manifest.entries) and ``nbytes``."""
    committed = "head_digest" in head
    texts: list[bytes] = []
    index: dict[str, list[Any]] = {}
    nbytes = 0
    pos = 1  # inside the tensors object, after its "{"
    for name, dtype, shape, chunks in tensors:
        key = _COMPACT.encode(name).encode() + b":"
        body = _COMPACT.encode({"chunks": chunks}).encode()
        if texts:
            pos += 1  # the comma before it
        index[name] = [dtype, shape, pos + len(key), len(body)]
        if committed:
            index[name].append(xxhash.xxh3_64_hexdigest(body))
        texts.append(key + body)
        pos += len(key) + len(body)
        nbytes += sum(_raw_bytes(dtype, c) for c in chunks)
    head["nbytes"] = nbytes
    head["index"] = index
    return texts, pos


# A committed manifest's first keys, in this order, then their seal: its *lead*, which a reader
# of the first bytes alone trusts (ckptd.manifest.lead; docs/format.md)
LEAD_KEYS = ("format", "version", "checksum", "step", "attempt", "generation")


def _lead_first(head: dict[str, Any]) -> dict[str, Any]:
    """``head`` with its lead first, the lead seal's place after it and the head digest's after
    that (partials have none: only the coordinator reads them, whole)."""
    if "rank" in head or not all(k in head for k in LEAD_KEYS):
        return dict(head)
    out = {k: head[k] for k in LEAD_KEYS}
    out["lead"] = "xxh3_64:" + "0" * 16
    if head["version"] >= 5:  # a document of an older version is encoded as it was written
        out["head_digest"] = "xxh3_64:" + "0" * 16
    out.update((k, v) for k, v in head.items() if k not in out)
    return out


def _raw_bytes(dtype: str, chunk: Any) -> int:
    """A chunk's raw length, from its row (its box's elements × the item size) or its object
    (versions 1-4: ``length``), for the head's ``nbytes``. A document edited by hand may say
    nothing sensible: 0 then (a reader checks every chunk, and uses ``nbytes`` for listings)."""
    try:
        if isinstance(chunk, dict):
            return int(chunk["length"])
        return int(math.prod(chunk[1])) * dtypes.ITEMSIZE[dtype]
    except (KeyError, IndexError, TypeError, ValueError):
        return 0


# json.dumps(..., separators=(",", ":")) without making an encoder for each call (a partial's
# encode called it once a tensor)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def encode_file(head: dict[str, Any], tensors: Iterable[TensorDoc]) -> bytes:
    """The file of a manifest or a partial whose ``head`` (its JSON form but the tensors) and
    ``tensors`` (each as a :data:`TensorDoc`) are given: see :func:`encode_doc`."""
    head = _lead_first(head)
    if "rank" in head and head.get("partial", 1) >= 3:  # no index: parsed whole
        body = _COMPACT.encode({name: [dtype, shape, chunks]
                                for name, dtype, shape, chunks in tensors}).encode()
        texts = [body[1:-1]] if len(body) > 2 else []
        pos = len(body) - 1
    else:
        texts, pos = _entries(head, tensors)
    head_json = _COMPACT.encode(head).encode()
    # seal(tail_field + head + tail) built in one buffer: each tensor's text is freed as it is
    # appended (the manifest of a 1024-rank reshard is ~10 MB; the texts, the joined tail, the
    # body, the unsealed and the sealed document were five copies of it)
    out = unsealed_start()
    tail = len(TENSORS_KEY) + pos + 2  # TENSORS_KEY{<texts>}}
    head_end = None
    if "head_digest" in head:  # fixed-width fields: the head's length is known before it is written
        head_end = len(out) + len(tail_field(tail, 0)) - 1 + len(head_json) - 2
    out += tail_field(tail, head_end)[1:]
    out += head_json[1:-1]
    assert head_end is None or len(out) == head_end
    out += TENSORS_KEY + b"{"
    texts.reverse()
    while texts:
        out += texts.pop()
        if texts:
            out += b","
    out += b"}}"
    if "lead" in head:  # the first mark: the keys before it are the writer's own
        lead_end = out.index(LEAD_MARK) + len(LEAD_MARK) + 17
        seal_lead(out, lead_end)
        if head_end is not None:
            assert out.startswith(HEAD_DIGEST_MARK, lead_end)
            seal_head(out, lead_end, head_end)
    return bytes(seal_in_place(out))


__all__ = ["LEAD_KEYS", "TensorDoc", "encode_doc", "encode_file"]
