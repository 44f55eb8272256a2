"""The fixed cost of a save: a tiny state on W gloo ranks (local disk), from the call to every
rank's ``result()``; that is the commit protocol plus a few small files, nothing else.

    python benchmarks/commit.py [--world 8] [--saves 30] [--dir DIR]

Each save: all ranks pass a barrier, call ``save_async`` on 4 small tensors (16 KiB a rank) and
wait for ``result()``; the figure is the slowest rank's time (an all-reduce MAX after the save).
Prints the median and the 90th percentile over ``--saves`` saves (the first two are warm-up and
dropped), next to the floor: the same number of fsync'd file writes (data, frame table, partial
on every rank; manifest and ``latest`` on rank 0) done by the ranks directly, measured in the
same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import multirank  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WARMUP = 2


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _save_rank(rank: int, world: int, root: str, saves: int) -> list[float]:
    import ckptd

    state = {f"w{i}": ckptd.Shard(torch.full((16, 64), float(rank)), (16 * world, 64),
                                  (16 * rank, 0)) for i in range(4)}
    out = []
    with ckptd.Checkpointer(root, keep_last=2) as ckpt:
        for step in range(saves + WARMUP):
            dist.barrier()
            t0 = time.perf_counter()
            ckpt.save_async(state, step=step).result()
            out.append(_slowest(time.perf_counter() - t0))
    return out[WARMUP:]


def _floor_rank(rank: int, world: int, root: str, saves: int) -> list[float]:
    """Three fsync'd small files a rank, then two on rank 0 after everyone's: the writes a
    commit cannot avoid, with a barrier standing for the protocol's wait."""
    payload = os.urandom(16 << 10)
    out = []
    for step in range(saves + WARMUP):
        d = os.path.join(root, f"floor-{step}")
        os.makedirs(d, exist_ok=True)
        dist.barrier()
        t0 = time.perf_counter()
        for name in (f"{rank}.bin", f"{rank}.frames", f"{rank}.json"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(payload if name.endswith(".bin") else payload[:256])
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()
        if rank == 0:
            for name in ("manifest.json", "latest"):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(payload[:512])
                    f.flush()
                    os.fsync(f.fileno())
        dist.barrier()
        out.append(_slowest(time.perf_counter() - t0))
    return out[WARMUP:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--saves", type=int, default=30)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ckptd-commit-", dir=args.dir) as root:
        floor = multirank.run(_floor_rank, args.world, root, args.saves, timeout=600)[0]
        saves = multirank.run(_save_rank, args.world, os.path.join(root, "ckpt"), args.saves,
                              timeout=600)[0]

    def row(name: str, xs: list[float]) -> str:
        xs = sorted(xs)
        return (f"| {name} | {statistics.median(xs) * 1e3:.1f} ms | "
                f"{xs[int(0.9 * (len(xs) - 1))] * 1e3:.1f} ms |")

    print(f"tiny save, W = {args.world} gloo ranks, {args.saves} saves\n")
    print("| | median | p90 |\n|---|---:|---:|")
    print(row("ckptd: save_async → every rank's result()", saves))
    print(row("floor: the same fsync'd writes, barriers for the protocol", floor))
    print(f"\nratio (median): {statistics.median(saves) / statistics.median(floor):.2f}× floor")


if __name__ == "__main__":
    main()
