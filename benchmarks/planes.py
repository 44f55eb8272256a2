"""Byte planes before zstd: the figures behind ``zstd-planes`` (ckptd/manifest/codecs.py) and
``compression="auto"`` (ckptd/writer/autocodec.py).

    python benchmarks/planes.py [--mib 64] [--runs 5]

On random normals in bf16 and fp32 (``--mib`` each), median of ``--runs``: the zstd ratio
without and with byte planes (ckptd's codec, level 1), zstd's throughput per core, and the
time to regroup one 1 MiB frame into planes with numpy (what ckptd does) and with torch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ckptd.manifest import codecs


def _median_s(fn, runs: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def row(dtype: torch.dtype, mib: int, runs: int, g: torch.Generator) -> str:
    n = (mib << 20) // dtype.itemsize
    raw = torch.randn(n, generator=g).to(dtype).view(torch.uint8).numpy().tobytes()
    size = dtype.itemsize
    plain = len(codecs.encode(raw, codecs.ZSTD, size))
    planes = len(codecs.encode(raw, codecs.ZSTD_PLANES, size))
    secs = _median_s(lambda: codecs.encode(raw, codecs.ZSTD_PLANES, size), runs)
    frame = raw[: 1 << 20]
    t_np = _median_s(lambda: codecs._planes(frame, size, False), runs * 4)
    u8 = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    t_torch = _median_s(lambda: u8.view(-1, size).t().contiguous(), runs * 4)
    return (f"| {str(dtype).removeprefix('torch.')} | {len(raw) / plain:.2f} "
            f"| {len(raw) / planes:.2f} | {len(raw) / secs / 1e9:.2f} "
            f"| {t_np * 1e3:.2f} | {t_torch * 1e3:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print("| dtype | ratio zstd | ratio planes + zstd | zstd-planes GB/s/core "
          "| planes of 1 MiB: numpy ms | torch ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        print(row(dtype, args.mib, args.runs, g))


if __name__ == "__main__":
    main()
