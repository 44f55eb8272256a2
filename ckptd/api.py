"""Module-level functions that use the process-wide default Checkpointer (``ckptd.init``).
Each takes what the :class:`~ckptd.Checkpointer` method of the same name takes."""

from __future__ import annotations

from typing import Any

from ckptd import checkpointer
from ckptd.catalog import StepMetadata
from ckptd.checkpointer import Checkpointer, LoadResult
from ckptd.loader.load import Strict
from ckptd.policies import Retention, SavePolicy
from ckptd.storage import Storage
from ckptd.writer.handle import SaveHandle, SaveResult


def init(
    root: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    keep_last: int | None = None,
    compression: str | None = None,
    storage_options: dict[str, Any] | None = None,
    max_inflight: int = 1,
    threads: int | None = None,
    on_busy: str = "block",
    run_id: str | None = None,
    storage: Storage | None = None,
    debug_overlap: bool = False,
    host_budget_bytes: int | None = None,
    read_only: bool = False,
    agent: bool | None = None,
    retention: Retention | None = None,
    save_policy: SavePolicy | None = None,
) -> Checkpointer:
    """Create the process-wide default Checkpointer that ``ckptd.save``, ``ckptd.load``, ...
    use (closing a previous one) and return it.

    Args:
        root, rank, world_size, keep_last, compression, storage_options, max_inflight,
        threads, on_busy, run_id, storage, debug_overlap, host_budget_bytes, read_only,
        agent, retention, save_policy: the parameters of :class:`~ckptd.Checkpointer`, with
            the same defaults; ``help(ckptd.Checkpointer)`` documents each.

    >>> import ckptd                                         # doctest: +SKIP
    >>> ckptd.init("/shared/ckpts/run1", keep_last=3)        # doctest: +SKIP
    """
    previous = checkpointer.default_or_none()
    if previous is not None:
        previous.close()
    ckpt = Checkpointer(
        root,
        rank=rank,
        world_size=world_size,
        keep_last=keep_last,
        compression=compression,
        storage_options=storage_options,
        max_inflight=max_inflight,
        threads=threads,
        on_busy=on_busy,
        run_id=run_id,
        storage=storage,
        debug_overlap=debug_overlap,
        host_budget_bytes=host_budget_bytes,
        read_only=read_only,
        agent=agent,
        retention=retention,
        save_policy=save_policy,
    )
    checkpointer.set_default(ckpt)
    return ckpt


def _get() -> Checkpointer:
    return checkpointer.default()


def save_async(
    state: Any,
    *,
    step: int | None = None,
    overlap: bool = False,
    training: dict[str, Any] | None = None,
    urgent: bool = False,
    overwrite: bool = False,
) -> SaveHandle:
    """Stage ``state`` into host memory and write it in the background
    (:meth:`Checkpointer.save_async <ckptd.Checkpointer.save_async>`); returns a
    ``concurrent.futures.Future`` of the :class:`~ckptd.SaveResult`."""
    return _get().save_async(state, step=step, overlap=overlap, training=training,
                             urgent=urgent, overwrite=overwrite)


def save(
    state: Any,
    *,
    step: int | None = None,
    training: dict[str, Any] | None = None,
    urgent: bool = False,
    overwrite: bool = False,
) -> SaveResult:
    """Save and return once the step is committed on every rank
    (:meth:`Checkpointer.save <ckptd.Checkpointer.save>`)."""
    return _get().save(state, step=step, training=training, urgent=urgent,
                       overwrite=overwrite)


def wait() -> None:
    """Every in-flight save committed; raises the first background error."""
    _get().wait()


def close() -> None:
    """Close the default Checkpointer (``Checkpointer.close``: drain in-flight saves, raise a
    pending background error) and forget it; nothing without one."""
    ckpt = checkpointer.default_or_none()
    if ckpt is None:
        return
    try:
        ckpt.close()
    finally:
        checkpointer.set_default(None)


def latest_step() -> int | None:
    """Newest committed step under the root, or None."""
    return _get().latest_step()


def load(
    state: Any,
    *,
    step: int | None = None,
    strict: Strict = True,
    source: str | None = None,
    trust: bool = False,
) -> LoadResult:
    """Fill ``state`` in place from a committed step, resharding to its layout
    (:meth:`Checkpointer.load <ckptd.Checkpointer.load>`): everything ``state`` asks for must
    be saved (``strict="exact"``: and nothing saved left unasked; ``strict=False``: skip what
    is missing); ``source`` may name a torch.distributed.checkpoint directory
    (``trust=True`` to read its pickle)."""
    return _get().load(state, step=step, strict=strict, source=source, trust=trust)


def steps() -> list[int]:
    """The committed steps under the root, ascending."""
    return _get().steps()


def metadata(step: int | None = None) -> StepMetadata:
    """What committed ``step`` (default: the latest) holds, from its manifest alone."""
    return _get().metadata(step)


def delete(step: int) -> bool:
    """Remove committed ``step``; False if it was not committed (see Checkpointer.delete)."""
    return _get().delete(step)


def should_save(step: int) -> bool:
    """Whether to save ``step``, by the default Checkpointer's ``save_policy``."""
    return _get().should_save(step)
