"""How good the data orders' shuffles are (``ckptd.data``): uniform epoch orders at every
dataset size, sharded batches that mix shards, and a sharded position whose cost does not grow
with the number of shards.

The statistical tests are deterministic (fixed seeds: they pass or fail the same way on every
run). Each chi-square statistic is compared with the critical value of its distribution at an
upper tail of 1e-6 (Wilson–Hilferty's approximation): a uniform shuffle would fail one with
probability about 1e-6, and the whole file with less than 1e-5.
"""

from __future__ import annotations

import math
import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import numpy as np
import pytest

from ckptd.data import GlobalOrder, ShardedOrder

SEEDS = 20_000


def chi_square_critical(df: int, z: float = 4.753) -> float:
    """The chi-square value that ``df`` degrees of freedom exceed with probability 1e-6."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, expected: float) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def epoch_orders(length: int, places: int, seeds: int = SEEDS) -> np.ndarray:
    """The first ``places`` samples of epoch 0 for seeds 0 .. seeds-1, one row per seed."""
    return np.array([_first(GlobalOrder(length, seed=s), places) for s in range(seeds)])


def _first(order: GlobalOrder, places: int) -> list[int]:
    return [order.index(p) for p in range(places)]


@pytest.mark.parametrize("length", [3, 4, 5, 6])
def test_every_order_of_a_small_dataset_is_equally_likely(length: int) -> None:
    rows = epoch_orders(length, length)
    codes = rows @ (length ** np.arange(length))
    counts = np.array(list(Counter(codes.tolist()).values()))
    cells = math.factorial(length)
    assert len(counts) == cells  # every order occurs
    x = chi_square(counts, SEEDS / cells)
    assert x < chi_square_critical(cells - 1), f"chi-square {x:.0f} over {cells} orders"


@pytest.mark.parametrize("length", [16, 64])
def test_the_first_two_samples_of_an_epoch_are_uniform(length: int) -> None:
    """Over 20,000 seeds: which sample comes first (``length`` cells), how far the second is
    from it (``(second - first) mod length``: ``length - 1`` cells), and which pair comes first
    (``length·(length-1)`` cells, 5 expected per cell at 64)."""
    rows = epoch_orders(length, 2)
    first = np.bincount(rows[:, 0], minlength=length)
    assert chi_square(first, SEEDS / length) < chi_square_critical(length - 1)
    gap = np.bincount((rows[:, 1] - rows[:, 0]) % length, minlength=length)[1:]
    x = chi_square(gap, SEEDS / (length - 1))
    assert x < chi_square_critical(length - 2), f"chi-square {x:.0f} over {length - 1} gaps"
    pairs = np.bincount(rows[:, 0] * length + rows[:, 1], minlength=length * length)
    assert pairs[np.arange(length) * (length + 1)].sum() == 0  # never a sample twice
    cells = length * (length - 1)
    off_diagonal = np.delete(pairs, np.arange(length) * (length + 1))
    x = chi_square(off_diagonal, SEEDS / cells)
    assert x < chi_square_critical(cells - 1), f"chi-square {x:.0f} over {cells} pairs"


def _odd(order: list[int]) -> bool:
    seen, transpositions = [False] * len(order), 0
    for i in range(len(order)):
        j, cycle = i, 0
        while not seen[j]:
            seen[j], j, cycle = True, order[j], cycle + 1
        transpositions += max(cycle - 1, 0)
    return transpositions % 2 == 1


def test_odd_and_even_orders_are_equally_likely_at_a_power_of_4() -> None:
    """At 16 = 4^2 (the exact shuffle): 2,000 seeds, odd orders within 5 standard deviations
    of 1,000 (a fair coin leaves that range with probability 6e-7). At 4096 = 4^6, the first
    size the computed permutation serves: both parities among 24 seeds (a fair coin gives one
    parity 24 times with probability 1.2e-7)."""
    odd = sum(_odd(_first(GlobalOrder(16, seed=s), 16)) for s in range(2000))
    assert abs(odd - 1000) < 5 * math.sqrt(2000 / 4), odd
    parities = {_odd(_first(GlobalOrder(4096, seed=s), 4096)) for s in range(24)}
    assert parities == {False, True}


@pytest.mark.parametrize("length", [4096, 10**6 + 3, 4**15])
def test_the_computed_permutation_places_the_first_samples_uniformly(length: int) -> None:
    """Above the exact shuffle: over 12,800 seeds, the first sample's place in 64 equal bins
    and the gap to the second sample's (mod length) in 64 bins are uniform."""
    seeds, bins = 12_800, 64
    rows = np.array([_first(GlobalOrder(length, seed=s), 2) for s in range(seeds)])
    first = np.bincount(rows[:, 0] * bins // length, minlength=bins)
    gap = np.bincount((rows[:, 1] - rows[:, 0]) % length * bins // length, minlength=bins)
    for counts in (first, gap):  # bins of equal width within one sample: ~equal expectations
        assert chi_square(counts, seeds / bins) < chi_square_critical(bins - 1), counts


# --------------------------------------------------------------------------- sharded batches


def test_a_sharded_global_batch_mixes_shards() -> None:
    """100 shards x 1000 records, global batches of 256 over a whole epoch with the default
    block size: each batch draws from many shards (one, before blocks), and a record is
    hardly ever followed by the next of its shard."""
    order = ShardedOrder([1000] * 100, seed=5)
    got = [order.index(p) for p in range(100_000)]
    batches = [got[i:i + 256] for i in range(0, len(got) - 255, 256)]
    shards = [len({s for s, _ in batch}) for batch in batches]
    assert sum(shards) / len(shards) >= 8, Counter(shards)
    consecutive = sum(a[0] == b[0] and b[1] == a[1] + 1 for a, b in pairwise(got))
    assert consecutive / len(got) < 0.01


def _work(order: ShardedOrder, positions: range) -> tuple[int, int]:
    """(Python bytecodes executed, peak bytes allocated) by ``order.index`` over
    ``positions``, once the epoch's layout exists: counted, not timed."""
    order.index(positions[0])
    opcodes = 0

    def trace(frame: Any, event: str, arg: Any) -> Callable[..., Any]:
        nonlocal opcodes
        frame.f_trace_opcodes = True
        opcodes += event == "opcode"
        return trace

    sys.settrace(trace)
    try:
        for p in positions:
            order.index(p)
    finally:
        sys.settrace(None)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for p in positions:
            order.index(p + order.length // 2)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return opcodes, peak


def test_a_sharded_position_costs_the_same_at_100x_the_shards() -> None:
    """A position's work (bytecodes run, memory allocated) at 102,400 shards is that at 1,024
    shards (each of 10 records): the epoch's layout is computed once, and a position is two
    binary searches and a permutation. Before, every position hashed a tuple of all the shard
    lengths (1.1 ms a sample at 10^5 shards)."""
    small = _work(ShardedOrder([10] * 1024, seed=1), range(5000, 5200))
    large = _work(ShardedOrder([10] * 102_400, seed=1), range(5000, 5200))
    assert large[0] <= small[0] * 1.1 + 200, (small, large)  # bytecodes
    assert large[1] <= small[1] * 2 + 16_384, (small, large)  # bytes: no copy of the shards
