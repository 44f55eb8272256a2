"""Any other fsspec URL as a checkpoint root: ``memory://x``, ``file://...``, ``gs://...``:
the generic fsspec calls (``open``/``pipe_file``/``cat_file``/``ls``/``rm``). fsspec backends
are imported here, lazily, so that the local fast path needs none of them. S3 has its own
backend, :class:`ckptd.storage.s3_storage.S3Storage`.

On an object store ``put_atomic`` is a single put, which appears whole or not at all; on a
filesystem it is a write and a rename. See docs/storage.md.
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec

from ckptd import config
from ckptd.buffers import Buffer
from ckptd.errors import StorageError
from ckptd.storage.base import Gate, Storage, blocks, check_ranges, relative
from ckptd.storage.s3_transfer import S3_PROTOCOLS

__all__ = ["FsspecStorage"]


class FsspecStorage(Storage):
    """A checkpoint root at an fsspec URL (not S3). Thread-safe. ``storage_options`` go to
    the fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if "://" not in url:
            raise ValueError(f"not an fsspec URL (expected protocol://...): {url!r}")
        self.url = url.rstrip("/")
        self.protocol = self.url.split("://", 1)[0]
        if self.protocol in S3_PROTOCOLS:
            raise ValueError(f"{self.url}: S3 has its own backend: ckptd.storage.open_storage "
                             "(or ckptd.storage.s3_storage.S3Storage)")
        try:
            fs = fsspec.filesystem(self.protocol, **dict(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise ImportError(f"{self.url}: no fsspec backend for this URL: {e}") from e
        self._root = fs._strip_protocol(self.url).rstrip("/")
        self._fs = fs

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _path(self, path: str) -> str:
        """The backend's own path (S3: the key) of ``path`` under the root."""
        return posixpath.join(self._root, relative(self.url, path)).rstrip("/")

    def _url(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    # -- the Storage protocol --------------------------------------------------------------

    def write_file(self, path: str, parts: Iterable[Buffer], gate: Gate | None = None) -> int:
        full = self._path(path)
        total = 0
        try:
            self._makedirs(posixpath.dirname(full))
            with self._fs.open(full, "wb") as f:
                for block in blocks(parts, gate=gate):
                    total += len(block)
                    f.write(block)
        except OSError as e:
            raise _storage_error(self._url(path), "write", e) from e
        return total

    def put_atomic(self, path: str, data: bytes) -> None:
        full = self._path(path)
        try:
            self._makedirs(posixpath.dirname(full))
            if self._is_local():  # a filesystem: readers could see a half-written file
                tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
                self._fs.pipe_file(tmp, data)
                self._fs.mv(tmp, full)
            else:  # an object store or memory: one put is all-or-nothing
                self._fs.pipe_file(full, data)
        except OSError as e:
            raise _storage_error(self._url(path), "write", e) from e

    def read_bytes(self, path: str) -> bytes:
        data: bytes = self._fs.cat_file(self._path(path))
        return data

    def read_ranges(
        self, path: str, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes] | list[bytearray]:
        check_ranges(self._url(path), ranges)
        full = self._path(path)
        out: list[bytes] = []
        for offset, length in ranges:
            data = self._fs.cat_file(full, start=offset, end=offset + length) if length else b""
            if len(data) != length:
                raise EOFError(
                    f"{self._url(path)}: wanted {length} bytes at offset {offset}, got {len(data)}"
                )
            out.append(data)
        return out

    def size(self, path: str) -> int:
        return int(self._fs.size(self._path(path)))

    def exists(self, path: str) -> bool:
        return bool(self._fs.exists(self._path(path)))

    def list_dir(self, path: str) -> list[str]:
        full = self._path(path)
        try:
            entries = self._fs.ls(full, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = set()
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name != full:  # `ls` of a file lists the file itself
                names.add(posixpath.basename(name))
        return sorted(names)

    def remove(self, path: str) -> None:
        try:
            self._fs.rm(self._path(path), recursive=True)
        except FileNotFoundError:
            pass

    # -- beyond the protocol ---------------------------------------------------------------

    @property
    def poll_interval_s(self) -> tuple[float, float]:
        """``(first, longest)`` pause between polls of this root while a commit is awaited
        (:func:`ckptd.storage.base.poll_interval`): an object store's bounds for remote
        stores, where every poll is a billed, rate-limited request; the filesystem bounds for
        memory:// and file://."""
        cfg = config.get()
        if self._is_local() or "memory" in _protocols(self._fs):
            return cfg.poll_min_s, cfg.poll_max_s
        return cfg.remote_poll_min_s, cfg.remote_poll_max_s

    def _is_local(self) -> bool:
        return "file" in _protocols(self._fs) or "local" in _protocols(self._fs)

    def _makedirs(self, parent: str) -> None:
        if self._is_local() and parent:
            self._fs.makedirs(parent, exist_ok=True)


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _storage_error(url: str, action: str, e: OSError) -> StorageError:
    err = StorageError(f"{url}: {action} failed: {e.strerror or e}")
    err.errno = e.errno
    return err
