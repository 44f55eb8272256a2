"""The lead of a committed manifest: which step, attempt and generation it names, from its
first :data:`PREFIX_BYTES` alone (``docs/format.md``, *The lead*), and, in format 5, where it
splits into head and tail. One ranged read tells a waiting rank that its save committed and a
listing which step is which, without reading the rest of the file; the seal makes those bytes
trustworthy on their own (the rest is checked by whatever reads it: :mod:`ckptd.manifest.parse`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ckptd.errors import CorruptCheckpoint
from ckptd.manifest.entries import Parts
from ckptd.manifest.envelope import MAX_INT, check_version, lead_digest
from ckptd.manifest.fields import integer as _int
from ckptd.manifest.fields import plain_name as _name

# What a reader of the lead fetches: the lead's fixed part is at most ~230 bytes, leaving room for
# an attempt id of ~280 (one that names files is at most 255: a file name's limit)
PREFIX_BYTES = 512

# A committed manifest's lead as the writer makes it (encode.LEAD_KEYS); one of format 3 written
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
    found = _read(prefix, where)
    return found[0] if found is not None else None


def _read(prefix: bytes, where: str) -> tuple[Lead, re.Match[bytes]] | None:
    """:func:`lead`, with the match its fields came from."""
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
    return Lead(step, attempt, generation), m


def parts(prefix: bytes, where: str) -> Parts | None:
    """Where a committed manifest of format 5 splits into head and tail, from the sealed lead
    in its first bytes (:func:`lead` checks it); None for any other manifest, which is read
    whole."""
    found = _read(prefix, where)
    if found is None or found[0].generation is None or found[1]["head"] is None:
        return None
    m = found[1]
    head, tail = int(m["head"], 16), int(m["tail"], 16)
    if not (m.end() < head <= MAX_INT and tail <= MAX_INT):
        raise CorruptCheckpoint(f"{where}: the head length {head} does not fit the manifest")
    return Parts(head, tail, m.end())


__all__ = ["PREFIX_BYTES", "Lead", "lead", "parts"]
