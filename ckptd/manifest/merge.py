"""Merging the partial manifests of one save attempt into the step's manifest.

Runs in the coordinator, in the background, with no collectives: the partials on storage are the
only input. A partial lists the chunks its rank wrote; the tensors it holds that a replica
wrote it sums up per replica set (how many, a digest of their names, and which of them it
wrote: version 2) or names (version 1); so merging costs what the ranks wrote plus a few
entries per rank, not ranks × tensors. Checks that the ranks that wrote a tensor agree on its
dtype and global shape, that every tensor a rank holds was written (by a member of its replica
set), and that every element is covered by at least one chunk (a hole names the tensor and the
missing box).
Chunks with identical boxes are kept once (the lowest rank's); partially overlapping chunks are
all kept (``ckptd verify`` checks that the copies agree).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptd.errors import CorruptCheckpoint, StateMismatch
from ckptd.manifest.schema import Chunk, Manifest, TensorEntry
from ckptd.regions import Box


def merge(partials: Sequence[Manifest], *, keep_copies: bool = False) -> Manifest:
    """The step's manifest from every rank's partial (one per rank of the saving world).
    ``keep_copies``: keep every rank's chunk of a box several ranks wrote (an offline reshard
    writes a small replicated box into each target rank's files, to be read from there), not
    only the first."""
    if not partials:
        raise CorruptCheckpoint("no partial manifests to merge")
    first = partials[0]
    ranks = sorted(p.rank for p in partials if p.rank is not None)
    if ranks != list(range(first.world_size)):
        raise CorruptCheckpoint(
            f"attempt {first.attempt}: partials of ranks {ranks}, "
            f"expected 0..{first.world_size - 1}"
        )
    for p in partials:
        if (p.attempt, p.step, p.world_size) != (first.attempt, first.step, first.world_size):
            raise CorruptCheckpoint(
                f"partial of rank {p.rank} belongs to attempt {p.attempt} step {p.step} world "
                f"{p.world_size}, not attempt {first.attempt} step {first.step} world "
                f"{first.world_size}"
            )
    tensors: dict[str, TensorEntry] = {}
    chunks: dict[str, list[Chunk]] = {}
    seen: dict[str, set[Box]] = {}
    for p in sorted(partials, key=lambda p: p.rank or 0):
        for name, entry in p.tensors.items():
            known = tensors.get(name)
            if known is None:
                tensors[name] = TensorEntry(entry.dtype_name, entry.shape)
                chunks[name], seen[name] = [], set()
            elif (known.dtype_name, known.shape) != (entry.dtype_name, entry.shape):
                raise StateMismatch(
                    f"{name}: rank {p.rank} saves dtype {entry.dtype_name} shape {entry.shape}, an "
                    f"earlier rank {known.dtype_name} shape {known.shape}"
                )
            for c in entry.chunks:
                if keep_copies or c.box not in seen[name]:
                    seen[name].add(c.box)
                    chunks[name].append(c)
    for p in partials:
        unwritten = [n for n in p.holds if n not in tensors]
        if unwritten:
            raise StateMismatch(
                f"{unwritten[0]}: held by rank {p.rank} but saved by no rank (check the leaves' "
                "replica/replicas)"
            )
    _check_replica_sets(partials)
    for name, entry in tensors.items():
        hole = find_hole(Box.whole(entry.shape), [c.box for c in chunks[name]])
        if hole is not None:
            raise StateMismatch(
                f"{name}: elements at offsets {list(hole.offsets)} sizes {list(hole.sizes)} of "
                f"shape {list(entry.shape)} are saved by no rank (check the leaves' offsets and "
                "replica/replicas)"
            )
        tensors[name] = TensorEntry(entry.dtype_name, entry.shape, tuple(chunks[name]))
    locals_: dict[str, dict[str, object]] = {}
    for p in partials:
        locals_.update(p.locals)
    return Manifest(
        step=first.step,
        attempt=first.attempt,
        world_size=first.world_size,
        created=max(p.created for p in partials),
        tensors=tensors,
        values=next((p.values for p in partials if p.rank == 0), {}),
        locals=locals_,
        training=next((p.training for p in partials if p.rank == 0), {}),
        tuples=next((p.tuples for p in partials if p.rank == 0), frozenset()),
    )


def _check_replica_sets(partials: Sequence[Manifest]) -> None:
    """Every tensor of a replica set was written by one of the set's members: the union of
    what they wrote has as many names as the set (each wrote only names of the set). Ranks
    whose partials are of version 1 (a root written mid-upgrade) say nothing of their sets:
    what they wrote counts towards every set, a weaker check for that attempt alone."""
    old: set[str] = set()
    for p in partials:
        if p.partial < 2:
            old.update(p.tensors)
    wrote: dict[tuple[int, int, str], set[str]] = {}
    members: dict[tuple[int, int, str], list[int]] = {}
    for p in partials:
        for s in p.replicated:
            wrote.setdefault(s.key, set()).update(s.wrote)
            members.setdefault(s.key, []).append(p.rank or 0)
    for key, names in wrote.items():
        replicas, count, _ = key
        if len(names) == count or (old and len(names | old) >= count):
            continue
        ranks = sorted(members[key])
        shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        if len(names) > count:  # the digest matched, the names did not: not a ckptd partial
            raise CorruptCheckpoint(f"ranks {shown} wrote {len(names)} tensors of a replica "
                                    f"set of {count}")
        raise StateMismatch(
            f"{count - len(names)} of the {count} tensors that ranks {shown} hold with "
            f"replicas={replicas} were saved by no rank (check the leaves' replica/replicas)")


def find_hole(whole: Box, boxes: Sequence[Box]) -> Box | None:
    """A box of ``whole`` that none of ``boxes`` (each inside ``whole``) covers, or None when
    they cover it all.

    Saves almost always tile their tensors: then the boxes are disjoint and their sizes add up,
    which :func:`_tiles` proves by one sort and a sweep. Otherwise (a hole, or replicas that
    overlap in part) the boxes are subtracted from the whole, largest first."""
    if _tiles(whole, boxes):
        return None
    remaining = [whole] if whole.numel else []
    for b in sorted(boxes, key=lambda b: -b.numel):
        if not remaining:
            break
        nxt: list[Box] = []
        for r in remaining:
            nxt.extend(r.subtract(b))
        remaining = nxt
    return remaining[0] if remaining else None


def _tiles(whole: Box, boxes: Sequence[Box]) -> bool:
    """True when ``boxes`` are pairwise disjoint and their elements add up to ``whole``'s: then,
    lying inside it, they cover it exactly. Sorted by their start in dimension 0, a box can only
    meet the boxes still open at that start; O(n log n) for the boxes of sharded tensors."""
    if sum(b.numel for b in boxes) != whole.numel:
        return False
    if whole.ndim == 0:
        return True
    spans = sorted(((b.offsets, b.ends) for b in boxes if b.numel), key=lambda s: s[0][0])
    open_: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for lo, hi in spans:
        open_ = [o for o in open_ if o[1][0] > lo[0]]
        for olo, ohi in open_:
            if all(a < d and c < b for a, b, c, d in zip(olo, ohi, lo, hi, strict=True)):
                return False
        open_.append((lo, hi))
    return True
