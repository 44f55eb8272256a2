"""S3 (``s3://bucket/prefix``) as a checkpoint root: parallel multipart uploads, parallel
ranged GETs and bounded retries with backoff (:mod:`ckptd.storage.s3`), tuned by
:class:`~ckptd.storage.s3_transfer.S3Transfer`.

Commit rule: ``put_atomic`` is a single PUT, and an object appears whole or not at all, so
``manifest.json`` written last by one PUT is the commit (there is no rename to rely on);
``latest`` is only a hint. See docs/storage.md.

Example::

    storage = S3Storage("s3://bucket/run1", {"client_kwargs": {"endpoint_url": url}})
    storage.write_file("data/0/a.bin", [buf1, buf2])     # multipart upload above 128 MiB
    storage.put_atomic("000100/manifest.json", b"{...}")  # the commit
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ckptd import config
from ckptd.buffers import Buffer
from ckptd.storage.base import Gate, Storage, check_ranges, join, relative
from ckptd.storage.s3_transfer import S3_PROTOCOLS, S3Transfer


class S3Storage(Storage):
    """A checkpoint root on S3 (or an S3-compatible server). Thread-safe.

    ``storage_options`` go to :class:`s3fs.S3FileSystem` (``key``, ``secret``,
    ``client_kwargs={"endpoint_url": ...}``, ``s3_additional_kwargs``...), except that ckptd
    owns the retry policy, configured by ``transfer`` (default: ``S3Transfer.from_env()``).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 transfer: S3Transfer | None = None) -> None:
        self.url = url.rstrip("/")
        self.protocol = self.url.split("://", 1)[0]
        if self.protocol not in S3_PROTOCOLS:
            raise ValueError(f"not an S3 URL (s3://bucket/prefix): {url!r}")
        try:
            import fsspec
            import s3fs  # noqa: F401  (fails early, with the hint, instead of inside fsspec)
        except ImportError as e:
            raise ImportError(f"{self.url}: S3 needs s3fs: pip install 'ckptd[s3]'") from e
        from ckptd.storage.s3 import S3Objects
        from ckptd.storage.s3_retry import client_config

        self.transfer = transfer or S3Transfer.from_env()
        options = dict(storage_options or {})
        options["config_kwargs"] = client_config(options.get("config_kwargs"), self.transfer)
        fs = fsspec.filesystem(self.protocol, **options)
        bucket, _, self._root = fs._strip_protocol(self.url).partition("/")
        self._objects = S3Objects(fs, bucket, self.transfer)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    def _key(self, path: str) -> str:
        """The object key of ``path`` under the root."""
        return join(self._root, relative(self.url, path))

    # -- the Storage protocol --------------------------------------------------------------

    def write_file(self, path: str, parts: Iterable[Buffer], gate: Gate | None = None) -> int:
        return self._objects.write_file(self._key(path), parts, gate)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._objects.put(self._key(path), data)

    def read_bytes(self, path: str) -> bytes:
        return self._objects.read_bytes(self._key(path))

    def read_ranges(
        self, path: str, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes] | list[bytearray]:
        check_ranges(f"{self.url}/{path}", ranges)
        return self._objects.read_ranges(self._key(path), ranges)

    def size(self, path: str) -> int:
        return self._objects.size(self._key(path))

    def exists(self, path: str) -> bool:
        return self._objects.exists(self._key(path))

    def list_dir(self, path: str) -> list[str]:
        return self._objects.list_dir(self._key(path))

    def remove(self, path: str) -> None:
        self._objects.remove(self._key(path))

    # -- beyond the protocol ---------------------------------------------------------------

    @property
    def poll_interval_s(self) -> tuple[float, float]:
        """``(first, longest)`` pause between polls while a commit is awaited: every poll is a
        billed, rate-limited request of 10-30 ms."""
        cfg = config.get()
        return cfg.remote_poll_min_s, cfg.remote_poll_max_s

    def abort_incomplete_uploads(self, prefix: str = "", *, min_age_s: float = 0.0) -> int:
        """Abort multipart uploads under the directory ``prefix`` started at least ``min_age_s``
        ago; returns how many. ``ckptd gc`` passes a ``min_age_s`` above the commit timeout, so
        that it never aborts an upload still in progress, except under steps that can no
        longer commit."""
        return self._objects.abort_incomplete_uploads(self._key(prefix), min_age_s)

    def incomplete_uploads(self, prefix: str = "") -> list[tuple[str, float]]:
        """``(path, age in seconds)`` of the multipart uploads in progress under ``prefix``,
        paths relative to the root."""
        base = f"{self._root}/" if self._root else ""
        return [(k[len(base):], age)
                for k, age in self._objects.incomplete_uploads(self._key(prefix))]


__all__ = ["S3Storage", "S3Transfer"]
