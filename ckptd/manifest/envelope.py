"""The manifest's envelope: what a reader checks before it believes anything in a manifest.

1. its size, against ``config.max_manifest_bytes`` (a manifest of padding must not cost every
   rank GBs of memory to parse);
2. its digest (format 2 on): the file starts ``{"digest":"xxh3_64:<16 hex>",`` and the digest
   covers the file's own bytes with those 16 digits set to ``0`` — at a fixed place, so it is
   checked before anything is parsed, while the file stays plain JSON for people and tools;
3. strict JSON: duplicate keys, nesting too deep, integers too long are refused;
4. its format name and version.

A committed manifest of format 3 also seals its *lead*, its first few keys, on their own
(:func:`lead_digest`): what a reader of its first bytes alone learns is checked too. No torch
here.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from ckptd import config
from ckptd.errors import CorruptCheckpoint

FORMAT = "ckptd"
# 1: JSON; 2: the same, sealed with a digest of its own bytes; 3: frame sizes and checksums in
# binary tables beside the data, and an index that lets a reader parse only the tensors it
# needs; 4: bytes and tuples among the values, by path in ``types`` (manifest/values.py); 5:
# each chunk a row indexing the head's ``files``, ``codecs`` and ``tables`` (manifest/rows.py),
# and a committed manifest seals its head and each tensor's entry on their own, so a load reads
# the head and the entries it needs, not the whole file (manifest/entries.py). Older versions
# still load
VERSION = 5

# A manifest's digest covers its own bytes: ``{"digest":"xxh3_64:<16 hex>",...}`` hashed with the
# 16 hex digits set to "0". It sits at a fixed place so a reader checks it before it parses
# (or trusts) anything; the file stays plain JSON for people and tools.
_DIGEST_HEAD = b'{"digest":"xxh3_64:'
_DIGEST_END = len(_DIGEST_HEAD) + 16
_ZEROS = b"0" * 16
MAX_INT = 1 << 62  # sizes, offsets and counts: above this no file or tensor is real
# Format 3: right after the digest, ``"tail":"<16 hex>",`` gives the length of the file's tail,
# ``,"tensors":{...}}`` (every tensor's chunks); the head before it is parsed alone.
_TAIL_HEAD = b'"tail":"'
TENSORS_KEY = b',"tensors":'
# Format 5, committed manifests: right after the tail, ``"head":"<16 hex>",`` gives the length of
# the head (everything before TENSORS_KEY), inside the lead and so sealed by it; right after the
# lead's seal, the head's own digest (:func:`head_digest`)
_HEAD_HEAD = b'"head":"'
HEAD_DIGEST_MARK = b',"head_digest":"xxh3_64:'


def tail_field(tail_bytes: int, head_bytes: int | None = None) -> bytes:
    """The start of a format-3 body (before :func:`seal`): ``{"tail":"<16 hex>",``, and in a
    committed manifest of format 5 ``"head":"<16 hex>",``."""
    out = b"{" + _TAIL_HEAD + f"{tail_bytes:016x}".encode() + b'",'
    if head_bytes is not None:
        out += _HEAD_HEAD + f"{head_bytes:016x}".encode() + b'",'
    return out


def seal(body: bytes) -> bytes:
    assert body.startswith(b"{") and len(body) > 2
    buf = unsealed_start()
    buf += body[1:]
    return bytes(seal_in_place(buf))


def unsealed_start() -> bytearray:
    """The start of a document that :func:`seal_in_place` seals once the rest is appended
    (``body`` of :func:`seal` without its ``{``): one buffer, no copy of a large manifest."""
    return bytearray(_DIGEST_HEAD + _ZEROS + b'",')


def seal_in_place(buf: bytearray) -> bytearray:
    assert buf.startswith(_DIGEST_HEAD + _ZEROS) and len(buf) > _DIGEST_END + 2
    buf[len(_DIGEST_HEAD) : _DIGEST_END] = xxhash.xxh3_64_hexdigest(buf).encode()
    return buf


def unseal(raw: bytes, where: str) -> bool:
    """Check the digest; False when the manifest has none (format version 1)."""
    if not raw.startswith(_DIGEST_HEAD):
        return False
    claimed = raw[len(_DIGEST_HEAD) : _DIGEST_END]
    actual = xxhash.xxh3_64_hexdigest(raw[: len(_DIGEST_HEAD)] + _ZEROS + raw[_DIGEST_END:])
    if claimed.decode(errors="replace") != actual:
        raise CorruptCheckpoint(
            f"{where}: the manifest's digest does not match its bytes (damaged or edited)"
        )
    return True


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # in C: this hook runs for every object of every manifest
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


# what ``json.loads(raw, object_pairs_hook=_unique_keys)`` builds on every call, made once (a
# coordinator parses W partials a save, most of them a few hundred bytes)
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def parse_json(raw: bytes, where: str) -> Any:
    """JSON from storage: duplicate keys, nesting too deep, integers too long for Python and
    invalid UTF-8 are each a :class:`CorruptCheckpoint` naming ``where``."""
    # json.loads of bytes, with the decoder made once (and UTF-8 known without asking
    # detect_encoding where the bytes start with '{"', as every manifest does)
    encoding = "utf-8" if raw.startswith(b'{"') else json.detect_encoding(raw)
    try:
        return _DECODER.decode(raw.decode(encoding, "surrogatepass"))
    except RecursionError:
        raise CorruptCheckpoint(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise CorruptCheckpoint(f"{where}: not valid JSON ({e})") from e


def open_doc(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest's JSON object (in format 3 its head: everything but the tensors' chunks),
    once its size, digest, format and version are checked."""
    return split_doc(raw, where)[0]


# The lead (``docs/format.md``): a committed manifest's first keys, through
# ``"lead":"xxh3_64:<16 hex>"``, sealed on their own so that a reader of the first bytes alone
# (``ckptd.manifest.lead``) can trust the step, attempt and generation they name.
LEAD_MARK = b',"lead":"xxh3_64:'


def lead_digest(raw: bytes | bytearray, end: int) -> str:
    """xxh3-64 of ``raw[:end]`` (a lead, ending in its seal's 16 digits and a quote) with the
    file's digest and the lead's seal each set to 16 zeros. The file's digest is left out
    because it covers the lead seal: each seal is made, and checked, without the other."""
    seal_at = end - 17
    return xxhash.xxh3_64_hexdigest(bytes(raw[: len(_DIGEST_HEAD)]) + _ZEROS
                                     + bytes(raw[_DIGEST_END:seal_at]) + _ZEROS
                                     + bytes(raw[end - 1 : end]))


def seal_lead(buf: bytearray, end: int) -> None:
    """Write the lead seal of ``buf``, whose lead ends at ``end`` (before :func:`seal_in_place`,
    whose digest covers it)."""
    assert buf[end - 17 - len(LEAD_MARK) + 1 : end] == LEAD_MARK[1:] + _ZEROS + b'"'
    buf[end - 17 : end - 1] = lead_digest(buf, end).encode()


def head_digest(raw: bytes | bytearray, lead_end: int, head: int) -> str:
    """xxh3-64 of the head ``raw[:head]`` of a committed manifest of format 5 whose lead ends at
    ``lead_end`` (its head digest follows), with the file's digest and the head digest each set
    to 16 zeros. It covers the lead seal; the file's digest covers it in turn."""
    at = lead_end + len(HEAD_DIGEST_MARK)
    view, h = memoryview(raw), xxhash.xxh3_64()
    for part in (view[: len(_DIGEST_HEAD)], _ZEROS, view[_DIGEST_END:at], _ZEROS,
                 view[at + 16 : head]):
        h.update(part)
    return h.hexdigest()


def seal_head(buf: bytearray, lead_end: int, head: int) -> None:
    """Write the head digest of ``buf`` (after :func:`seal_lead`, before
    :func:`seal_in_place`)."""
    at = lead_end + len(HEAD_DIGEST_MARK)
    assert buf[lead_end:at] == HEAD_DIGEST_MARK and buf[at : at + 16] == _ZEROS
    buf[at : at + 16] = head_digest(buf, lead_end, head).encode()


def check_manifest_size(size: int, where: str) -> None:
    """A manifest over ``config.max_manifest_bytes`` is refused before it is read or parsed."""
    limit = config.get().max_manifest_bytes
    if size > limit:
        raise CorruptCheckpoint(
            f"{where}: {size} bytes, over the manifest limit of {limit} "
            "(ckptd.config max_manifest_bytes, CKPTD_MAX_MANIFEST_BYTES)"
        )


def check_version(version: Any, where: str) -> int:
    """A format version this reader understands (a newer one is refused, naming both)."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptCheckpoint(f"{where}: missing format version")
    if version > VERSION:
        raise CorruptCheckpoint(
            f"{where}: format version {version} is newer than this ckptd understands "
            f"({VERSION}); upgrade ckptd to read it"
        )
    return version


def split_doc(raw: bytes, where: str) -> tuple[dict[str, Any], int | None]:
    """:func:`open_doc`, and in format 3 where the tensors object starts in ``raw`` (None
    before: the document holds them)."""
    check_manifest_size(len(raw), where)
    sealed = unseal(raw, where)
    tail_at: int | None = None
    at = _DIGEST_END + 2
    if sealed and raw[at : at + len(_TAIL_HEAD)] == _TAIL_HEAD:
        digits = raw[at + len(_TAIL_HEAD) : at + len(_TAIL_HEAD) + 16]
        try:
            cut = len(raw) - int(digits, 16)
        except ValueError:
            raise CorruptCheckpoint(f"{where}: malformed tail length {digits!r}") from None
        if not (at < cut and raw.startswith(TENSORS_KEY + b"{", cut) and raw.endswith(b"}}")):
            raise CorruptCheckpoint(f"{where}: the tail length does not point at the tensors")
        doc = parse_json(raw[:cut] + b"}", where)
        tail_at = cut + len(TENSORS_KEY)
    else:
        doc = parse_json(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{where}: not a ckptd manifest (no 'format': 'ckptd')")
    version = check_version(doc.get("version"), where)
    if version >= 2 and not sealed:
        raise CorruptCheckpoint(f"{where}: format version {version} without its digest")
    if (version >= 3) != (tail_at is not None):
        raise CorruptCheckpoint(f"{where}: format version {version} with"
                                f"{'out' if tail_at is None else ''} a tensor index")
    return doc, tail_at
