"""Reading and editing a chunk of a manifest's JSON form (``parse.whole_doc``, or the file
itself parsed as JSON) by field name: a row of version 5 (``ckptd.manifest.rows``) indexes the
head's ``files``, ``codecs`` and ``tables``, and its length and frame count are derived."""

from __future__ import annotations

import math
from typing import Any

from ckptd import dtypes
from ckptd.manifest.rows import AT


def row(doc: dict[str, Any], tensor: str, i: int = 0) -> list[Any]:
    """Chunk ``i`` of ``tensor`` (the list itself: editing it edits ``doc``)."""
    return doc["tensors"][tensor]["chunks"][i]


def file_of(doc: dict[str, Any], r: list[Any]) -> str:
    return doc["files"][r[AT["file"]]][0]


def length_of(doc: dict[str, Any], tensor: str, r: list[Any]) -> int:
    """The raw length a reader derives: the box's elements × the item size."""
    dtype = doc["tensors"][tensor]["dtype"] if "tensors" in doc else doc["index"][tensor][0]
    return math.prod(r[AT["sizes"]]) * dtypes.ITEMSIZE[dtype]


def frames_of(doc: dict[str, Any], tensor: str, r: list[Any]) -> tuple[str, int, int, str]:
    """``(table file, first, count, digest)`` of the chunk's run of its frame table."""
    count = -(-length_of(doc, tensor, r) // r[AT["frame_bytes"]])
    return doc["tables"][r[AT["table"]]], r[AT["first"]], count, r[AT["digest"]]


def set_file(doc: dict[str, Any], r: list[Any], path: str) -> None:
    """Point the chunk at ``path`` (a new entry of ``files``: other chunks keep theirs)."""
    doc["files"].append([path, doc["files"][r[AT["file"]]][1]])
    r[AT["file"]] = len(doc["files"]) - 1


def set_codec(doc: dict[str, Any], r: list[Any], codec: str) -> None:
    if codec not in doc["codecs"]:
        doc["codecs"].append(codec)
    r[AT["codec"]] = doc["codecs"].index(codec)
