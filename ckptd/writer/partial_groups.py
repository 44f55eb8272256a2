"""One frame table for the partials of several ranks that one process writes at about the same
time: the node agent, which writes every rank of its node.

Each rank's job ends by writing its frame table (a file, created and fsync'd) and its partial
manifest (:meth:`~ckptd.writer.pipeline.RankWriter.write_partial`). Through :class:`Groups`,
the jobs of one attempt that reach that point together write it together, as a database's
group commit does: the first one writes at once, alone; the ones that arrive while a write is
under way queue, and the first of them then writes one table for the whole queue and each of
their partials, which name their slices of it (as ``ckptd reshard`` writes one table for many
target ranks). Nobody waits for a rank that has not arrived, so a group never delays a save;
a node's ranks write fewer tables than there are ranks (``docs/format.md``, *Fsyncs*;
``tests/test_partial_groups.py``: eight ranks, two tables). A table is named after the first
rank of its group; every rank's partial names the table it uses. If the shared write fails,
every rank of the group fails with that error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptd.writer import own_partials
from ckptd.writer.pipeline import check_chunks

if TYPE_CHECKING:
    from ckptd.manifest import Chunk, Manifest
    from ckptd.storage import Storage
    from ckptd.writer.pipeline import RankWriter, Share


@dataclass(eq=False)
class _Entry:
    writer: RankWriter
    share: Share
    chunks: list[tuple[str, Chunk]]
    ready: threading.Event = field(default_factory=threading.Event)
    batch: list[_Entry] | None = None  # the entries it writes (itself first): it leads
    partial: Manifest | None = None
    error: BaseException | None = None


class Groups:
    """The queues of partials waiting to be written, by (storage, step, attempt)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # a queue exists while a write for its attempt is under way
        self._queues: dict[tuple[Storage, int, str], list[_Entry]] = {}

    def write_partial(self, writer: RankWriter, share: Share,
                      chunks: list[tuple[str, Chunk]]) -> Manifest:
        """``writer.write_partial(share, chunks)``, with the ranks of the same attempt that
        arrive meanwhile sharing one frame table."""
        check_chunks(share, chunks)  # a rank's own mistake fails it alone
        key = (writer.storage, share.step, share.attempt)
        me = _Entry(writer, share, chunks)
        with self._lock:
            queue = self._queues.get(key)
            if queue is None:
                self._queues[key] = []  # a write is under way: later ones queue
                me.batch = [me]
            else:
                queue.append(me)
        if me.batch is None:
            me.ready.wait()  # written by the one that led its queue, or made its leader
        if me.batch is not None:
            self._lead(key, me.batch)
        if me.error is not None:
            raise me.error
        assert me.partial is not None
        return me.partial

    def _lead(self, key: tuple[Storage, int, str], batch: list[_Entry]) -> None:
        """Write ``batch``'s table and partials; then the queue that formed meanwhile goes to
        its first entry to write."""
        try:
            partials = batch[0].writer.partials([(e.share, e.chunks) for e in batch],
                                                checked=True)  # (in write_partial)
        except BaseException as e:  # noqa: BLE001 - each rank of the batch raises it
            for entry in batch:
                entry.error = e
        else:
            for entry, partial in zip(batch, partials, strict=True):
                try:
                    own_partials.put_partial(entry.writer.storage, partial)
                    entry.partial = partial
                except BaseException as e:  # noqa: BLE001 - that rank raises it
                    entry.error = e
        with self._lock:
            queue = self._queues.pop(key)
            if queue:
                self._queues[key] = []
                queue[0].batch = queue
        for entry in batch[1:]:
            entry.ready.set()
        if queue:
            queue[0].ready.set()


__all__ = ["Groups"]
