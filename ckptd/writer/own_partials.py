"""The partials this process wrote, kept for a coordinator in the same process, which takes
them from here instead of reading and decoding them again (:func:`ckptd.writer.commit.coordinate`):
a node agent writes every rank of its node (at W = 8 on one node, decoding the 8 partials was
about a tenth of the agent's CPU per save), a saving rank 0 its own.

A partial is put in place by one rename of exactly ``encode()`` of the object kept, so the one
taken is the one a read would decode (``tests/test_commit_protocol.py`` checks that the merge
is the same, byte for byte). The coordinator still lists the directory: what is present
decides, never this memory. Bounded: the :data:`_Kept.KEEP` newest (a rank that does not
coordinate never takes its own).
"""

from __future__ import annotations

import collections
import threading

from ckptd.manifest import Manifest, layout
from ckptd.storage import Storage


class _Kept:
    """Partials by (storage URL, path), oldest first."""

    KEEP = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: collections.OrderedDict[tuple[str, str], Manifest] = (
            collections.OrderedDict())

    def put(self, storage: Storage, path: str, partial: Manifest) -> None:
        with self._lock:
            self._by_path[storage.url, path] = partial
            self._by_path.move_to_end((storage.url, path))
            while len(self._by_path) > self.KEEP:
                self._by_path.popitem(last=False)

    def take(self, storage: Storage, path: str) -> Manifest | None:
        with self._lock:
            return self._by_path.pop((storage.url, path), None)


_kept = _Kept()


def put_partial(storage: Storage, partial: Manifest) -> None:
    """Put a rank's ``partial`` in place — visible, not synced: the live coordinator reads it;
    after a power loss a lost partial only means a takeover cannot commit this attempt
    (docs/format.md, *Fsyncs*) — and keep it for this process's coordinator (before the
    rename: that coordinator may list the file the moment it appears)."""
    assert partial.rank is not None
    path = layout.partial_path(partial.step, partial.attempt, partial.rank)
    _kept.put(storage, path, partial)
    storage.put_visible(path, partial.encode())


def take(storage: Storage, path: str) -> Manifest | None:
    """The partial this process put at ``path`` of ``storage`` (once), if it still keeps it."""
    return _kept.take(storage, path)
