"""Storage backends behind one small interface (:mod:`ckptd.storage.base`)."""

from __future__ import annotations

from typing import Any

from ckptd.storage.base import Storage, join
from ckptd.storage.local import LocalStorage
from ckptd.storage.s3_transfer import S3_PROTOCOLS

__all__ = ["Storage", "LocalStorage", "open_storage", "join"]


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The backend for ``url``: a plain path or ``file://`` takes the local fast path,
    ``s3://`` :class:`~ckptd.storage.s3_storage.S3Storage`; any other fsspec URL
    (``memory://``, ``gs://``) :class:`~ckptd.storage.fsspec_backend.FsspecStorage`."""
    if "://" not in url or url.startswith("file://"):
        return LocalStorage(url)
    if url.split("://", 1)[0] in S3_PROTOCOLS:
        from ckptd.storage.s3_storage import S3Storage

        return S3Storage(url, storage_options or {})
    from ckptd.storage.fsspec_backend import FsspecStorage

    return FsspecStorage(url, storage_options or {})
