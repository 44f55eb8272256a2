"""A failed attempt, made known to every rank: the records a rank or the coordinator leaves
(the process group's store first, then storage: a rank's record beside the partials, the
coordinator's ``FAILED`` marker), and reading them back as the error every rank raises, with
the class of the original (``docs/format.md``)."""

from __future__ import annotations

import json
import logging

from ckptd import errors
from ckptd.errors import CkptdError
from ckptd.manifest import layout
from ckptd.storage import Storage
from ckptd.writer.group_store import GroupStore

log = logging.getLogger("ckptd")


def record_failure(
    storage: Storage,
    signals: GroupStore,
    step: int,
    attempt: str,
    rank: int,
    error: BaseException,
    *,
    share: bool = True,
) -> None:
    """Make a failed attempt visible to every rank (best effort, never raises): the c10d store
    first (it works when storage is what broke), then storage. ``share``: this rank could not
    do its share (the reason names the rank); otherwise the coordinator's commit failed. The
    coordinator (rank 0) writes the attempt's FAILED marker, any other rank its own record,
    which the coordinator finds in the listing it polls anyway and turns into FAILED."""
    kind = type(error).__name__
    reason = " ".join(str(error).split()) or kind
    reason = reason.removeprefix(f"step {step} was not committed: ")
    if share:
        reason = f"rank {rank} failed: {kind}: {reason}"
    signals.publish_failure(attempt, kind, reason)
    path = (layout.failed_path(step, attempt) if rank == 0
            else layout.rank_failed_path(step, attempt, rank))
    try:
        doc = {"rank": rank, "type": kind, "message": reason}
        storage.put_atomic(path, json.dumps(doc).encode())
    except Exception as e:  # noqa: BLE001 - the original error matters more
        log.warning("ckptd: could not record the failure of step %d at %s: %s", step, path, e)


def publish_recorded(storage: Storage, signals: GroupStore, step: int, attempt: str, rank: int,
                     error: BaseException) -> None:
    """The node agent failed this rank's job and recorded why on storage: tell the process
    group's store the same (the other ranks learn it at once, as when this process fails a save
    itself). What it recorded (the rank's record, or the coordinator's FAILED marker), or, if
    storage holds none (storage is what broke), this rank's share failure. Never raises."""
    try:
        path = (layout.failed_path(step, attempt) if rank == 0
                else layout.rank_failed_path(step, attempt, rank))
        found = _read_record(storage, path)
    except Exception:  # noqa: BLE001 - then what this rank knows
        found = None
    if found is None:
        kind = type(error).__name__
        reason = " ".join(str(error).split()) or kind
        found = kind, f"rank {rank} failed: {kind}: {reason}"
    signals.publish_failure(attempt, *found)


def not_committed(step: int, kind: str, reason: str) -> CkptdError:
    """The error every rank raises for a failed attempt, with the class of the original."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, CkptdError)):
        cls, reason = CkptdError, (reason if reason.startswith("rank ") else f"{kind}: {reason}")
    return cls(f"step {step} was not committed: {reason}")


def _read_record(storage: Storage, path: str) -> tuple[str, str] | None:
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        return str(doc["type"]), str(doc["message"])
    except (ValueError, KeyError, TypeError):
        return "CkptdError", f"unreadable failure record {path}"


def failure_of(
    storage: Storage, step: int, attempt: str, signals: GroupStore, names: list[str] | None = None,
    *, read: bool = True,
) -> CkptdError | None:
    """The attempt's failure, if any rank published one: the store first, then storage (the
    FAILED marker, unless ``read`` is False — a probe saw none —, or with ``names`` — the
    coordinator's listing — a rank's record)."""
    found = signals.failure(attempt)
    if found is not None:
        pass
    elif names is None and not read:
        return None
    elif names is None:
        found = _read_record(storage, layout.failed_path(step, attempt))
    else:
        failed = sorted(n for n in names if layout.is_rank_failure(n))
        if failed:
            found = _read_record(storage, f"{layout.partials_dir(step, attempt)}/{failed[0]}")
    return None if found is None else not_committed(step, *found)


def attempt_failed(storage: Storage, step: int, attempt: str, signals: GroupStore) -> bool:
    """Whether ``attempt`` failed for good: a rank published its failure, or the coordinator's
    FAILED marker or a rank's record is in place (no commit, ``ckptd finalize`` included, can
    use its files any more). Never raises: False when it cannot tell."""
    try:
        if signals.failure(attempt) is not None:
            return True
        names = storage.list_dir(layout.partials_dir(step, attempt))
    except Exception:  # noqa: BLE001 - unknown: keep the files
        return False
    return layout.FAILED in names or any(layout.is_rank_failure(n) for n in names)


__all__ = ["attempt_failed", "failure_of", "not_committed", "publish_recorded", "record_failure"]
