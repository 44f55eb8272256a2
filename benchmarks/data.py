"""The data orders at scale: what a position of ``ckptd.data``'s orders costs, in time and
memory, at a billion samples and a million shards (the figures in ``docs/data.md``).

    python benchmarks/data.py [--runs 5] [--samples 20000] [--sizes 1e6,1e8,1e9,1073741825]
                              [--shards 1e4,1e5,1e6] [--records 1000] [--randperm-max 1e8]

``GlobalOrder`` of each size N (4^15 + 1 is the worst case of the legacy algorithm's cycle
walking): µs per sample, the median of ``--runs`` runs of ``--samples`` consecutive positions
from the middle of epoch 1 (each run a new order: its epoch's setup, timed apart, comes first),
for algorithm 2 and the legacy algorithm 1; the memory of building the order and reading those
samples (tracemalloc, Python's and numpy's allocations: what the order keeps, and the peak).
Beside them, in the same run, what a materialised order costs: ``torch.randperm(N)`` (time
and bytes; above ``--randperm-max`` only the bytes it would need) and a lookup in such a table,
``table[p]``.

``ShardedOrder`` of each shard count S (``--records`` records each, default blocks of 16
shards): the same per-sample figure, the epoch's layout (shuffled shards and block starts,
computed at the first position of an epoch) and the memory, with the legacy algorithm's (shards
in sequence) beside, and the per-sample time relative to the smallest S. Tables on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fmt_bytes  # noqa: E402

from ckptd.data import GlobalOrder, ShardedOrder  # noqa: E402
from ckptd.data.order import ORDER_ALGORITHM  # noqa: E402
from ckptd.data.permutation import LEGACY  # noqa: E402

Make = Callable[[], Any]


def _count(text: str) -> int:
    return int(float(text))


def per_sample(make: Make, start: int, samples: int, runs: int) -> tuple[list[float], list[float]]:
    """(µs per sample, s of the epoch's setup) for each of ``runs`` new orders."""
    micro, setup = [], []
    for _ in range(runs):
        order = make()
        t = time.perf_counter()
        order.index(start)
        setup.append(time.perf_counter() - t)
        t = time.perf_counter()
        for p in range(start + 1, start + 1 + samples):
            order.index(p)
        micro.append((time.perf_counter() - t) / samples * 1e6)
    return micro, setup


def memory(make: Make, start: int, samples: int) -> tuple[int, int]:
    """Bytes allocated while building an order and reading ``samples`` positions: (what the
    order keeps after, the peak)."""
    tracemalloc.start()
    try:
        order = make()
        for p in range(start, start + samples):
            order.index(p)
        kept, peak = tracemalloc.get_traced_memory()
        del order
        return kept, peak
    finally:
        tracemalloc.stop()


def _mem(kept_peak: tuple[int, int]) -> str:
    kept, peak = kept_peak
    return f"{fmt_bytes(kept)} ({fmt_bytes(peak)})"


def randperm(n: int, runs: int, limit: int) -> tuple[float | None, int, float | None]:
    """(s for torch.randperm(n) or None above ``limit``, its bytes, µs of a lookup in it)."""
    nbytes = n * 8
    if n > limit:
        return None, nbytes, None
    times, table = [], None
    for _ in range(runs):
        t = time.perf_counter()
        table = torch.randperm(n)
        times.append(time.perf_counter() - t)
    assert table is not None
    lookup = table.numpy()
    t = time.perf_counter()
    for p in range(min(n, 20_000)):
        int(lookup[p])
    return statistics.median(times), nbytes, (time.perf_counter() - t) / min(n, 20_000) * 1e6


def _us(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def _s(xs: list[float]) -> str:
    m = statistics.median(xs)
    return f"{m * 1e3:.2f} ms" if m < 1 else f"{m:.2f} s"


def global_rows(sizes: list[int], args: argparse.Namespace) -> None:
    print(f"GlobalOrder: µs per sample, median (min–max) of {args.runs} runs of "
          f"{args.samples} positions; memory: tracemalloc, kept (peak)\n")
    print("| samples N | algorithm 2 µs/sample | epoch setup | memory | legacy µs/sample "
          "| torch.randperm(N) | its memory | lookup in it µs/sample |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        start = n + n // 2  # the middle of epoch 1
        new = per_sample(lambda n=n: GlobalOrder(n, seed=1), start, args.samples, args.runs)
        old = per_sample(lambda n=n: GlobalOrder(n, seed=1, algorithm=LEGACY), start,
                         args.samples, args.runs)
        mem = memory(lambda n=n: GlobalOrder(n, seed=1), start, args.samples)
        secs, nbytes, lookup = randperm(n, args.runs, args.randperm_max)
        print(f"| {n:,} | {_us(new[0])} | {_s(new[1])} | {_mem(mem)} | {_us(old[0])} "
              f"| {'—' if secs is None else f'{secs:.2f} s'} | {fmt_bytes(nbytes)} "
              f"| {'—' if lookup is None else f'{lookup:.2f}'} |")


def sharded_rows(shards: list[int], args: argparse.Namespace) -> None:
    print(f"\nShardedOrder, {args.records} records a shard, blocks of 16 shards: µs per sample, "
          f"median (min–max) of {args.runs} runs of {args.samples} positions\n")
    print("| shards S | records | algorithm 2 µs/sample | × the smallest S | epoch layout "
          "| memory kept (peak) | legacy µs/sample | legacy layout |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    first = None
    for s in shards:
        lengths = [args.records] * s
        total = s * args.records
        start = total + total // 2
        def make(algorithm: str = ORDER_ALGORITHM, lengths: list[int] = lengths) -> ShardedOrder:
            return ShardedOrder(lengths, seed=1, algorithm=algorithm)

        new = per_sample(make, start, args.samples, args.runs)
        old = per_sample(lambda: make(LEGACY), start, args.samples, args.runs)
        mem = memory(make, start, args.samples)
        m = statistics.median(new[0])
        first = first or m
        print(f"| {s:,} | {total:,} | {_us(new[0])} | {m / first:.2f} | {_s(new[1])} "
              f"| {_mem(mem)} | {_us(old[0])} | {_s(old[1])} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--sizes", default="1e6,1e8,1e9,1073741825")
    ap.add_argument("--shards", default="1e4,1e5,1e6")
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--randperm-max", type=_count, default=10**8)
    args = ap.parse_args(argv)
    global_rows([_count(x) for x in args.sizes.split(",")], args)
    sharded_rows([_count(x) for x in args.shards.split(",")], args)


if __name__ == "__main__":
    main()
