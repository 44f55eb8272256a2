"""Packing: where each piece goes in which data file.

A rank's writer pieces are laid out back to back (each aligned to the tunable file alignment) in
one arena; the arena is then cut, at piece boundaries, into up to ``files`` contiguous ranges of
similar size, one data file each, written in parallel. Order is deterministic (by name, then box)
so that a rank's pieces of one tensor stay adjacent.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.sharding import Piece


@dataclass
class Slot:
    piece: Piece
    offset: int  # in the arena
    nbytes: int


@dataclass
class FilePlan:
    index: int
    start: int  # arena range [start, end)
    end: int
    slots: list[Slot]


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def pack(pieces: list[Piece], files: int, alignment: int) -> tuple[list[FilePlan], int]:
    """Files and the arena size they need."""
    ordered = sorted(pieces, key=lambda p: (p.name, p.box.offsets, p.box.sizes))
    slots, cursor = [], 0
    for p in ordered:
        n = p.view.numel() * p.view.element_size()
        if n == 0:
            continue
        cursor = _align(cursor, alignment)
        slots.append(Slot(p, cursor, n))
        cursor += n
    total = _align(cursor, alignment)
    plans: list[FilePlan] = []
    target = max(1, -(-total // max(1, files)))
    current: list[Slot] = []
    start = 0
    for s in slots:
        current.append(s)
        end = _align(s.offset + s.nbytes, alignment)
        if end - start >= target and len(plans) < files - 1:
            plans.append(FilePlan(len(plans), start, end, current))
            current, start = [], end
    if current:
        plans.append(FilePlan(len(plans), start, _align(current[-1].offset + current[-1].nbytes, alignment), current))
    return plans, total
