"""The storage contract: the smallest interface the checkpoint protocol needs, as one abstract
class, :class:`Storage`.

Paths are ``str`` relative to the backend's root, with ``/`` separators (a ``pathlib.Path`` would
collapse the ``//`` of ``s3://``). A save calls, in this order::

    write_file(data/<attempt>/<file>, parts, gate)   # every data file; durable when it returns
    put_visible(<step>/ranks/<attempt>/<rank>.json)  # the rank's partial manifest
    put_atomic(<step>/manifest.json)      # the commit: all-or-nothing visible, durable
    put_visible(latest)                   # advisory pointer

``write_file`` need not be atomic: data file names are unique per save attempt and nothing reads
them before a manifest names them. ``put_atomic`` must be: a reader sees the whole object or
none (temp file + rename + directory fsync on a filesystem; a single PUT on an object store).
``write_file``'s ``gate`` (a writer's pace and stop: the node agent's) is called before each
block the backend writes (``gate(nbytes)``); what it raises leaves the file unfinished.

Eight methods are abstract; nine have a default that a backend overrides where it can do
better: ``close`` (release what it keeps open), ``put_visible`` (atomic, not yet durable),
``probe`` (a waiter's cheap question whether some paths exist), ``watch`` (a waiter woken
when a name appears), ``open_read`` (a :class:`ReadSession` for one load), ``append_text``,
``poll_interval_s`` (the pauses of the commit protocol's polling), ``incomplete_uploads`` and
``abort_incomplete_uploads`` (invisible leftovers such as S3 multipart uploads, for
``ckptd gc``). A user's own object with only the eight methods (``Checkpointer(storage=...)``)
is given the defaults, and the gate, by :func:`as_storage`.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ckptd import config
from ckptd.buffers import Buffer
from ckptd.storage.watch import Watch, no_watch

Gate = Callable[[int], None]  # before each block of a data file: a writer's pace and stop
Probe = Callable[[], list[bool]]  # whether each of the probed paths exists now (Storage.probe)


# A data file's bytes per write call on a filesystem or through fsspec, and per pass of the
# writer's gate; a multiple of O_DIRECT's 4096-byte alignment.
WRITE_BLOCK = 64 << 20


def blocks(parts: Iterable[Buffer], size: int = WRITE_BLOCK,
           gate: Gate | None = None) -> Iterator[memoryview]:
    """``parts`` as bytes views of at most ``size``, each passed through ``gate`` first."""
    for part in parts:
        view = memoryview(part).cast("B")
        for i in range(0, len(view), size):
            block = view[i : i + size]
            if gate is not None:
                gate(len(block))
            yield block


class ReadSession(Protocol):
    """The data files of one load, opened once: their sizes are known before anything is
    planned or allocated (a manifest may lie about them), and reads name a file and a range.

    ``fills_buffers``: ``read_into`` writes straight into the caller's memory (local files);
    otherwise ``read`` returns the backend's own buffer, which the caller uses in place (an
    object store's response body) and ``read_into`` costs one more copy."""

    sizes: dict[str, int]
    fills_buffers: bool
    # ``read`` returns views of memory that stays unchanged for the session (the node agent's
    # pinned copy): holding them costs no buffer, so a load verifies and copies in one pass
    resident: bool

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``path`` at ``offset``; EOFError if the file ends first."""
        ...

    def read(self, path: str, offset: int, length: int) -> Buffer: ...

    def close(self) -> None: ...


class _RangeSession:
    """A :class:`ReadSession` over ``size`` and ``read_ranges`` (every backend has them)."""

    fills_buffers = False
    resident = False

    def __init__(self, storage: Storage, paths: Sequence[str], threads: int = 8) -> None:
        self.storage = storage
        unique = list(dict.fromkeys(paths))
        with ThreadPoolExecutor(max(1, min(threads, len(unique)))) as pool:
            self.sizes = dict(zip(unique, pool.map(storage.size, unique), strict=True))

    def read(self, path: str, offset: int, length: int) -> Buffer:
        (blob,) = self.storage.read_ranges(path, [(offset, length)])
        return blob

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        blob = memoryview(self.read(path, offset, len(buf))).cast("B")
        buf[: len(blob)] = blob

    def close(self) -> None:
        pass


class BlockCache:
    """A :class:`ReadSession` that keeps the last ``capacity`` bytes it fetched, in aligned
    blocks, so that readers asking for neighbouring slices of the same frames (the target ranks
    of an offline reshard, each a thin slice of every tensor) fetch each block from storage
    about once. ``fetched`` counts the bytes that came from storage. Thread-safe: a block that
    one thread is fetching is waited for by the others, not fetched again."""

    fills_buffers = True
    resident = False

    def __init__(self, inner: ReadSession, block_bytes: int, capacity_bytes: int) -> None:
        self.inner, self.sizes = inner, inner.sizes
        self.block, self.capacity = max(1, block_bytes), max(block_bytes, capacity_bytes)
        self.fetched = 0
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], threading.Event] = {}

    def _get(self, path: str, index: int) -> bytes:
        key = (path, index)
        while True:
            with self._lock:
                data = self._blocks.get(key)
                if data is not None:
                    self._blocks.move_to_end(key)
                    return data
                fetching = self._pending.get(key)
                if fetching is None:  # this thread fetches it; others asking meanwhile wait
                    fetching = self._pending[key] = threading.Event()
                    break
            fetching.wait()  # then take it from the cache (or fetch it, if evicted already)
        try:
            start = index * self.block
            size = self.sizes.get(path)
            length = self.block if size is None else max(0, min(self.block, size - start))
            data = bytes(self.inner.read(path, start, length)) if length else b""
            with self._lock:
                self.fetched += len(data)
                self._blocks[key] = data
                self._held += len(data)
                while self._held > self.capacity and self._blocks:
                    self._held -= len(self._blocks.popitem(last=False)[1])
        finally:
            with self._lock:
                del self._pending[key]
            fetching.set()
        return data

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        pos = 0
        while pos < len(buf):
            index, skip = divmod(offset + pos, self.block)
            data = self._get(path, index)
            n = min(len(data) - skip, len(buf) - pos)
            if n <= 0:
                raise EOFError(f"{path}: wanted {len(buf)} bytes at offset {offset}, file ends "
                               f"after {pos}")
            buf[pos : pos + n] = data[skip : skip + n]
            pos += n

    def read(self, path: str, offset: int, length: int) -> Buffer:
        out = bytearray(length)
        self.read_into(path, offset, memoryview(out))
        return out

    def close(self) -> None:
        self._blocks.clear()
        self.inner.close()


def relative(url: str, path: str) -> str:
    """``path`` if it is a relative path without ``..`` (what every backend accepts)."""
    if path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"{url}: paths are relative, without '..': {path!r}")
    return path


def check_ranges(where: str, ranges: Sequence[tuple[int, int]]) -> None:
    for offset, length in ranges:
        if offset < 0 or length < 0:
            raise ValueError(f"{where}: bad range {offset}+{length}")


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p)


class Storage(ABC):
    """A checkpoint root (the module docstring). Implementations must be safe to call from
    several threads."""

    url: str

    @abstractmethod
    def write_file(self, path: str, parts: Iterable[Buffer], gate: Gate | None = None) -> int:
        """Write the concatenation of ``parts`` to ``path``, durably; returns bytes written.
        ``gate(nbytes)`` before each block it writes (what it raises: the file unfinished)."""

    @abstractmethod
    def put_atomic(self, path: str, data: bytes) -> None:
        """Write a small object so that readers see all of it or nothing."""

    @abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """The whole object (small objects: manifests, pointers). FileNotFoundError if absent."""

    @abstractmethod
    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> Sequence[Buffer]:
        """``(offset, length)`` byte ranges of one object, in order. A range past the end raises
        EOFError; a missing object FileNotFoundError."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Object size in bytes. FileNotFoundError if absent."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) of the direct children of ``path``; empty if it does not exist."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove an object or a whole prefix/directory; absent is not an error."""

    def put_visible(self, path: str, data: bytes) -> None:
        """Like :meth:`put_atomic` — a reader sees the whole object or none — but it need not be
        durable when it returns: for records nothing depends on after a power loss (a rank's
        partial, read by the live coordinator; the advisory ``latest``). By default
        :meth:`put_atomic` (an object store's PUT is durable anyway)."""
        self.put_atomic(path, data)

    def probe(self, paths: Sequence[str]) -> contextlib.AbstractContextManager[Probe | None]:
        """For a waiter that asks again and again whether ``paths`` exist (the commit
        protocol's polls): a :data:`Probe` that answers cheaply — on a filesystem each
        directory is opened once, then one ``stat`` a path — or None where asking is no cheaper
        than reading (an object store's request). By default None."""
        return contextlib.nullcontext(None)

    def watch(self, dirs: Sequence[str], names: Sequence[str] | None = None,
              ) -> contextlib.AbstractContextManager[Watch | None]:
        """For a waiter between two polls: a :class:`~ckptd.storage.watch.Watch` that ends its
        pause as soon as a name (any, or one of ``names``) appears in one of ``dirs`` (those
        that exist now), or None where the backend cannot tell (then the pause is a sleep).
        Only a hint: the waiter still polls. By default None."""
        return no_watch()

    def close(self) -> None:
        """Release what the backend keeps open between calls (a filesystem's directories kept
        for reads); it stays usable, and opens them again when needed. By default nothing."""
        return None

    def open_read(self, paths: Sequence[str]) -> ReadSession:
        """The data files of one load; by default, sizes and ranged reads."""
        return _RangeSession(self, paths)

    def append_text(self, path: str, text: str) -> None:
        """Append to a log-like object; by default read + rewrite (one writer at a time)."""
        try:
            old = self.read_bytes(path)
        except FileNotFoundError:
            old = b""
        self.put_atomic(path, old + text.encode())

    @property
    def poll_interval_s(self) -> tuple[float, float]:
        """``(first, longest)`` pause in seconds between two polls while the commit protocol
        waits on this storage; by default the filesystem bounds ``config.poll_min_s/max_s``."""
        cfg = config.get()
        return cfg.poll_min_s, cfg.poll_max_s

    def deferred_durability(self) -> contextlib.AbstractContextManager[None]:
        """Inside it, writes may skip their own flush to stable storage; leaving it without an
        error makes every one of them durable at once. For a writer that makes nothing visible
        before the end (``ckptd reshard``: a thousand target ranks, three fsyncs each). By
        default nothing changes: every write is durable when it returns."""
        return contextlib.nullcontext()

    def incomplete_uploads(self, prefix: str = "") -> list[tuple[str, float]]:
        """``(path, age_s)`` of writes under ``prefix`` that never became visible; none where
        an unfinished write leaves nothing behind."""
        return []

    def abort_incomplete_uploads(self, prefix: str = "", *, min_age_s: float = 0.0) -> int:
        """Drop the incomplete uploads under ``prefix`` older than ``min_age_s``; how many."""
        return 0


class Delegating(Storage):
    """Every method of another object with the eight abstract methods (any
    :class:`Storage`, or a user's own object that only has them: it is given the defaults, and
    its data files are passed through the gate block by block as it consumes them);
    subclasses override what they change."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.url = inner, inner.url
        self._native = isinstance(inner, Storage)

    def write_file(self, path: str, parts: Iterable[Buffer], gate: Gate | None = None) -> int:
        if self._native:
            return int(self.inner.write_file(path, parts, gate))
        return int(self.inner.write_file(path, parts if gate is None else blocks(parts,
                                                                                  gate=gate)))

    def put_atomic(self, path: str, data: bytes) -> None:
        self.inner.put_atomic(path, data)

    def probe(self, paths: Sequence[str]) -> contextlib.AbstractContextManager[Probe | None]:
        return self.inner.probe(paths) if self._native else contextlib.nullcontext(None)

    def watch(self, dirs: Sequence[str], names: Sequence[str] | None = None,
              ) -> contextlib.AbstractContextManager[Watch | None]:
        return self.inner.watch(dirs, names) if self._native else no_watch()

    def put_visible(self, path: str, data: bytes) -> None:
        if self._native:
            self.inner.put_visible(path, data)
        else:
            self.inner.put_atomic(path, data)

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.inner.read_bytes(path))

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> Sequence[Buffer]:
        return self.inner.read_ranges(path, ranges)  # type: ignore[no-any-return]

    def size(self, path: str) -> int:
        return int(self.inner.size(path))

    def exists(self, path: str) -> bool:
        return bool(self.inner.exists(path))

    def list_dir(self, path: str) -> list[str]:
        return list(self.inner.list_dir(path))

    def remove(self, path: str) -> None:
        self.inner.remove(path)


_EIGHT = ("write_file", "put_atomic", "read_bytes", "read_ranges", "size", "exists",
          "list_dir", "remove")


def as_storage(obj: Any) -> Storage:
    """``obj`` as a :class:`Storage`: itself if it is one, else (a user's own object with the
    eight methods and a ``url``) wrapped so that it has every default and honours a gate.
    TypeError naming what it lacks otherwise."""
    if isinstance(obj, Storage):
        return obj
    missing = [m for m in ("url", *_EIGHT) if not hasattr(obj, m)]
    if missing:
        raise TypeError(f"{type(obj).__name__} is not a storage: it has no {', '.join(missing)} "
                        "(ckptd.storage.Storage's methods)")
    return Delegating(obj)


def poll_interval(storage: Storage) -> tuple[float, float]:
    """``(first, longest)`` pause between two polls of ``storage`` (its ``poll_interval_s``):
    always positive, first <= longest."""
    first, longest = (float(x) for x in storage.poll_interval_s)
    first = max(first, 1e-4)
    return first, max(first, longest)
