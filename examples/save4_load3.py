"""Save a sharded model + Adam state on 4 ranks, load it on 3, check every element.

Run: python examples/save4_load3.py [--root DIR]
Each rank holds its own slice of every weight (a ckptd.Shard) and a ZeRO-style flat shard of
the optimizer state (a ckptd.FlatShard); the 3-rank job asks for a different split and gets
exactly the saved values. Real processes, torch.distributed with gloo on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptd

SHAPES = {
    "embed": (50, 16),
    "attn.qkv": (48, 16),
    "attn.out": (16, 16),
    "mlp.up": (64, 16),
    "mlp.down": (16, 64),
    "norm": (16,),
}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """Uneven row split: the first n % world ranks get one more row."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)


def state_for(rank: int, world: int, ref: dict[str, torch.Tensor], fill: float | None) -> dict:
    model = {}
    for name, t in ref.items():
        start, n = rows(t.shape[0], rank, world)
        local = (
            t[start : start + n].clone()
            if fill is None
            else torch.full_like(t[start : start + n], fill)
        )
        model[name] = ckptd.Shard(local, t.shape, (start,) + (0,) * (t.dim() - 1))
    # ZeRO-1: one flat buffer of all parameters' Adam moments, padded, split evenly over ranks.
    flat = torch.cat([t.reshape(-1) for t in ref.values()])
    per_rank = -(-flat.numel() // world)
    members = [(name, t.shape) for name, t in ref.items()]
    optim = {}
    for moment, scale in (("exp_avg", 0.1), ("exp_avg_sq", 0.01)):
        lo = rank * per_rank
        local = torch.zeros(per_rank)
        valid = flat[lo : lo + per_rank] * scale
        local[: valid.numel()] = valid if fill is None else fill
        optim[moment] = {"flat": ckptd.FlatShard(local, members, lo)}
    return {"model": model, "optim": optim, "step": 100}


def worker(rank: int, world: int, port: int, root: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckptd.init(root)
    ref = reference()
    if mode == "save":
        result = ckptd.save(state_for(rank, world, ref, None))
        if rank == 0:
            print(
                f"saved step {result.step} from {world} ranks: {result.nbytes} bytes by rank 0, "
                f"stall {result.stall_s * 1e3:.1f} ms"
            )
    else:
        state = state_for(rank, world, ref, fill=float("nan"))
        loaded = ckptd.load(state)
        expect = state_for(rank, world, ref, None)
        for name in SHAPES:
            assert torch.equal(state["model"][name].local, expect["model"][name].local), name
        for moment in ("exp_avg", "exp_avg_sq"):
            got, want = state["optim"][moment]["flat"].local, expect["optim"][moment]["flat"].local
            used = min(
                got.numel(), max(0, sum(t.numel() for t in ref.values()) - rank * got.numel())
            )
            assert torch.equal(got[:used], want[:used]), moment
        if rank == 0:
            print(
                f"loaded step {loaded.step} on {world} ranks: bit-exact "
                f"({loaded.nbytes_read} bytes read by rank 0)"
            )
    ckptd.wait()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="checkpoint root (default: a temp dir)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ckptd-example-")
    for world, mode in ((4, "save"), (3, "load")):
        mp.start_processes(
            worker, args=(world, free_port(), root, mode), nprocs=world, start_method="fork"
        )
    print(f"checkpoint in {root}; try: ckptd inspect {root}")


if __name__ == "__main__":
    main()
