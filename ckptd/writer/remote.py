"""A save's background half as data, for the node agent (:mod:`ckptd.agent`): what another
process needs to write one rank's staged arena, its partial manifest and (on rank 0) the commit.

The Saver stages into shared memory it got from an :class:`Offload`, describes the job with
:func:`encode` (JSON: names, boxes, arena offsets, the commit's parameters; never tensor data)
and hands it over; the agent rebuilds the file plans with :func:`decode` over its own mapping of
the same memory and runs :func:`run` — the same writer, partial and commit as in process.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ckptd.errors import CkptdError
from ckptd.manifest import TensorEntry, layout
from ckptd.manifest.schema import dtype_from_name, dtype_name
from ckptd.regions import Box
from ckptd.sharding import Piece
from ckptd.storage import Storage
from ckptd.writer import commit, retention
from ckptd.writer.files import ChunkList, Framing, gather
from ckptd.writer.pack import FilePlan, Slot
from ckptd.writer.pipeline import RankWriter, Round, Share, stored_bytes
from ckptd.writer.signals import Signals
from ckptd.writer.staging import Arena, StagingPool

VERSION = 1


class AgentLost(CkptdError):
    """The node agent died or stopped answering; the save continues in this process."""


class Stopped(CkptdError):
    """The agent stopped this write between two blocks (:meth:`Gate.stop`): the files written
    so far stay (and the one it stopped, unfinished), nothing is recorded as failed — another
    writer takes the share over, or this one goes on later (``written``: the chunks of each
    file written, by index, for :func:`run`)."""

    def __init__(self, message: str, written: dict[int, ChunkList] | None = None) -> None:
        super().__init__(message)
        self.written = written or {}


class Gate:
    """What the agent's I/O threads pass before each block the storage writes of one save's
    files (64 MiB on a filesystem, a part on S3; before each file too): a pace (at most ``rate``
    bytes/s over the write, ``$CKPTD_AGENT_WRITE_RATE``; None: no limit) and a stop
    (:meth:`stop`: the next block of every file raises :class:`Stopped`, a pace's wait ends at
    once; a block being written finishes, the file stays unfinished)."""

    def __init__(self, rate: float | None = None) -> None:
        self.rate = rate
        self.started = 0  # bytes past the gate (being written, or written)
        self._booked = 0  # bytes that came to it (the pace's schedule)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        with self._lock:  # each block's turn comes once the blocks before it had theirs
            due = self._t0 + self._booked / self.rate if self.rate else 0.0
            self._booked += nbytes
        wait = due - time.monotonic()
        if self._stop.wait(wait) if wait > 0 else self._stop.is_set():
            raise Stopped("the agent stopped this write")
        with self._lock:
            self.started += nbytes

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


class Ticket(Protocol):
    # The agent's reply once its part is done: ``nbytes``, ``write_s``; ``kept``: the agent
    # holds on to the arena (the memory tier's copy of the step); ``released``: the
    # ``data_ptr`` of arenas it let go of, free for the next saves. Or it raises
    # :class:`AgentLost`, or :class:`CkptdError` with the agent's reason.
    reply: Future[dict[str, Any]]


class Offload(Protocol):
    """Where staging memory comes from and the background half goes (the node agent)."""

    keep: int  # steps the agent keeps in memory, each in the arena it was staged in
    peers: bool  # it copies them to peers: one more arena held while a copy is sent
    on_release: Callable[[int], None] | None  # the agent gave back the arena at data_ptr

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over shared memory the agent can read too."""

    def submit(self, arena: torch.Tensor, job: dict[str, Any]) -> Ticket:
        """Hand ``job`` over; returns once the agent holds it (raises :class:`AgentLost`)."""

    @property
    def alive(self) -> bool: ...

    def close(self) -> None: ...

    def kept(self) -> Held:
        """What the agent holds of this root, unchanged until ``unpin(held.lease)``."""

    def unpin(self, lease: int) -> None: ...

    def committed(self, rank: int, step: int) -> None:
        """The trainer saw ``rank``'s ``step`` commit (a step the agent wrote but did not
        commit itself): older steps may go."""

    def settle(self) -> None:
        """The retention the agent owes (rank 0's), done now: the Saver closes."""


@dataclass(frozen=True)
class Held:
    """A node agent's memory as one load sees it."""

    files: dict[str, memoryview]  # data files of the root (path -> bytes, mapped read-only)
    lease: int  # keeps them unchanged until the load lets go
    copies: set[str]  # which of them are peer copies (another node's files)
    address: tuple[str, int] | None  # the agent's peer server (None: no job secret)


@dataclass(frozen=True)
class Commit:
    """What the commit needs besides the partials."""

    run_id: str
    generation: int
    overwrite: bool
    keep_last: int
    incarnation: str  # how the agent tells restarts apart (SaveOptions.incarnation)
    timeout_s: float | None = None  # the saving process's commit_timeout_s (None: the agent's)


def incarnation_of(commit_doc: dict[str, Any]) -> str:
    """A job's ``commit`` entry: its incarnation (a trainer that sends none: the run id)."""
    return str(commit_doc.get("incarnation") or commit_doc["run_id"])


def encode(share: Share, rnd: Round, *, codec: str, level: int, framing: Framing,
           commit_: Commit) -> dict[str, Any]:
    """The job: everything the agent needs to write it as the saving process would have —
    the plan, the codec and the framing, the commit's parameters (never tensor data)."""
    return {
        "version": VERSION,
        "share": {
            "step": share.step, "attempt": share.attempt, "rank": share.rank,
            "world_size": share.world_size,
            "declared": {n: [dtype_name(e.dtype), list(e.shape)]
                         for n, e in share.declared.items()},
            "values": share.values, "locals": share.locals, "training": share.training,
        },
        "nbytes": rnd.nbytes,
        "files": [{"index": p.index, "start": p.start, "end": p.end,
                   "slots": [[s.piece.name, list(s.piece.box.offsets), list(s.piece.box.sizes),
                              s.offset, s.nbytes] for s in p.slots]} for p in rnd.plans],
        "codec": codec, "level": level, "frame_bytes": framing.frame_bytes,
        "framing": {"min_frame_bytes": framing.min_frame_bytes,
                    "frames_per_chunk": framing.frames_per_chunk},
        "commit": {"run_id": commit_.run_id, "generation": commit_.generation,
                   "overwrite": commit_.overwrite, "keep_last": commit_.keep_last,
                   "incarnation": commit_.incarnation, "timeout_s": commit_.timeout_s},
    }


@dataclass
class Job:
    share: Share
    round: Round
    codec: str
    level: int
    commit: Commit
    framing: Framing


def decode(doc: dict[str, Any], arena: torch.Tensor) -> Job:
    """The job ``doc`` describes, its pieces viewing ``arena`` (the staged bytes). Every offset
    is checked against the arena: a job that points outside it is refused, not followed."""
    if doc.get("version") != VERSION:
        raise CkptdError(f"agent job version {doc.get('version')!r}, expected {VERSION}")
    s = doc["share"]
    declared = {n: TensorEntry(dtype_from_name(d, n), tuple(int(x) for x in shape))
                for n, (d, shape) in s["declared"].items()}
    plans = []
    for f in doc["files"]:
        slots = []
        for name, offsets, sizes, offset, nbytes in f["slots"]:
            entry = declared.get(name)
            if entry is None:
                raise CkptdError(f"agent job: slot for undeclared tensor {name!r}")
            itemsize = entry.dtype.itemsize
            if (nbytes != math.prod(sizes) * itemsize or offset < 0 or offset % itemsize
                    or offset + nbytes > arena.numel()):
                raise CkptdError(f"agent job: slot of {name!r} at {offset}+{nbytes} does not "
                                 f"fit its box or the {arena.numel()}-byte arena")
            view = arena[offset: offset + nbytes].view(entry.dtype).view(tuple(sizes))
            box = Box(tuple(offsets), tuple(sizes))
            slots.append(Slot(Piece(name, entry.shape, entry.dtype, box, view), offset, nbytes))
        plans.append(FilePlan(f["index"], f["start"], f["end"], slots))
    share = Share(s["step"], s["attempt"], s["rank"], s["world_size"], declared,
                  s["values"], s["locals"], s["training"])
    c, f = doc["commit"], doc.get("framing") or {}
    cfg = Framing.current()  # (a job without them: this process's)
    framing = Framing(_positive(doc.get("frame_bytes", cfg.frame_bytes), "frame_bytes"),
                      _positive(f.get("min_frame_bytes", cfg.min_frame_bytes), "min_frame_bytes"),
                      _positive(f.get("frames_per_chunk", cfg.frames_per_chunk),
                                "frames_per_chunk"))
    timeout = c.get("timeout_s")
    return Job(share, Round(plans, int(doc["nbytes"])), doc["codec"], int(doc["level"]),
               Commit(c["run_id"], int(c["generation"]), bool(c["overwrite"]),
                      int(c["keep_last"]), incarnation_of(c),
                      None if timeout is None else float(timeout)), framing)


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CkptdError(f"agent job: {name} {value!r} is not a positive integer")
    return value


def file_ranges(job: Job) -> dict[str, tuple[int, int]]:
    """Each data file of the job (its path under the root) and its bytes' range in the arena:
    with the raw codec, the file itself."""
    share = job.share
    step_dir = layout.step_dir(share.step)
    return {f"{step_dir}/{layout.data_file(share.attempt, share.rank, p.index)}": (p.start, p.end)
            for p in job.round.plans}


def run(storage: Storage, io: ThreadPoolExecutor, job: Job, arena: torch.Tensor,
        give_up: Callable[[list[int]], str | None] | None = None,
        gate: Gate | None = None, written: dict[int, ChunkList] | None = None) -> dict[str, Any]:
    """Write the files, the partial, and on rank 0 commit: the in-process save's background
    half, in the agent (then :func:`owe_retention`, once the trainer is told). A failure before
    the partial is recorded for the other ranks (and the files removed); the error is
    raised. ``give_up``: the commit's (:func:`ckptd.writer.commit.coordinate`). ``gate``: passed
    before each file; if it stopped a file, :class:`Stopped` is raised once no file is being
    written any more, with nothing recorded or removed (the files written stay, and its
    ``written`` says which). ``written``: files written already (a stopped run's), not written
    again."""
    share = job.share
    writer = RankWriter(storage, io, StagingPool(1), job.codec, job.level, gate)
    done = dict(written or {})
    todo = Round([p for p in job.round.plans if p.index not in done], job.round.nbytes)
    t0 = time.perf_counter()
    try:
        futures = writer.start_files(share, Arena(arena), todo, 0, stage_first=False,
                                     framing=job.framing)
        try:
            gather(futures)
        finally:
            done.update({p.index: f.result() for p, f in zip(todo.plans, futures, strict=True)
                         if f.exception() is None})
        chunks = [c for i in sorted(done) for c in done[i]]
        writer.write_partial(share, chunks)  # (a stop after the last file changes nothing)
    except Stopped as e:
        raise Stopped(str(e), done) from None
    except BaseException as e:
        commit.record_failure(storage, Signals(None), share.step, share.attempt, share.rank, e)
        writer.discard(share, len(job.round.plans))
        raise
    write_s = time.perf_counter() - t0
    if share.rank == 0:
        try:
            commit.coordinate(storage, share.step, share.attempt, share.world_size,
                              job.commit.run_id, generation=job.commit.generation,
                              overwrite=job.commit.overwrite, give_up=give_up,
                              timeout_s=job.commit.timeout_s)
        except BaseException:
            if commit.attempt_failed(storage, share.step, share.attempt, Signals(None)):
                writer.discard(share, len(job.round.plans), partial=True)  # never committable
            raise
    return {"nbytes": stored_bytes(chunks), "write_s": write_s}


def owe_retention(owed: retention.Owed, storage: Storage, job: Job) -> None:
    """On rank 0, once the commit is announced: retention is owed, and settled when the next
    save is staged or the writer closes (:class:`~ckptd.writer.retention.Owed`)."""
    if job.share.rank == 0:
        owed.owe(storage, job.commit.keep_last)


def pool_for(offload: Offload, slots: int) -> StagingPool:
    """A staging pool whose arenas are the agent's shared memory."""
    # the arenas the agent may hold besides the one being staged: the kept steps, one being
    # copied to a peer, one a load (another process's, perhaps) is reading
    pool = StagingPool(slots + offload.keep + int(offload.peers) + 1,
                       allocate=offload.allocate)
    offload.on_release = pool.release_buffer
    return pool


__all__ = ["AgentLost", "Commit", "Gate", "Job", "Offload", "Stopped", "Ticket", "decode",
           "encode", "file_ranges", "owe_retention", "run", "pool_for"]
