"""The Checkpointer: the face of one root for one rank — its configuration, ``describe``,
the hand-off of saves to the save path (:class:`ckptd.writer.save.Saver`) and loading
(:class:`ckptd.loader.reader.Reader`). Constructing one does no I/O; :meth:`Checkpointer.open`
(on first use) joins the node agent and claims the root. No collectives happen after it on the
save path.

Opening and closing the root are :mod:`ckptd.lifecycle`, managing its committed steps
:mod:`ckptd.step_management`: the class's two bases.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd import policies, stateful
from ckptd.agent.executor import AgentExecutor
from ckptd.agent.load_tier import memory_tier
from ckptd.errors import CkptdError
from ckptd.lifecycle import Lifecycle
from ckptd.loader.load import Strict
from ckptd.loader.reader import LoadResult, Reader
from ckptd.manifest import layout
from ckptd.policies import Retention, SavePolicy
from ckptd.sharding import describe
from ckptd.step_management import StepManagement
from ckptd.storage import Storage, open_storage
from ckptd.storage.base import as_storage
from ckptd.world import resolve_world
from ckptd.writer.handle import Phase, SaveHandle, SaveResult
from ckptd.writer.save import Saver

_default: Checkpointer | None = None  # the process default (``ckptd.init``)


def default() -> Checkpointer:
    """The process-wide default Checkpointer that ``ckptd.init`` created."""
    if _default is None:
        raise CkptdError("call ckptd.init(root) first")
    return _default


def default_or_none() -> Checkpointer | None:
    return _default


def set_default(ckpt: Checkpointer | None) -> None:
    global _default
    _default = ckpt


class Checkpointer(Lifecycle, StepManagement):
    """Checkpoints of one training job under ``root``: saves (``save``, ``save_async``),
    loads (``load``) and what is there (``latest_step``), for this rank.

    Args:
        root: where the checkpoints go: a local directory, ``file://``, ``s3://bucket/prefix``
            or ``gs://``/``az://``/... (fsspec). Each step is ``ROOT/step-NNNNNNNNN``.
        rank: this process's rank; None: the process group's, else ``$RANK`` (0).
        world_size: the number of ranks; None: the process group's, else ``$WORLD_SIZE`` (1).
        keep_last: committed steps to keep; older ones are removed after each commit, once
            the next save is staged. 0 or less keeps every step. Short for
            ``retention=KeepLast(keep_last)``; None (neither given): 3.
        compression: None (raw bytes), ``"zstd"`` or ``"zstd:LEVEL"`` (byte planes + zstd,
            level 1 by default), or ``"auto"`` (zstd only when the measured storage
            bandwidth is below what zstd delivers; the first save is raw).
        storage_options: options for the storage backend (for ``s3://``: ``s3fs``'s
            credentials, endpoint, region, ...).
        max_inflight: saves that may be in flight (staged, not yet committed) at once; each
            holds a staging copy of the state in host memory. A save beyond it waits for the
            oldest (``on_busy="block"``; logged once, and in ``SaveResult.waited_s``) or is
            dropped (``on_busy="skip"``).
        threads: I/O threads for writes and reads; None: ``$CKPTD_IO_THREADS``, else
            min(4, cores).
        on_busy: ``"block"`` (default) or ``"skip"``: what a save does when ``max_inflight``
            saves are in flight. A skipped save's ``result().skipped`` is True.
        run_id: the id every rank of one job incarnation shares; None: agreed by one
            broadcast (when the root is opened) if ``torch.distributed`` is initialised,
            else ``$CKPTD_RUN_ID`` or torchrun's ``$TORCHELASTIC_RUN_ID`` and restart count.
        storage: a ``ckptd.storage.base.Storage`` object to use instead of opening ``root``
            (saves then run in this process: no other process can open it).
        debug_overlap: check at ``handle.wait_staged()`` that a state saved with
            ``overlap=True`` was not modified before it was staged (``CorruptCheckpoint``
            naming the tensor); also ``$CKPTD_DEBUG_OVERLAP=1``. Costs a comparison.
        host_budget_bytes: the most host memory one save may stage; a larger state is staged
            and written in rounds (the caller then waits until it is durable). None: no limit.
        read_only: a reader (an evaluation job, a tool): it never takes the root over and
            refuses ``save``. A writing Checkpointer claims the root when it opens it: a job
            still writing under the previous owner fails its next commit.
        agent: hand each staged save to this node's agent process, started if none runs;
            None: ``$CKPTD_AGENT`` (1 or 0), and when that is unset, on Linux. With
            ``agent=False``, with no agent to be had, or with ``storage=``, saves run in this
            process.
        retention: which committed steps rank 0 keeps after each commit, a policy:
            ``ckptd.KeepLast(2) | ckptd.KeepEvery(100)``, ``ckptd.KeepBest(2, "loss")``
            (``docs/guide.md``, *Managing steps*). The newest step is always kept. Not
            with ``keep_last``.
        save_policy: what :meth:`should_save` asks: ``ckptd.SaveEvery(steps=100)``.

    Every parameter is fixed at construction: setting the attribute of one later
    (``ckpt.keep_last = 5``) raises ``AttributeError``; build a new Checkpointer instead.

    Constructing does no I/O: the root is opened (:meth:`open`: the run id agreed, the node
    agent joined, the root claimed) by the first call that needs it.

    Raises:
        ValueError: both ``keep_last`` and ``retention`` given, or a bad ``keep_last`` (here);
            a bad ``compression`` or ``on_busy`` (when the root is opened).
        TypeError: a ``retention`` or ``save_policy`` that is not a policy.

    Example:
        import tempfile
        import torch
        import ckptd

        model = torch.nn.Linear(4, 2)
        with ckptd.Checkpointer(tempfile.mkdtemp(), keep_last=2) as ckpt:
            ckpt.save({"model": model, "step": 10})
            fresh = torch.nn.Linear(4, 2)
            assert ckpt.load({"model": fresh}).step == 10
        assert torch.equal(fresh.weight, model.weight)
    """

    def __init__(
        self,
        root: str,
        *,
        rank: int | None = None, world_size: int | None = None,
        keep_last: int | None = None, compression: str | None = None,
        storage_options: dict[str, Any] | None = None,
        max_inflight: int = 1, threads: int | None = None, on_busy: str = "block",
        run_id: str | None = None, storage: Storage | None = None,
        debug_overlap: bool = False, host_budget_bytes: int | None = None,
        read_only: bool = False, agent: bool | None = None,
        retention: Retention | None = None, save_policy: SavePolicy | None = None,
    ) -> None:
        """See the class's Args."""
        self._retention = policies.resolve(keep_last, retention)
        self.keep_last = keep_last if keep_last is not None or retention else 3
        if save_policy is not None and not isinstance(save_policy, SavePolicy):
            raise TypeError(f"save_policy must have should_save(step), got {save_policy!r}")
        self._save_policy = save_policy
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.storage = (as_storage(storage) if storage is not None
                        else open_storage(root, storage_options))
        self.url = self.storage.url
        self.threads = self.threads_for(threads)
        self.read_only = read_only
        self._last_step: int | None = None
        self._closed = False
        self._io = ThreadPoolExecutor(self.threads, thread_name_prefix="ckptd-io")
        self._saver: Saver | None = None
        self._prepare_open(root, own_storage=storage is None, run_id=run_id,
                           compression=compression, max_inflight=max_inflight, on_busy=on_busy,
                           host_budget_bytes=host_budget_bytes, debug_overlap=debug_overlap,
                           agent=agent, storage_options=storage_options)

    def __setattr__(self, name: str, value: Any) -> None:
        # a constructor parameter is fixed once set (its value went into the save options,
        # the storage, the agent): assigning it later would be silently ignored
        if name in _PARAMETERS and (name in self.__dict__ or name not in _STORED):
            raise AttributeError(
                f"Checkpointer.{name} is fixed at construction and cannot change: build a new "
                f"Checkpointer(..., {name}=...) (close this one first)")
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ saving
    def save_async(
        self,
        state: Any,
        *,
        step: int | None = None,
        overlap: bool = False,
        training: dict[str, Any] | None = None,
        urgent: bool = False,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Stage ``state`` into host memory and write it in the background.

        Returns once the state is staged: the caller may then modify every tensor. With
        ``overlap=True`` it returns at once and stages in the background; call
        ``handle.wait_staged()`` before modifying the state. ``urgent=True`` (the preemption
        save) writes this step uncompressed whatever ``compression`` says, through the same
        staging buffers and I/O threads. A committed step is immutable: saving its number again
        fails (on every rank) unless ``overwrite=True``. ``step=None``: ``state["step"]`` if
        it is an int, else the step after the last one saved or loaded here (or after the
        newest committed one).

        With ``max_inflight`` saves still in flight it first waits for the oldest to finish
        (``on_busy="block"``: the first such wait is logged with the remedies, each one is
        ``handle.waited_s`` and ``SaveResult.waited_s``) or returns a skipped handle
        (``on_busy="skip"``).

        Args:
            state: the state tree: nested dicts/lists of tensors (plain, DTensor,
                :class:`~ckptd.Shard`, :class:`~ckptd.FlatShard`, :class:`~ckptd.Fused`,
                :class:`~ckptd.Local`), JSON values, and objects with ``state_dict()`` and
                ``load_state_dict()`` (a model, an optimizer, an LR scheduler).
            step: the step number; None: ``state["step"]`` if it is an int, else the step
                after the last one saved or loaded here (or after the newest committed one).
            overlap: return before staging; call ``handle.wait_staged()`` before modifying
                the state.
            training: JSON metadata stored with the step (``LoadResult.training``).
            urgent: write this step uncompressed (the preemption save).
            overwrite: replace the step if it is already committed.

        Returns:
            A :class:`SaveHandle`, a ``concurrent.futures.Future`` of the :class:`SaveResult`.

        Raises:
            CkptdError: a read-only or closed Checkpointer; the step already committed
                (raised by the handle, without ``overwrite``); or an earlier save's
                background error, raised once.
            StateMismatch: the state tree is not one ckptd can save (a bad leaf, a name
                clash), naming the entry.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                w = torch.ones(4)
                handle = ckpt.save_async({"w": w}, step=1, training={"loss": 0.25})
                w.add_(1)  # staged already: the save keeps the ones
                assert handle.result().step == 1
        """
        started = time.perf_counter()
        saver = self._writer()
        saver.raise_pending()
        step = self._next_step(state, step)
        described = describe(stateful.unfold(state).tree, self.rank, self.world_size)
        handle = saver.save_async(described, step, overlap=overlap, training=training,
                                  urgent=urgent, overwrite=overwrite, started=started)
        self._last_step = step
        return handle

    def reserve(self, state: Any) -> int:
        """Allocate (and fault in) the staging memory ``state`` will need, ahead of the first
        save, so that save's stall is one copy rather than one copy plus page faults.

        Args:
            state: a state tree as :meth:`save_async` takes it (only shapes and dtypes count).

        Returns:
            The bytes reserved.

        Raises:
            CkptdError: a read-only or closed Checkpointer.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                state = {"w": torch.zeros(1024)}
                assert ckpt.reserve(state) >= 4096
                ckpt.save(state, step=1)
        """
        tree = stateful.unfold(state).tree
        return self._writer().reserve(describe(tree, self.rank, self.world_size))

    def save(
        self,
        state: Any,
        *,
        step: int | None = None,
        training: dict[str, Any] | None = None,
        urgent: bool = False,
        overwrite: bool = False,
    ) -> SaveResult:
        """Save ``state`` and return once the step is committed on every rank:
        ``save_async(...).result()``.

        Args:
            state: the state tree (see :meth:`save_async`).
            step: the step number; None: as :meth:`save_async` chooses it.
            training: JSON metadata stored with the step.
            urgent: write this step uncompressed (the preemption save).
            overwrite: replace the step if it is already committed.

        Returns:
            This rank's :class:`SaveResult`.

        Raises:
            CkptdError: a read-only or closed Checkpointer, the step already committed
                (without ``overwrite``), or the save failed (its error's class kept:
                :class:`~ckptd.StorageError`, ...).

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                ckpt.save({"w": torch.ones(2)}, step=1)
                try:
                    ckpt.save({"w": torch.zeros(2)}, step=1)
                except ckptd.CkptdError as e:
                    assert "already committed" in str(e)
                else:
                    raise AssertionError("no error")
                ckpt.save({"w": torch.zeros(2)}, step=1, overwrite=True)
        """
        return self.save_async(state, step=step, training=training, urgent=urgent,
                               overwrite=overwrite).result()

    def load(self, state: Any, *, step: int | None = None, strict: Strict = True,
             source: str | None = None, trust: bool = False) -> LoadResult:
        """Fill ``state`` in place from a committed step (resharding to its layout).

        ``strict=True`` (the default): everything ``state`` asks for must be in the checkpoint
        with its shape and dtype, else :class:`~ckptd.StateMismatch` names it and nothing is
        touched; what the checkpoint holds beyond that is left alone (an evaluation job may
        load ``{"model": ...}`` from a checkpoint with optimizer state). ``strict="exact"``:
        also every saved tensor must be asked for (by some rank). ``strict=False``: what is
        missing from the checkpoint is skipped, the destination keeps its value.

        ``source`` loads from another checkpoint instead of this root: a
        torch.distributed.checkpoint directory (its pickled ``.metadata`` is only read with
        ``trust=True``).

        A model, an optimizer beside it, an LR scheduler or any object with ``state_dict()``
        and ``load_state_dict()`` in ``state`` gets its loaded state once the whole load
        succeeded (``ckptd.stateful``); a failed load leaves them as they were.

        Args:
            state: the destination tree, filled in place: tensors (any layout; each gets
                its own part of the saved values), JSON values, stateful objects.
            step: the step to load; None: the newest committed one.
            strict: ``True``, ``"exact"`` or ``False``, as above.
            source: another checkpoint to load from (a torch.distributed.checkpoint
                directory); None: this root.
            trust: allow reading ``source``'s pickled metadata.

        Returns:
            A :class:`LoadResult`: the step, its URL, the bytes read, its ``training``
            metadata.

        Raises:
            CheckpointNotFound: no committed step (or not the one named; also when it was
                deleted while being read).
            StateMismatch: a key is missing or a shape or dtype differs; nothing was modified.
            CorruptCheckpoint: a file of the step is damaged or tampered with.
            StorageError: the storage refused a read.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                ckpt.save({"model": {"w": torch.ones(3)}, "optim": {"m": torch.ones(3)}},
                          step=2)
                evaluation = {"model": {"w": torch.zeros(3)}}  # the optimizer is not asked for
                assert ckpt.load(evaluation).step == 2
                assert torch.equal(evaluation["model"]["w"], torch.ones(3))
                try:
                    ckpt.load({"model": {"w": torch.zeros(5)}})
                except ckptd.StateMismatch as e:
                    assert "model/w" in str(e)
                else:
                    raise AssertionError("no error")
        """
        self._check_open()
        self.open()
        unfolded = stateful.unfold(state, loading=True)
        try:
            result = self._load(unfolded.tree, step, strict, source, trust)
        except BaseException:
            unfolded.undo()
            raise
        unfolded.restore()
        return result

    def _load(self, state: Any, step: int | None, strict: Strict, source: str | None,
              trust: bool) -> LoadResult:
        reader = Reader(self.storage, self.rank, self.world_size, self._io)
        if source is not None or self.storage.exists(layout.DCP_METADATA):
            found = reader.load_source(state, source, step, strict, trust)
            if found is not None:
                return found
        described = describe(state, self.rank, self.world_size)
        executor = self._saver.executor if self._saver is not None else None
        offload = executor.client if isinstance(executor, AgentExecutor) else None
        with memory_tier(offload, self.storage, self._agent_spec, self.rank, self.world_size,
                         agents=self._agents) as tier:
            if tier is not None:  # what the node agent holds, in front of the storage
                reader = Reader(tier, self.rank, self.world_size, self._io)
            result = (reader.load_named(described, step, strict) if step is not None
                      else reader.load_newest(described, strict))
        if tier is not None:
            result = dataclasses.replace(result,
                                         nbytes_from_memory=tier.served - tier.served_peer,
                                         nbytes_from_peer=tier.served_peer)
        self._last_step = max(self._last_step or result.step, result.step)
        return result


_PARAMETERS = frozenset(inspect.signature(Checkpointer.__init__).parameters) - {"self"}
# the parameters the Checkpointer keeps as attributes (set once, by __init__); "url" is the
# root's resolved address
_STORED = frozenset({"rank", "world_size", "storage", "keep_last", "threads", "read_only",
                     "url"})  # run_id is a property: agreed when the root is opened
_PARAMETERS |= {"url"}


__all__ = ["Checkpointer", "LoadResult", "SaveHandle", "SaveResult", "Phase"]
