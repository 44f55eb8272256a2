"""Any fsspec URL as a checkpoint root: ``s3://bucket/prefix``, ``memory://x``, ``file://...``.

``s3://`` gets a dedicated path (:mod:`ckptd.storage.s3`: parallel multipart uploads, parallel
ranged GETs, bounded retries with backoff); every other filesystem takes the generic fsspec calls
(``open``/``pipe_file``/``cat_file``/``ls``/``rm``). fsspec backends are imported here, lazily, so
that the local fast path needs none of them.

Commit rule on object stores: ``put_atomic`` is a single PUT, and an object appears whole or not
at all, so ``manifest.json`` written last by one PUT is the commit (there is no rename to rely on);
``latest`` is only a hint. See docs/storage.md.

Example::

    storage = FsspecStorage("s3://bucket/run1", {"client_kwargs": {"endpoint_url": url}})
    storage.write_file("data/0/a.bin", [buf1, buf2])     # multipart upload above 128 MiB
    storage.put_atomic("000100/manifest.json", b"{...}")  # the commit
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import fsspec

from ckptd import config
from ckptd.errors import StorageError
from ckptd.storage.base import Buffer, join

if TYPE_CHECKING:
    from ckptd.storage.s3 import S3Objects

__all__ = ["FsspecStorage", "S3Transfer"]

_S3_PROTOCOLS = ("s3", "s3a")


@dataclasses.dataclass(frozen=True)
class S3Transfer:
    """S3 transfer tuning; the defaults are explained in docs/storage.md ("Tuning")."""

    # Upload part size. S3 requires >= 5 MiB for every part but the last. 16 MiB amortises
    # per-request overhead (~10-30 ms on S3) while keeping buffered memory bounded.
    part_bytes: int = 16 << 20
    # An object of known size up to `single_put_parts` x `part_bytes` (128 MiB) is one PUT, not
    # a multipart upload (S3 takes up to 5 GB in one PUT). Data files of a rank under ~1 GiB
    # (>= 64 MiB each, `min_file_bytes`) are then 1 request instead of 2 + size/part_bytes, and
    # there is no CompleteMultipartUpload to wait for; the bandwidth comes from the files written
    # in parallel. docs/storage.md, "Tuning saves to S3", has the measurements. 1: only an
    # object that fits one part is a PUT.
    single_put_parts: int = 8
    # Ranged-GET unit: a read range is fetched by max(1, length // read_part_bytes) concurrent
    # GETs of equal size. 64 MiB: docs/storage.md, "Tuning loads from S3", has the measurements.
    read_part_bytes: int = 64 << 20
    # Requests in flight per storage object (all threads together); also bounds upload buffers:
    # at most `concurrency` x `part_bytes` (16 x 16 MiB = 256 MiB) of bodies are held at once.
    # One S3 connection carries ~50-100 MB/s, so 16 connections approach the NIC of a typical
    # training node.
    concurrency: int = 16
    # Attempts per request (first try included), and the backoff: before retry n a uniformly random
    # wait in [0, min(max_delay_s, base_delay_s * 2**(n-1))] ("full jitter"). With the defaults a
    # request gives up after ~13 s of waiting on average, 25 s at most.
    max_attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 20.0

    def __post_init__(self) -> None:
        counts = (self.part_bytes, self.read_part_bytes, self.single_put_parts, self.concurrency,
                  self.max_attempts)
        if min(counts) <= 0:
            raise ValueError(f"S3Transfer: sizes and counts must be positive: {self}")

    @classmethod
    def from_env(cls) -> S3Transfer:
        """Defaults, overridden by ``CKPTD_S3_<FIELD>`` environment variables (upper case), the
        same convention as :mod:`ckptd.config`; used when no ``transfer`` is given."""
        changes: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = f"CKPTD_S3_{field.name.upper()}"
            raw = os.environ.get(name)
            if raw is None:
                continue
            try:
                changes[field.name] = float(raw) if field.type == "float" else int(raw)
            except ValueError as e:
                kind = "a number" if field.type == "float" else "an integer"
                raise ValueError(f"{name}={raw!r}: expected {kind}") from e
        return cls(**changes)


class FsspecStorage:
    """A checkpoint root at an fsspec URL. Thread-safe.

    ``storage_options`` go to the fsspec filesystem (for S3, to :class:`s3fs.S3FileSystem`:
    ``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``, ``s3_additional_kwargs``...),
    except that on S3 ckptd owns the retry policy, configured by ``transfer``.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        transfer: S3Transfer | None = None,
    ) -> None:
        if "://" not in url:
            raise ValueError(f"not an fsspec URL (expected protocol://...): {url!r}")
        self.url = url.rstrip("/")
        self.protocol = self.url.split("://", 1)[0]
        self.transfer = transfer or S3Transfer.from_env()
        options = dict(storage_options or {})
        self._s3: S3Objects | None = None
        if self.protocol in _S3_PROTOCOLS:
            try:
                import s3fs  # noqa: F401  (fails early, with the hint, instead of inside fsspec)
            except ImportError as e:
                raise ImportError(f"{self.url}: S3 needs s3fs: pip install 'ckptd[s3]'") from e
            from ckptd.storage.s3 import S3Objects
            from ckptd.storage.s3_retry import client_config

            options["config_kwargs"] = client_config(options.get("config_kwargs"), self.transfer)
            fs = fsspec.filesystem(self.protocol, **options)
            bucket, _, self._root = fs._strip_protocol(self.url).partition("/")
            self._s3 = S3Objects(fs, bucket, self.transfer)
        else:
            try:
                fs = fsspec.filesystem(self.protocol, **options)
            except (ImportError, ValueError) as e:
                raise ImportError(f"{self.url}: no fsspec backend for this URL: {e}") from e
            self._root = fs._strip_protocol(self.url).rstrip("/")
        self._fs = fs

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _path(self, path: str) -> str:
        """The backend's own path (S3: the key) of ``path`` under the root."""
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"{self.url}: paths are relative, without '..': {path!r}")
        return join(self._root, path) if self._s3 else posixpath.join(self._root, path).rstrip("/")

    def _url(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    # -- the Storage protocol --------------------------------------------------------------

    def write_file(self, path: str, parts: Iterable[Buffer]) -> int:
        if self._s3:
            return self._s3.write_file(self._path(path), parts)
        full = self._path(path)
        total = 0
        try:
            self._makedirs(posixpath.dirname(full))
            with self._fs.open(full, "wb") as f:
                for part in parts:
                    total += len(memoryview(part).cast("B"))
                    f.write(part)
        except OSError as e:
            raise _storage_error(self._url(path), "write", e) from e
        return total

    def put_atomic(self, path: str, data: bytes) -> None:
        if self._s3:
            return self._s3.put(self._path(path), data)
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
        if self._s3:
            return self._s3.read_bytes(self._path(path))
        data: bytes = self._fs.cat_file(self._path(path))
        return data

    def read_ranges(
        self, path: str, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes] | list[bytearray]:
        for offset, length in ranges:
            if offset < 0 or length < 0:
                raise ValueError(f"{self._url(path)}: bad range {offset}+{length}")
        if self._s3:
            return self._s3.read_ranges(self._path(path), ranges)
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
        if self._s3:
            return self._s3.size(self._path(path))
        return int(self._fs.size(self._path(path)))

    def exists(self, path: str) -> bool:
        if self._s3:
            return self._s3.exists(self._path(path))
        return bool(self._fs.exists(self._path(path)))

    def list_dir(self, path: str) -> list[str]:
        if self._s3:
            return self._s3.list_dir(self._path(path))
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
        if self._s3:
            return self._s3.remove(self._path(path))
        try:
            self._fs.rm(self._path(path), recursive=True)
        except FileNotFoundError:
            pass

    # -- beyond the protocol ---------------------------------------------------------------

    @property
    def poll_interval_s(self) -> tuple[float, float]:
        """``(first, longest)`` pause between polls of this root while a commit is awaited
        (:func:`ckptd.storage.base.poll_interval`): an object store's bounds for S3 and other
        remote stores, where every poll is a billed, rate-limited request of 10-30 ms; the
        filesystem bounds for memory:// and file://."""
        cfg = config.get()
        if self._s3 is None and (self._is_local() or "memory" in _protocols(self._fs)):
            return cfg.poll_min_s, cfg.poll_max_s
        return cfg.remote_poll_min_s, cfg.remote_poll_max_s

    def abort_incomplete_uploads(self, prefix: str = "", *, min_age_s: float = 0.0) -> int:
        """Abort multipart uploads under the directory ``prefix`` started at least ``min_age_s``
        ago (S3 only; elsewhere there are none); returns how many. ``ckptd gc`` passes a
        ``min_age_s`` above the commit timeout, so that it never aborts an upload still in
        progress, except under steps that can no longer commit."""
        if not self._s3:
            return 0
        return self._s3.abort_incomplete_uploads(self._path(prefix), min_age_s)

    def incomplete_uploads(self, prefix: str = "") -> list[tuple[str, float]]:
        """``(path, age in seconds)`` of the multipart uploads in progress under ``prefix``,
        paths relative to the root (S3 only; elsewhere there are none)."""
        if not self._s3:
            return []
        base = _dir_prefix(self._path(""))
        return [(k[len(base) :], age) for k, age in self._s3.incomplete_uploads(self._path(prefix))]

    def _is_local(self) -> bool:
        return "file" in _protocols(self._fs) or "local" in _protocols(self._fs)

    def _makedirs(self, parent: str) -> None:
        if self._is_local() and parent:
            self._fs.makedirs(parent, exist_ok=True)


def _dir_prefix(key: str) -> str:
    return f"{key}/" if key else ""


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _storage_error(url: str, action: str, e: OSError) -> StorageError:
    err = StorageError(f"{url}: {action} failed: {e.strerror or e}")
    err.errno = e.errno
    return err
