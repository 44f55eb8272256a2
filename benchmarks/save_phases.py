"""Where a save's time goes: every storage operation of a few saves, timed from the call.

    python benchmarks/save_phases.py [--size-mib 1024] [--saves 3] [--dir DIR]

Prints, per save, the stall, the time to durable, and each data-file write and small atomic put
(start offset from the call and duration), so the gaps between phases show. A profiling aid,
not a benchmark table: see benchmarks/save.py for figures against floors and DCP.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterable

import torch

import ckptd
from ckptd.storage.local import LocalStorage


class TimedStorage(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.events: list[tuple[str, str, float, float]] = []

    def write_file(self, path: str, parts: Iterable[bytes | bytearray | memoryview],
                   gate=None) -> int:  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        n = super().write_file(path, parts, gate)
        self.events.append(("write", path.rsplit("/", 1)[-1], t, time.perf_counter() - t))
        return n

    def put_atomic(self, path: str, data: bytes) -> None:
        t = time.perf_counter()
        super().put_atomic(path, data)
        self.events.append(("put", path.rsplit("/", 2)[-1], t, time.perf_counter() - t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ckptd-phases-", dir=args.dir)
    n = args.size_mib // 16
    state = {f"t{i}": torch.randn(4 << 20) for i in range(n)}  # 16 MiB each
    storage = TimedStorage(root)
    try:
        with ckptd.Checkpointer(root, storage=storage, keep_last=0) as c:
            c.reserve(state)
            for step in range(args.saves):
                storage.events.clear()
                t0 = time.perf_counter()
                h = c.save_async(state, step=step)
                t1 = time.perf_counter()
                h.result()
                t2 = time.perf_counter()
                print(f"save {step}: stall {t1 - t0:.3f} s, durable {t2 - t0:.3f} s")
                for op, name, start, took in sorted(storage.events, key=lambda e: e[2]):
                    print(f"   {op:5s} {name:28s} +{start - t0:.3f} s  took {took:.3f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
