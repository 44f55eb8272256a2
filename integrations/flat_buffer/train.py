"""A flat-buffer trainer (Fast-LLM / ZeRO style) checkpointed by ckptd, resumed on another layout.

    python integrations/flat_buffer/train.py [--root DIR] [--save dp2.tp1.pp2]
                                             [--resume dp1.tp3.pp1] [--verify]

The trainer keeps, per pipeline stage, one **flat buffer** per kind of state — parameters (fp32
master), gradients, Adam's two moments — holding the stage's parameters back to back (their
tensor-parallel shards, or whole for TP-replicated norms), padded to a multiple of the DP size
and **sharded over data-parallel ranks** (ZeRO-3: each DP rank owns a contiguous slice and
all-gathers the parameters for the forward). Ranks are ordered TP fastest, then DP, then PP.

It declares its slices to ckptd with ``ckptd.FlatShard(slice, members, start)``: the members are
the stage's parameters with the TP box each buffer holds, so the checkpoint stores *logical*
tensors (``model/layers.2.up.weight``, ``optim/exp_avg/...``), never the padding, and any other
DP×TP×PP layout can load them into its own buffers. Gradients are recomputed every step and are
not saved.

The model's forward/backward is a stand-in: the gradient of an elementwise quadratic loss with a
target fixed by each element's *global* coordinates. That keeps the example a few seconds on two
CPU cores and makes the trajectory independent of the layout, so ``--verify`` can check that
training 8 steps on one layout equals 4 steps on it, a save, and 4 more on another — bit for bit.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import tempfile
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptd

VOCAB, HIDDEN, FFN, LAYERS = 30, 12, 24, 4  # every TP degree 1, 2, 3 divides them
PAD_TO = 8  # each DP slice of a buffer is a multiple of this many elements
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int

    @staticmethod
    def parse(text: str) -> Layout:  # "dp2.tp1.pp2"
        sizes = dict((p[:2], int(p[2:])) for p in text.split("."))
        return Layout(sizes.get("dp", 1), sizes.get("tp", 1), sizes.get("pp", 1))

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:  # (pp, dp, tp)
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def __str__(self) -> str:
        return f"dp{self.dp}.tp{self.tp}.pp{self.pp}"


# (name, global shape, how TP splits it, layer or None) — embed on the first stage, the final
# norm and the head on the last.
PARAMS = [("embed.weight", (VOCAB, HIDDEN), "rows", None)]
for _i in range(LAYERS):
    PARAMS += [
        (f"layers.{_i}.norm.weight", (HIDDEN,), "replicated", _i),
        (f"layers.{_i}.up.weight", (FFN, HIDDEN), "rows", _i),
        (f"layers.{_i}.down.weight", (HIDDEN, FFN), "cols", _i),
    ]
PARAMS += [
    ("norm_f.weight", (HIDDEN,), "replicated", None),
    ("head.weight", (VOCAB, HIDDEN), "rows", None),
]


def stage_of(name: str, layer: int | None, pp: int) -> int:
    if layer is not None:
        return layer * pp // LAYERS
    return 0 if name == "embed.weight" else pp - 1


def tp_box(shape: tuple[int, ...], split: str, tp: int, t: int) -> tuple[tuple[int, ...], ...]:
    """(offsets, sizes) of the part of a parameter that TP rank ``t`` holds."""
    if split == "rows":
        n = shape[0] // tp
        return (t * n, 0), (n, shape[1])
    if split == "cols":
        n = shape[1] // tp
        return (0, t * n), (shape[0], n)
    return (0,) * len(shape), shape


def pattern(
    name: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], salt: int
) -> torch.Tensor:
    """Values in [-1, 1] fixed by the logical tensor and the global index (integer arithmetic:
    the same bits whatever the layout)."""
    idx = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)
    idx = idx[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
    mixed = (idx * 7919 + zlib.crc32(name.encode()) + salt * 104729) % 2003 - 1001
    return mixed.to(torch.float32) / 1000.0


class StageShard:
    """This rank's slice of its stage's flat buffers, and how to declare it to ckptd."""

    def __init__(self, layout: Layout, rank: int) -> None:
        pp_rank, self.dp_rank, tp_rank = layout.coords(rank)
        self.members: list[Any] = []
        init, target, counted = [], [], []
        for name, shape, split, layer in PARAMS:
            if stage_of(name, layer, layout.pp) != pp_rank:
                continue
            offsets, sizes = tp_box(shape, split, layout.tp, tp_rank)
            whole = tuple(sizes) == tuple(shape)
            self.members.append((name, shape) if whole else (name, shape, offsets, sizes))
            init.append(pattern(name, shape, offsets, sizes, salt=1) * 0.1)
            target.append(pattern(name, shape, offsets, sizes, salt=2))
            # the logged loss counts a TP-replicated parameter on one TP rank only
            counted.append(torch.full((math.prod(sizes),), float(not whole or tp_rank == 0)))
        numel = sum(t.numel() for t in init)
        quantum = layout.dp * PAD_TO
        per = math.ceil(numel / quantum) * quantum // layout.dp
        self.start = self.dp_rank * per

        def my_slice(parts: list[torch.Tensor]) -> torch.Tensor:
            full = torch.zeros(per * layout.dp)  # the padding is zeros, and stays zeros
            full[:numel] = torch.cat(parts)
            return full[self.start : self.start + per].clone()

        self.params = my_slice(init)
        self.target = my_slice(target)
        self.counted = my_slice(counted)
        self.grads = torch.zeros(per)
        self.exp_avg = torch.zeros(per)
        self.exp_avg_sq = torch.zeros(per)

    def state(self, step: int) -> dict[str, Any]:
        """The ckptd state tree: the slices as FlatShards of the stage's logical tensors."""

        def flat(buf: torch.Tensor) -> dict[str, ckptd.FlatShard]:
            return {"flat": ckptd.FlatShard(buf, self.members, self.start)}

        return {
            "model": flat(self.params),
            "optim": {"exp_avg": flat(self.exp_avg), "exp_avg_sq": flat(self.exp_avg_sq)},
            "step": step,
        }


def adam_step(s: StageShard, step: int) -> None:
    """AdamW without weight decay, elementwise on the slice; one basic op at a time, so every
    element rounds the same way whatever the slice it sits in."""
    b1, b2 = BETAS
    s.exp_avg.mul_(b1).add_(s.grads * (1 - b1))
    s.exp_avg_sq.mul_(b2).add_(s.grads * s.grads * (1 - b2))
    m_hat = s.exp_avg / (1 - b1**step)
    v_hat = s.exp_avg_sq / (1 - b2**step)
    s.params.sub_(m_hat / (v_hat.sqrt() + EPS) * LR)


def train(rank: int, layout: Layout, root: str, steps: int, save_every: int) -> None:
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    dp_group = None
    for p in range(layout.pp):  # every rank creates every group, in the same order
        for t in range(layout.tp):
            ranks = [p * layout.dp * layout.tp + d * layout.tp + t for d in range(layout.dp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                dp_group = group
    ckptd.init(root, keep_last=2)
    shard = StageShard(layout, rank)
    step = 0
    if ckptd.latest_step() is not None:
        state = shard.state(0)
        ckptd.load(state)  # fills this layout's slices from whatever layout saved them
        step = state["step"]
        if rank == 0:
            print(f"resumed step {step} on {layout} ({layout.world} ranks)", flush=True)
    while step < steps:
        step += 1
        weights = torch.empty(shard.params.numel() * layout.dp)  # ZeRO-3: gather for forward
        dist.all_gather_single(weights, shard.params, group=dp_group)
        mine = weights[shard.start : shard.start + shard.params.numel()]
        torch.sub(mine, shard.target, out=shard.grads)  # the stand-in backward
        adam_step(shard, step)
        loss = torch.stack([(shard.grads * shard.grads * shard.counted).sum() / 2])
        dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step} on {layout}: loss {loss.item():.4f}", flush=True)
        if step % save_every == 0 or step == steps:
            ckptd.save_async(shard.state(step))  # returns once the slices are staged
    ckptd.wait()


def _worker(rank: int, layout: Layout, port: int, root: str, steps: int, save_every: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks share this host's cores
    dist.init_process_group("gloo", rank=rank, world_size=layout.world)
    try:
        train(rank, layout, root, steps, save_every)
    finally:
        dist.destroy_process_group()


def run(layout: Layout, root: str, steps: int, save_every: int = 4) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _worker,
        args=(layout, port, root, steps, save_every),
        nprocs=layout.world,
        start_method="fork",
    )


def logical_state(root: str) -> dict[str, torch.Tensor]:
    """The newest checkpoint under ``root`` as whole logical tensors, loaded in this process."""
    tensors = {name: torch.empty(shape) for name, shape, _, _ in PARAMS}
    state: dict[str, Any] = {
        "model": dict(tensors),
        "optim": {
            k: {n: torch.empty_like(t) for n, t in tensors.items()}
            for k in ("exp_avg", "exp_avg_sq")
        },
    }
    with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as ck:
        ck.load(state, strict=False)  # strict would also want the "step" value
    flat: dict[str, torch.Tensor] = {}

    def walk(tree: dict[str, Any], prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            else:
                flat[f"{prefix}{key}"] = value

    walk(state, "")
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="checkpoint root (default: a temp dir)")
    parser.add_argument("--save", default="dp2.tp1.pp2", help="layout of the first run")
    parser.add_argument("--resume", default="dp1.tp3.pp1", help="layout of the resumed run")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also train --steps without interruption; compare bit for bit",
    )
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ckptd-flat-")
    first, second = Layout.parse(args.save), Layout.parse(args.resume)
    half = args.steps // 2
    run(first, f"{root}/run", half)
    run(second, f"{root}/run", args.steps)
    if args.verify:
        run(first, f"{root}/reference", args.steps)
        got, want = logical_state(f"{root}/run"), logical_state(f"{root}/reference")
        differ = [
            n for n in want if not torch.equal(got[n].view(torch.int32), want[n].view(torch.int32))
        ]
        if differ:
            raise SystemExit(f"resumed training differs from uninterrupted training: {differ}")
        print(
            f"verified: {half} steps on {first}, save, {args.steps - half} on {second} == "
            f"{args.steps} steps on {first}, bit for bit ({len(want)} logical tensors)"
        )
    print(f"checkpoints in {root}; try: ckptd inspect {root}/run")


if __name__ == "__main__":
    main()
