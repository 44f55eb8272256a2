"""Who this process is: rank and world size, and the run id all ranks of one job share; the
collectives that make ranks agree (:func:`gather_object`, :func:`from_rank0`)."""

from __future__ import annotations

import contextvars
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ckptd import config
from ckptd.errors import CkptdError

T = TypeVar("T")


# Set inside :func:`alone`: this thread's ckptd calls make no collectives.
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptd_alone", default=False)


@contextmanager
def alone() -> Iterator[None]:
    """Inside, this process is a world of its own for ckptd (rank 0 of 1): no collectives
    even when a process group is initialised. For a caller that saves or loads on one rank
    while its peers do not take part (a framework that checkpoints from rank 0 alone)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def dist_or_none() -> Any:
    """``torch.distributed`` when a process group is initialised (and not inside
    :func:`alone`), else None."""
    import torch.distributed as dist

    if _ALONE.get():
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _group() -> Any:
    """``torch.distributed`` when a process group of more than one rank is initialised: when
    ranks have peers to agree with."""
    dist = dist_or_none()
    return dist if dist is not None and dist.get_world_size() > 1 else None


def gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (foreground only: a collective); ``[obj]`` alone."""
    dist = _group()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(compute: Callable[[], T]) -> T:
    """What ``compute()`` returns on rank 0, on every rank: rank 0 alone calls it, one
    broadcast shares it (foreground only: a collective). Without peers (no process group, or
    one rank) each process calls it itself."""
    dist = _group()
    if dist is None:
        return compute()
    box: list[Any] = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def shared_from_rank0(compute: Callable[[], T]) -> T:
    """:func:`from_rank0` for a ``compute`` that may fail: when it raises on rank 0, rank 0
    raises its error and every other rank raises the same one line — the same class when it
    is one of ckptd's errors, else :class:`CkptdError` naming it — rather than wait for a
    broadcast that never comes, or go on without the result (foreground only: a collective)."""
    dist = _group()
    if dist is None:
        return compute()
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (True, compute())
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = e
            box[0] = (False, type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if not box[0][0]:
        raise _remote_error(box[0][1], box[0][2])
    return box[0][1]  # type: ignore[no-any-return]


def _remote_error(kind: str, message: str) -> CkptdError:
    """Rank 0's error of class ``kind`` with ``message``, as another rank raises it."""
    from ckptd import errors

    cls: Any = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, CkptdError):
        return cls(message)  # type: ignore[no-any-return]
    return CkptdError(f"rank 0 failed: {kind}: {message}")


def fail_together(
    error: BaseException | None, remote: Callable[[int, str, str], BaseException]
) -> None:
    """Every rank calls this at the same point of a collective operation: if any rank failed,
    every rank raises — its own error, or ``remote(rank, error class name, message)`` for the
    first rank that failed — so no rank goes on to a collective its peers never reach."""
    reports = gather_object(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            raise remote(rank, *report)


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size``, each (when None) from the process group, else from the
    launcher's ``RANK`` / ``WORLD_SIZE`` (0 and 1 by default); a rank outside the world is a
    :class:`CkptdError`. Inside :func:`alone`: 0 and 1."""
    dist = dist_or_none()
    if _ALONE.get():
        rank, world_size = (0 if rank is None else rank), (1 if world_size is None else world_size)
    if rank is None:
        rank = dist.get_rank() if dist else int(os.environ.get("RANK", 0))
    if world_size is None:
        world_size = dist.get_world_size() if dist else int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world_size:
        raise CkptdError(f"rank {rank} outside world of size {world_size}")
    return rank, world_size


def agree_attempt_base(world_size: int, run_id_given: bool) -> int:
    """Where a writer's attempt numbers start (attempts are ``<run>-<number>``). A run id
    agreed here is new for every incarnation: 0. A run id the caller gave may be the same
    across restarts (a scheduler's job id): then rank 0's clock in milliseconds, agreed by one
    broadcast, so a restart never reuses its predecessor's attempt names (a commit would take
    a dead incarnation's partial for a rank's share, and ``ckptd gc`` would judge the new
    attempts older than the old ones, so dead). Ranks without a process group cannot agree
    on it: 0, and a run id reused across their restarts keeps that hazard (``docs/api.md``)."""
    if not run_id_given:
        return 0
    if _group() is not None:
        return int(from_rank0(_clock_ms))
    return _clock_ms() if world_size == 1 else 0


def _clock_ms() -> int:
    return time.time_ns() // 1_000_000


def agree_run_id(rank: int, world_size: int, run_id: str | None) -> str:
    """One id for this job incarnation, the same on every rank (one broadcast at init, or the
    launcher's environment)."""
    if run_id:
        return run_id
    given = config.RUN_ID.get()
    if given:
        return given
    if _group() is not None:
        return str(from_rank0(lambda: uuid.uuid4().hex[:12]))
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return (
            f"{os.environ['TORCHELASTIC_RUN_ID']}-r"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
    if world_size == 1:
        return uuid.uuid4().hex[:12]
    raise CkptdError(
        "ranks cannot agree on a run id: initialise torch.distributed before ckptd.init, "
        "or pass run_id= (or set CKPTD_RUN_ID) identically on every rank"
    )
