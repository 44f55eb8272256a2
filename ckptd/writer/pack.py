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


PIECE_ALIGN = 64  # element alignment for every dtype, and a cache line


def pack(
    pieces: list[Piece], files: int, alignment: int, min_file_bytes: int = 1,
    piece_align: int | None = PIECE_ALIGN,
) -> tuple[list[FilePlan], int]:
    """Files (at most ``files``, none below ``min_file_bytes`` unless it is the only one) and
    the arena size they need. Each file starts at an ``alignment`` boundary of the arena and is
    padded to one, so it can be written with O_DIRECT in one call; pieces inside a file are only
    aligned to ``piece_align`` (None: to their item size, the least a dtype view needs), so
    small tensors do not waste a block each."""
    ordered = sorted(pieces, key=lambda p: (p.name, p.box.offsets, p.box.sizes))
    sized = [(p, p.view.numel() * p.view.element_size()) for p in ordered]
    sized = [(p, n) for p, n in sized if n]
    total_raw = sum(n for _, n in sized)
    target = max(1, min_file_bytes, -(-total_raw // max(1, files)))
    plans: list[FilePlan] = []
    current: list[Slot] = []
    start = cursor = 0
    for i, (p, n) in enumerate(sized):
        cursor = _align(cursor, piece_align or p.view.element_size())
        current.append(Slot(p, cursor, n))
        cursor += n
        last = i == len(sized) - 1
        if last or (cursor - start >= target and len(plans) < files - 1):
            end = _align(cursor, alignment)
            plans.append(FilePlan(len(plans), start, end, current))
            current, start, cursor = [], end, end
    return plans, cursor
