"""How a wait for the commit paces its polls of storage (:class:`Poller`): the coordinator's
wait for the partials and every other rank's wait for the manifest
(:mod:`ckptd.writer.commit`)."""

from __future__ import annotations

import random
import time

from ckptd import config
from ckptd.storage import Storage
from ckptd.storage.base import poll_interval
from ckptd.storage.watch import Watch
from ckptd.writer import exiting
from ckptd.writer.group_store import GroupStore

_jitter = random.Random()
_NO_SIGNALS = GroupStore(None)


# a long wait's pause grows to this fraction of the time waited so far (config.poll_idle_max_s)
PATIENCE = 1 / 8
# ... and to this fraction where a complete watch (a local filesystem: ckptd.storage.watch)
# ends the pause at every change: the polls are a safety net there
WATCHED_PATIENCE = 1 / 2


class Poller:
    """Pauses between polls of ``storage`` until ``timeout_s`` has passed.

    The first pause is the storage's first interval (:func:`ckptd.storage.base.poll_interval`);
    each next one doubles, up to the storage's longest — and, once the wait has gone on for
    a while, up to :data:`PATIENCE` of the time waited so far, at most
    ``config.poll_idle_max_s`` (each poll wakes a thread: CPU on every waiting rank). Every
    pause is drawn uniformly in [½, 1] of the current interval, so ranks that started waiting
    together do not poll in lockstep, and none ends past the deadline. Bounded both ways: at
    most ``max(longest, poll_idle_max_s)`` between two polls, and at most about
    ``2 + log2(longest / first) + 2 * timeout_s / longest`` polls in all.

    With a ``watch`` (:meth:`Storage.watch`) a pause ends early when a name appears; with a
    complete one (a local filesystem, where every change is reported) the first pause is
    already the storage's longest, and the pauses of a long wait grow to
    :data:`WATCHED_PATIENCE` of the time waited, at most ``config.poll_watched_idle_max_s``.
    """

    def __init__(self, storage: Storage, timeout_s: float, *, coordinating: bool = False,
                 watch: Watch | None = None) -> None:
        self.watch = watch  # ends a pause when a name appears (Storage.watch), if it can
        self.first, self.longest = poll_interval(storage)
        self.idle_longest = max(self.longest, config.get().poll_idle_max_s)
        self.coordinating = coordinating  # which exit deadline applies (ckptd.writer.exiting)
        # a complete watch ends a pause at every change of storage: a poll on a timer finds
        # only what the process group's store alone carries (a failure storage could not take)
        self.interval = self.longest if watch is not None and watch.complete else self.first
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.polls = 0
        self.abandoned = False  # it ended early: the process is exiting on an error
        # whether a complete watch ended the last pause (the first poll counts as woken)
        self._woken = watch is not None and watch.complete

    def signals(self, signals: GroupStore) -> GroupStore:
        """The process group's store for this poll, or an inert one when a complete watch
        ended the last pause: storage changed, and storage is what to read — the store's
        answer is a request to the coordinator's process, busy with that change. What the
        store alone carries (a failure storage could not take) is asked after a pause the
        watch did not end: at worst one pause later."""
        return _NO_SIGNALS if self._woken else signals

    def wait(self) -> bool:
        """Pause before the next poll; False (without pausing) once the deadline has passed,
        or the earlier one of an exit after an error (:mod:`ckptd.writer.exiting`, which also
        cuts a pause short); then :attr:`abandoned` says which."""
        now = time.monotonic()
        end = self.deadline
        exit_at = exiting.deadline(self.started, coordinating=self.coordinating)
        if exit_at is not None and exit_at < end:
            end = exit_at
        if now >= end:
            self.abandoned = end != self.deadline
            return False
        pause = min(self.interval * _jitter.uniform(0.5, 1.0), end - now)
        if self.watch is None or exit_at is not None:
            exiting.pause(pause)  # cut short when the process starts exiting on an error
            self._woken = False
        else:  # cut short when what is waited for may have appeared
            self._woken = self.watch.wait(pause) and self.watch.complete
        idle, patience = self.idle_longest, PATIENCE
        if self.watch is not None and self.watch.complete:  # every change wakes it: poll less
            idle, patience = max(idle, config.get().poll_watched_idle_max_s), WATCHED_PATIENCE
        longest = min(max(self.longest, (now - self.started) * patience), idle)
        self.interval = min(self.interval * 2, longest)
        self.polls += 1
        return True


__all__ = ["PATIENCE", "WATCHED_PATIENCE", "Poller"]
