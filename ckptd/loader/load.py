"""Loading a committed step into any destination layout.

Order of work, chosen so that a failed load leaves every destination tensor untouched:

1. **check** — every destination tensor exists in the checkpoint with the same global shape and
   dtype, every destination value key exists (``strict``, the default), and with
   ``strict="exact"`` no saved tensor is left unasked (across ranks when ``torch.distributed``
   is initialised). All ranks learn every rank's problems, so all raise together.
2. **plan** — overlapping chunks, frames, coalesced ranges (:mod:`ckptd.loader.plan`). With
   read-once on, pieces that several ranks need are read by one of them (:mod:`.read_once`).
3. **read + verify** — ranges are fetched in parallel threads and every frame's checksum is
   verified, holding at most the load budget (``load_budget_bytes``) of read buffers. When
   everything fits, the data is kept; otherwise the ranges that fit at the end of the plan are
   kept and the others are only verified (and read again in step 5, usually from the page cache).
4. **agree** — with ``torch.distributed`` initialised, ranks exchange their read errors, so that
   either every rank copies or none does.
5. **copy** — the kept data is copied; the other ranges are read again and verified again, whole
   raw frames straight into contiguous destination memory (:mod:`.direct`), the rest through
   read buffers and copied view to view, in the worker threads; read-once pieces are broadcast
   by their reader; then JSON values and per-rank values are replaced in their containers.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptd import config, errors
from ckptd.errors import CkptdError, CorruptCheckpoint, StateMismatch
from ckptd.loader import direct, read_once
from ckptd.loader.fetch import (
    Buffers,
    Fetched,
    ReadStats,
    StepFiles,
    copy_range,
    run_ranges,
)
from ckptd.loader.plan import LoadPlan, Range, plan_load
from ckptd.manifest import Manifest
from ckptd.sharding import LOCAL_PREFIX, Described, Local, Piece, local_name, put_values
from ckptd.storage import Storage
from ckptd.world import dist_or_none, fail_together, gather_object


@dataclass
class LoadStats:
    """What one load did on this rank (``last_stats()``; benchmarks and tests read it)."""

    needed_bytes: int = 0  # bytes of the destination regions read from storage by this rank
    planned_ranges: int = 0
    runs: int = 0  # contiguous byte runs the ranges form (ranges split only by the read unit)
    reads: ReadStats = field(default_factory=ReadStats)  # both passes
    reread: ReadStats = field(default_factory=ReadStats)  # the copy pass's share of ``reads``
    peak_buffer_bytes: int = 0  # the reader's peak host memory for read buffers
    budget_bytes: int = 0
    passes: int = 1  # 2 when the data did not fit the budget and some ranges were read twice
    broadcast_bytes: int = 0  # read-once: bytes received from or sent to other ranks
    # seconds per phase: check, plan, read (+ verify), agree, copy, reread (+ verify + copy),
    # broadcast
    seconds: dict[str, float] = field(default_factory=dict)
    # CPU seconds of the calling thread for the metadata: reading and decoding the manifest,
    # the check and the plan (the data's reads and copies excluded)
    metadata_cpu_s: float = 0.0


# How a load checks its destination against the checkpoint: True (the default), everything
# the destination asks for must be saved, and saved entries it does not ask for are left alone
# (a partial load); "exact", also every saved tensor must be asked for by some rank; False,
# what is missing is skipped (the destination keeps its value)
Strict = bool | Literal["exact"]


def strictness(strict: Strict) -> tuple[bool, bool]:
    """``(missing is an error, unasked is an error)`` for ``strict``; a ValueError for any
    other value."""
    if strict is True or strict is False:
        return strict, False
    if strict == "exact":
        return True, True
    raise ValueError(f"strict must be True, False or 'exact', got {strict!r}")


_last = threading.local()


def last_stats() -> LoadStats | None:
    """The statistics of the last load in this thread."""
    return getattr(_last, "stats", None)


def summary(problems: list[str], limit: int = 8) -> str:
    """Problems in one line: the first ``limit``, and how many more."""
    more = f"; ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def agree(saved: list[str], asked: set[str], problems: list[str], strict: Strict,
          world_size: int, where: str) -> None:
    """The end of a load's check, on every rank of every loader (a ckptd checkpoint, a DCP
    directory): whether any rank asks for each of ``saved`` (the same list everywhere; an O(T)
    union, :func:`_union_of_asks`), every rank's ``problems`` once any rank has one, and under
    ``strict="exact"`` the saved tensors no rank asks for. Raises :class:`StateMismatch` naming
    ``where``, on every rank alike, before anything is touched."""
    _, exact = strictness(strict)
    wanted, anyone_failed, ranks = _union_of_asks(saved, asked, bool(problems))
    if anyone_failed:
        gathered = gather_object(problems)
        problems = [f"rank {r}: {msg}" if len(gathered) > 1 else msg
                    for r, probs in enumerate(gathered) for msg in probs]
    if exact and (ranks > 1 or world_size == 1):
        problems += [f"{n}: saved but not in the destination state (strict='exact')"
                     for n, w in zip(saved, wanted, strict=True) if not w]
    if problems:
        raise StateMismatch(f"{where}: {summary(problems)}")


def aborted(rank: int, kind: str, message: str,
            known: tuple[type[CkptdError], ...] = ()) -> CkptdError:
    """The error every rank raises when rank ``rank`` failed a load (``kind``: its class's
    name): that class when it is one of ckptd's errors (or of ``known``), else
    :class:`CorruptCheckpoint`."""
    cls: Any = next((k for k in known if k.__name__ == kind), None) or getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, CkptdError)):
        cls = CorruptCheckpoint
    return cls(f"load aborted on every rank: rank {rank} failed: {message}")  # type: ignore[no-any-return]


def check(manifest: Manifest, described: Described, rank: int, strict: Strict,
          world_size: int) -> list[Piece]:
    """The destination pieces to fill; raises StateMismatch before anything is touched."""
    missing_fails, _ = strictness(strict)
    problems: list[str] = []
    pieces: list[Piece] = []
    for p in described.pieces:
        entry = manifest.tensors.get(p.name)
        if entry is None:
            if p.name.startswith(f"{LOCAL_PREFIX}/"):
                continue  # a rank the saved world did not have keeps its per-rank value
            if missing_fails:
                problems.append(f"{p.name}: missing from the checkpoint")
            continue
        if entry.shape != p.global_shape:
            problems.append(f"{p.name}: saved shape {entry.shape}, destination {p.global_shape}")
        elif entry.dtype != p.dtype:
            problems.append(f"{p.name}: saved dtype {entry.dtype}, destination {p.dtype}")
        else:
            pieces.append(p)
    if missing_fails:
        for key in described.values:
            if key not in manifest.values:
                problems.append(f"{key}: value missing from the checkpoint")
    asked = {p.name for p in described.pieces if not p.name.startswith(f"{LOCAL_PREFIX}/")}
    saved = sorted(n for n in manifest.tensors if not n.startswith(f"{LOCAL_PREFIX}/"))
    agree(saved, asked, problems, strict, world_size, f"step {manifest.step}")
    return pieces


def _union_of_asks(saved: list[str], asked: set[str], failed: bool,
                   ) -> tuple[list[bool], bool, int]:
    """For each of ``saved`` (the same list on every rank), whether any rank asks for it;
    whether any rank found a problem; the number of ranks. One all-reduce of a byte per saved
    tensor: O(T) per rank, where gathering every rank's names cost O(W·T) each."""
    dist = dist_or_none()
    mine = [n in asked for n in saved]
    if dist is None or dist.get_world_size() == 1:
        return mine, failed, 1
    import torch

    mask = torch.tensor([*mine, failed], dtype=torch.uint8)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX)
    flags = [bool(x) for x in mask.tolist()]
    return flags[:-1], flags[-1], dist.get_world_size()


def gap_bytes(storage: Storage) -> int:
    """The coalescing gap for this storage (a remote store pays more per request)."""
    t = config.get()
    return t.remote_gap_bytes if "://" in storage.url else t.gap_bytes


def unit_bytes(storage: Storage, buffers: Buffers) -> int:
    """The largest range for this storage: the pooled buffer size locally; on remote storage
    ``remote_unit_bytes``, at most a quarter of the budget (a range above the pooled size is
    one buffer of its exact length, reserved as such, so the budget still bounds the load)."""
    if "://" not in storage.url:
        return buffers.unit
    return max(buffers.unit, min(config.get().remote_unit_bytes, buffers.limit // 4))


def make_plan(storage: Storage, manifest: Manifest, pieces: list[Piece], rank: int | None,
              buffers: Buffers) -> LoadPlan:
    return plan_load(manifest, pieces, rank=rank, gap_bytes=gap_bytes(storage),
                     unit_bytes=unit_bytes(storage, buffers))


def kept_suffix(ranges: list[Range], buffers: Buffers, threads: int, remote: bool) -> set[int]:
    """Indices of the ranges whose data the verify pass keeps for the copy pass.

    Remote storage: all when they fit the budget, else the longest suffix that leaves room for
    ``threads`` ranges in flight. Local: all or nothing (``config.local_hold_bytes``)."""
    costs = [buffers.cost(r) for r in ranges]
    room = buffers.limit if remote else min(buffers.limit, config.get().local_hold_bytes)
    if sum(costs) <= room:
        return set(range(len(ranges)))
    if not remote:
        return set()
    room -= threads * max(costs, default=0)
    kept: set[int] = set()
    for i in range(len(ranges) - 1, -1, -1):
        if costs[i] > room:
            break
        room -= costs[i]
        kept.add(i)
    return kept


def _corrupt(rank: int, kind: str, message: str) -> CkptdError:
    """A read that failed on one rank: every rank raises CorruptCheckpoint naming it."""
    return CorruptCheckpoint(f"load aborted on every rank: rank {rank} failed: {message}")


def load_into(
    storage: Storage,
    step_dir: str,
    manifest: Manifest,
    described: Described,
    *,
    rank: int,
    world_size: int,
    strict: Strict,
    pool: ThreadPoolExecutor,
    metadata_since: float | None = None,
) -> int:
    """Fill ``described``'s destination from ``manifest``; returns the stored bytes read.
    ``metadata_since``: this thread's ``time.thread_time()`` when the caller began reading the
    manifest (``LoadStats.metadata_cpu_s`` counts from there; default: from this call)."""
    stats = LoadStats()
    _last.stats = stats
    clock = _Clock(stats.seconds)
    cpu0 = time.thread_time() if metadata_since is None else metadata_since
    pieces = check(manifest, described, rank, strict, world_size)
    dist = dist_or_none()
    sharing = read_once.plan_sharing(pieces, storage) if dist is not None else None
    mine = sharing.to_read(pieces) if sharing is not None else pieces
    clock("check")
    buffers = Buffers(config.get().load_budget_bytes)
    stats.budget_bytes = buffers.limit
    plan = LoadPlan()
    kept: set[int] = set()
    error: BaseException | None = None
    held: dict[int, Fetched] = {}
    files: StepFiles | None = None
    try:
        try:  # every rank must reach _agree, or its peers hang: errors wait until then
            plan = make_plan(storage, manifest, mine, rank, buffers)
            stats.needed_bytes, stats.planned_ranges = plan.needed_bytes, len(plan.ranges)
            stats.runs = plan.runs(gap_bytes(storage))
            # opened once for both passes: sizes checked before any buffer is allocated, and
            # (locally) the files stay readable even if retention removes them meanwhile
            files = StepFiles(storage, step_dir, {r.file for r in plan.ranges})
            files.check_bounds(plan.ranges)
            if files.session.resident:  # views of pinned memory: hold all, one pass
                buffers.limit = max(buffers.limit, sum(buffers.cost(r) for r in plan.ranges))
                kept = set(range(len(plan.ranges)))
            else:
                kept = kept_suffix(plan.ranges, buffers, pool._max_workers,  # typeshed has it
                                   remote="://" in storage.url)
            clock("plan")
            stats.metadata_cpu_s = time.thread_time() - cpu0
            held = run_ranges(files, plan.ranges, pool, buffers, hold=kept, stats=stats.reads)
        except Exception as e:  # noqa: BLE001 - raised by _agree, on every rank
            error = e
        clock("read")
        try:
            fail_together(error, _corrupt)
        except BaseException:
            _free(held, plan.ranges, buffers)
            raise
        assert files is not None
        clock("agree")
        try:
            futures = [pool.submit(copy_range, plan.ranges[i], got.data)
                       for i, got in held.items()]
            for f in futures:
                f.result()
        finally:
            _free(held, plan.ranges, buffers)
        clock("copy")
        rest = [r for i, r in enumerate(plan.ranges) if i not in kept]
        if rest:
            stats.passes = 2
            direct.fill(files, manifest, rest, rank, pool, buffers, gap_bytes(storage),
                        unit_bytes(storage, buffers), stats.reread)
            stats.reads.add(stats.reread)
            clock("reread")
    finally:
        if files is not None:
            files.close()
    if sharing is not None:
        stats.broadcast_bytes = sharing.broadcast(buffers)
        clock("broadcast")
    stats.peak_buffer_bytes = buffers.peak
    _replace_values(manifest, described, rank)
    return stats.reads.stored_bytes


def _free(held: dict[int, Fetched], ranges: list[Range], buffers: Buffers) -> None:
    for i in list(held):
        held.pop(i).free()
        buffers.release(buffers.cost(ranges[i]))


class _Clock:
    """Records the seconds since the previous call under each phase name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


def _replace_values(manifest: Manifest, described: Described, rank: int) -> None:
    put_values(described, manifest.values, manifest.tuples)
    saved_locals = manifest.locals.get(str(rank), {})
    for key, slot in described.local_slots.items():
        if key in saved_locals:
            slot.container[slot.key] = Local(saved_locals[key])


__all__ = ["load_into", "check", "local_name", "last_stats", "LoadStats"]
