"""Who writes what in an offline reshard (:mod:`ckptd.elastic.resharder`): each target rank's
boxes, a box several ranks hold written once, and the small dim-0 boxes of a group of ranks
coalesced into one chunk framed at the ranks' boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptd import config
from ckptd.loader.targets import Assignment, Target
from ckptd.regions import Box


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

    With ``group`` > 1, the boxes of a tensor held by consecutive ranks of a group (ranks
    ``[k * group, (k + 1) * group)``) that are each smaller than ``coalesce_below`` and tile a
    run of whole rows along dim 0 are written as one box of at most ``coalesce_max`` bytes by
    its first holder (:func:`coalesce`),
    framed at the ranks' boundaries: a restart still reads exactly its own bytes, and the
    manifest lists one chunk per group instead of one per rank."""
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
    """Merge, in place, the boxes of a tensor that consecutive ranks of a group hold alone and
    that tile whole rows along dim 0 (the same number of rows each, the last run's last box
    possibly fewer; each smaller than ``below`` bytes; at most ``most`` bytes in all): each run
    of two or more becomes one box,
    appended to ``target`` with its first holder, framed at the ranks' boundaries (so a rank's
    box is exactly one frame); the boxes it replaces keep no holder. FSDP2's dim-0 shards at a
    thousand ranks are the case: a chunk per group, not per rank, for every small tensor."""
    runs: dict[tuple[str, int], list[int]] = {}
    for i, (t, rs) in enumerate(zip(target, holders, strict=True)):
        b = t.box
        if (len(rs) == 1 and b.ndim and b.numel and 0 < t.nbytes < below
                and not any(b.offsets[1:]) and b.sizes[1:] == t.shape[1:]):
            runs.setdefault((t.name, rs[0] // group), []).append(i)
    for members in runs.values():
        members.sort(key=lambda i: target[i].box.offsets[0])
        run: list[int] = []
        for i in [*members, -1]:
            if i >= 0 and run:
                first, last = target[run[0]].box, target[run[-1]].box
                if (target[i].box.offsets[0] == last.offsets[0] + last.sizes[0]
                        and last.sizes[0] == first.sizes[0]
                        and target[i].box.sizes[0] <= first.sizes[0]
                        and (len(run) + 1) * target[run[0]].nbytes <= most):
                    run.append(i)
                    continue
            if len(run) > 1:
                t, boxes = target[run[0]], [target[j].box for j in run]
                rows = boxes[-1].offsets[0] + boxes[-1].sizes[0] - boxes[0].offsets[0]
                target.append(Target(t.name, t.shape, t.dtype,
                                     Box(boxes[0].offsets, (rows, *t.shape[1:])), t.nbytes))
                holders.append([min(holders[j][0] for j in run)])
                for j in run:
                    holders[j] = []
            run = [i]
