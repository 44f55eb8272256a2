"""Preemption: the SIGTERM handler in one process, and agreement across real gloo ranks.

The multi-rank tests start real processes, send a real SIGTERM to one of them, and check that
every rank saw ``preempted()`` turn True at the same loop iteration. When to signal is decided
by messages from the workers (a queue), never by sleeping.
"""

from __future__ import annotations

import os
import queue
import signal
import statistics
import threading
import time
from datetime import timedelta
from multiprocessing.queues import Queue
from types import FrameType
from typing import Any

import multirank
import pytest
import torch
import torch.distributed as dist

from ckptd.elastic.preemption import (
    PreemptionError,
    grace_deadline,
    on_preemption,
    preempted,
    remaining_grace_s,
)

# children are forked from the tests' one forkserver (a clean single-threaded server that has
# imported torch once), so they start fast and never inherit this process's threads
CTX = multirank.forkserver()
TIMEOUT_S = 60.0

# --------------------------------------------------------------------------- one process


def _raise_sigterm() -> None:
    # CPython runs the Python-level handler in the main thread at the next bytecode boundary,
    # which is before os.kill's caller continues; the asserts after this call rely on that.
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.usefixtures("clean_sigterm")
def test_sigterm_sets_a_sticky_flag_runs_the_callback_and_records_the_deadline() -> None:
    calls: list[float] = []
    watch = on_preemption(lambda: calls.append(time.monotonic()), grace_s=25.0)
    assert preempted() is False
    assert grace_deadline() is None
    assert remaining_grace_s() is None
    before = time.monotonic()
    _raise_sigterm()
    after = time.monotonic()
    assert len(calls) == 1
    assert watch.signal_time is not None
    assert before <= watch.signal_time <= after
    assert grace_deadline() == watch.signal_time + 25.0
    assert preempted() is True
    assert preempted() is True  # sticky
    remaining = remaining_grace_s()
    assert remaining is not None and 0 < remaining <= 25.0
    # A second SIGTERM runs the callback again but keeps the first signal's time.
    first = watch.signal_time
    _raise_sigterm()
    assert len(calls) == 2
    assert watch.signal_time == first


@pytest.mark.usefixtures("clean_sigterm")
def test_uninstall_restores_the_previous_handler_and_install_is_idempotent() -> None:
    seen: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    signal.signal(signal.SIGTERM, previous)
    watch = on_preemption()
    ours = signal.getsignal(signal.SIGTERM)
    assert ours is not previous
    # Installing again keeps the original "previous", not our own handler.
    assert on_preemption(grace_s=5.0) is watch
    assert signal.getsignal(signal.SIGTERM) is ours
    assert watch.grace_s == 5.0
    _raise_sigterm()
    assert seen == []  # not chained by default
    assert preempted() is True
    watch.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous
    # The state is reset, and the restored handler is the one that runs now.
    assert preempted() is False
    assert grace_deadline() is None
    _raise_sigterm()
    assert seen == [signal.SIGTERM]
    watch.uninstall()  # idempotent
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.usefixtures("clean_sigterm")
def test_default_handler_is_restored_after_uninstall() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    on_preemption().uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.usefixtures("clean_sigterm")
def test_chain_calls_the_previous_python_handler_after_ours() -> None:
    order: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: order.append("previous"))
    on_preemption(lambda: order.append("callback"), chain=True)
    _raise_sigterm()
    assert order == ["callback", "previous"]
    assert preempted() is True


@pytest.mark.usefixtures("clean_sigterm")
def test_install_outside_the_main_thread_is_refused() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            on_preemption()
        except BaseException as e:  # noqa: B036 - collected and checked below
            errors.append(e)

    t = threading.Thread(target=install)
    t.start()
    t.join()
    assert len(errors) == 1
    assert isinstance(errors[0], PreemptionError)
    assert str(errors[0]) == "on_preemption() must be called from the main thread"


@pytest.mark.usefixtures("clean_sigterm")
def test_every_must_be_positive() -> None:
    with pytest.raises(PreemptionError, match="every must be >= 1, got 0"):
        preempted(every=0)


# --------------------------------------------------------------------------- real ranks

SYNC_ITERATION = 50  # the workers report "in the loop" after this many preempted() calls
MAX_ITERATIONS = 500_000  # a bound so that a broken agreement ends instead of spinning


def _init_gloo(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=TIMEOUT_S))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
    )


def _agreement_worker(
    rank: int, world: int, every: int, port_q: Queue[int], out_q: Queue[tuple[Any, ...]]
) -> None:
    _init_gloo(rank, world, port_q.get(timeout=TIMEOUT_S))
    callbacks: list[int] = []
    watch = on_preemption(lambda: callbacks.append(1), grace_s=30.0)
    x = torch.ones(64)
    result: tuple[Any, ...] = ("no preemption", rank)
    for i in range(1, MAX_ITERATIONS + 1):
        x.mul_(1.0001)  # a stand-in for a micro-batch
        if preempted(every=every):
            result = (
                "preempted",
                rank,
                i,
                watch.signal_time is not None,
                len(callbacks),
                remaining_grace_s(),
            )
            break
        if i == SYNC_ITERATION:
            out_q.put(("looping", rank, os.getpid()))
    out_q.put(result)
    dist.destroy_process_group()


class _Ranks:
    """Worker processes on gloo, with the rendezvous store hosted by this process."""

    def __init__(self, target: Any, world: int, extra: tuple[Any, ...]) -> None:
        self.port_q: Queue[int] = CTX.Queue()
        self.out_q: Queue[tuple[Any, ...]] = CTX.Queue()
        self.procs = [
            CTX.Process(
                target=target,
                args=(rank, world, *extra, self.port_q, self.out_q),
                daemon=True,
            )
            for rank in range(world)
        ]
        for p in self.procs:
            p.start()
        # The store server lives here, on a port the kernel picks (port 0), so concurrent test
        # runs cannot collide on it; the workers learn the port from the queue.
        self.store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=TIMEOUT_S), False)
        for _ in self.procs:
            self.port_q.put(self.store.port)

    def receive(self) -> tuple[Any, ...]:
        """The next worker message; fails at once if a worker died instead of answering."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return self.out_q.get(timeout=0.5)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                assert dead == [], f"a worker exited with {dead}"
        raise AssertionError(f"no worker message within {TIMEOUT_S} s")

    def finish(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [p for p in self.procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert alive == [], "workers hung"
        assert [p.exitcode for p in self.procs] == [0] * len(self.procs)


@pytest.mark.parametrize(
    ("world", "target_rank", "every"),
    [(2, 1, 1), (4, 2, 1), (4, 0, 7)],
    ids=["2-ranks", "4-ranks", "4-ranks-every-7"],
)
def test_sigterm_to_one_rank_is_seen_by_every_rank_at_the_same_iteration(
    world: int, target_rank: int, every: int
) -> None:
    ranks = _Ranks(_agreement_worker, world, (every,))
    try:
        pids: dict[int, int] = {}
        while len(pids) < world:
            kind, rank, pid = ranks.receive()
            assert kind == "looping", (kind, rank, pid)
            pids[rank] = pid
        # Every rank is past SYNC_ITERATION calls of preempted(); signal one of them.
        os.kill(pids[target_rank], signal.SIGTERM)
        results = sorted((ranks.receive() for _ in range(world)), key=lambda r: r[1])
    finally:
        ranks.finish()
    assert [r[0] for r in results] == ["preempted"] * world, results
    iterations = {r[2] for r in results}
    assert len(iterations) == 1, results
    (iteration,) = iterations
    assert iteration > SYNC_ITERATION
    assert iteration % every == 0
    # Only the signalled rank received the signal and ran the callback ...
    assert [r[3] for r in results] == [rank == target_rank for rank in range(world)]
    assert [r[4] for r in results] == [int(rank == target_rank) for rank in range(world)]
    # ... but every rank knows the grace left.
    for r in results:
        assert r[5] is not None and 0 < r[5] <= 30.0, r


def _cost_worker(
    rank: int, world: int, calls: int, port_q: Queue[int], out_q: Queue[tuple[Any, ...]]
) -> None:
    _init_gloo(rank, world, port_q.get(timeout=TIMEOUT_S))
    on_preemption()
    for _ in range(200):  # warm up the connections and the reused buffer
        preempted()
    dist.barrier()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        preempted()
        samples.append(time.perf_counter_ns() - t0)
    every_samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        preempted(every=8)
        every_samples.append(time.perf_counter_ns() - t0)
    out_q.put(("cost", rank, statistics.median(samples), statistics.fmean(every_samples)))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_measure_preempted_cost_per_call(world: int) -> None:
    """Not a timing assertion beyond a sanity bound: prints the median cost per call."""
    ranks = _Ranks(_cost_worker, world, (4000,))
    try:
        results = [ranks.receive() for _ in range(world)]
    finally:
        ranks.finish()
    medians = sorted(r[2] / 1000 for r in results)
    every_8 = sorted(r[3] / 1000 for r in results)
    print(f"\npreempted() on {world} gloo ranks: median {medians} µs; every=8 mean {every_8} µs")
    assert max(medians) < 5000.0
