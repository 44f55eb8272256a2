"""FSDP2 + ckptd: train on 4 ranks, save without stalling, resume on 2 ranks with Adam state.

    python integrations/fsdp2/train.py [--root DIR] [--save-world 4] [--resume-world 2]

A small decoder-style model is wrapped with ``fully_shard`` (each block, then the root) on a
1-d mesh of gloo ranks on 127.0.0.1. Every few steps the training loop takes the model and
optimizer as they are to ``ckptd.save_async``, which takes their state by parameter name
(DTensors, sharded as FSDP2 holds them) and returns once it is copied to host memory. The second
run, on a different number of ranks, builds the same model and a fresh optimizer and
``ckptd.load`` s into them (resharding the DTensors; the Adam state is created to be filled) and
carries on. Both runs print a fingerprint of the whole model + optimizer
state: the one saved with the checkpoint and the one after the resume must be equal.

Under torchrun, one phase per launch::

    torchrun --standalone --nproc-per-node 4 integrations/fsdp2/train.py --root DIR --steps 4
    torchrun --standalone --nproc-per-node 2 integrations/fsdp2/train.py --root DIR --steps 7
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptd

VOCAB, HIDDEN, LAYERS, SEQ, GLOBAL_BATCH = 64, 32, 2, 16, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (the same data for any world size)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    for _ in range(SEQ):  # a learnable sequence: each token a fixed function of the last
        tokens = torch.cat([tokens, (tokens[:, -1:] * 5 + 3) % VOCAB], dim=1)
    per = GLOBAL_BATCH // world
    mine = tokens[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every full tensor of the model and Adam state (collective: all ranks call it)."""
    msd, osd = get_state_dict(model, opt)
    h = hashlib.sha256()

    def add(prefix: str, tree: Any) -> None:
        for key in sorted(tree, key=str):
            value = tree[key]
            if isinstance(value, dict):
                add(f"{prefix}/{key}", value)
            elif isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                h.update(f"{prefix}/{key}".encode())
                h.update(full.detach().reshape(-1).view(torch.uint8).numpy().tobytes())

    add("model", msd)
    add("optim", osd["state"])
    return h.hexdigest()[:16]


def train(rank: int, world: int, root: str, steps: int, save_every: int) -> None:
    ckptd.init(root, keep_last=2)
    model, opt = build(world)
    start = 0
    if ckptd.latest_step() is not None:
        state = {"model": model, "optim": opt, "step": 0}
        loaded = ckptd.load(state)  # reshards whatever world size saved it, Adam state too
        start = state["step"]
        now, saved = fingerprint(model, opt), loaded.training["fingerprint"]
        if rank == 0:
            print(
                f"resumed step {start} on {world} ranks from a checkpoint of "
                f"{loaded.training['world_size']} ranks: state {now}, saved {saved}",
                flush=True,
            )
        if now != saved:
            raise SystemExit(f"rank {rank}: resumed state {now} differs from the saved {saved}")
    for step in range(start, steps):
        tokens, targets = batch(step, rank, world)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1} on {world} ranks: loss {loss.item():.4f}", flush=True)
        if (step + 1) % save_every == 0:
            ckptd.save_async(  # returns once staged; training goes on while it is written
                {"model": model, "optim": opt, "step": step + 1},
                training={"fingerprint": fingerprint(model, opt), "world_size": world},
            )
    ckptd.wait()


def _worker(rank: int, world: int, port: int, root: str, steps: int, save_every: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks share this host's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, root, steps, save_every)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="checkpoint root (default: a temp dir)")
    parser.add_argument("--save-world", type=int, default=4)
    parser.add_argument("--resume-world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="torchrun: train up to this step")
    parser.add_argument("--save-every", type=int, default=2)
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ckptd-fsdp2-")
    if "LOCAL_RANK" in os.environ:  # under torchrun: one phase
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), root, args.steps or 4, args.save_every)
        finally:
            dist.destroy_process_group()
        return
    for world, steps in ((args.save_world, 4), (args.resume_world, 7)):
        mp.start_processes(
            _worker,
            args=(world, _free_port(), root, steps, args.save_every),
            nprocs=world,
            start_method="fork",
        )
    print(f"checkpoints in {root}; try: ckptd inspect {root}")


if __name__ == "__main__":
    main()
