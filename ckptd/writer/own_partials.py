"""The partials this process wrote, kept for a coordinator in the same process, which takes
them from here instead of reading and decoding them again (:func:`ckptd.writer.commit.coordinate`):
a node agent writes every rank of its node, a saving rank 0 its own.

A partial is put in place by one rename of exactly ``encode()`` of the object kept, so the one
taken is the one a read would decode (``tests/test_commit_protocol.py`` checks that the merge
is the same, byte for byte). The coordinator still lists the directory: what is present
decides, never this memory. What is kept is bounded: only rank 0's partial, unless the process
writes for several ranks (:func:`keep_every_rank`: the node agent); the :data:`_Kept.KEEP`
newest; each, as a partial is made (:meth:`RankWriter.partial`), naming its chunks' frame
tables by reference, not holding them.
"""

from __future__ import annotations

import collections
import threading

from ckptd.manifest import Manifest, layout
from ckptd.storage import Storage


class _Kept:
    """Partials by (storage URL, path), oldest first."""

    KEEP = 64

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
_every_rank = False


def keep_every_rank() -> None:
    """This process writes several ranks' shares (the node agent): keep every rank's partial,
    not only rank 0's, for a coordinator here."""
    global _every_rank
    _every_rank = True


def put_partial(storage: Storage, partial: Manifest) -> None:
    """Put a rank's ``partial`` in place — visible, not synced: the live coordinator reads it;
    after a power loss a lost partial only means a takeover cannot commit this attempt
    (docs/format.md, *Fsyncs*) — and keep it for this process's coordinator (before the
    rename: that coordinator may list the file the moment it appears)."""
    assert partial.rank is not None
    path = layout.partial_path(partial.step, partial.attempt, partial.rank)
    if partial.rank == 0 or _every_rank:
        _kept.put(storage, path, partial)
    storage.put_visible(path, partial.encode())


def take(storage: Storage, path: str) -> Manifest | None:
    """The partial this process put at ``path`` of ``storage`` (once), if it still keeps it."""
    return _kept.take(storage, path)
