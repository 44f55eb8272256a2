"""Batch re-derivation for a new world size.

When an elastic job restarts on a different number of ranks, :func:`replan` picks the
micro-batch size, the gradient-accumulation steps and the ZeRO stage so that the global batch
stays inside a tolerance band around the previous one and the per-GPU memory estimate fits a
budget. It is a pure function of its arguments: no I/O, no torch, no global state.

The settings are :mod:`ckptd.elastic.specs`, the per-GPU memory model (its terms, defaults and
``state_gib``/``total_gib``) is :mod:`ckptd.elastic.gpu_memory`; both are re-exported here. The
search and its tie-breaks are described in :func:`replan` and in ``docs/elastic_replan.md``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction

from ckptd.elastic.gpu_memory import (
    ACTIVATION_CONSTANT,
    GRAD_BYTES,
    OPTIM_BYTES,
    OPTIM_SLOTS,
    PARAM_BYTES,
    MemoryEstimate,
    MemoryModel,
    estimate_memory,
)
from ckptd.elastic.infeasible import NoFeasiblePlan, diagnose
from ckptd.elastic.specs import (
    InvalidSpec,
    ModelSpec,
    TrainingSpec,
    check_zero_stage,
    positive_int,
)

__all__ = [  # the specs and the memory model are re-exported: this is the planner's front door
    "InvalidSpec", "MemoryEstimate", "ModelSpec", "NoFeasiblePlan", "Plan", "TrainingSpec",
    "batch_band", "estimate_memory", "planner", "replan",
]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The result of :func:`replan`.

    ``deviation`` is the relative change of the global batch, ``(new - previous) / previous``.

    Attributes:
        training: the chosen settings for the new world.
        deviation: the relative change of the global batch.
        memory: the settings' per-GPU :class:`MemoryEstimate`.

    Example:
        from ckptd import elastic

        m = elastic.ModelSpec(hidden_size=4096, num_hidden_layers=28,
                              num_parameters=4_832_071_680)
        previous = elastic.TrainingSpec(1, 480, 6, 1, 4096)  # global batch 2880
        plan = elastic.replan(m, previous, 488, mem_limit_gib=120, max_micro_batch_size=32)
        assert plan.training.global_batch_size == 2928 and plan.memory.total_gib <= 120
    """

    training: TrainingSpec
    deviation: float
    memory: MemoryEstimate


def batch_band(global_batch: int, tolerance: float) -> tuple[int, int]:
    """``(floor(B * (1 - tol)), ceil(B * (1 + tol)))``, computed exactly.

    The tolerance is taken as the decimal it prints as, so 0.1 means exactly 1/10 and the band
    of 2880 is [2592, 3168], not [2591, 3169] as binary floating point would round it.

    >>> batch_band(2880, 0.10)
    (2592, 3168)
    """
    tol = _exact_tolerance(tolerance)
    lo = math.floor(global_batch * (1 - tol))
    hi = math.ceil(global_batch * (1 + tol))
    return max(lo, 1), hi


def _exact_tolerance(tolerance: float) -> Fraction:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise InvalidSpec(f"tolerance must be a number, got {tolerance!r}")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise InvalidSpec(f"tolerance must be finite and >= 0, got {tolerance!r}")
    return Fraction(repr(float(tolerance)))


@dataclasses.dataclass(frozen=True)
class _Search:
    """Everything :func:`replan` fixes before looking at a world size."""

    model: ModelSpec
    previous: TrainingSpec
    band: tuple[int, int]
    mem_limit_gib: float
    max_micro_batch_size: int
    zero_stages: tuple[int, ...]
    memory: MemoryModel
    # world sizes in [1, band's upper end] that have a plan, found on first need: the diagnosis
    # of every infeasible row of a table looks for the nearest one (`ckptd plan --to-world
    # 8..4096:8` for a memory-bound 70B model rescanned up to 4500 sizes per row: 20 s -> 0.4 s)
    _feasible: list[list[int]] = dataclasses.field(default_factory=list, compare=False)

    def feasible_worlds(self) -> list[int]:
        if not self._feasible:
            self._feasible.append([w for w in range(1, self.band[1] + 1)
                                   if self.best(w) is not None])
        return self._feasible[0]

    def nearest_feasible(self, world: int, *, above: bool) -> int | None:
        """The nearest world size above (or below) ``world`` within the band that has a plan."""
        found = self.feasible_worlds()
        if above:
            i = bisect.bisect_right(found, world)
            return found[i] if i < len(found) else None
        i = bisect.bisect_left(found, world)
        return found[i - 1] if i > 0 else None

    def best(self, world: int) -> _Candidate | None:
        """The chosen setting at ``world``, or None."""
        target = self.previous.global_batch_size
        lo, hi = self.band
        seq = self.previous.sequence_length
        lowest_stage = min(self.zero_stages)
        states = [sum(self.memory.state(self.model, z, world)) for z in self.zero_stages]
        best: _Candidate | None = None
        for micro in range(min(self.max_micro_batch_size, hi // world), 0, -1):
            step = world * micro  # the global batch grows by this per accumulation step
            accum_lo, accum_hi = max(1, -(-lo // step)), hi // step
            if accum_lo > accum_hi:
                continue
            # The accumulation steps nearest the previous batch; on a tie the smaller one.
            near = min(max(target // step, accum_lo), accum_hi)
            accum = near
            if near < accum_hi and abs(step * (near + 1) - target) < abs(step * near - target):
                accum = near + 1
            distance = abs(step * accum - target)
            activations = self.memory.activations(self.model, micro, seq)
            for zero, state in zip(self.zero_stages, states, strict=True):
                if state + activations > self.mem_limit_gib:
                    continue
                if best is None or (distance, zero) < (best.distance, best.zero):
                    best = _Candidate(distance, zero, micro, accum, state + activations)
            if best is not None and best.distance == 0 and best.zero == lowest_stage:
                break  # nothing later can beat an exact hit at the lowest stage
        return best

    def cheapest(self, world: int) -> _Candidate | None:
        """The in-band setting at ``world`` needing the least memory (for the diagnosis)."""
        target = self.previous.global_batch_size
        lo, hi = self.band
        if world > hi:
            return None
        # Every global batch is a multiple of the world size, so if any setting lands in the
        # band, micro-batch 1 does too; and memory grows with the micro-batch.
        accum_lo, accum_hi = max(1, -(-lo // world)), hi // world
        if accum_lo > accum_hi:
            return None
        accum = min(max(target // world, accum_lo), accum_hi)
        seq = self.previous.sequence_length
        activations = self.memory.activations(self.model, 1, seq)
        totals = [
            (sum(self.memory.state(self.model, z, world)) + activations, z)
            for z in self.zero_stages
        ]
        total, zero = min(totals)
        return _Candidate(abs(world * accum - target), zero, 1, accum, total)

    def nearest_outside(self, world: int) -> tuple[int, int] | None:
        """``(global batch, micro-batch)`` nearest the previous batch among memory-feasible
        settings at ``world`` with any accumulation count, ignoring the band."""
        target = self.previous.global_batch_size
        seq = self.previous.sequence_length
        states = [sum(self.memory.state(self.model, z, world)) for z in self.zero_stages]
        best: tuple[int, int, int] | None = None
        for micro in range(self.max_micro_batch_size, 0, -1):
            activations = self.memory.activations(self.model, micro, seq)
            if min(states) + activations > self.mem_limit_gib:
                continue
            step = world * micro
            for accum in {max(1, target // step), max(1, -(-target // step))}:
                g = step * accum
                key = (abs(g - target), g, -micro)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[1], -best[2])


@dataclasses.dataclass(frozen=True)
class _Candidate:
    distance: int
    zero: int
    micro: int
    accum: int
    total_gib: float


def _make_search(
    model: ModelSpec,
    previous: TrainingSpec,
    *,
    tolerance: float,
    mem_limit_gib: float,
    max_micro_batch_size: int,
    zero_stages: Iterable[int],
    memory: MemoryModel,
) -> _Search:
    if not isinstance(model, ModelSpec):
        raise InvalidSpec(f"model must be a ModelSpec, got {model!r}")
    if not isinstance(previous, TrainingSpec):
        raise InvalidSpec(f"previous must be a TrainingSpec, got {previous!r}")
    positive_int("replan", "max_micro_batch_size", max_micro_batch_size)
    if isinstance(mem_limit_gib, bool) or not isinstance(mem_limit_gib, (int, float)):
        raise InvalidSpec(f"mem_limit_gib must be a number, got {mem_limit_gib!r}")
    if not mem_limit_gib > 0:
        raise InvalidSpec(f"mem_limit_gib must be > 0, got {mem_limit_gib!r}")
    stages = tuple(zero_stages)
    if not stages:
        raise InvalidSpec("zero_stages must name at least one ZeRO stage")
    for z in stages:
        check_zero_stage("zero_stages", z)
    return _Search(
        model=model,
        previous=previous,
        band=batch_band(previous.global_batch_size, tolerance),
        mem_limit_gib=float(mem_limit_gib),
        max_micro_batch_size=max_micro_batch_size,
        zero_stages=tuple(dict.fromkeys(stages)),
        memory=memory,
    )


def replan(
    model: ModelSpec,
    previous: TrainingSpec,
    world_size: int,
    *,
    tolerance: float = 0.10,
    mem_limit_gib: float,
    max_micro_batch_size: int,
    zero_stages: Sequence[int] = (1, 2, 3),
    param_bytes: float = PARAM_BYTES,
    grad_bytes: float = GRAD_BYTES,
    optim_bytes: float = OPTIM_BYTES,
    optim_slots: float = OPTIM_SLOTS,
    activation_constant: float = ACTIVATION_CONSTANT,
) -> Plan:
    """Batch settings for ``world_size`` ranks that keep the global batch near ``previous``'s.

    Search: with ``B`` the previous global batch, the band is
    ``[floor(B*(1-tol)), ceil(B*(1+tol))]``. Micro-batch sizes go from
    ``min(max_micro_batch_size, upper // world_size)`` down to 1, ZeRO stages in the order
    given; for each pair the accumulation steps that land in the band form a range computed
    arithmetically, and the count nearest ``B`` is taken (the smaller on a tie). Settings whose
    :func:`estimate_memory` ``total_gib`` exceeds ``mem_limit_gib`` are dropped. The winner has
    the smallest ``|global batch - B|``; ties go to the lower ZeRO stage, then to the one found
    first (the larger micro-batch). The sequence length is kept.

    Args:
        model: the model's sizes.
        previous: the settings to stay near (their global batch is ``B``).
        world_size: the new number of data-parallel ranks.
        tolerance: the band's relative half-width.
        mem_limit_gib: the per-GPU memory limit (required).
        max_micro_batch_size: the largest micro-batch to try (required).
        zero_stages: the ZeRO stages to try, in order of preference.
        param_bytes, grad_bytes, optim_bytes, optim_slots, activation_constant: the memory
            model's parameters (see :func:`estimate_memory`).

    Returns:
        The :class:`Plan`.

    Raises:
        NoFeasiblePlan: nothing fits (naming the tolerance, memory limit or world size that
            would work).
        InvalidSpec: bad arguments.

    Example:
        from ckptd import elastic

        m = elastic.ModelSpec(hidden_size=4096, num_hidden_layers=28,
                              num_parameters=4_832_071_680)
        previous = elastic.TrainingSpec(1, 480, 6, 1, 4096)  # global batch 2880
        p = elastic.replan(m, previous, 488, mem_limit_gib=120, max_micro_batch_size=32)
        t = p.training
        assert (t.micro_batch_size, t.gradient_accumulation_steps) == (6, 1)
        assert t.global_batch_size == 2928 and round(p.deviation, 4) == 0.0167
    """
    plan = planner(
        model,
        previous,
        tolerance=tolerance,
        mem_limit_gib=mem_limit_gib,
        max_micro_batch_size=max_micro_batch_size,
        zero_stages=zero_stages,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optim_bytes=optim_bytes,
        optim_slots=optim_slots,
        activation_constant=activation_constant,
    )
    return plan(world_size)


def planner(
    model: ModelSpec,
    previous: TrainingSpec,
    *,
    tolerance: float = 0.10,
    mem_limit_gib: float,
    max_micro_batch_size: int,
    zero_stages: Sequence[int] = (1, 2, 3),
    param_bytes: float = PARAM_BYTES,
    grad_bytes: float = GRAD_BYTES,
    optim_bytes: float = OPTIM_BYTES,
    optim_slots: float = OPTIM_SLOTS,
    activation_constant: float = ACTIVATION_CONSTANT,
) -> Callable[[int], Plan]:
    """:func:`replan` with everything but the world size fixed (validated once).

    >>> m = ModelSpec(hidden_size=4096, num_hidden_layers=28, num_parameters=4_832_071_680)
    >>> plan = planner(m, TrainingSpec(1, 480, 6, 1, 4096), mem_limit_gib=120,
    ...                max_micro_batch_size=32)
    >>> [plan(w).training.global_batch_size for w in (8, 488)]
    [2880, 2928]
    """
    memory = MemoryModel(param_bytes, grad_bytes, optim_bytes, optim_slots, activation_constant)
    search = _make_search(
        model,
        previous,
        tolerance=tolerance,
        mem_limit_gib=mem_limit_gib,
        max_micro_batch_size=max_micro_batch_size,
        zero_stages=zero_stages,
        memory=memory,
    )

    def plan(world_size: int) -> Plan:
        positive_int("replan", "world_size", world_size)
        return _plan_or_raise(search, world_size, tolerance)

    return plan


def _plan_or_raise(search: _Search, world: int, tolerance: float) -> Plan:
    best = search.best(world)
    if best is None:
        raise diagnose(search, world, tolerance)
    training = TrainingSpec(
        zero_stage=best.zero,
        world_size=world,
        micro_batch_size=best.micro,
        gradient_accumulation_steps=best.accum,
        sequence_length=search.previous.sequence_length,
    )
    target = search.previous.global_batch_size
    return Plan(
        training=training,
        deviation=(training.global_batch_size - target) / target,
        memory=search.memory.estimate(
            search.model, best.zero, world, best.micro, training.sequence_length
        ),
    )
