"""Storage backends behind one small interface (:mod:`ckptd.storage.base`)."""

from __future__ import annotations

from typing import Any

from ckptd.storage.base import Storage, join
from ckptd.storage.local import LocalStorage

__all__ = ["Storage", "LocalStorage", "open_storage", "join"]


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The backend for ``url``: a plain path or ``file://`` takes the local fast path; any other
    fsspec URL (``s3://``, ``memory://``) goes through :mod:`ckptd.storage.fsspec_backend`."""
    if "://" not in url or url.startswith("file://"):
        return LocalStorage(url)
    from ckptd.storage.fsspec_backend import FsspecStorage

    return FsspecStorage(url, storage_options or {})
