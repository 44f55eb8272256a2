"""SIGTERM → one agreed save point on every rank.

Only the preempted node receives SIGTERM, but every rank must save the same step. The signal
handler therefore does no work beyond recording the signal; the training loop asks
:func:`preempted` at a safe point (after each micro-batch), and that call agrees across ranks:
when ``torch.distributed`` is initialised it all-reduces (MAX) the local flag, so every rank
gets ``True`` at the same call, and from then on ``True`` without communicating (sticky)::

    ckptd.on_preemption(grace_s=30.0)
    for batch in loader:
        loss = step(batch)
        if ckptd.preempted():
            ckptd.save(state)          # must be durable before grace_deadline()
            sys.exit(0)                # torchrun re-spawns the workers

Timeline of one preemption::

    SIGTERM on rank k ── handler: flag, monotonic time, callback ── (returns at once)
    next preempted() on every rank ── all-reduce MAX ── True everywhere, same call
    save ── must be committed by grace_deadline() = signal time + grace_s

The all-reduce carries, in its one float64 element, the grace left on the signalled rank, so
every rank (not only the signalled one) knows :func:`grace_deadline`, up to the latency of the
all-reduce. It runs in the foreground, in the caller's thread, on a tensor allocated once.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ckptd.errors import CkptdError

# The all-reduced value is 0 on a rank that saw no signal and _OFFSET - remaining grace on one
# that did; MAX then picks a signalled rank with the least grace left. 1e9 s is far above any
# grace period and keeps float64 resolution at ~0.1 µs.
_OFFSET = 1e9

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionError(CkptdError, RuntimeError):
    """The preemption handler cannot be (un)installed here (not the main thread)."""


@dataclasses.dataclass
class _State:
    installed: bool = False
    previous: _Handler = None
    callback: Callable[[], object] | None = None
    chain: bool = False
    grace_s: float = 30.0
    signal_time: float | None = None  # monotonic time of the first SIGTERM on this rank
    agreed: bool = False  # every rank has seen the preemption (sticky)
    deadline: float | None = None  # monotonic time by which the save must be durable
    calls: int = 0  # preempted() calls since install, for every=N


_state = _State()


def _handle_sigterm(signum: int, frame: FrameType | None) -> None:
    # Runs in the main thread between two bytecodes, possibly inside any Python code of the
    # training loop: record and return, nothing that could take a lock the loop holds.
    if _state.signal_time is None:
        _state.signal_time = time.monotonic()
    if _state.callback is not None:
        _state.callback()
    previous = _state.previous
    if _state.chain and callable(previous):
        previous(signum, frame)


class PreemptionWatch:
    """The installed SIGTERM handler; :meth:`uninstall` puts the previous handler back."""

    @property
    def grace_s(self) -> float:
        return _state.grace_s

    @property
    def signal_time(self) -> float | None:
        """Monotonic time of the SIGTERM on this rank, or None."""
        return _state.signal_time

    def uninstall(self) -> None:
        """Restore the handler that was in place before :func:`on_preemption` and forget
        any recorded signal. Idempotent; main thread only."""
        uninstall()


_watch = PreemptionWatch()


def on_preemption(
    callback: Callable[[], object] | None = None,
    *,
    grace_s: float = 30.0,
    chain: bool = False,
) -> PreemptionWatch:
    """Install the SIGTERM handler (main thread only; idempotent).

    The handler records that the signal came and when (``time.monotonic()``), then runs
    ``callback()`` if given. The callback runs inside a signal handler, interrupting the
    training loop at an arbitrary bytecode: keep it async-signal-light — set a flag, write a
    log line; no collectives, no locks, no waiting, no saving (save after :func:`preempted`
    returns True). ``grace_s`` is how long the scheduler waits between SIGTERM and SIGKILL.

    The previous handler is kept and restored by :meth:`PreemptionWatch.uninstall`. With
    ``chain=True`` it is also called after ours when it is a Python callable (the default
    action, which would kill the process, is never chained). Calling again while installed
    only updates ``callback``, ``grace_s`` and ``chain``.

    Args:
        callback: called (inside the signal handler) when SIGTERM arrives; None: none.
        grace_s: seconds between SIGTERM and SIGKILL, for the deadline the watch reports.
        chain: also call the previous Python handler after ours.

    Returns:
        The ``PreemptionWatch`` (``.uninstall()`` restores the previous handler).

    Raises:
        PreemptionError: not called from the main thread, or ``grace_s`` < 0.

    Example:
        import ckptd

        watch = ckptd.on_preemption(grace_s=25.0)
        assert ckptd.preempted() is False
        watch.uninstall()
    """
    if threading.current_thread() is not threading.main_thread():
        raise PreemptionError("on_preemption() must be called from the main thread")
    if not grace_s >= 0:
        raise PreemptionError(f"grace_s must be >= 0, got {grace_s!r}")
    _state.callback = callback
    _state.grace_s = float(grace_s)
    _state.chain = chain
    if not _state.installed:
        _state.previous = signal.signal(signal.SIGTERM, _handle_sigterm)
        _state.installed = True
    return _watch


def installed() -> bool:
    """Whether :func:`on_preemption`'s handler is installed."""
    return _state.installed


def uninstall() -> None:
    """Restore the previous SIGTERM handler and reset the preemption state (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        raise PreemptionError("the preemption handler must be uninstalled from the main thread")
    if _state.installed:
        previous = _state.previous
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    fresh = _State()
    for field in dataclasses.fields(_State):
        setattr(_state, field.name, getattr(fresh, field.name))


def preempted(*, every: int = 1, group: Any = None) -> bool:
    """True once a SIGTERM reached any rank; the same answer on every rank at the same call.

    Call it at a safe point (after each micro-batch) on every rank, in the same order as any
    other collective. When ``torch.distributed`` is initialised with more than one rank, it does
    one all-reduce (MAX) of a reused one-element CPU tensor over ``group`` (default: the world)
    in the caller's thread; without it, it returns the local flag. Once True it stays True and
    stops communicating. When the default group is pure NCCL, the first call creates a gloo side
    group (collectively, on every rank) so that no call waits for the GPU; a ``group`` passed
    in must be able to all-reduce CPU tensors (gloo, or a ``"cpu:gloo,cuda:nccl"`` group).

    ``every=N`` all-reduces only on every N-th call (counted since :func:`on_preemption`) and
    otherwise returns the last agreed answer, so ranks still agree on the same call provided
    they all call it equally often with the same N. Use it when one all-reduce per micro-batch
    costs too much; the save then starts up to N-1 calls later.

    Args:
        every: all-reduce on every ``every``-th call only.
        group: the process group to agree over; None: the world.

    Returns:
        True once any rank received SIGTERM.

    Raises:
        PreemptionError: ``every`` < 1.

    Example:
        import ckptd

        watch = ckptd.on_preemption()
        for step in range(3):
            if ckptd.preempted():
                break  # save (urgent=True) and exit here
        watch.uninstall()
    """
    if _state.agreed:
        return True
    if every < 1:
        raise PreemptionError(f"every must be >= 1, got {every!r}")
    channel = _channel(group)
    if channel is None:
        if _state.signal_time is not None:
            _set_deadline(_state.signal_time + _state.grace_s)
        return _state.agreed
    _state.calls += 1
    if _state.calls % every:
        return False
    deadline = _all_reduce_deadline(channel)
    if deadline is not None:
        _set_deadline(deadline)
    return _state.agreed


def agree(flag: bool, *, group: Any = None) -> tuple[bool, bool]:
    """:func:`preempted` and, in the same all-reduce, whether ``flag`` is True on any rank:
    ``(preempted, any rank's flag)``, the same on every rank at the same call (a collective,
    like :func:`preempted`; without ``torch.distributed``, this rank's own). For decisions
    each rank takes from its own clock (``ckptd.SaveEvery(seconds=...)``)."""
    channel = _channel(group)
    if channel is None:
        if _state.signal_time is not None:
            _set_deadline(_state.signal_time + _state.grace_s)
        return _state.agreed, flag
    deadline = _all_reduce_deadline(channel, 1.0 if flag else 0.0)
    if deadline is not None and not _state.agreed:
        _set_deadline(deadline)
    return _state.agreed, channel.flag_seen


def _set_deadline(deadline: float) -> None:
    _state.deadline = deadline
    _state.agreed = True


def grace_deadline() -> float | None:
    """Monotonic time by which the preemption save must be durable, or None.

    On the signalled rank it is the signal time + ``grace_s`` as soon as the signal arrives; on
    the other ranks it is known once :func:`preempted` has returned True (derived from the
    grace left on the signalled rank at that call).
    """
    if _state.deadline is not None:
        return _state.deadline
    if _state.signal_time is not None:
        return _state.signal_time + _state.grace_s
    return None


def remaining_grace_s() -> float | None:
    """Seconds left until :func:`grace_deadline` (negative once past it), or None."""
    deadline = grace_deadline()
    return None if deadline is None else deadline - time.monotonic()


@dataclasses.dataclass(frozen=True)
class _Channel:
    """What one group's agreement all-reduce uses, set up once per group."""

    group: Any  # the group the flag is all-reduced over (a gloo side group under pure NCCL)
    world_size: int
    buf: Any  # torch.Tensor: one float64 element, reused by every call
    pair: Any  # torch.Tensor: two float64 elements, the same and agree()'s flag

    @property
    def flag_seen(self) -> bool:
        """agree()'s flag of its last all-reduce: set on some rank."""
        return bool(self.pair[1].item() > 0.0)


_channels: dict[Any, _Channel] = {}  # process group object -> its channel


def _channel(group: Any) -> _Channel | None:
    """The channel for ``group``, or None when there is nothing to agree with."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = dist.GroupMember.WORLD if group is None else group
    channel = _channels.get(key)
    if channel is None:
        channel = _channels[key] = _open_channel(group)
    return channel if channel.world_size > 1 else None


def _open_channel(group: Any) -> _Channel:
    import torch
    import torch.distributed as dist

    world_size = int(dist.get_world_size(group))
    comm = group
    if group is None and world_size > 1 and str(dist.get_backend()) == "nccl":
        # A CUDA tensor would make every call wait for the GPU stream (.item() synchronises),
        # a bubble per micro-batch; a gloo side group keeps the flag on the CPU. new_group is
        # itself collective: every rank gets here at the same (first) preempted() call.
        comm = dist.new_group(backend="gloo")
    return _Channel(comm, world_size, torch.zeros(1, dtype=torch.float64),
                    torch.zeros(2, dtype=torch.float64))


def _all_reduce_deadline(channel: _Channel, flag: float | None = None) -> float | None:
    """The agreed deadline; with ``flag`` (agree()), that too is all-reduced, in
    ``channel.pair``."""
    import torch.distributed as dist

    buf = channel.buf if flag is None else channel.pair
    now = time.monotonic()
    if _state.signal_time is None:
        buf[0] = 0.0
    else:
        remaining = _state.signal_time + _state.grace_s - now
        buf[0] = _OFFSET - min(remaining, _OFFSET / 2)  # an infinite grace stays > 0
    if flag is not None:
        buf[1] = flag
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=channel.group)
    value = float(buf[0].item())
    if value <= 0.0:
        return None
    return now + (_OFFSET - value)
