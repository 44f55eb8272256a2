"""A storage view that serves some data files from memory: the node agent's copy of the newest
step (``docs/agent.md``, *The memory tier*). Everything else — manifests, frame tables, the data
files memory does not hold, every write — goes to the storage underneath.

The loader opens a step's data files with :meth:`open_read`; the files held in memory are read
from there (their frames' checksums are verified by the loader as for any read), the others are
opened on the storage. ``served`` counts the bytes that came from memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np

from ckptd.storage.base import Buffer, Delegating, ReadSession, Storage, extended


class MemoryTier(Delegating):
    """Every method but ``open_read`` is the storage underneath."""

    def __init__(self, base: Storage, files: Mapping[str, memoryview]) -> None:
        """``files``: path (relative to the root, as the manifest names it) -> its bytes,
        unchanged for as long as this object is used (the agent pins them for the load)."""
        super().__init__(base)
        self.base = extended(base)
        self.files = dict(files)
        self.served = 0
        self._lock = threading.Lock()

    def open_read(self, paths: Sequence[str]) -> ReadSession:
        rest = [p for p in paths if p not in self.files]
        return _TierSession(self, self.base.open_read(rest) if rest else None)

    def _count(self, n: int) -> None:
        with self._lock:
            self.served += n


class _TierSession:
    def __init__(self, tier: MemoryTier, inner: ReadSession | None) -> None:
        self.tier, self.inner = tier, inner
        self.sizes = {**(inner.sizes if inner else {}),
                      **{p: len(m) for p, m in tier.files.items()}}
        # memory alone: hand out views (the loader copies from them on its threads); with
        # files on storage, what their session does best
        self.fills_buffers = inner.fills_buffers if inner is not None else False
        self.resident = inner is None  # pinned by the agent for this load

    def _slice(self, path: str, offset: int, length: int) -> memoryview:
        mem = self.tier.files[path]
        if offset < 0 or offset + length > len(mem):
            raise EOFError(f"{path}: wanted {length} bytes at offset {offset}, the copy in "
                           f"memory has {len(mem)}")
        self.tier._count(length)
        return mem[offset: offset + length]

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        if path in self.tier.files:  # numpy's copy lets the other threads run
            np.copyto(np.frombuffer(buf, np.uint8), np.frombuffer(self._slice(path, offset,
                                                                              len(buf)), np.uint8))
        else:
            assert self.inner is not None
            self.inner.read_into(path, offset, buf)

    def read(self, path: str, offset: int, length: int) -> Buffer:
        if path in self.tier.files:
            return self._slice(path, offset, length)
        assert self.inner is not None
        return self.inner.read(path, offset, length)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


__all__ = ["MemoryTier"]
