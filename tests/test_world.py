"""Rank 0's answer on every rank (``ckptd.world.from_rank0``): rank 0 alone computes it; inside
``ckptd.world.alone`` one rank saves and loads by itself while its peers do not take part."""

from __future__ import annotations

import multirank
import torch
import torch.distributed as dist

import ckptd
from ckptd.world import alone, from_rank0, resolve_world


def _calls(rank: int, world: int) -> tuple[object, list[int]]:
    called: list[int] = []

    def compute() -> dict[str, int]:
        called.append(rank)
        return {"from": rank}

    return from_rank0(compute), called


def test_rank_0_computes_and_every_rank_gets_its_answer():
    out = multirank.run(_calls, 3, timeout=120)
    assert out == [({"from": 0}, [0]), ({"from": 0}, []), ({"from": 0}, [])]


def test_without_a_process_group_each_process_computes_its_own():
    assert _calls(5, 8) == ({"from": 5}, [5])


def _rank0_alone(rank: int, world: int, root: str) -> object:
    """Rank 0 saves and loads by itself (as Lightning's checkpoint plugin does) while rank 1
    waits at a barrier: without ``alone`` the first broadcast waits for rank 1 forever."""
    got: object = None
    if rank == 0:
        with alone():
            assert resolve_world(None, None) == (0, 1)
            with ckptd.Checkpointer(root, rank=0, world_size=1, keep_last=1) as ck:
                ck.save({"w": torch.arange(4.0), "note": "rank 0"}, step=3)
            state = {"w": torch.zeros(4), "note": ""}
            with ckptd.Checkpointer(root, rank=0, world_size=1, read_only=True) as ck:
                ck.load(state)
            got = (state["w"].tolist(), state["note"])
    dist.barrier()
    return got


def test_inside_alone_one_rank_of_a_group_saves_and_loads_without_its_peers(tmp_path):
    out = multirank.run(_rank0_alone, 2, str(tmp_path / "root"), timeout=120)
    assert out == [([0.0, 1.0, 2.0, 3.0], "rank 0"), None]
