"""A committed manifest of format 5 read in parts (``docs/format.md``, *Integrity*): its head,
checked against the head digest, and then only the entries of the tensors a reader decodes,
each checked against the digest its index entry gives, so that a load of a few tensors out of
thousands neither reads nor hashes the rest of the file.

No I/O here: the caller gives a function that reads byte ranges of the file
(``ckptd.catalog.ManifestFile``). A manifest read whole keeps its entries as slices of its
bytes (:class:`WholeTail`), its file digest checked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptd.errors import CorruptCheckpoint
from ckptd.manifest.envelope import (
    FORMAT,
    HEAD_DIGEST_MARK,
    TENSORS_KEY,
    check_manifest_size,
    check_version,
    head_digest,
    parse_json,
)

# Reads ``(offset, length)`` ranges of one manifest file, in order (EOFError past its end)
RangeRead = Callable[[Sequence[tuple[int, int]]], Sequence[bytes]]

# Entries of one load closer than this are read as one range: the gap costs fewer bytes than
# another request (an entry is ~100 bytes a chunk; the bytes between are other tensors')
ENTRY_GAP = 1024


@dataclass(frozen=True)
class Parts:
    """Where a committed manifest of format 5 splits, from its sealed lead: ``head`` bytes
    (everything before ``,"tensors":``), then ``tail`` bytes; the lead ends at ``lead_end``,
    where the head digest follows."""

    head: int
    tail: int
    lead_end: int


def check_head(raw: bytes, parts: Parts, where: str) -> dict[str, Any]:
    """The JSON object of the head ``raw`` (exactly ``parts.head`` bytes), once its size,
    head digest, format and version are checked: a :class:`CorruptCheckpoint` naming ``where``
    for each defect."""
    check_manifest_size(parts.head + parts.tail, where)
    assert len(raw) == parts.head
    at = parts.lead_end + len(HEAD_DIGEST_MARK)
    if raw[parts.lead_end : at] != HEAD_DIGEST_MARK:
        raise CorruptCheckpoint(f"{where}: the manifest's head digest is missing")
    if raw[at : at + 16].decode(errors="replace") != head_digest(raw, parts.lead_end,
                                                                  parts.head):
        raise CorruptCheckpoint(f"{where}: the manifest's head does not match its digest "
                                "(damaged or edited)")
    doc = parse_json(raw + b"}", where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{where}: not a ckptd manifest (no 'format': 'ckptd')")
    if check_version(doc.get("version"), where) < 5:
        raise CorruptCheckpoint(f"{where}: format version {doc['version']} with a head digest")
    return doc


class WholeTail:
    """The entries of a manifest read whole (its file digest checked): slices of its bytes."""

    def __init__(self, raw: bytes, tail_at: int) -> None:
        self.raw = raw
        self.at = tail_at  # where the tensors object's "{" is; index offsets count from it
        self.end = len(raw) - 2  # the tensors object's closing "}" and the document's
        self.spans: dict[str, tuple[int, int, str | None]] | None = None  # not needed

    def text(self, name: str, start: int, length: int, digest: str | None) -> bytes:
        return self.raw[start : start + length]


class RangedTail:
    """The entries of a manifest whose head alone was read: fetched from the file when asked
    for (:meth:`prefetch` reads many in few ranges), each checked against its digest before it
    is handed out."""

    def __init__(self, read: RangeRead, parts: Parts, where: str) -> None:
        self.read, self.where = read, where
        self.at = parts.head + len(TENSORS_KEY)
        self.end = parts.head + parts.tail - 2
        # name -> (offset in the file, length, digest), filled by the index's decoder
        self.spans: dict[str, tuple[int, int, str | None]] | None = {}
        self._fetched: dict[str, bytes] = {}
        self._given: set[str] = set()  # entries handed out (their tensor decoded them)
        self._lock = threading.Lock()

    def prefetch(self, names: Iterable[str]) -> None:
        """Read the entries of ``names`` not read yet, as few ranges as lie within
        :data:`ENTRY_GAP` of each other, each entry checked."""
        assert self.spans is not None
        with self._lock:
            want = sorted((self.spans[n][0], n) for n in set(names)
                          if n in self.spans and n not in self._fetched and n not in self._given)
        runs: list[list[Any]] = []  # [first byte, end, names]
        for start, name in want:
            end = start + self.spans[name][1]
            if runs and start - runs[-1][1] <= ENTRY_GAP:
                runs[-1][1] = max(runs[-1][1], end)
                runs[-1][2].append(name)
            else:
                runs.append([start, end, [name]])
        if not runs:
            return
        blobs = self._read([(lo, hi - lo) for lo, hi, _ in runs], runs[0][2][0])
        got = {}
        for (lo, _, names_), blob in zip(runs, blobs, strict=True):
            view = memoryview(blob)
            for name in names_:
                start, length, digest = self.spans[name]
                got[name] = self._checked(name, bytes(view[start - lo : start - lo + length]),
                                          digest)
        with self._lock:
            self._fetched.update(got)

    def text(self, name: str, start: int, length: int, digest: str | None) -> bytes:
        with self._lock:
            body = self._fetched.pop(name, None)
            self._given.add(name)
        if body is None:
            body = self._checked(name, bytes(self._read([(start, length)], name)[0]), digest)
        return body

    def _read(self, ranges: list[tuple[int, int]], name: str) -> Sequence[bytes]:
        try:
            return self.read(ranges)
        except EOFError as e:
            raise CorruptCheckpoint(f"{self.where}: {name}: the manifest is truncated ({e})"
                                    ) from None

    def _checked(self, name: str, body: bytes, digest: str | None) -> bytes:
        if digest is None:
            raise CorruptCheckpoint(f"{self.where}: {name}: the index entry has no digest")
        if xxhash.xxh3_64_hexdigest(body) != digest:
            raise CorruptCheckpoint(f"{self.where}: {name}: the manifest's entry for this tensor "
                                    "does not match its digest (damaged or edited)")
        return body


Tail = WholeTail | RangedTail
