"""Run a function on N real processes joined by a ``torch.distributed`` gloo group on 127.0.0.1.

    results = run(fn, world_size, *args, timeout=120)   # fn(rank, world_size, *args) per rank

- Processes fork from a forkserver that preloaded torch (see ``forkserver``), so 8 ranks start
  fast on two cores; ``fn`` must be a module-level function and ``args`` picklable.
- The parent owns the rendezvous: a ``TCPStore`` server listening on a socket it bound to
  127.0.0.1 port 0 before forking, so there is no window in which another process can take the
  port. The parent never initialises ``torch.distributed`` (forking a process that has a
  process group would hand every child the same, broken, group).
- ``run`` returns each rank's return value, in rank order. If any rank raises, ``run`` raises
  :class:`RankFailed` whose message carries that rank's traceback text (and those of other ranks
  that failed at about the same time); the stragglers are killed. A run that exceeds ``timeout``
  kills every rank still alive and raises :class:`RankFailed` naming them. Return values travel
  by plain pickle (tensors are copied, not shared).
- Inside ``fn``, :func:`store` is this run's store (coordination without collectives) and
  :func:`exchange` an all-gather of strings through it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

# Once the first rank has failed, how long the others get to report their own failure (often the
# root cause is on another rank) before they are killed. Only bounds the wait: a rank that
# reports earlier ends it earlier.
FAILURE_GRACE_S = 2.0

_store: dist.TCPStore | None = None


class RankFailed(RuntimeError):
    """One or more ranks raised, died or timed out; the message has their tracebacks."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def store() -> dist.TCPStore:
    """This run's TCPStore (only inside a function started by :func:`run`)."""
    if _store is None:
        raise RuntimeError("multirank.store() is only available inside multirank.run()")
    return _store


def exchange(key: str, value: str) -> list[str]:
    """All-gather one string per rank through the store (no collective communication)."""
    s = store()
    rank, world = dist.get_rank(), dist.get_world_size()
    s.set(f"exchange/{key}/{rank}", value)
    keys = [f"exchange/{key}/{r}" for r in range(world)]
    s.wait(keys)
    return [s.get(k).decode() for k in keys]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    store_timeout: timedelta,
    pg_timeout: timedelta,
) -> None:
    global _store
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    try:
        _store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=store_timeout)
        dist.init_process_group(
            "gloo", store=_store, rank=rank, world_size=world_size, timeout=pg_timeout
        )
        result = fn(rank, world_size, *args, **kwargs)
        # plain pickle: multiprocessing's pickler would share tensors through file descriptors
        # that die with this process
        conn.send(("ok", pickle.dumps(result)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


# What the forkserver imports once, before it forks any rank. A rank unpickles its function by
# importing the test module that defines it, and that module's imports: everything heavy those
# need belongs here, or every rank of every run pays for it (torch.distributed.tensor and pytest
# alone cost ~1.2 s of CPU per rank: a 4-rank all_reduce took 3 s on 2 cores, 0.2 s with them
# here). One server serves the whole test session, so the list is the union over the test files.
# Names that do not import (s3fs without the extra) are skipped by the server.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "pytest",
    "hypothesis", "s3fs", "safetensors", "ckptd", "ckptd.checkpointer", "ckptd.cli",
    "ckptd.elastic.preemption", "multirank", "transformer_state",
]


def forkserver() -> Any:
    """forkserver: children fork from a clean single-threaded server that has imported torch
    once, so they start fast and never inherit a lock held by one of the test process's threads
    (a plain fork did: a rank hung before init_process_group after earlier tests left threads)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked processes.

    ``pg_timeout`` bounds each collective inside the ranks (default: ``timeout``); store waits
    (:func:`exchange`) are bounded by ``timeout`` only, so that ranks that gave up on a collective
    can still tell the others so.
    """
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "multirank.run() forks: the parent must not initialise torch.distributed"
        )
    ctx = forkserver()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(world_size * 4)
    port = listener.getsockname()[1]
    outer = timedelta(seconds=timeout)
    master = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns (and closes) the socket
        timeout=outer,
    )
    inner = timedelta(seconds=pg_timeout if pg_timeout is not None else timeout)
    procs: list[mp.process.BaseProcess] = []
    readers: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, port, send, args, kwargs, outer, inner),
                name=f"multirank-{rank}",
            )
            p.start()
            send.close()  # the child holds the only write end: EOF means it died
            procs.append(p)
            readers[recv] = rank
        return _collect(procs, readers, world_size, time.monotonic() + timeout, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        for r in readers:
            r.close()
        del master


def _collect(
    procs: list[mp.process.BaseProcess],
    readers: dict[Connection, int],
    world_size: int,
    deadline: float,
    timeout: float,
) -> list[Any]:
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = dict(readers)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for conn in wait(list(pending), timeout=remaining):
            rank = pending.pop(conn)  # type: ignore[arg-type]
            try:
                status, payload = conn.recv()  # type: ignore[union-attr]
            except EOFError:
                procs[rank].join()
                failures[rank] = (
                    f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
                )
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
        if failures and pending:
            # the others are probably blocked on the failed rank; give them a moment to say so
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    if failures or pending:
        # in arrival order: the first failure is usually the cause of the others
        parts = [f"--- rank {r} ---\n{text}" for r, text in failures.items()]
        if pending and not failures:
            head = (
                f"timed out after {timeout:.0f}s; ranks still running: {sorted(pending.values())}"
            )
        elif pending:
            head = f"ranks {sorted(failures)} failed; killed ranks {sorted(pending.values())}"
        else:
            head = f"ranks {sorted(failures)} failed"
        raise RankFailed(f"multirank: {head}\n" + "\n".join(parts), failures)
    return [results[r] for r in range(world_size)]
