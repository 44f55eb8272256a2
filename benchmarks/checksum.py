"""Checksum throughput: the figure behind ckptd's choice of xxh3_64 (ckptd/manifest/codecs.py).

    python benchmarks/checksum.py [--size 256MiB] [--runs 5] [--frame 1MiB] [--json out.json]

For each available algorithm (xxh3_64, xxh3_128, crc32c, zlib.crc32, blake3) on one buffer of
--size random bytes, median of --runs after one warm-up:

- ``whole``: one call over the whole buffer;
- ``frames``: one call per --frame bytes (what ckptd does: a checksum per 1 MiB frame), so
  Python's per-call overhead shows;
- ``2 threads``: two threads each hashing half of the frames, aggregate GB/s (≈ 2 × ``frames``
  on 2 idle cores if the binding releases the GIL);
- ``GIL``: whether a call holds the GIL: a pure-Python thread spins and records the longest
  gap between its iterations during a whole-buffer call; a gap of ≥ 80 % of the call means
  the GIL was held throughout. This decides whether checksumming in ckptd's io threads stalls
  the training loop's Python thread (the 2-thread figure alone cannot tell on a busy machine).

Prints one markdown table and optionally writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fmt_bytes, machine_info, parse_size  # noqa: E402


def algorithms() -> dict[str, tuple[Callable[[memoryview], object], str]]:
    """name -> (function over a buffer, where it comes from); only importable ones."""
    algos: dict[str, tuple[Callable[[memoryview], object], str]] = {}
    try:
        import xxhash

        algos["xxh3_64"] = (xxhash.xxh3_64_intdigest, f"xxhash {xxhash.VERSION}")
        algos["xxh3_128"] = (xxhash.xxh3_128_intdigest, f"xxhash {xxhash.VERSION}")
    except ImportError:
        pass
    try:
        import crc32c

        algos["crc32c"] = (crc32c.crc32c, "crc32c (ICRAR)")
    except ImportError:
        try:
            import google_crc32c

            algos["crc32c"] = (lambda b: google_crc32c.value(bytes(b)), "google-crc32c")
        except ImportError:
            pass
    algos["zlib.crc32"] = (zlib.crc32, f"zlib {zlib.ZLIB_RUNTIME_VERSION}")
    try:
        import blake3

        algos["blake3"] = (lambda b: blake3.blake3(b).digest(), "blake3 (1 thread)")
    except ImportError:
        pass
    return algos


def _time(fn: Callable[[], None], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(size: int, frame: int, runs: int) -> list[dict[str, object]]:
    data = bytearray(os.urandom(size))
    mem = memoryview(data)
    frames = [mem[i : i + frame] for i in range(0, size, frame)]
    halves = [frames[: len(frames) // 2], frames[len(frames) // 2 :]]
    rows = []
    for name, (fn, origin) in algorithms().items():

        def whole(fn: Callable[[memoryview], object] = fn) -> None:
            fn(mem)

        def framed(fn: Callable[[memoryview], object] = fn) -> None:
            for f in frames:
                fn(f)

        def two_threads(fn: Callable[[memoryview], object] = fn) -> None:
            def work(part: list[memoryview]) -> None:
                for f in part:
                    fn(f)

            ts = [threading.Thread(target=work, args=(h,)) for h in halves]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        w, f, t2 = _time(whole, runs), _time(framed, runs), _time(two_threads, runs)
        held = statistics.median(_gil_held_fraction(fn, mem) for _ in range(3))
        rows.append(
            {
                "algorithm": name,
                "impl": origin,
                "whole_GBps": size / w / 1e9,
                "frames_GBps": size / f / 1e9,
                "two_threads_GBps": size / t2 / 1e9,
                "gil_held_fraction": held,
                "gil_released": held < 0.8,
            }
        )
    return rows


def _gil_held_fraction(fn: Callable[[memoryview], object], mem: memoryview) -> float:
    """Longest pause of a spinning Python thread during ``fn(mem)``, as a fraction of the call."""
    stop = threading.Event()
    gap = [0.0]

    def spin() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gap[0] = max(gap[0], now - last)
            last = now

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.02)
    gap[0] = 0.0
    t = time.perf_counter()
    fn(mem)
    call = time.perf_counter() - t
    stop.set()
    th.join()
    return gap[0] / call


def table(rows: list[dict[str, object]], size: int, frame: int, runs: int) -> str:
    head = (
        f"Checksums on {fmt_bytes(size)} of random bytes, GB/s (10^9 B/s), median of {runs} "
        f"after a warm-up; frames = one call per {fmt_bytes(frame)}\n\n"
        "| algorithm | implementation | whole buffer | per frame | 2 threads, per frame "
        "(aggregate) | releases the GIL? (longest Python pause / call) |\n"
        "|---|---|---:|---:|---:|---|\n"
    )
    lines = [
        f"| {r['algorithm']} | {r['impl']} | {r['whole_GBps']:.1f} | {r['frames_GBps']:.1f} | "
        f"{r['two_threads_GBps']:.1f} | {'yes' if r['gil_released'] else 'no'} "
        f"({r['gil_held_fraction']:.2f}) |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256MiB", help="buffer size (default 256MiB)")
    ap.add_argument("--frame", default="1MiB", help="frame size for the per-frame figures")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per figure (median)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    size, frame = parse_size(args.size), parse_size(args.frame)
    rows = bench(size, frame, max(1, args.runs))
    print(table(rows, size, frame, args.runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "size": size,
                    "frame": frame,
                    "runs": args.runs,
                    "rows": rows,
                    "machine": machine_info(None),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
