"""S3 objects under one ``s3://bucket/prefix``: multipart writes, parallel ranged reads, retries.

Requests go through the aiobotocore client that s3fs builds from the user's ``storage_options``
(credentials, endpoint, region, ``s3_additional_kwargs`` such as SSE), driven on fsspec's I/O event
loop; callers are ordinary threads. The policy lives here, once per concern:

- **Writes** (:meth:`S3Objects.write_file`) stream the caller's buffers into parts of
  ``part_bytes`` (one copy each, so a producer may reuse a buffer after yielding it) and upload
  up to ``concurrency`` parts at a time, each with the CRC32 that S3 verifies (declared on the
  upload, see :meth:`_WithDefaults.checksum_algorithm`). An object that fits in one part is a
  single PUT. On failure,
  parts not yet sent are dropped, the ones in flight are waited for, and the upload is aborted;
  if even the abort fails (S3 unreachable), :meth:`S3Objects.abort_incomplete_uploads`
  (``ckptd gc``) removes it later. Nothing is visible under the key until Complete succeeds.
- **Atomic puts** are a single PUT: S3 objects appear whole or not at all; there is no rename.
- **Reads** split ranges larger than ``part_bytes`` and issue ranged GETs concurrently.
- **Retries**: every request, including reading its response body, goes through one loop
  (:meth:`S3Objects._retrying`) with the policy of :mod:`ckptd.storage.s3_retry`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ckptd.errors import StorageError
from ckptd.storage import s3_retry as retry
from ckptd.storage.base import Buffer

if TYPE_CHECKING:
    from ckptd.storage.fsspec_backend import S3Transfer

T = TypeVar("T")

_S3_MAX_PARTS = 10_000
_S3_MAX_PART_BYTES = 5 << 30


def part_size(part_number: int, base: int) -> int:
    """Size of 1-based part ``part_number``: doubles every 1000 parts so that S3's 10 000-part
    limit never caps an object (16 MiB parts: the first 16 GiB, then 32 MiB parts...)."""
    return min(base << ((part_number - 1) // 1000), _S3_MAX_PART_BYTES)


class _Chunker:
    """Re-chunks the caller's buffers into upload parts, as ``bytes`` (see :meth:`take`)."""

    def __init__(self, parts: Iterable[Buffer]) -> None:
        # A list or tuple is held whole by the caller, who waits in write_file: its buffers stay
        # valid, so a part can be joined straight from them. Any other iterable is a producer
        # that may reuse a buffer once it has yielded it: what a part holds of it is copied
        # before the next one is asked for.
        self._stable = isinstance(parts, (list, tuple))
        self._it: Iterator[Buffer] = iter(parts)
        self._pending = memoryview(b"")
        self.total = 0

    def _refill(self) -> bool:
        while not len(self._pending):
            nxt = next(self._it, None)
            if nxt is None:
                return False
            self._pending = memoryview(nxt).cast("B")
        return True

    def take(self, size: int) -> bytes | None:
        """The next ``size`` bytes (fewer at the end); None when the stream is exhausted.

        ``bytes``, built by one copy (a join: no zero-filled buffer first): aiohttp sends a
        bytes body as it is, but copies a bytearray once more (it slices the body to its
        length), and botocore refuses a memoryview. A part spanning several buffers of a
        producer costs a second copy."""
        pieces: list[Buffer] = []
        filled = 0
        while filled < size and self._refill():
            k = min(size - filled, len(self._pending))
            piece = self._pending[:k]
            pieces.append(piece if self._stable else bytes(piece))
            self._pending = self._pending[k:]
            filled += k
        if not pieces:
            return None
        self.total += filled
        first = pieces[0]
        return first if len(pieces) == 1 and isinstance(first, bytes) else b"".join(pieces)

    def at_end(self) -> bool:
        return not self._refill()


class S3Objects:
    """The S3 side of :class:`ckptd.storage.fsspec_backend.FsspecStorage` (keys, not paths)."""

    def __init__(self, fs: Any, bucket: str, transfer: S3Transfer) -> None:
        self._fs = fs
        self.bucket = bucket
        self.transfer = transfer
        self._requests = asyncio.Semaphore(transfer.concurrency)
        self._part_slots = threading.BoundedSemaphore(transfer.concurrency)
        self._rng = random.Random()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        # fsspec's I/O thread; the property raises (rather than hangs) in a forked child
        loop: asyncio.AbstractEventLoop = self._fs.loop
        return loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _call(self, op: str, key: str, action: str, **kwargs: Any) -> dict[str, Any]:
        return await self._retrying(lambda c: getattr(c, op)(**kwargs), key, action)

    async def _retrying(
        self, request: Callable[[Any], Awaitable[T]], key: str, action: str
    ) -> T:
        """``request(client)`` with bounded retries. A missing object raises FileNotFoundError;
        anything else that does not succeed raises StorageError naming the object."""
        await self._fs.set_session()
        client = await self._fs.get_s3(self.bucket)
        for attempt in range(1, self.transfer.max_attempts + 1):
            try:
                async with self._requests:
                    return await request(_WithDefaults(client, self._fs))
            except retry.STORAGE_EXCEPTIONS as e:  # anything else is a bug: let it through as is
                if retry.code(e) in retry.NOT_FOUND_CODES:
                    raise FileNotFoundError(errno.ENOENT, "no such object", self.url(key)) from e
                why = retry.reason(e)
                if not retry.retryable(e):
                    raise StorageError(f"{self.url(key)}: {action} failed: {why}") from e
                if attempt == self.transfer.max_attempts:
                    raise StorageError(
                        f"{self.url(key)}: {action} failed after {attempt} attempts: {why}"
                    ) from e
            await asyncio.sleep(retry.delay_s(attempt, self.transfer, self._rng))
        raise AssertionError("unreachable")

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: str, data: Buffer) -> None:
        self._run(self._call("put_object", key, "PUT", Bucket=self.bucket, Key=key, Body=data))

    def write_file(self, key: str, parts: Iterable[Buffer]) -> int:
        chunks = _Chunker(parts)
        upload: _Upload | None = None
        inflight: list[concurrent.futures.Future[dict[str, Any]]] = []
        # A slot is taken before a part buffer is filled and freed when its upload ends, so all
        # threads together hold at most `concurrency` part buffers.
        self._part_slots.acquire()
        holding = True
        try:
            body = chunks.take(part_size(1, self.transfer.part_bytes))
            if body is None or chunks.at_end():
                self.put(key, body if body is not None else b"")
                return chunks.total
            created = self._run(self._retrying(
                lambda c: c.create_multipart_upload(
                    Bucket=self.bucket, Key=key, **c.checksum_algorithm()
                ),
                key,
                "start upload",
            ))
            upload = _Upload(created["UploadId"])
            number = 1
            while body is not None and not upload.failed.is_set():
                inflight.append(self._submit_part(key, upload, number, body))
                holding, body = False, None
                number += 1
                if number > _S3_MAX_PARTS:
                    raise StorageError(f"{self.url(key)}: object exceeds {_S3_MAX_PARTS} parts")
                self._part_slots.acquire()
                holding = True
                body = chunks.take(part_size(number, self.transfer.part_bytes))
            concurrent.futures.wait(inflight)
            error = _first_error(inflight)
            if error is not None:
                raise error
            parts_done = [f.result() for f in inflight]
            self._run(self._complete(key, upload.upload_id, parts_done, chunks.total))
            return chunks.total
        except BaseException as e:
            if upload is None:
                raise
            upload.failed.set()  # parts not yet started give up without a request
            concurrent.futures.wait(inflight)  # never abort while a part may still land
            note = self._abort_after_failure(key, upload.upload_id)
            if note and isinstance(e, StorageError):
                raise StorageError(f"{e.args[0]}; {note}") from e.__cause__
            raise
        finally:
            if holding:
                self._part_slots.release()

    def _submit_part(
        self, key: str, upload: _Upload, number: int, body: bytes
    ) -> concurrent.futures.Future[dict[str, Any]]:
        fut = asyncio.run_coroutine_threadsafe(
            self._upload_part(key, upload, number, body), self._loop
        )

        def finished(f: concurrent.futures.Future[dict[str, Any]]) -> None:
            if f.exception() is not None:
                upload.failed.set()
            self._part_slots.release()

        fut.add_done_callback(finished)
        return fut

    async def _upload_part(
        self, key: str, upload: _Upload, number: int, body: bytes
    ) -> dict[str, Any]:
        if upload.failed.is_set():
            raise _Skipped()
        resp: dict[str, Any] = await self._retrying(
            lambda c: c.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload.upload_id, PartNumber=number,
                Body=body, **c.checksum_algorithm(),
            ),
            key,
            f"upload part {number}",
        )
        part = {"PartNumber": number, "ETag": resp["ETag"]}
        part.update({k: v for k, v in resp.items() if k.startswith("Checksum")})
        part.pop("ChecksumType", None)
        return part

    async def _complete(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], total: int
    ) -> None:
        try:
            await self._call(
                "complete_multipart_upload", key, "complete upload", Bucket=self.bucket,
                Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts},
            )
        except StorageError as e:
            # A retried Complete whose first response was lost finds the upload already gone.
            if retry.code(e.__cause__) != "NoSuchUpload":
                raise
            head = await self._call("head_object", key, "HEAD", Bucket=self.bucket, Key=key)
            if head["ContentLength"] != total:
                raise

    def _abort_after_failure(self, key: str, upload_id: str) -> str:
        """Abort a failed upload; a note for the error message if even that fails."""
        try:
            self._run(self._abort(key, upload_id))
        except (StorageError, FileNotFoundError) as e:
            return f"incomplete upload {upload_id} left for `ckptd gc` ({e})"
        return ""

    async def _abort(self, key: str, upload_id: str) -> None:
        try:
            await self._call(
                "abort_multipart_upload", key, "abort upload", Bucket=self.bucket, Key=key,
                UploadId=upload_id,
            )
        except StorageError as e:
            if retry.code(e.__cause__) != "NoSuchUpload":
                raise

    def abort_incomplete_uploads(self, prefix: str, min_age_s: float = 0.0) -> int:
        """Abort the uploads under the "directory" ``prefix`` (``a/b`` covers ``a/b/...``, not
        ``a/bc``) started at least ``min_age_s`` ago; how many."""
        return self._run(self._abort_all(_dir_prefix(prefix), min_age_s))

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, float]]:
        """``(key, age in seconds)`` of every upload in progress under the "directory"
        ``prefix``, oldest key first."""
        now = time.time()
        found = self._run(self._list_uploads(_dir_prefix(prefix)))
        return sorted((key, now - started) for key, _, started in found)

    async def _list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """``(key, upload id, start time)`` of the uploads in progress under ``prefix``."""
        out: list[tuple[str, str, float]] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = await self._call("list_multipart_uploads", prefix, "list uploads", **kw)
            for u in page.get("Uploads", []):
                out.append((u["Key"], u["UploadId"], u["Initiated"].timestamp()))
            if not page.get("IsTruncated"):
                return out
            kw["KeyMarker"] = page["NextKeyMarker"]
            kw["UploadIdMarker"] = page["NextUploadIdMarker"]

    async def _abort_all(self, prefix: str, min_age_s: float) -> int:
        now = time.time()
        doomed = [(k, u) for k, u, t in await self._list_uploads(prefix) if now - t >= min_age_s]
        await _all_or_cancel([self._abort(k, u) for k, u in doomed])
        return len(doomed)

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, key: str) -> bytes:
        return self._run(self._get(key, None))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self._run(self._read_ranges(key, ranges))

    async def _read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        step = self.transfer.part_bytes
        pieces: list[list[tuple[int, int]]] = [
            [(o, min(step, offset + length - o)) for o in range(offset, offset + length, step)]
            for offset, length in ranges
        ]
        flat = [p for per_range in pieces for p in per_range]
        got = iter(await _all_or_cancel([self._get(key, p) for p in flat]))
        return [b"".join(next(got) for _ in per_range) for per_range in pieces]

    async def _get(self, key: str, rng: tuple[int, int] | None) -> bytes:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if rng is not None:
            kw["Range"] = f"bytes={rng[0]}-{rng[0] + rng[1] - 1}"

        async def get(client: Any) -> bytes:
            resp = await client.get_object(**kw)
            async with resp["Body"] as body:
                data: bytes = await body.read()
                return data

        action = "GET" if rng is None else f"GET bytes {rng[0]}+{rng[1]}"
        try:
            data = await self._retrying(get, key, action)
        except StorageError as e:
            if retry.code(e.__cause__) == "InvalidRange" and rng is not None:
                raise EOFError(f"{self.url(key)}: range {rng[0]}+{rng[1]} beyond the end") from e
            raise
        if rng is not None and len(data) != rng[1]:
            raise EOFError(
                f"{self.url(key)}: wanted {rng[1]} bytes at offset {rng[0]}, got {len(data)}"
            )
        return data

    def size(self, key: str) -> int:
        head = self._run(self._call("head_object", key, "HEAD", Bucket=self.bucket, Key=key))
        return int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        """An object, or a non-empty prefix (a "directory")."""
        if key:
            try:
                self.size(key)
                return True
            except FileNotFoundError:
                pass
        return bool(self._run(self._list(_dir_prefix(key), delimiter=None, limit=1)))

    def list_dir(self, key: str) -> list[str]:
        prefix = _dir_prefix(key)
        names = {k[len(prefix) :].rstrip("/") for k in self._run(self._list(prefix, "/", None))}
        return sorted(n for n in names if n)

    def remove(self, key: str) -> None:
        self._run(self._remove(key))

    async def _remove(self, key: str) -> None:
        keys = await self._list(_dir_prefix(key), delimiter=None, limit=None)
        if key:
            keys.append(key)
        batches = [keys[i : i + 1000] for i in range(0, len(keys), 1000)]  # the API maximum
        await _all_or_cancel([self._delete(key, batch) for batch in batches])

    async def _delete(self, key: str, batch: list[str]) -> None:
        resp = await self._call(
            "delete_objects", key, "DELETE", Bucket=self.bucket,
            Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
        )
        errors = resp.get("Errors", [])
        if errors:
            first = errors[0]
            raise StorageError(
                f"{self.url(first['Key'])}: DELETE failed: {first.get('Code')} "
                f"({len(errors)} objects not deleted)"
            )

    async def _list(self, prefix: str, delimiter: str | None, limit: int | None) -> list[str]:
        """Keys (and, with a delimiter, common prefixes) under ``prefix``."""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        if limit:
            kw["MaxKeys"] = limit
        out: list[str] = []
        while True:
            page = await self._call("list_objects_v2", prefix, "LIST", **kw)
            out += [o["Key"] for o in page.get("Contents", [])]
            out += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated") or (limit and len(out) >= limit):
                return out
            kw["ContinuationToken"] = page["NextContinuationToken"]


@dataclasses.dataclass
class _Upload:
    upload_id: str
    failed: threading.Event = dataclasses.field(default_factory=threading.Event)


class _Skipped(Exception):
    """A part not uploaded because another part of the same upload had already failed."""


def _first_error(futures: Sequence[concurrent.futures.Future[Any]]) -> BaseException | None:
    errors = [f.exception() for f in futures]
    real = [e for e in errors if e is not None and not isinstance(e, _Skipped)]
    return real[0] if real else next((e for e in errors if e is not None), None)


class _WithDefaults:
    """The client, with s3fs's per-request defaults (``s3_additional_kwargs``, requester pays)
    merged into every call, as s3fs itself does."""

    def __init__(self, client: Any, fs: Any) -> None:
        self._client = client
        self._fs = fs

    def __getattr__(self, op: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._client, op)

        def call(**kwargs: Any) -> Awaitable[Any]:
            return method(**self._fs._get_s3_method_kwargs(method, **kwargs))  # type: ignore

        return call

    def checksum_algorithm(self) -> dict[str, str]:
        """``ChecksumAlgorithm`` for CreateMultipartUpload and UploadPart: CRC32, the checksum
        botocore puts on every PUT and part unless told otherwise
        (``request_checksum_calculation="when_required"``, for S3-compatible stores without
        flexible checksums: then nothing). Declared, S3 checks each part's CRC32 and keeps a
        composite of them; undeclared, it would checksum the whole object again on Complete
        (and moto copies it once more to do so)."""
        config = getattr(getattr(self._client, "meta", None), "config", None)
        when = getattr(config, "request_checksum_calculation", None) or "when_supported"
        return {"ChecksumAlgorithm": "CRC32"} if when == "when_supported" else {}


async def _all_or_cancel(coros: Sequence[Awaitable[T]]) -> list[T]:
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


def _dir_prefix(key: str) -> str:
    return f"{key}/" if key else ""
