"""Helpers of S3 multipart uploads (:meth:`ckptd.storage.s3.S3Objects.write_file`): part
sizes, re-chunking the caller's buffers into parts, and the state of one upload."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ckptd.storage.base import Buffer

MAX_PARTS = 10_000
MAX_PART_BYTES = 5 << 30


def part_size(part_number: int, base: int) -> int:
    """Size of 1-based part ``part_number``: doubles every 1000 parts so that S3's 10 000-part
    limit never caps an object (16 MiB parts: the first 16 GiB, then 32 MiB parts...)."""
    return min(base << ((part_number - 1) // 1000), MAX_PART_BYTES)


class Chunker:
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
