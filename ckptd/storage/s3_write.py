"""Helpers of S3 uploads (:meth:`ckptd.storage.s3.S3Objects.write_file`): part sizes,
re-chunking the caller's buffers into request bodies, the memory budget of the bodies in flight,
and the state of one multipart upload."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ckptd.buffers import Buffer

MAX_PARTS = 10_000
MAX_PART_BYTES = 5 << 30


def part_size(part_number: int, base: int) -> int:
    """Size of 1-based part ``part_number``: doubles every 1000 parts so that S3's 10 000-part
    limit never caps an object (16 MiB parts: the first 16 GiB, then 32 MiB parts...)."""
    return min(base << ((part_number - 1) // 1000), MAX_PART_BYTES)


class Chunker:
    """Re-chunks the caller's buffers into request bodies (see :meth:`take`)."""

    def __init__(self, parts: Iterable[Buffer]) -> None:
        # A list or tuple is held whole by the caller, who waits in write_file: its size is
        # known before the first request (so a small object can be one PUT, see
        # S3Transfer.single_put_parts). Any other iterable is a producer that may reuse a buffer
        # once it has yielded it: what a body holds of it is copied before the next is asked for.
        self.known_size: int | None = None
        if isinstance(parts, (list, tuple)):
            self.known_size = sum(memoryview(p).nbytes for p in parts)
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

    def take(self, size: int) -> io.BytesIO | None:
        """The next ``size`` bytes (fewer at the end) as a request body; None when the stream
        is exhausted.

        One copy, into a ``BytesIO`` that owns its buffer. botocore wraps any ``bytes`` body of
        a PUT or part in ``BytesIO(body)``, which shares the bytes until aiohttp asks for its
        buffer (``BytesIOPayload``: ``getbuffer()``), and that unshares it: a second copy of the
        whole body. A ``BytesIO`` written into owns its buffer, so that copy never happens.
        The body is rewound before every attempt (:func:`rewound`)."""
        body: io.BytesIO | None = None
        filled = 0
        while filled < size and self._refill():
            k = min(size - filled, len(self._pending))
            if body is None:
                body = io.BytesIO()
            body.write(self._pending[:k])
            self._pending = self._pending[k:]
            filled += k
        if body is None:
            return None
        self.total += filled
        return body

    def at_end(self) -> bool:
        return not self._refill()


def rewound(body: io.BytesIO) -> io.BytesIO:
    """``body`` at its start: botocore reads a file body from where it stands (checksum,
    signature, Content-Length), and an earlier attempt left it at the end."""
    body.seek(0)
    return body


class Budget:
    """Bytes of request bodies held at once, all threads together (the upload memory bound).
    A body larger than the whole budget is let through when nothing else is held."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cv:
            while self._used and self._used + n > self._limit:
                self._cv.wait()
            self._used += n

    def release(self, n: int) -> None:
        with self._cv:
            self._used -= n
            self._cv.notify_all()


@dataclasses.dataclass
class Upload:
    upload_id: str
    failed: threading.Event = dataclasses.field(default_factory=threading.Event)


class Skipped(Exception):
    """A part not uploaded because another part of the same upload had already failed."""


def first_error(futures: Sequence[concurrent.futures.Future[Any]]) -> BaseException | None:
    errors = [f.exception() for f in futures]
    real = [e for e in errors if e is not None and not isinstance(e, Skipped)]
    return real[0] if real else next((e for e in errors if e is not None), None)
