"""SIGTERM -> committed for a large state, next to the floor measured in the same run.

One process holds ``--gib`` GiB of fp32 state in a ZeRO-style flat buffer (declared with
``ckptd.FlatShard``), sends itself SIGTERM, and runs the preemption path of
``ckptd.elastic.ElasticRun`` (drain, project, an uncompressed ``urgent`` save through the
run's own staging buffers, commit). ``--compression zstd`` makes the run a compressed one (its
periodic saves are compressed; the preemption save still is not). ``--warm`` first does one periodic async save, as a training run would have done, so
the staging buffers exist; without it the preemption save allocates them (page-fault bound).
The floor is writing the same number of bytes to the same filesystem with ``O_DIRECT`` (what
ckptd's local backend uses; falls back to buffered + ``fsync``) from as many threads::

    python integrations/torchrun/bench_preempt.py --gib 4 --root /tmp/bench --warm
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import ckptd
from ckptd import elastic


def write_floor(directory: str, nbytes: int, threads: int) -> float:
    """Seconds to write and fsync ``nbytes`` in ``threads`` files of equal size."""
    os.makedirs(directory, exist_ok=True)
    chunk = 64 << 20
    per = nbytes // threads // chunk * chunk

    def one(i: int) -> None:
        block = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        path = f"{directory}/floor-{i}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:
            fd = os.open(path, flags, 0o644)
        try:
            for _ in range(per // chunk):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
            block.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    seconds = time.perf_counter() - t0
    shutil.rmtree(directory)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--root", required=True, help="a directory on the filesystem to measure")
    p.add_argument("--warm", action="store_true", help="one async save first (arena exists)")
    p.add_argument("--grace-s", type=float, default=30.0)
    p.add_argument("--compression", default=None, help="the run's compression (e.g. zstd)")
    args = p.parse_args()
    threads = os.cpu_count() or 1
    n = int(args.gib * (1 << 30)) // 4
    members = 64
    size = -(-n // members)
    flat = torch.empty(size * members).uniform_()  # touched: resident, like a real state
    state = {"model": {"flat": ckptd.FlatShard(
        flat, [(f"layers.{i}.w", (size,)) for i in range(members)], 0)}}
    root = os.path.join(args.root, "ckpt")
    shutil.rmtree(root, ignore_errors=True)
    ckpt = ckptd.init(root, compression=args.compression, threads=threads, keep_last=2)
    run = elastic.resume(ckpt, reference=elastic.TrainingSpec(1, 1, 1, 1, 1),
                         model=elastic.ModelSpec(1, 1, n), grace_s=args.grace_s)
    warm: dict[str, float] = {}
    if args.warm:
        run.step_done()
        h = run.save_async(state)
        r = h.result()
        warm = {"async_stall_s": h.stall_s, "async_write_s": r.write_s}
    run.step_done()
    flat.add_(1.0)
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckptd.preempted()
    out = run.save_on_preemption(state)
    total = time.monotonic() - t0
    nbytes = flat.numel() * 4
    floor = write_floor(os.path.join(args.root, "floor"), nbytes, threads)
    print(json.dumps({
        "gib": nbytes / (1 << 30), "threads": threads, "warm": args.warm,
        "compression": args.compression, **warm,
        "saved": out.saved, "reason": out.reason, "drain_s": out.drain_s,
        "save_s": out.save_s, "sigterm_to_committed_s": out.signal_to_committed_s,
        "measured_total_s": total, "projected_s": out.projected_s,
        "write_floor_s": floor, "floor_gb_s": nbytes / floor / 1e9,
        "save_gb_s": nbytes / out.save_s / 1e9 if out.save_s else None}, indent=1))
    ckpt.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
