"""When to save: :class:`SaveEvery`, the save policy a training loop asks at each step.

    ckpt = ckptd.Checkpointer(root, save_policy=ckptd.SaveEvery(steps=100, seconds=1800))
    for step in range(start, steps):
        train_step()
        if ckpt.should_save(step):
            ckpt.save_async(state, step=step)
        if ckptd.preempted():      # (no collective: known since should_save's)
            ckpt.wait()
            sys.exit(0)

Every rank must save the same steps, so every rank must get the same answer at the same call.
A step count gives it by itself; a clock and a SIGTERM do not (each rank has its own clock, and
only the preempted node gets the signal): when the policy looks at either, ``should_save`` is a
collective — one all-reduce of two numbers, the one :func:`ckptd.preempted` does, over the
world (``group``) — and every rank must call it at the same point, as it calls ``preempted``.
A rank that is due (its clock, its signal) makes every rank save.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ckptd.elastic import preemption


@dataclass
class SaveEvery:
    """Save every ``steps`` steps (the steps that are multiples of it), every ``seconds``
    seconds (counted from the last save it asked for, or from the first call), and once on
    preemption (``on_preemption``: a SIGTERM on any rank, as :func:`ckptd.preempted` sees it;
    the handler of :func:`ckptd.on_preemption` is installed when the policy is made, unless
    one is: make it in the main thread). ``should_save`` is True when any of them is due.

    With ``seconds`` or ``on_preemption``, ``should_save`` is a collective (see the module
    docstring): call it on every rank at the same point of the loop. With ``steps`` alone and
    ``on_preemption=False`` it communicates nothing.

    Args:
        steps: save the steps that are multiples of it; None: not by count.
        seconds: save when this many seconds passed since the last save it asked for; None:
            not by time.
        on_preemption: save once when any rank got SIGTERM.
        group: the process group to agree over; None: the world.

    Raises:
        ValueError: ``steps`` or ``seconds`` not positive, or nothing to save on.

    Example:
        import ckptd

        policy = ckptd.SaveEvery(steps=100, on_preemption=False)
        assert [s for s in range(0, 301, 50) if policy.should_save(s)] == [0, 100, 200, 300]
    """

    steps: int | None = None
    seconds: float | None = None
    on_preemption: bool = True
    group: Any = field(default=None, repr=False)  #: the process group to agree over
    _since: float | None = field(default=None, init=False, repr=False)
    _preemption_saved: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.steps is not None and (not isinstance(self.steps, int)
                                       or isinstance(self.steps, bool) or self.steps < 1):
            raise ValueError(f"SaveEvery(steps) must be a positive integer, got {self.steps!r}")
        if self.seconds is not None and not (isinstance(self.seconds, (int, float))
                                             and math.isfinite(self.seconds)
                                             and self.seconds > 0):
            raise ValueError(f"SaveEvery(seconds) must be a positive number, got "
                             f"{self.seconds!r}")
        if self.steps is None and self.seconds is None and not self.on_preemption:
            raise ValueError("SaveEvery needs steps=, seconds= or on_preemption=True")
        if self.on_preemption and not preemption.installed():
            preemption.on_preemption()

    def should_save(self, step: int) -> bool:
        """Whether to save ``step`` (see the class docstring); the same on every rank.

        Args:
            step: the step the loop is at.

        Returns:
            True when a count, the clock or a preemption makes it due.
        """
        now = time.monotonic()
        if self._since is None:
            self._since = now
        due = self.steps is not None and step % self.steps == 0
        watch_signal = self.on_preemption and not self._preemption_saved
        if self.seconds is not None or watch_signal:
            late = self.seconds is not None and now - self._since >= self.seconds
            preempted, late = preemption.agree(late, group=self.group)
            if watch_signal and preempted:
                self._preemption_saved = True  # once: the loop is about to stop
                due = True
            due = due or late
        if due:
            self._since = now
        return due


__all__ = ["SaveEvery"]
