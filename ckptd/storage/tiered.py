"""A storage view that serves some data files from memory: the node agents' copies of the newest
step (``docs/agent.md``, *The memory tier*). Everything else — manifests, frame tables, the data
files no memory holds, every write — goes to the storage underneath.

The loader opens a step's data files with :meth:`open_read`; the files held in this node's
memory are read from there, the files another node's agent holds are read from it (``remote``),
the others are opened on the storage (their frames' checksums are verified by the loader as for
any read). A remote read that fails (the agent died, or dropped the step) is read from storage
instead. ``served`` counts the bytes memory served, ``served_peer`` the part of them that was not
this node's own files: peer copies it holds and other nodes' agents.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import numpy as np

from ckptd.buffers import Buffer
from ckptd.storage.base import Delegating, ReadSession, Storage

log = logging.getLogger("ckptd")


class Remote(Protocol):
    """A data file another node's agent holds."""

    size: int

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset``; raises OSError when the agent cannot serve it."""


class MemoryTier(Delegating):
    """Every method but ``open_read`` is the storage underneath."""

    def __init__(self, base: Storage, files: Mapping[str, memoryview],
                 copies: Collection[str] = (), remote: Mapping[str, Remote] | None = None
                 ) -> None:
        """``files``: path (relative to the root, as the manifest names it) -> its bytes,
        unchanged for as long as this object is used (the agent pins them for the load);
        ``copies``: which of them are peer copies; ``remote``: files other agents hold."""
        super().__init__(base)
        self.base = base
        self.files = dict(files)
        self.copies = frozenset(copies)
        self.remote = {p: r for p, r in (remote or {}).items() if p not in self.files}
        self.served = self.served_peer = 0
        self._failed: set[str] = set()  # remote files read from storage after a failure
        self._lock = threading.Lock()

    def open_read(self, paths: Sequence[str]) -> ReadSession:
        rest = [p for p in paths if p not in self.files and p not in self.remote]
        return _TierSession(self, paths, self.base.open_read(rest) if rest else None)

    def _count(self, path: str, n: int) -> None:
        with self._lock:
            self.served += n
            if path in self.copies or path in self.remote:
                self.served_peer += n

    def _fallback(self, path: str, e: OSError) -> None:
        """A remote read failed: later reads of ``path`` go to storage; said once per file."""
        with self._lock:
            first = path not in self._failed
            self._failed.add(path)
        if first:
            log.warning("ckptd: %s: reading it from %r failed (%s); reading it from storage",
                        path, self.remote[path], e)


class _TierSession:
    def __init__(self, tier: MemoryTier, paths: Sequence[str], inner: ReadSession | None
                 ) -> None:
        self.tier, self.inner = tier, inner
        # remote files read from storage after a failure, one session each: opened once, closed
        # with this session (never while another thread may be reading through it)
        self._fallback: dict[str, ReadSession] = {}
        self._lock = threading.Lock()
        self.sizes = {**(inner.sizes if inner else {}),
                      **{p: len(m) for p, m in tier.files.items()},
                      **{p: r.size for p, r in tier.remote.items() if p in paths}}
        # this node's memory alone: hand out views (the loader copies from them on its
        # threads); with files on storage, what their session does best
        only_here = inner is None and not any(p in tier.remote for p in paths)
        self.fills_buffers = inner.fills_buffers if inner is not None else not only_here
        self.resident = only_here  # pinned by the agent for this load

    def _slice(self, path: str, offset: int, length: int) -> memoryview:
        mem = self.tier.files[path]
        if offset < 0 or offset + length > len(mem):
            raise EOFError(f"{path}: wanted {length} bytes at offset {offset}, the copy in "
                           f"memory has {len(mem)}")
        self.tier._count(path, length)
        return mem[offset: offset + length]

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        if path in self.tier.files:  # numpy's copy lets the other threads run
            np.copyto(np.frombuffer(buf, np.uint8), np.frombuffer(self._slice(path, offset,
                                                                              len(buf)), np.uint8))
        elif path in self.tier.remote:
            self._remote_into(path, offset, buf)
        else:
            assert self.inner is not None
            self.inner.read_into(path, offset, buf)

    def _remote_into(self, path: str, offset: int, buf: memoryview) -> None:
        if path not in self.tier._failed:
            try:
                self.tier.remote[path].read_into(offset, buf)
                self.tier._count(path, len(buf))
                return
            except OSError as e:
                self.tier._fallback(path, e)
        with self._lock:
            session = self._fallback.get(path)
            if session is None:
                session = self._fallback[path] = self.tier.base.open_read([path])
        session.read_into(path, offset, buf)

    def read(self, path: str, offset: int, length: int) -> Buffer:
        if path in self.tier.files:
            return self._slice(path, offset, length)
        if path in self.tier.remote:
            buf = bytearray(length)
            self._remote_into(path, offset, memoryview(buf))
            return buf
        assert self.inner is not None
        return self.inner.read(path, offset, length)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        for session in self._fallback.values():
            session.close()


__all__ = ["MemoryTier", "Remote"]
