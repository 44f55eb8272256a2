"""Module-level functions that use the process-wide default Checkpointer (``ckptd.init``).
Each takes what the :class:`~ckptd.Checkpointer` method of the same name takes."""

from __future__ import annotations

from typing import Any

from ckptd import checkpointer
from ckptd.checkpointer import Checkpointer, LoadResult
from ckptd.loader.load import Strict
from ckptd.policies import Retention, SavePolicy
from ckptd.step_metadata import StepMetadata
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

    Returns:
        The new default :class:`~ckptd.Checkpointer` (constructed: it opens its root on first
        use).

    Raises:
        CkptdError: closing the previous default Checkpointer raised its pending background
            error (the new one is not created then).
        ValueError: a parameter is invalid (see :class:`~ckptd.Checkpointer`).

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp(), keep_last=2)
        ckptd.save({"w": torch.ones(3), "step": 1})
        assert ckptd.latest_step() == 1
        ckptd.close()
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
    """Stage ``state`` into host memory and write it in the background, with the default
    Checkpointer (:meth:`Checkpointer.save_async <ckptd.Checkpointer.save_async>`).

    Args:
        state, step, overlap, training, urgent, overwrite: as for
            :meth:`Checkpointer.save_async <ckptd.Checkpointer.save_async>`.

    Returns:
        A :class:`~ckptd.SaveHandle`, the ``concurrent.futures.Future`` of the
        :class:`~ckptd.SaveResult`, completed once the step is committed on every rank.

    Raises:
        CkptdError: no ``ckptd.init`` before; or an earlier save's background error.

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp())
        model = torch.nn.Linear(4, 2)
        handle = ckptd.save_async({"model": model, "step": 5})
        # the state is staged: training may go on and modify the model
        assert handle.result().step == 5
        ckptd.close()
    """
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
    """Save ``state`` with the default Checkpointer and return once the step is committed on
    every rank (:meth:`Checkpointer.save <ckptd.Checkpointer.save>`).

    Args:
        state, step, training, urgent, overwrite: as for
            :meth:`Checkpointer.save <ckptd.Checkpointer.save>`.

    Returns:
        The :class:`~ckptd.SaveResult` of this rank.

    Raises:
        CkptdError: no ``ckptd.init`` before; the step is already committed (without
            ``overwrite=True``); or the save failed (its error's class is kept:
            :class:`~ckptd.StorageError`, ...).

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp())
        result = ckptd.save({"w": torch.arange(4.0)}, step=3, training={"loss": 0.5})
        assert (result.step, result.skipped) == (3, False)
        ckptd.close()
    """
    return _get().save(state, step=step, training=training, urgent=urgent,
                       overwrite=overwrite)


def wait() -> None:
    """Block until every in-flight save of the default Checkpointer is committed.

    Raises:
        CkptdError: no ``ckptd.init`` before; or the first background error of a save not
            yet reported (raised once).

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp(), max_inflight=2)
        ckptd.save_async({"w": torch.zeros(2)}, step=1)
        ckptd.save_async({"w": torch.ones(2)}, step=2)
        ckptd.wait()
        assert ckptd.latest_step() == 2
        ckptd.close()
    """
    _get().wait()


def close() -> None:
    """Close the default Checkpointer and forget it: in-flight saves are drained first
    (:meth:`Checkpointer.close <ckptd.Checkpointer.close>`). Does nothing without one;
    ``ckptd.save`` and the other module functions then need a new ``ckptd.init``.

    Raises:
        CkptdError: a pending background error of a save (the Checkpointer is forgotten
            all the same).

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp())
        ckptd.save_async({"w": torch.ones(2)}, step=1)
        ckptd.close()  # the save is committed before it returns
        ckptd.close()  # nothing to close: no error
    """
    ckpt = checkpointer.default_or_none()
    if ckpt is None:
        return
    try:
        ckpt.close()
    finally:
        checkpointer.set_default(None)


def latest_step() -> int | None:
    """The newest committed step under the default Checkpointer's root, or None.

    "Newest" is in commit order (a newer run's steps win over an older run's, whatever their
    numbers); nothing is committed by asking.

    Returns:
        The step number, or None when the root holds no committed step.

    Raises:
        CkptdError: no ``ckptd.init`` before.

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp())
        assert ckptd.latest_step() is None
        ckptd.save({"w": torch.ones(2)}, step=7)
        assert ckptd.latest_step() == 7
        ckptd.close()
    """
    return _get().latest_step()


def load(
    state: Any,
    *,
    step: int | None = None,
    strict: Strict = True,
    source: str | None = None,
    trust: bool = False,
) -> LoadResult:
    """Fill ``state`` in place from a committed step with the default Checkpointer,
    resharding to its layout (:meth:`Checkpointer.load <ckptd.Checkpointer.load>`).

    Args:
        state, step, strict, source, trust: as for
            :meth:`Checkpointer.load <ckptd.Checkpointer.load>`: everything ``state`` asks
            for must be saved (``strict="exact"``: and nothing saved left unasked;
            ``strict=False``: skip what is missing); ``source`` may name a
            torch.distributed.checkpoint directory (``trust=True`` to read its pickle).

    Returns:
        The :class:`~ckptd.LoadResult`: the step loaded, its URL, bytes read, its
        ``training`` metadata.

    Raises:
        CkptdError: no ``ckptd.init`` before.
        CheckpointNotFound: no committed step (or not the one named).
        StateMismatch: the destination asks for what is not saved, or a shape or dtype
            differs; nothing was modified.
        CorruptCheckpoint: a file of the step is damaged.

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp())
        ckptd.save({"w": torch.arange(3.0), "step": 4})
        state = {"w": torch.zeros(3), "step": 0}
        result = ckptd.load(state)
        assert result.step == 4 and state["step"] == 4
        assert torch.equal(state["w"], torch.arange(3.0))
        ckptd.close()
    """
    return _get().load(state, step=step, strict=strict, source=source, trust=trust)


def steps() -> list[int]:
    """The committed steps under the default Checkpointer's root, ascending
    (:meth:`Checkpointer.steps <ckptd.Checkpointer.steps>`).

    Returns:
        The step numbers, ascending.

    Raises:
        CkptdError: no ``ckptd.init`` before.

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp(), keep_last=0)
        for step in (4, 2, 8):
            ckptd.save({"w": torch.ones(2)}, step=step)
        assert ckptd.steps() == [2, 4, 8]
        ckptd.close()
    """
    return _get().steps()


def metadata(step: int | None = None) -> StepMetadata:
    """What committed ``step`` (default: the latest) holds, from its manifest alone
    (:meth:`Checkpointer.metadata <ckptd.Checkpointer.metadata>`).

    Args:
        step: a committed step; None: the latest.

    Returns:
        A read-only :class:`~ckptd.StepMetadata`.

    Raises:
        CkptdError: no ``ckptd.init`` before.
        CheckpointNotFound: there is no such step.

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp())
        ckptd.save({"w": torch.zeros(3, dtype=torch.bfloat16)}, step=1)
        assert ckptd.metadata().tensors["w"].dtype == torch.bfloat16
        ckptd.close()
    """
    return _get().metadata(step)


def delete(step: int) -> bool:
    """Remove committed ``step`` with the default Checkpointer
    (:meth:`Checkpointer.delete <ckptd.Checkpointer.delete>`).

    Args:
        step: the step to remove.

    Returns:
        True if this call removed it, False if it was not committed.

    Raises:
        CkptdError: no ``ckptd.init`` before, or a save of ``step`` is in flight.

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp(), keep_last=0)
        ckptd.save({"w": torch.ones(2)}, step=1)
        ckptd.save({"w": torch.ones(2)}, step=2)
        assert ckptd.delete(1) and ckptd.steps() == [2]
        ckptd.close()
    """
    return _get().delete(step)


def should_save(step: int) -> bool:
    """Whether to save ``step``, by the default Checkpointer's ``save_policy``
    (:meth:`Checkpointer.should_save <ckptd.Checkpointer.should_save>`).

    Args:
        step: the step the loop is at.

    Returns:
        Whether to save it.

    Raises:
        CkptdError: no ``ckptd.init`` before, or no ``save_policy``.

    Example:
        import tempfile
        import torch
        import ckptd

        ckptd.init(tempfile.mkdtemp(), save_policy=ckptd.SaveEvery(steps=5, on_preemption=False))
        saved = [step for step in range(1, 16) if ckptd.should_save(step)]
        assert saved == [5, 10, 15]
        ckptd.close()
    """
    return _get().should_save(step)
