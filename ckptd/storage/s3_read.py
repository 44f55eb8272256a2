"""Reads from S3: every range lands in one buffer of its exact size, filled by ranged GETs.

A range of ``read_ranges`` is one ``bytearray`` of its length, allocated once. It is fetched by
``k = max(1, length // read_part_bytes)`` ranged GETs of equal size (so every GET is at least
``read_part_bytes`` and less than twice that, and a range a little longer than the unit is not
followed by a tiny second request), run concurrently, and each GET streams its body straight
into its slice of the buffer, chunk by chunk as the socket delivers it. Compared with reading
each body whole (``await body.read()``: aiohttp joins its chunks into a new ``bytes``) and
joining the parts of a range (another copy), every byte is copied once, and a range never
occupies more than its length in memory, which is what the loader's budget counts.

A GET that fails, including mid-body, is retried whole by :meth:`S3Objects._retrying` (its
slice is simply overwritten). A body shorter than its ``Content-Length`` (the connection closed
early) is an ``IncompleteReadError``, retried like any cut-off transfer; a range that starts
past the end of the object is ``InvalidRange`` (416) and one that ends past it returns fewer
bytes than asked: both raise ``EOFError`` naming the object, without retrying.

Integrity: ranged GETs carry no checksum S3 could verify for us (botocore validates response
checksums of whole-object GETs only); ckptd's readers verify every frame's checksum on exactly
the bytes returned here (:mod:`ckptd.loader.fetch`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import botocore.exceptions

from ckptd.errors import StorageError
from ckptd.storage import s3_retry as retry
from ckptd.storage.s3_transfer import S3Transfer

T = TypeVar("T")


class S3Objects(Protocol):
    """What a range read needs of :class:`ckptd.storage.s3.S3Objects` (declared here: that
    module imports this one)."""

    bucket: str
    transfer: S3Transfer

    def url(self, key: str) -> str: ...

    async def _retrying(self, request: Callable[[Any], Awaitable[T]], key: str,
                        action: str) -> T: ...

# Fallback chunk for bodies without aiohttp's StreamReader (aiobotocore's httpx backend).
_CHUNK = 1 << 20


def split(offset: int, length: int, unit: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the GETs that fetch ``[offset, offset + length)``: ``k =
    max(1, length // unit)`` pieces of equal size (to the byte), so each is at least ``unit``
    (unless the range is shorter) and less than ``2 * unit``; none for an empty range."""
    if length <= 0:
        return []
    k = max(1, length // max(1, unit))
    bounds = [offset + length * i // k for i in range(k + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


async def read_ranges(
    objs: S3Objects, key: str, ranges: Sequence[tuple[int, int]]
) -> list[bytearray]:
    """The bytes of ``ranges`` of ``key``, one exact-size buffer per range."""
    out = [bytearray(length) for _, length in ranges]
    gets = []
    for (offset, length), buf in zip(ranges, out, strict=True):
        view = memoryview(buf)
        for start, n in split(offset, length, objs.transfer.read_part_bytes):
            gets.append(get_into(objs, key, start, view[start - offset : start - offset + n]))
    await all_or_cancel(gets)
    return out


async def get_into(objs: S3Objects, key: str, start: int, into: memoryview) -> None:
    """Fill ``into`` with bytes ``[start, start + len(into))`` of ``key``: one ranged GET."""
    n = len(into)
    kw: dict[str, Any] = {
        "Bucket": objs.bucket, "Key": key, "Range": f"bytes={start}-{start + n - 1}"}

    async def get(client: Any) -> int:
        resp = await client.get_object(**kw)
        async with resp["Body"] as body:
            return await _fill(body, into, int(resp.get("ContentLength", n)), objs.url(key))

    try:
        got = await objs._retrying(get, key, f"GET bytes {start}+{n}")
    except StorageError as e:
        if retry.code(e.__cause__) == "InvalidRange":
            raise EOFError(f"{objs.url(key)}: range {start}+{n} beyond the end") from e
        raise
    if got != n:
        raise EOFError(f"{objs.url(key)}: wanted {n} bytes at offset {start}, got {got}")


async def _fill(body: Any, into: memoryview, declared: int, url: str) -> int:
    """Stream ``body`` into ``into``; the bytes received. A body longer than ``into`` (a
    server that ignored the Range header) is an error; one shorter than it declared is an
    ``IncompleteReadError`` (retried)."""
    if declared > len(into):
        raise StorageError(
            f"{url}: asked for {len(into)} bytes, the server sends {declared} (Range ignored?)")
    # aiohttp's StreamReader hands over each chunk as the socket delivered it (no joining);
    # other transports go through the body's own read().
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    readany = getattr(content, "readany", None)
    pos = 0
    while True:
        chunk = await (readany() if readany is not None else body.read(_CHUNK))
        if not chunk:
            break
        end = pos + len(chunk)
        if end > len(into):
            raise StorageError(f"{url}: the server sent more than the {len(into)} bytes asked")
        into[pos:end] = chunk
        pos = end
    if pos < declared:
        raise botocore.exceptions.IncompleteReadError(actual_bytes=pos, expected_bytes=declared)
    return pos


async def all_or_cancel(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Run concurrently; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
    if failed is not None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise failed.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]
