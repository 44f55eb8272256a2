"""Who writes what in an offline reshard (:mod:`ckptd.elastic.resharder`): each target rank's
boxes, a box several ranks hold written once, and the small boxes of a tensor that a group of
ranks holds one after another (row-major) coalesced into a few chunks framed at the ranks'
boundaries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckptd import config
from ckptd.loader.targets import Assignment, Target
from ckptd.regions import Box, flat_run, flat_to_boxes


@dataclass
class RankPlan:
    rank: int
    holds: list[Target]
    writes: list[Target]
    hold_bytes: int = field(init=False)
    write_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.hold_bytes = sum(t.nbytes for t in self.holds)
        self.write_bytes = sum(t.nbytes for t in self.writes)


def split_writers(assignment: Assignment, replicate_small: int,
                  max_share: float | None = None, group: int = 1,
                  coalesce_below: int = 0, coalesce_max: int = 0) -> list[RankPlan]:
    """Who writes what: unique boxes by their holder; replicated ones (the same box on several
    ranks) once, as a save writes them (one chunk, which every holder reads): a small one
    (``replicate_small``) by its first holder, so that a restart opens one more file for all of
    them rather than one per tensor, a larger one by the holder with the fewest bytes so far.
    With ``max_share`` > 0 (``replicate_max_share``, default 0), small ones are written by
    every holder instead while the extra copies stay within ``max_share`` of the distinct bytes
    (smallest first): each rank then reads only its own files. So the bytes written are at most
    ``1 + max_share`` times the checkpoint's.

    With ``group`` > 1, the boxes of a tensor that ranks of a group (ranks
    ``[k * group, (k + 1) * group)``) hold one after another in row-major order, each smaller
    than ``coalesce_below``, are written by the run's first holder as the few boxes of their
    flat range, at most ``coalesce_max`` bytes a run, framed at the ranks' boundaries
    (:func:`coalesce`): a restart still reads its own frames, and the manifest lists a few
    chunks per group instead of one per rank."""
    if max_share is None:
        max_share = config.get().replicate_max_share
    index: dict[tuple[str, Box], int] = {}  # (name, box) -> its number, in assignment order
    target: list[Target] = []
    holders: list[list[int]] = []
    for r, targets in enumerate(assignment.ranks):
        for t in targets:
            i = index.setdefault((t.name, t.box), len(target))
            if i == len(target):
                target.append(t)
                holders.append([r])
            elif holders[i][-1] != r:
                holders[i].append(r)
    if group > 1:
        coalesce(target, holders, group, coalesce_below, coalesce_max)
    writes: list[list[int]] = [[] for _ in assignment.ranks]
    load = [0] * len(assignment.ranks)
    shared = []
    size = [t.nbytes for t in target]
    room = max_share * sum(size)  # bytes of extra copies allowed
    for i in sorted(range(len(target)), key=lambda i: (size[i], target[i].name,
                                                       target[i].box.offsets)):
        rs = holders[i]
        if not rs:  # written as part of a coalesced box
            continue
        extra = (len(rs) - 1) * size[i]
        if len(rs) == 1 or (size[i] <= replicate_small and 0 < extra <= room):
            room -= extra
            for r in rs:
                writes[r].append(i)
                load[r] += size[i]
        elif size[i] <= replicate_small:  # once, by the first holder
            writes[rs[0]].append(i)
            load[rs[0]] += size[i]
        else:
            shared.append(i)
    for i in sorted(shared, key=lambda i: (-size[i], target[i].name, target[i].box.offsets)):
        owner = min(holders[i], key=lambda r: (load[r], r))
        writes[owner].append(i)
        load[owner] += size[i]
    return [RankPlan(r, holds, [target[i] for i in sorted(writes[r])])
            for r, holds in enumerate(assignment.ranks)]


def coalesce(target: list[Target], holders: list[list[int]], group: int, below: int,
             most: int) -> None:
    """Merge, in place, the boxes of a tensor that ranks of one group hold alone, each smaller
    than ``below`` bytes and contiguous in the tensor's row-major order, where they follow one
    another without a gap: each such run of two or more boxes (at most ``most`` bytes) becomes
    the few boxes of its flat range (:func:`ckptd.regions.flat_to_boxes`: whole rows, and a
    part row at either end), appended to ``target`` with the run's first holder and framed so
    that every rank's boundary is a frame's (the gcd of their distances), so a rank reads
    exactly its own frames — unless that gcd would cut more than 4 frames per rank (slices
    that do not line up, as ZeRO-3's): then a frame is as large as the largest slice, and a
    rank reads at most one frame more than its own; the boxes they replace keep no holder.
    FSDP2's dim-0 shards (a frame each) and ZeRO-3's flat slices at a thousand ranks are the
    cases: a few chunks per group and tensor, not one per rank."""
    runs: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # -> (start, stop, index)
    for i, (t, rs) in enumerate(zip(target, holders, strict=True)):
        # (a 0-d tensor has one box: never a run of two)
        flat = flat_run(t.box, Box.whole(t.shape))
        if len(rs) == 1 and flat is not None and 0 < t.nbytes < below:
            runs.setdefault((t.name, rs[0] // group), []).append((*flat, i))
    for members in runs.values():
        members.sort()
        run: list[tuple[int, int, int]] = []
        for m in [*members, None]:
            if m is not None and run and m[0] == run[-1][1] and (
                    (m[1] - run[0][0]) * target[m[2]].nbytes // (m[1] - m[0]) <= most):
                run.append(m)
                continue
            if len(run) > 1:
                _merge(target, holders, run)
            run = [m] if m is not None else []


def _merge(target: list[Target], holders: list[list[int]], run: list[tuple[int, int, int]],
           ) -> None:
    t = target[run[0][2]]
    item = t.nbytes // (run[0][1] - run[0][0])
    start, stop = run[0][0], run[-1][1]
    writer = min(holders[i][0] for _, _, i in run)
    at = start
    for box in flat_to_boxes(t.shape, start, stop):
        end = at + box.numel
        frame, cuts, widest = 0, 0, 0  # every rank boundary inside the box is a frame
        for a, b, _ in run:  # boundary (the last frame may be shorter) ...
            if at < a < end:
                frame, cuts = math.gcd(frame, a - at), cuts + 1
            widest = max(widest, min(b, end) - max(a, at))
        if frame and box.numel // frame > 4 * (cuts + 1):
            frame = widest  # ... unless that takes tiny frames: a frame per rank, over-reading
        target.append(Target(t.name, t.shape, t.dtype, box, (frame or box.numel) * item))
        holders.append([writer])
        at = end
    for _, _, i in run:
        holders[i] = []
