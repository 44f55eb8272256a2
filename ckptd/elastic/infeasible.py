"""A world size with no batch plan: :class:`NoFeasiblePlan`, and :func:`diagnose`, which finds
the nearest options that would work (a looser tolerance, more memory, fewer or more ranks) and
names them in the error (``docs/elastic_replan.md``)."""

from __future__ import annotations

import math
from typing import Protocol

from ckptd.elastic.specs import TrainingSpec
from ckptd.errors import CkptdError


class Setting(Protocol):
    """A batch setting the search found (its ``_Candidate``)."""

    @property
    def zero(self) -> int: ...
    @property
    def accum(self) -> int: ...
    @property
    def total_gib(self) -> float: ...


class Search(Protocol):
    """What :func:`diagnose` asks of the planner's search (``ckptd.elastic.search``)."""

    @property
    def previous(self) -> TrainingSpec: ...
    @property
    def band(self) -> tuple[int, int]: ...
    @property
    def mem_limit_gib(self) -> float: ...
    @property
    def zero_stages(self) -> tuple[int, ...]: ...

    def nearest_outside(self, world: int) -> tuple[int, int] | None:
        """``(global batch, micro-batch)`` nearest the previous batch at ``world``, the band
        ignored."""

    def cheapest(self, world: int) -> Setting | None:
        """The in-band setting at ``world`` needing the least memory."""

    def nearest_feasible(self, world: int, *, above: bool) -> int | None:
        """The nearest world size above (or below) ``world`` that has a plan."""


class NoFeasiblePlan(CkptdError, ValueError):
    """No batch setting at this world size keeps the global batch in the band and fits memory.

    The message names the nearest options; they are also attributes (``None`` when that option
    does not exist or would not help):

    - ``needed_tolerance``: the smallest tolerance with which this world size has a plan under
      the same memory limit;
    - ``needed_mem_limit_gib``: the smallest memory limit with which this world size has a plan
      under the same tolerance;
    - ``world_below``: the largest smaller world size that has a plan (leave
      ``world_size - world_below`` ranks idle);
    - ``world_above``: the smallest larger world size that has a plan (only searched when memory,
      not the band, is what rules this world size out).

    Args:
        message: the error's text.
        world_size: the world size that has no plan.
        band: the global batch band ``(lower, upper)`` searched.
        needed_tolerance, needed_mem_limit_gib, world_below, world_above: the nearest
            options, as above.

    Example:
        from ckptd import elastic

        m = elastic.ModelSpec(hidden_size=4096, num_hidden_layers=28,
                              num_parameters=4_832_071_680)
        previous = elastic.TrainingSpec(1, 480, 6, 1, 4096)  # global batch 2880
        try:
            elastic.replan(m, previous, 800, mem_limit_gib=120, max_micro_batch_size=32)
        except elastic.NoFeasiblePlan as e:
            assert e.world_size == 800 and e.band == (2592, 3168)
        else:
            raise AssertionError("no error")
    """

    def __init__(
        self,
        message: str,
        *,
        world_size: int,
        band: tuple[int, int],
        needed_tolerance: float | None = None,
        needed_mem_limit_gib: float | None = None,
        world_below: int | None = None,
        world_above: int | None = None,
    ) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.band = band
        self.needed_tolerance = needed_tolerance
        self.needed_mem_limit_gib = needed_mem_limit_gib
        self.world_below = world_below
        self.world_above = world_above


def _fmt_gib(value: float) -> str:
    return f"{value:g}" if value == int(value) else f"{value:.2f}"


def diagnose(search: Search, world: int, tolerance: float) -> NoFeasiblePlan:
    """Why ``world`` has no plan under ``search``, and the nearest options that do work."""
    target = search.previous.global_batch_size
    lo, hi = search.band
    options: list[str] = []

    needed_tolerance: float | None = None
    outside = search.nearest_outside(world)
    if outside is not None:
        g, micro = outside
        needed_tolerance = abs(g - target) / target
        # Round the printed percentage up so that using it is always enough.
        pct = math.ceil(needed_tolerance * 10000 - 1e-9) / 100
        options.append(f"tolerance {pct:.2f}% (global batch {g}, micro-batch {micro})")

    needed_mem: float | None = None
    cheapest = search.cheapest(world)
    if cheapest is not None and cheapest.total_gib > search.mem_limit_gib:
        needed_mem = cheapest.total_gib
        shown = math.ceil(needed_mem * 100 - 1e-9) / 100
        options.append(
            f"mem_limit_gib {shown:.2f} (ZeRO-{cheapest.zero}, micro-batch 1, "
            f"accumulation {cheapest.accum})"
        )

    world_below: int | None = None
    # A world above the band's upper end has no plan, so start there; and if even the cheapest
    # setting at this world exceeds memory, fewer ranks (more state per rank) cannot help,
    # unless no stage shards anything.
    memory_bound = cheapest is not None and cheapest.total_gib > search.mem_limit_gib
    sharded = any(z >= 1 for z in search.zero_stages)
    if not (memory_bound and sharded):
        world_below = search.nearest_feasible(min(world, hi + 1), above=False)
        if world_below is not None:
            options.append(f"world size {world_below} (leave {world - world_below} ranks idle)")

    world_above: int | None = None
    if memory_bound and sharded:
        world_above = search.nearest_feasible(world, above=True)
        if world_above is not None:
            options.append(f"world size {world_above}")

    why = "nearest options: " + ", or ".join(options) if options else "no nearby option"
    message = (
        f"world size {world} has no plan: global batch {target} ±{float(tolerance) * 100:g}% "
        f"= [{lo}, {hi}] under {_fmt_gib(search.mem_limit_gib)} GiB/GPU; {why}"
    )
    return NoFeasiblePlan(
        message,
        world_size=world,
        band=search.band,
        needed_tolerance=needed_tolerance,
        needed_mem_limit_gib=needed_mem,
        world_below=world_below,
        world_above=world_above,
    )
