"""S3 objects under one ``s3://bucket/prefix``: multipart writes, parallel ranged reads, retries.

Requests go through the aiobotocore client that s3fs builds from the user's ``storage_options``
(credentials, endpoint, region, ``s3_additional_kwargs`` such as SSE), driven on fsspec's I/O event
loop; callers are ordinary threads. The policy lives here, once per concern:

- **Writes** (:meth:`S3Objects.write_file`): an object of known size up to
  ``single_put_parts`` x ``part_bytes`` (128 MiB) is a single PUT; a larger one streams the
  caller's buffers into parts of ``part_bytes`` (one copy each, so a producer may reuse a buffer
  after yielding it) and uploads up to ``concurrency`` parts at a time, each with the CRC32 that
  S3 verifies (declared on the upload, see :meth:`_WithDefaults.checksum_algorithm`). On
  failure,
  parts not yet sent are dropped, the ones in flight are waited for, and the upload is aborted;
  if even the abort fails (S3 unreachable), :meth:`S3Objects.abort_incomplete_uploads`
  (``ckptd gc``) removes it later. Nothing is visible under the key until Complete succeeds.
- **Atomic puts** are a single PUT: S3 objects appear whole or not at all; there is no rename.
- **Reads** (:mod:`ckptd.storage.s3_read`) fill one exact-size buffer per range with
  concurrent ranged GETs of about ``read_part_bytes``, each streamed straight into its slice.
- **Retries**: every request, including reading its response body, goes through one loop
  (:meth:`S3Objects._retrying`) with the policy of :mod:`ckptd.storage.s3_retry`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import io
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ckptd.buffers import Buffer
from ckptd.errors import StorageError
from ckptd.storage import s3_read
from ckptd.storage import s3_retry as retry
from ckptd.storage.base import Gate
from ckptd.storage.s3_read import all_or_cancel
from ckptd.storage.s3_write import (
    MAX_PARTS,
    Budget,
    Chunker,
    Skipped,
    Upload,
    first_error,
    part_size,
    rewound,
)

if TYPE_CHECKING:
    from ckptd.storage.s3_transfer import S3Transfer

T = TypeVar("T")

class S3Objects:
    """The S3 calls of :class:`ckptd.storage.s3_storage.S3Storage` (keys, not paths)."""

    def __init__(self, fs: Any, bucket: str, transfer: S3Transfer) -> None:
        self._fs = fs
        self.bucket = bucket
        self.transfer = transfer
        self._requests = asyncio.Semaphore(transfer.concurrency)
        self._bodies = Budget(transfer.concurrency * transfer.part_bytes)
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

    def put(self, key: str, data: Buffer | io.BytesIO) -> None:
        def request(c: Any) -> Awaitable[dict[str, Any]]:
            body = rewound(data) if isinstance(data, io.BytesIO) else data
            return c.put_object(Bucket=self.bucket, Key=key, Body=body)  # type: ignore[no-any-return]

        self._run(self._retrying(request, key, "PUT"))

    def write_file(self, key: str, parts: Iterable[Buffer], gate: Gate | None = None) -> int:
        """One object from ``parts``: a single PUT when small, else a multipart upload whose
        parts are sent in parallel; ``gate(nbytes)`` before each part (the file unfinished, the
        upload aborted, if it raises)."""
        chunks = Chunker(parts)
        first = part_size(1, self.transfer.part_bytes)
        if chunks.known_size is not None and chunks.known_size <= (
            self.transfer.single_put_parts * first
        ):
            first = max(chunks.known_size, 1)  # a small object of known size: one PUT
        upload: Upload | None = None
        inflight: list[concurrent.futures.Future[dict[str, Any]]] = []
        # Budget is taken before a body is filled and given back when its request ends, so all
        # threads together hold at most `concurrency` x `part_bytes` of bodies.
        if gate is not None:  # the writer's pace and stop, before each part
            gate(first)
        self._bodies.acquire(first)
        held = first
        try:
            body = chunks.take(first)
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
            upload = Upload(created["UploadId"])
            number = 1
            while body is not None and not upload.failed.is_set():
                inflight.append(self._submit_part(key, upload, number, body, held))
                held, body = 0, None
                number += 1
                if number > MAX_PARTS:
                    raise StorageError(f"{self.url(key)}: object exceeds {MAX_PARTS} parts")
                size = part_size(number, self.transfer.part_bytes)
                if chunks.at_end():
                    break
                if gate is not None:
                    gate(size)
                self._bodies.acquire(size)
                held = size
                body = chunks.take(size)
            concurrent.futures.wait(inflight)
            error = first_error(inflight)
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
            if held:
                self._bodies.release(held)

    def _submit_part(
        self, key: str, upload: Upload, number: int, body: io.BytesIO, held: int
    ) -> concurrent.futures.Future[dict[str, Any]]:
        fut = asyncio.run_coroutine_threadsafe(
            self._upload_part(key, upload, number, body), self._loop
        )

        def finished(f: concurrent.futures.Future[dict[str, Any]]) -> None:
            if f.exception() is not None:
                upload.failed.set()
            self._bodies.release(held)

        fut.add_done_callback(finished)
        return fut

    async def _upload_part(
        self, key: str, upload: Upload, number: int, body: io.BytesIO
    ) -> dict[str, Any]:
        if upload.failed.is_set():
            raise Skipped()
        resp: dict[str, Any] = await self._retrying(
            lambda c: c.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload.upload_id, PartNumber=number,
                Body=rewound(body), **c.checksum_algorithm(),
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
        await all_or_cancel([self._abort(k, u) for k, u in doomed])
        return len(doomed)

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, key: str) -> bytes:
        """The whole object: one GET (botocore checks the object's full CRC32, when S3 has one)."""

        async def get(client: Any) -> bytes:
            resp = await client.get_object(Bucket=self.bucket, Key=key)
            async with resp["Body"] as body:
                data: bytes = await body.read()
                return data

        return self._run(self._retrying(get, key, "GET"))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytearray]:
        """One exact-size buffer per range, filled by concurrent ranged GETs of about
        ``read_part_bytes`` each (:mod:`ckptd.storage.s3_read`)."""
        return self._run(s3_read.read_ranges(self, key, ranges))

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
        await all_or_cancel([self._delete(key, batch) for batch in batches])

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


def _dir_prefix(key: str) -> str:
    return f"{key}/" if key else ""
