"""The Checkpointer: the face of one root for one rank — its configuration, ``describe``,
the hand-off of saves to the save path (:class:`ckptd.writer.save.Saver`) and loading
(:class:`ckptd.loader.reader.Reader`). Constructing one does no I/O; :meth:`Checkpointer.open`
(on first use) joins the node agent and claims the root. No collectives happen after it on the
save path.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd import catalog, config, policies, stateful
from ckptd.agent.client import AgentClient
from ckptd.agent.executor import AgentExecutor
from ckptd.agent.launch import agent_wanted, connect_for, timeout_s
from ckptd.agent.load_tier import memory_tier
from ckptd.errors import CheckpointNotFound, CkptdError
from ckptd.loader.load import Strict
from ckptd.loader.reader import LoadResult, Reader
from ckptd.manifest import Manifest, layout
from ckptd.policies import Retention, SavePolicy
from ckptd.sharding import describe
from ckptd.storage import Storage, open_storage
from ckptd.storage.base import as_storage
from ckptd.world import agree_attempt_base, agree_run_id, resolve_world
from ckptd.writer import exiting
from ckptd.writer.autocodec import AutoCodec
from ckptd.writer.executor import InProcess
from ckptd.writer.group_store import GroupStore
from ckptd.writer.handle import Phase, SaveHandle, SaveResult
from ckptd.writer.retention import remove_step
from ckptd.writer.save import SaveOptions, Saver
from ckptd.writer.staging import StagingPool

log = logging.getLogger("ckptd")

_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
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


class Checkpointer:
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
        # the same on every rank: whether loads ask every node's agent what it holds
        self._agents = not read_only and agent_wanted(agent, root, own_storage=storage is None)
        if self._agents:
            timeout_s()  # a bad setting fails here, not at the first save
        # the root as resolved here (an absolute path): an agent started elsewhere must not
        # resolve a relative one in its own working directory
        self._agent_spec = ({"url": self.url, "options": storage_options} if self._agents
                            else None)
        # what open() does, on first use (saved here: it needs the process group, which the
        # caller may set up after constructing)
        self._open_args: dict[str, Any] = dict(
            run_id=run_id, compression=compression,
            max_inflight=max_inflight, on_busy=on_busy, host_budget_bytes=host_budget_bytes,
            debug_overlap=debug_overlap, agent=agent, storage_options=storage_options,
            own_storage=storage is None)
        self._run_id: str | None = None
        self._opened = False
        self._open_error: BaseException | None = None
        self._open_lock = threading.Lock()
        _live.add(self)

    def __setattr__(self, name: str, value: Any) -> None:
        # a constructor parameter is fixed once set (its value went into the save options,
        # the storage, the agent): assigning it later would be silently ignored
        if name in _PARAMETERS and (name in self.__dict__ or name not in _STORED):
            raise AttributeError(
                f"Checkpointer.{name} is fixed at construction and cannot change: build a new "
                f"Checkpointer(..., {name}=...) (close this one first)")
        super().__setattr__(name, value)

    def open(self) -> Checkpointer:
        """Open the root for this Checkpointer, once (later calls return at once); returns it.

        A writing Checkpointer agrees its run id with the other ranks, joins this node's agent
        (started if none runs; waits for an earlier incarnation's saves in it) and, on rank 0,
        takes the root over: the previous owner's complete attempts are committed in its name
        first, so the newest state it made durable is ``latest_step()``. A read-only
        Checkpointer has nothing to open.

        The first ``save``, ``save_async``, ``load``, ``latest_step``, ``read_manifest``,
        ``reserve``, ``pool``, ``executor`` or ``hands_off`` calls it; ``with
        Checkpointer(...)`` too. With ``torch.distributed`` initialised it is a collective
        (one broadcast, the same whichever call makes it): every rank opens at the same point
        of its sequence of collectives. When the first call differs between ranks, or only
        some ranks make it (``if rank == 0: ckpt.latest_step()``), call ``open()`` on every
        rank first. Safe to call from several threads. An open that failed raises its error
        again on every later use.

        Returns:
            This Checkpointer.

        Raises:
            CkptdError: the Checkpointer is closed, or an earlier open failed.
            ForeignWriter: the root could not be claimed.

        Example:
            import tempfile
            import ckptd

            ckpt = ckptd.Checkpointer(tempfile.mkdtemp()).open()
            assert ckpt.latest_step() is None
            ckpt.close()
        """
        with self._open_lock:
            if self._open_error is not None:
                raise CkptdError(f"{self.url}: this Checkpointer could not open its root: "
                                 f"{self._open_error}") from self._open_error
            if self._opened:
                return self
            self._check_open()
            try:
                if not self.read_only:
                    self._saver = self._open_writer(**self._open_args)
            except BaseException as e:
                self._open_error = e
                raise
            self._opened = True
        return self

    def _open_writer(self, *, run_id: str | None, storage_options: dict[str, Any] | None,
                     agent: bool | None, own_storage: bool, **kw: Any) -> Saver:
        """The Saver of a writing Checkpointer: the run id agreed (the open's one collective),
        the node agent joined, the root claimed on rank 0."""
        self._run_id = agree_run_id(self.rank, self.world_size, run_id)
        options = SaveOptions(
            rank=self.rank, world_size=self.world_size, run_id=self._run_id,
            threads=self.threads, retention=self._retention, compression=kw["compression"],
            max_inflight=kw["max_inflight"], on_busy=kw["on_busy"],
            host_budget_bytes=kw["host_budget_bytes"],
            debug_overlap=kw["debug_overlap"] or config.DEBUG_OVERLAP.get(),
            attempt_base=agree_attempt_base(
                self.world_size, bool(run_id or config.RUN_ID.get())))
        client = connect_for(agent, self.url, storage_options, own_storage=own_storage,
                             threads=self.threads, incarnation=options.incarnation,
                             rank=self.rank)
        auto = AutoCodec(options.threads) if options.compression == "auto" else None
        executor = self._executor(options, client, auto)
        try:
            return Saver(self.storage, options, executor.signals, executor, auto)
        except BaseException:  # the root cannot be claimed: let go of the agent too
            executor.close()
            raise

    @property
    def run_id(self) -> str:
        """This job incarnation's id, the same on every rank (opens a writing Checkpointer;
        a read-only one agrees it on first access)."""
        if not self.read_only:
            self.open()
        if self._run_id is None:
            self._run_id = agree_run_id(self.rank, self.world_size, self._open_args["run_id"])
        return self._run_id

    def _executor(self, options: SaveOptions, client: AgentClient | None,
                  auto: AutoCodec | None) -> InProcess | AgentExecutor:
        """What runs the saves' background half: this process's I/O threads, or the node
        agent (with those as its fallback)."""
        here = InProcess(self.storage, self._io, GroupStore.from_process_group(),
                         max(1, options.max_inflight), auto)
        if client is None:
            return here
        return AgentExecutor(client, here, max(1, options.max_inflight), self.rank)

    @property
    def inflight(self) -> tuple[SaveHandle, ...]:
        """This rank's saves not yet committed or failed, oldest first (at most
        ``max_inflight``; empty for a read-only Checkpointer)."""
        return self._saver.inflight if self._saver is not None else ()

    @staticmethod
    def threads_for(threads: int | None) -> int:
        """The I/O thread count a ``threads=`` value means.

        Args:
            threads: the value given; None or 0: ``$CKPTD_IO_THREADS``, else min(4, cores).

        Returns:
            The number of threads.
        """
        return threads or config.io_threads()

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

    @property
    def pool(self) -> StagingPool:
        """The staging memory of this rank's saves (opens the root; refused on a read-only
        Checkpointer)."""
        return self._writer().pool

    def _writer(self) -> Saver:
        self._check_open()
        self.open()
        if self._saver is None:
            raise CkptdError(f"{self.url}: this Checkpointer is read-only (read_only=True)")
        return self._saver

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

    def _next_step(self, state: Any, step: int | None) -> int:
        if step is not None:
            return int(step)
        given = state.get("step") if isinstance(state, dict) else None
        if isinstance(given, int) and not isinstance(given, bool):
            return given
        if self._last_step is not None:
            return self._last_step + 1
        latest = self.latest_step()
        return 0 if latest is None else latest + 1

    @property
    def executor(self) -> str:
        """Where this rank's saves are written now: ``"agent"`` (the node agent takes each one
        over once it is staged; ``ckptd agent --status`` tells what it holds), or
        ``"process"`` (this process's own threads: with ``agent=False``, a read-only
        Checkpointer, no agent to be had, or once the agent was lost)."""
        self.open()
        return self._saver.executor.name if self._saver is not None else "process"

    @property
    def hands_off(self) -> bool:
        """Whether this rank's saves go to a node agent that, stopping (SIGTERM) and unable to
        write a save inside the grace window, hands it to a peer's agent (``docs/agent.md``)."""
        self.open()
        return self._saver is not None and self._saver.executor.hands_off

    def wait(self) -> None:
        """Block until every in-flight save of this rank is committed.

        Raises:
            CkptdError: the first background error of a save not yet reported (raised once;
                its class kept).

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                ckpt.save_async({"w": torch.ones(2)}, step=1)
                ckpt.wait()
                assert ckpt.inflight == ()
        """
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        """Drain in-flight saves and stop the threads; idempotent. ``with Checkpointer(...)``
        calls it on exit.

        Raises:
            CkptdError: a pending background error of a save (raised once).

        Example:
            import tempfile
            import torch
            import ckptd

            ckpt = ckptd.Checkpointer(tempfile.mkdtemp())
            ckpt.save_async({"w": torch.ones(2)}, step=1)
            ckpt.close()  # step 1 is committed before it returns
            ckpt.close()
        """
        with self._open_lock:  # an open under way finishes first; none starts after this
            if self._closed:
                return
            self._closed = True
        try:
            if self._saver is not None:
                try:
                    self._saver.close()
                finally:
                    self._saver.executor.close()
        finally:
            self._io.shutdown(wait=True)
            _live.discard(self)

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this Checkpointer is closed")

    def __enter__(self) -> Checkpointer:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reading
    def latest_step(self) -> int | None:
        """Newest committed step under the root, in commit order (``docs/format.md``): a newer
        owner's steps win over an older owner's whatever their numbers. Never commits
        anything.

        Returns:
            The step number, or None when there is no committed step.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                assert ckpt.latest_step() is None
                ckpt.save({"w": torch.ones(2)}, step=3)
                assert ckpt.latest_step() == 3
        """
        self.open()
        last = catalog.newest(self.storage)
        return None if last is None else last.step

    def read_manifest(self, step: int) -> Manifest:
        """Advanced: the decoded manifest of committed ``step``, ckptd's own record of the
        format (chunks, files, codecs, attempts; ``docs/format.md``), for tools and tests.
        Its shape follows the format and may change between versions: :meth:`metadata` is
        the stable view.

        Args:
            step: a committed step.

        Returns:
            The step's ``Manifest``.

        Raises:
            CheckpointNotFound: the step is not committed.
            CorruptCheckpoint: its manifest is damaged.
        """
        self.open()
        return catalog.read_manifest(self.storage, step)

    # ------------------------------------------------------------------ managing steps
    def steps(self) -> list[int]:
        """The committed steps under the root, ascending by number. (:meth:`latest_step` is
        the newest in commit order, the last of these unless an older run's steps have
        larger numbers.) Reads the manifests' first bytes only.

        Returns:
            The step numbers, ascending.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp(), keep_last=0) as ckpt:
                for step in (5, 10, 15):
                    ckpt.save({"w": torch.ones(2)}, step=step)
                assert ckpt.steps() == [5, 10, 15]
        """
        return catalog.committed_steps(self.storage)

    def metadata(self, step: int | None = None) -> catalog.StepMetadata:
        """What committed ``step`` (default: the latest) holds — tensors, dtypes, global
        shapes, the world that saved it, its ``training=`` metadata, its size — read from its
        manifest alone, no tensor data.

        Args:
            step: a committed step; None: the latest.

        Returns:
            A read-only :class:`~ckptd.StepMetadata`.

        Raises:
            CheckpointNotFound: there is no such step (or none at all).

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                ckpt.save({"model": {"w": torch.zeros(4, 2)}}, step=3, training={"loss": 0.5})
                meta = ckpt.metadata(3)
            assert meta.tensors["model/w"].shape == (4, 2) and meta.world_size == 1
            assert meta.training["loss"] == 0.5
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFound(f"{self.url}: no committed checkpoint")
        return catalog.step_metadata(self.storage, int(step))

    def delete(self, step: int) -> bool:
        """Remove committed ``step``; True if this call removed it, False if it was not
        committed (already removed, by retention or another caller, or never saved: not an
        error). The manifest goes first, then the files, as retention removes them: a load
        of the step that is under way either completes or fails with CheckpointNotFound
        ("removed while it was being read"), never with half its data. Refused
        (CkptdError) for a step that a save of this Checkpointer has in flight, and on a
        read-only Checkpointer. Every rank may call it; the first to get there removes it.

        Args:
            step: the step to remove.

        Returns:
            True if this call removed it, False if it was not committed.

        Raises:
            CkptdError: a save of ``step`` is in flight here, or the Checkpointer is
                read-only or closed.

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp(), keep_last=0) as ckpt:
                ckpt.save({"w": torch.ones(2)}, step=1)
                ckpt.save({"w": torch.ones(2)}, step=2)
                assert ckpt.delete(1) is True
                assert ckpt.delete(1) is False  # already gone: not an error
                assert ckpt.steps() == [2]
        """
        self._check_open()
        if self.read_only:
            raise CkptdError(f"{self.url}: this Checkpointer is read-only (read_only=True): "
                             f"it does not delete step {step}")
        step = int(step)
        if step in {h.step for h in self.inflight}:
            raise CkptdError(f"{self.url}/{layout.step_dir(step)}: a save of step {step} is in "
                             "flight; wait() for it before deleting the step")
        return remove_step(self.storage, step)

    @property
    def retention(self) -> Retention | None:
        """The retention policy rank 0 applies after each commit (None: every step is
        kept): ``retention=``, or ``KeepLast(keep_last)``."""
        return self._retention

    def should_save(self, step: int) -> bool:
        """Whether to save ``step``, by the ``save_policy`` given (``ckptd.SaveEvery``): call
        it at the same point on every rank (it may be a collective). False for the step this
        Checkpointer last saved or loaded (a resumed loop does not save it again).

        Args:
            step: the step the loop is at.

        Returns:
            Whether to save it.

        Raises:
            CkptdError: the Checkpointer has no ``save_policy``.

        Example:
            import tempfile
            import torch
            import ckptd

            policy = ckptd.SaveEvery(steps=10, on_preemption=False)
            with ckptd.Checkpointer(tempfile.mkdtemp(), save_policy=policy) as ckpt:
                for step in range(1, 31):
                    if ckpt.should_save(step):
                        ckpt.save_async({"w": torch.ones(2)}, step=step)
                ckpt.wait()
                assert ckpt.steps() == [10, 20, 30]
        """
        if self._save_policy is None:
            raise CkptdError("should_save() needs a save policy: Checkpointer(..., "
                             "save_policy=ckptd.SaveEvery(steps=100))")
        due = self._save_policy.should_save(step)
        return due and step != self._last_step

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


def _drain_at_exit() -> None:
    # An unhandled error ends the process (the interpreter set sys.last_value on printing it),
    # often a collective that failed because a peer died: wait for other ranks' part of the
    # in-flight saves only error_exit_wait_s, for a dead rank's never comes (writer/exiting.py)
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        # (a rank that only waits to hear of the commit stops at once: it adds nothing)
        exiting.begin(config.get().error_exit_wait_s,
                      "this process is exiting after an unhandled error (error_exit_wait_s)",
                      follow_s=0.0)
    for ckpt in list(_live):
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - exiting anyway; say why
            log.error("ckptd: a save did not complete before exit: %s", e)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, a multiprocessing ``fork`` process) inherits copies
    of the parent's Checkpointers without their threads, locks held mid-use perhaps: they are
    not its own to drain or close at its exit."""
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# Drain before concurrent.futures refuses new work at interpreter exit: its hook is registered
# with threading's exit hooks, which run before atexit's and in reverse order of registration.
try:
    threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other Pythons
    atexit.register(_drain_at_exit)


__all__ = ["Checkpointer", "LoadResult", "SaveHandle", "SaveResult", "Phase"]
