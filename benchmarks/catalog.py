"""What finding the committed steps costs: bytes read, requests and CPU of ``catalog.committed``.

    python benchmarks/catalog.py [--tensors 2000] [--ranks 64] [--steps 50] [--dir DIR]

Writes ``--steps`` committed manifests of one model (``--tensors`` tensors, each cut into
``--ranks`` chunks: a 22.5 MB manifest at the defaults) under one root, then times
``catalog.committed`` (what ``latest_step()``, ``load()``, retention and ``ckptd gc`` call)
on manifests with a sealed lead, which it reads alone, and on manifests without one (written
before the lead: read whole, as every manifest was before). Only manifests are written: no data.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fmt_bytes, scratch  # noqa: E402

from ckptd import catalog  # noqa: E402
from ckptd.buffers import Buffer  # noqa: E402
from ckptd.manifest import encode, layout  # noqa: E402
from ckptd.manifest.frames import FrameRef  # noqa: E402
from ckptd.manifest.schema import Chunk, Manifest, TensorEntry  # noqa: E402
from ckptd.regions import Box  # noqa: E402
from ckptd.storage import LocalStorage  # noqa: E402
from ckptd.storage.base import Delegating  # noqa: E402


class Counting(Delegating):
    """Counts the bytes and requests of the reads it passes on."""

    def __init__(self, root: str) -> None:
        super().__init__(LocalStorage(root))
        self.bytes = self.requests = 0

    def read_bytes(self, path: str) -> bytes:
        out = super().read_bytes(path)
        self.bytes, self.requests = self.bytes + len(out), self.requests + 1
        return out

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> Sequence[Buffer]:
        out = super().read_ranges(path, ranges)
        self.bytes, self.requests = self.bytes + sum(len(b) for b in out), self.requests + 1
        return out


def model(tensors: int, ranks: int) -> Manifest:
    """A committed manifest: ``tensors`` tensors of ``ranks`` row blocks, one per rank."""
    entries = {}
    for i in range(tensors):
        chunks = tuple(
            Chunk(Box((r * 4, 0), (4, 256)), f"data/run-000001/r{r:05d}-0.bin", i * 4096, 4096,
                  "raw", 4096, None, r, FrameRef(f"data/run-000001/r{r:05d}.frames", i, 1,
                                                 "0" * 16))
            for r in range(ranks))
        entries[f"model/layers.{i}.weight"] = TensorEntry("float32", (ranks * 4, 256), chunks)
    return Manifest(step=0, attempt="run-000001", world_size=ranks, created=time.time(),
                    tensors=entries, generation=1)


def measure(root: str, base: Manifest, steps: int) -> tuple[int, int, int, float]:
    """Manifest size, bytes read, requests and the least CPU seconds of three calls."""
    size = 0
    for s in range(1, steps + 1):
        raw = dataclasses.replace(base, step=s).encode()
        os.makedirs(os.path.join(root, layout.step_dir(s)))
        with open(os.path.join(root, layout.manifest_path(s)), "wb") as f:
            f.write(raw)
        size = len(raw)
    storage = Counting(root)
    assert len(catalog.committed(storage)) == steps  # and the page cache is warm
    cpu = []
    for _ in range(3):
        storage.bytes = storage.requests = 0
        t = time.process_time()
        catalog.committed(storage)
        cpu.append(time.process_time() - t)
    return size, storage.bytes, storage.requests, min(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    base = model(args.tensors, args.ranks)
    print("| manifests | each | read | requests | CPU |\n|---|---:|---:|---:|---:|")
    with scratch(args.dir) as where:
        for name, lead in (("with a lead", True), ("without (read whole)", False)):
            root = tempfile.mkdtemp(prefix="ckptd-catalog-", dir=where)
            # without: as the writer made them before the lead was sealed
            unsealed = mock.patch.object(encode, "_lead_first", dict)
            with contextlib.nullcontext() if lead else unsealed:
                size, nbytes, requests, cpu = measure(root, base, args.steps)
            print(f"| {args.steps} {name} | {fmt_bytes(size)} | {fmt_bytes(nbytes)} | "
                  f"{requests} | {cpu * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
