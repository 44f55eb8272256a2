"""Offline reshard at scale: ``ckptd reshard CKPT --to-world N --out DEST`` of an 8-rank
FSDP2-shaped checkpoint (a small GPT, every parameter and its Adam moments sharded along dim 0,
and its Adam ``step``, a 0-d tensor replicated on every rank, as ``torch.optim.Adam`` keeps it)
for N up to a thousand, with the inferred layout and with explicit ZeRO stages.

    python benchmarks/reshard.py [--worlds 8,256,1024] [--zero inferred,0,3] [--hidden 256]

Each reshard runs as its own ``ckptd`` process (the command users run). Per row: wall time, the
process's peak RSS, bytes written (the files under DEST) next to the source's bytes, the floor:
DEST's bytes at the write bandwidth measured in the same run (``common.write_floor``-style:
one file, written and fsync'd), and DEST's manifest next to the source's. The target is wall ≤
floor + 10 s, peak RSS ≤ 256 MiB and bytes written ≤ 1.01 × the source's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ckptd  # noqa: E402

W = 8


def params(hidden: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    out = {"tok_embeddings.weight": (vocab, hidden), "norm.weight": (hidden,),
           "output.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + "attention.wq.weight": (hidden, hidden),
                p + "attention.wk.weight": (hidden, hidden),
                p + "attention.wv.weight": (hidden, hidden),
                p + "attention.wo.weight": (hidden, hidden),
                p + "feed_forward.w1.weight": (4 * hidden, hidden),
                p + "feed_forward.w2.weight": (hidden, 4 * hidden),
                p + "feed_forward.w3.weight": (4 * hidden, hidden),
                p + "attention_norm.weight": (hidden,), p + "ffn_norm.weight": (hidden,)}
    return out


def save_source(root: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """8 ranks, FSDP2's layout (dim-0 shards), saved one after another in this process."""
    def shard(shape: tuple[int, ...], rank: int, seed: int) -> ckptd.Shard:
        per = -(-shape[0] // W)
        a = min(shape[0], rank * per)
        b = min(shape[0], a + per)
        g = torch.Generator().manual_seed(seed)
        local = torch.randn((b - a, *shape[1:]), generator=g)
        return ckptd.Shard(local, shape, (a,) + (0,) * (len(shape) - 1))

    ranks = [ckptd.Checkpointer(root, rank=r, world_size=W, run_id="src") for r in range(W)]
    handles = []
    for r, c in enumerate(ranks):
        state = {"model": {n: shard(s, r, i) for i, (n, s) in enumerate(shapes.items())},
                 "optim": {"state": {n: {"exp_avg": shard(s, r, i + 1000),
                                         "exp_avg_sq": shard(s, r, i + 2000),
                                         "step": torch.tensor(7.0)}
                                     for i, (n, s) in enumerate(shapes.items())}},
                 "step": 7}
        handles.append(c.save_async(state, step=7))
    for h in handles:
        h.result()
    for c in ranks:
        c.close()


def tree_bytes(path: str, suffix: str = "") -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if f.endswith(suffix))


def write_bw(where: str, nbytes: int) -> float:
    """Bytes/s of one file written and fsync'd (the floor's bandwidth), median of 3."""
    block = os.urandom(1 << 20)
    out = []
    for _ in range(3):
        path = os.path.join(where, "floor.bin")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        out.append(max(1, nbytes >> 20) * (1 << 20) / (time.perf_counter() - t0))
        os.remove(path)
    return sorted(out)[1]


def reshard(src: str, dest: str, world: int, zero: str) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one ``ckptd reshard`` process."""
    cmd = [sys.executable, "-m", "ckptd.cli", "reshard", src, "--to-world", str(world),
           "--out", dest] + ([] if zero == "inferred" else ["--zero", zero])
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "maxrss=%M", *cmd], capture_output=True,
                       text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    m = re.search(r"maxrss=(\d+)", p.stderr)
    return wall, int(m.group(1)) * 1024 if m else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="8,256,1024")
    ap.add_argument("--zero", default="inferred,0,3", help="layouts: inferred and ZeRO stages")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=6000)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ckptd-reshard-bench-", dir=args.dir)
    try:
        src = os.path.join(work, "src")
        save_source(src, params(args.hidden, args.layers, args.vocab))
        src_bytes = tree_bytes(src, ".bin")
        bw = write_bw(work, src_bytes)
        print(f"source: 8 ranks, {src_bytes / 2**20:.1f} MiB of data; write floor "
              f"{bw / 2**20:.0f} MiB/s\n")
        src_manifest = tree_bytes(src, "manifest.json")
        print("| --to-world | layout | wall | floor + 10 s | peak RSS | bytes written / source "
              "| manifest / source's |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for world in (int(x) for x in args.worlds.split(",")):
            for zero in args.zero.split(","):
                dest = os.path.join(work, f"out-{world}-{zero}")
                wall, rss = reshard(src, dest, world, zero)
                written = tree_bytes(dest, ".bin")
                print(f"| {world} | {'inferred' if zero == 'inferred' else 'ZeRO ' + zero} | "
                      f"{wall:.1f} s | {written / bw + 10:.1f} s | {rss / 2**20:.0f} MiB | "
                      f"{written / src_bytes:.3f} | {tree_bytes(dest, 'manifest.json') / 2**20:.2f}"
                      f" / {src_manifest / 2**20:.2f} MiB |", flush=True)
                shutil.rmtree(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
