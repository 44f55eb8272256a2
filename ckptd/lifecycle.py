"""A Checkpointer's life, :class:`Lifecycle` (a base of :class:`ckptd.Checkpointer`): its root
opened on first use — the run id agreed, the node agent joined or this process's threads chosen
to run the saves' background half, the root claimed — and closed; and the process's end, where
every live Checkpointer is drained (at exit) or forgotten (in a forked child).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor  # before the exit hook below: see there
from typing import Any, TypeVar

from ckptd import config
from ckptd.agent.client import AgentClient
from ckptd.agent.executor import AgentExecutor
from ckptd.agent.launch import agent_wanted, connect_for, timeout_s
from ckptd.errors import CkptdError
from ckptd.policies import Retention
from ckptd.storage import Storage
from ckptd.world import agree_attempt_base, agree_run_id
from ckptd.writer import exiting
from ckptd.writer.autocodec import AutoCodec
from ckptd.writer.executor import InProcess
from ckptd.writer.group_store import GroupStore
from ckptd.writer.handle import SaveHandle
from ckptd.writer.save import SaveOptions, Saver
from ckptd.writer.staging import StagingPool

log = logging.getLogger("ckptd")

_live: weakref.WeakSet[Lifecycle] = weakref.WeakSet()

# the class built on Lifecycle (ckptd.Checkpointer), which open() and ``with`` return
Checkpointer = TypeVar("Checkpointer", bound="Lifecycle")


class Lifecycle:
    """Opening and closing a Checkpointer's root (its constructor sets the attributes below)."""

    rank: int
    world_size: int
    storage: Storage
    url: str
    threads: int
    read_only: bool
    _retention: Retention | None
    _closed: bool
    _io: ThreadPoolExecutor
    _saver: Saver | None

    def _prepare_open(self, root: str, *, own_storage: bool, run_id: str | None,
                      compression: str | None, max_inflight: int, on_busy: str,
                      host_budget_bytes: int | None, debug_overlap: bool, agent: bool | None,
                      storage_options: dict[str, Any] | None) -> None:
        """The constructor's part that concerns the open: whether the node agent is used (its
        settings checked now), and what :meth:`open` will need."""
        # the same on every rank: whether loads ask every node's agent what it holds
        self._agents = not self.read_only and agent_wanted(agent, root, own_storage=own_storage)
        self._min_bytes = 0  # with an agent: a rank's save under this is still written here
        if self._agents:
            timeout_s()  # a bad setting fails here, not at the first save
            self._min_bytes = config.AGENT_MIN_BYTES.get()
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
            own_storage=own_storage)
        self._run_id: str | None = None
        self._opened = False
        self._open_error: BaseException | None = None
        self._open_lock = threading.Lock()
        _live.add(self)

    def open(self: Checkpointer) -> Checkpointer:
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
        executor = self._executor(options, client, auto, self._min_bytes)
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
                  auto: AutoCodec | None, min_bytes: int) -> InProcess | AgentExecutor:
        """What runs the saves' background half: this process's I/O threads, or the node
        agent (with those as its fallback, which writes a save under ``min_bytes``)."""
        here = InProcess(self.storage, self._io, GroupStore.from_process_group(),
                         max(1, options.max_inflight), auto)
        if client is None:
            return here
        return AgentExecutor(client, here, max(1, options.max_inflight), self.rank, min_bytes)

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

    @property
    def executor(self) -> str:
        """Where this rank's saves are written now: ``"agent"`` (the node agent takes each one
        over once it is staged, but for a save smaller than ``$CKPTD_AGENT_MIN_BYTES``, which
        this process writes; ``ckptd agent --status`` tells what it holds), or ``"process"``
        (this process's own threads: with ``agent=False``, a read-only Checkpointer, no agent
        to be had, or once the agent was lost). Each save's own is ``SaveResult.executor``."""
        self.open()
        return self._saver.executor.name if self._saver is not None else "process"

    @property
    def hands_off(self) -> bool:
        """Whether this rank's saves go to a node agent that, stopping (SIGTERM) and unable to
        write a save inside the grace window, hands it to a peer's agent (``docs/agent.md``;
        a save under ``$CKPTD_AGENT_MIN_BYTES`` is written in process and never handed)."""
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
            if self._open_args["own_storage"]:  # the directories it keeps open for reads
                self.storage.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this Checkpointer is closed")

    def __enter__(self: Checkpointer) -> Checkpointer:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


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


__all__ = ["Lifecycle"]
