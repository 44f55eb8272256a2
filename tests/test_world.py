"""Rank 0's answer on every rank (``ckptd.world.from_rank0``): rank 0 alone computes it."""

from __future__ import annotations

import multirank

from ckptd.world import from_rank0


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
