"""Retention policies: which committed steps a root keeps.

A policy is a small frozen value that decides, from the committed steps in commit order and
the ``training=`` metadata each save recorded, which steps to keep::

    KeepLast(2) | KeepEvery(100)            # the newest two, and every 100th step
    KeepBest(2, "loss", mode="min")         # the two with the lowest training["loss"]

``a | b`` (or :class:`KeepAny`) keeps a step if any of its policies keeps it. Rank 0 applies
the Checkpointer's policy after each commit (``ckptd.writer.retention``), and always keeps the
newest step whatever the policy says (a resume needs it). Nothing is remembered between
saves: every decision is taken again from what the root holds — the steps committed and the
metrics in their manifests — so a new Checkpointer on the same root (a restart) applies the
same rule to the old steps.

Policies travel to the node agent as JSON (:meth:`Retention.to_json`, :func:`from_json`).
This module does no I/O and imports nothing of ckptd.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Candidate:
    """A committed step as a policy sees it: its number and its ``training`` metadata (empty
    unless the policy reads a metric, :attr:`Retention.metrics`)."""

    step: int
    training: Mapping[str, Any]


class Retention(ABC):
    """A retention policy (see the module docstring). Subclasses are frozen dataclasses;
    ``a | b`` is :class:`KeepAny` ``(a, b)``."""

    @abstractmethod
    def keep(self, steps: Sequence[Candidate]) -> set[int]:
        """The steps to keep among ``steps``.

        Args:
            steps: the committed steps, oldest first in commit order, each with its
                ``training`` metadata.

        Returns:
            The step numbers to keep (rank 0 keeps the newest one whatever this says).
        """

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The policy as JSON (:func:`from_json` reads it back)."""

    @property
    def metrics(self) -> frozenset[str]:
        """The ``training`` keys the policy reads (none: no manifest is read to decide)."""
        return frozenset()

    def __or__(self, other: Retention) -> KeepAny:
        if not isinstance(other, Retention):
            return NotImplemented
        return KeepAny(self, other)


def _positive(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class KeepLast(Retention):
    """Keep the newest ``n`` committed steps (in commit order). ``keep_last=n`` is short for
    ``retention=KeepLast(n)``.

    Args:
        n: how many (a positive integer).

    Raises:
        ValueError: ``n`` is not a positive integer.

    Example:
        import tempfile
        import torch
        import ckptd

        root = tempfile.mkdtemp()
        with ckptd.Checkpointer(root, retention=ckptd.KeepLast(2)) as ckpt:
            for step in range(5):
                ckpt.save({"w": torch.ones(2)}, step=step)
        # retention runs after each commit, in the background; close() settles it
        assert ckptd.Checkpointer(root, read_only=True).steps() == [3, 4]
    """

    n: int

    def __post_init__(self) -> None:
        _positive(self.n, "KeepLast(n)")

    def keep(self, steps: Sequence[Candidate]) -> set[int]:
        return {c.step for c in steps[-self.n:]}

    def to_json(self) -> dict[str, Any]:
        return {"last": self.n}


@dataclass(frozen=True)
class KeepEvery(Retention):
    """Keep every step whose number is a multiple of ``steps`` (0, 100, 200, ... for
    ``KeepEvery(100)``): the long-lived history beside the newest steps.

    Args:
        steps: the period (a positive integer).

    Raises:
        ValueError: ``steps`` is not a positive integer.

    Example:
        import tempfile
        import torch
        import ckptd

        root = tempfile.mkdtemp()
        policy = ckptd.KeepLast(2) | ckptd.KeepEvery(10)
        with ckptd.Checkpointer(root, retention=policy) as ckpt:
            for step in range(0, 35, 5):
                ckpt.save({"w": torch.ones(2)}, step=step)
        assert ckptd.Checkpointer(root, read_only=True).steps() == [0, 10, 20, 25, 30]
    """

    steps: int

    def __post_init__(self) -> None:
        _positive(self.steps, "KeepEvery(steps)")

    def keep(self, steps: Sequence[Candidate]) -> set[int]:
        return {c.step for c in steps if c.step % self.steps == 0}

    def to_json(self) -> dict[str, Any]:
        return {"every": self.steps}


@dataclass(frozen=True)
class KeepBest(Retention):
    """Keep the ``n`` steps with the best value of ``training[metric]``, the ``training=``
    dict of their save: the lowest with ``mode="min"``, the highest with ``"max"``. A step
    whose save recorded no such number (or NaN) is not among the best; between equal values
    the newer step wins.

    Args:
        n: how many (a positive integer).
        metric: the key of ``training`` to rank by.
        mode: ``"min"`` (lower is better) or ``"max"``.

    Raises:
        ValueError: a bad ``n``, an empty ``metric``, or another ``mode``.

    Example:
        import tempfile
        import torch
        import ckptd

        root = tempfile.mkdtemp()
        with ckptd.Checkpointer(root, retention=ckptd.KeepBest(2, "loss")) as ckpt:
            for step, loss in enumerate([0.9, 0.3, 0.5, 0.7]):
                ckpt.save({"w": torch.ones(2)}, step=step, training={"loss": loss})
        # the best two, and the newest (always kept)
        assert ckptd.Checkpointer(root, read_only=True).steps() == [1, 2, 3]
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive(self.n, "KeepBest(n)")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest(metric) must be a non-empty string, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode) must be 'min' or 'max', got {self.mode!r}")

    @property
    def metrics(self) -> frozenset[str]:
        return frozenset({self.metric})

    def keep(self, steps: Sequence[Candidate]) -> set[int]:
        scored = []
        for order, c in enumerate(steps):
            value = c.training.get(self.metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and not math.isnan(value):
                scored.append(((value if self.mode == "min" else -value), -order, c.step))
        return {step for _, _, step in sorted(scored)[: self.n]}

    def to_json(self) -> dict[str, Any]:
        return {"best": self.n, "metric": self.metric, "mode": self.mode}


@dataclass(frozen=True, init=False)
class KeepAny(Retention):
    """Keep a step if any of ``policies`` keeps it (also written ``a | b``).

    Args:
        policies: the policies (at least one); nested ``KeepAny`` are flattened.

    Raises:
        TypeError: an argument is not a retention policy.
        ValueError: no policy given.

    Example:
        import ckptd

        policy = ckptd.KeepAny(ckptd.KeepLast(2), ckptd.KeepBest(1, "loss"))
        assert policy == ckptd.KeepLast(2) | ckptd.KeepBest(1, "loss")
        assert policy.metrics == {"loss"}
    """

    policies: tuple[Retention, ...]

    def __init__(self, *policies: Retention) -> None:
        flat: list[Retention] = []
        for p in policies:
            if not isinstance(p, Retention):
                raise TypeError(f"KeepAny takes retention policies, got {p!r}")
            flat.extend(p.policies if isinstance(p, KeepAny) else (p,))
        if not flat:
            raise ValueError("KeepAny needs at least one policy")
        object.__setattr__(self, "policies", tuple(flat))

    @property
    def metrics(self) -> frozenset[str]:
        return frozenset().union(*(p.metrics for p in self.policies))

    def keep(self, steps: Sequence[Candidate]) -> set[int]:
        return set().union(*(p.keep(steps) for p in self.policies))

    def to_json(self) -> dict[str, Any]:
        return {"any": [p.to_json() for p in self.policies]}


def from_json(doc: Any) -> Retention:
    """The policy :meth:`Retention.to_json` wrote (ValueError naming what is wrong)."""
    if isinstance(doc, dict) and len(doc) >= 1:
        if set(doc) == {"last"}:
            return KeepLast(doc["last"])
        if set(doc) == {"every"}:
            return KeepEvery(doc["every"])
        if set(doc) == {"best", "metric", "mode"}:
            return KeepBest(doc["best"], doc["metric"], doc["mode"])
        if set(doc) == {"any"} and isinstance(doc["any"], list):
            return KeepAny(*map(from_json, doc["any"]))
    raise ValueError(f"not a retention policy: {doc!r}")


def resolve(keep_last: int | None, retention: Retention | None) -> Retention | None:
    """The policy of ``keep_last=`` / ``retention=`` (None: keep every step). ``keep_last``
    is short for ``KeepLast(keep_last)``, 0 or less keeps every step, and None (not given) means 3
    unless ``retention`` is given; giving both is an error."""
    if retention is not None:
        if keep_last is not None:
            raise ValueError("give keep_last= or retention=, not both "
                             f"(keep_last={keep_last!r}, retention={retention!r})")
        if not isinstance(retention, Retention):
            raise TypeError(f"retention must be a policy such as ckptd.KeepLast(3), "
                            f"got {retention!r}")
        return retention
    n = 3 if keep_last is None else keep_last
    if not isinstance(n, int) or isinstance(n, bool):
        raise ValueError(f"keep_last must be an integer, got {keep_last!r}")
    return KeepLast(n) if n > 0 else None


@runtime_checkable
class SavePolicy(Protocol):
    """When to save: ``should_save(step)`` (``ckptd.SaveEvery`` is ckptd's). Called at the same
    point on every rank, it must give every rank the same answer."""

    def should_save(self, step: int) -> bool: ...


__all__ = ["Candidate", "KeepAny", "KeepBest", "KeepEvery", "KeepLast", "Retention",
           "SavePolicy", "from_json", "resolve"]
