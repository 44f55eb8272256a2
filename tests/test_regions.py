"""Properties of the region math and of ``describe`` against dense index arithmetic.

Every property compares with a dense reference: a boolean mask per box over a small global
shape, or ``torch.arange`` values whose positions say which element a view really holds.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.errors import StateMismatch
from ckptd.manifest import find_hole
from ckptd.regions import Box, copy_region, flat_to_boxes
from ckptd.sharding import FlatShard, Fused, Shard, describe

# local settings (a profile would leak into every other module's hypothesis tests)
examples = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@st.composite
def box_in(draw: st.DrawFn, shape: tuple[int, ...], nonempty: bool = False) -> Box:
    offsets, sizes = [], []
    for s in shape:
        o = draw(st.integers(0, s - 1 if nonempty else s))
        offsets.append(o)
        sizes.append(draw(st.integers(1 if nonempty else 0, s - o)))
    return Box(tuple(offsets), tuple(sizes))


@st.composite
def shape_and_boxes(draw: st.DrawFn, n: int, nonempty: bool = False) -> tuple[Any, ...]:
    shape = draw(shapes)
    return (shape, *(draw(box_in(shape, nonempty)) for _ in range(n)))


def mask(shape: tuple[int, ...], box: Box) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.bool)
    m[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))] = True
    return m


# --- Box -----------------------------------------------------------------------------------


@examples
@given(shape_and_boxes(2))
def test_intersect_is_exactly_the_common_elements(sab: tuple[Any, ...]) -> None:
    shape, a, b = sab
    common = mask(shape, a) & mask(shape, b)
    got = a.intersect(b)
    if not bool(common.any()):
        assert got is None
    else:
        assert got is not None
        assert torch.equal(mask(shape, got), common)
        assert b.intersect(a) == got


@examples
@given(shape_and_boxes(2))
def test_subtract_gives_disjoint_boxes_covering_exactly_the_difference(
    sab: tuple[Any, ...],
) -> None:
    shape, a, b = sab
    parts = a.subtract(b)
    assert len(parts) <= 2 * a.ndim
    covered = torch.zeros(shape, dtype=torch.int32)
    for p in parts:
        assert p.numel > 0
        assert a.contains(p)
        covered += mask(shape, p).int()
    assert int(covered.max()) <= 1, "subtract returned overlapping boxes"
    assert torch.equal(covered.bool(), mask(shape, a) & ~mask(shape, b))


@examples
@given(shape_and_boxes(2, nonempty=True))
def test_contains_means_every_element_is_inside(sab: tuple[Any, ...]) -> None:
    shape, a, b = sab
    inside = bool((mask(shape, b) <= mask(shape, a)).all())
    assert a.contains(b) == inside


@examples
@given(shape_and_boxes(2, nonempty=True))
def test_within_indexes_the_box_inside_a_tensor_holding_the_outer_box(
    sab: tuple[Any, ...],
) -> None:
    shape, outer, inner = sab
    inner = outer.intersect(inner)
    if inner is None:
        return
    glob = torch.arange(math.prod(shape)).reshape(shape)
    held = glob[mask_slices(outer)]
    assert torch.equal(held[inner.within(outer)], glob[mask_slices(inner)])


def mask_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))


@examples
@given(shape_and_boxes(1), st.lists(st.integers(0, 3), min_size=3, max_size=3))
def test_shift_and_json_round_trip(sab: tuple[Any, ...], by: list[int]) -> None:
    _, a = sab
    by_t = tuple(by[: a.ndim])
    assert a.shift(by_t).offsets == tuple(o + b for o, b in zip(a.offsets, by_t, strict=True))
    assert a.shift(by_t).sizes == a.sizes
    assert Box.from_json(a.to_json()) == a


@pytest.mark.parametrize(
    "raw", [[[0], [1], [2]], [[0], ["1"]], [[True], [1]], "0,1", [[0, 1], [1]], [[-1], [2]]]
)
def test_box_from_json_rejects_malformed_records(raw: Any) -> None:
    with pytest.raises(ValueError):
        Box.from_json(raw)


# --- flat_to_boxes -------------------------------------------------------------------------


@st.composite
def flat_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    stop = draw(st.integers(start, n))
    return shape, start, stop


@examples
@given(flat_range())
def test_flat_to_boxes_are_contiguous_in_order_and_cover_exactly_the_range(
    r: tuple[tuple[int, ...], int, int],
) -> None:
    shape, start, stop = r
    boxes = flat_to_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    glob = torch.arange(math.prod(shape)).reshape(shape)
    flat: list[int] = []
    for b in boxes:
        assert b.numel > 0
        assert Box.whole(shape).contains(b)
        flat += glob[mask_slices(b)].reshape(-1).tolist()
    assert flat == list(range(start, stop))


@pytest.mark.parametrize("start,stop", [(-1, 2), (3, 2), (0, 25), (25, 25)])
def test_flat_to_boxes_rejects_ranges_outside_the_tensor(start: int, stop: int) -> None:
    with pytest.raises(ValueError, match="outside a tensor of 24 elements"):
        flat_to_boxes((2, 3, 4), start, stop)


# --- copy_region ---------------------------------------------------------------------------


@examples
@given(shape_and_boxes(2, nonempty=True))
def test_copy_region_moves_exactly_the_overlap(sab: tuple[Any, ...]) -> None:
    shape, src_box, dst_box = sab
    region = src_box.intersect(dst_box)
    glob = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    src = glob[mask_slices(src_box)].clone()
    dst = torch.full(dst_box.sizes, -1.0, dtype=torch.float64)
    if region is not None:
        copy_region(region, src, src_box, dst, dst_box)
    want = torch.full(shape, -1.0, dtype=torch.float64)
    if region is not None:
        want[mask_slices(region)] = glob[mask_slices(region)]
    assert torch.equal(dst, want[mask_slices(dst_box)])


# --- describe ------------------------------------------------------------------------------


def global_values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct non-negative values per (tensor, element): base from the name, arange inside."""
    base = 1000 * (sum(map(ord, name)) % 97)
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) + base


@st.composite
def flat_buffer(draw: st.DrawFn) -> tuple[list[tuple[Any, ...]], int, int, int]:
    """Members (whole or boxes), padding length, and the local slice [lo, hi) of the buffer."""
    members: list[tuple[Any, ...]] = []
    for i in range(draw(st.integers(1, 4))):
        shape = draw(shapes)
        if draw(st.booleans()):
            members.append((f"m{i}", shape))
        else:
            b = draw(box_in(shape, nonempty=True))
            members.append((f"m{i}", shape, b.offsets, b.sizes))
    total = sum(math.prod(m[3]) if len(m) == 4 else math.prod(m[1]) for m in members)
    padding = draw(st.integers(0, 7))
    lo = draw(st.integers(0, total + padding))
    hi = draw(st.integers(lo, total + padding))
    return members, padding, lo, hi


def member_box(m: tuple[Any, ...]) -> Box:
    return Box(tuple(m[2]), tuple(m[3])) if len(m) == 4 else Box.whole(tuple(m[1]))


@examples
@given(flat_buffer())
def test_flat_shard_pieces_cover_exactly_the_members_elements_in_its_range(
    fb: tuple[list[tuple[Any, ...]], int, int, int],
) -> None:
    members, padding, lo, hi = fb
    chunks = [global_values(m[0], m[1])[mask_slices(member_box(m))].reshape(-1) for m in members]
    buffer = torch.cat([*chunks, torch.full((padding,), -1.0, dtype=torch.float64)])
    local = buffer[lo:hi].clone()
    state = {"optim": {"exp_avg": {"flat": FlatShard(local, members, lo)}}}
    pieces = describe(state, 0, 1).pieces

    # dense expectation: which elements of which member the buffer positions [lo, hi) hold
    want = {m[0]: torch.zeros(m[1], dtype=torch.bool) for m in members}
    cursor = 0
    for m in members:
        b = member_box(m)
        pos = torch.arange(cursor, cursor + b.numel).reshape(b.sizes)
        want[m[0]][mask_slices(b)] = (pos >= lo) & (pos < hi)
        cursor += b.numel
    got = {m[0]: torch.zeros(m[1], dtype=torch.int32) for m in members}
    viewed = 0
    for p in pieces:
        short = p.name.removeprefix("optim/exp_avg/")
        assert p.name == f"optim/exp_avg/{short}", "member names are relative to the container"
        shape = next(tuple(m[1]) for m in members if m[0] == short)
        assert p.global_shape == shape
        assert torch.equal(p.view, global_values(short, shape)[mask_slices(p.box)])
        assert p.view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        got[short][mask_slices(p.box)] += 1
        viewed += p.box.numel
    for name in want:
        assert torch.equal(got[name] == 1, want[name]), f"{name}: covered {got[name]}"
        assert int(got[name].max()) <= 1
    data_in_range = sum(int(w.sum()) for w in want.values())
    assert viewed == data_in_range, "padding (or a double count) produced a piece"


def test_flat_shard_entirely_in_padding_yields_no_piece() -> None:
    local = torch.zeros(4)
    state = {"flat": FlatShard(local, [("w", (2, 3))], start=6)}
    assert describe(state, 0, 1).pieces == []


def test_flat_shard_members_as_dict_mean_whole_tensors() -> None:
    local = torch.arange(10.0)
    state = {"m": {"flat": FlatShard(local, {"a": (2, 2), "b": (3,)}, start=0)}}
    pieces = {p.name: p for p in describe(state, 0, 1).pieces}
    assert sorted(pieces) == ["m/a", "m/b"]
    assert torch.equal(pieces["m/a"].view, torch.arange(4.0).reshape(2, 2))
    assert torch.equal(pieces["m/b"].view, torch.arange(4.0, 7.0))


def test_writing_through_flat_pieces_fills_the_local_buffer_in_place() -> None:
    local = torch.full((9,), -1.0)
    state = {"flat": FlatShard(local, [("w", (2, 3))], start=2)}
    for p in describe(state, 0, 1).pieces:
        p.view.copy_(global_values("w", (2, 3))[mask_slices(p.box)])
    want = global_values("w", (2, 3)).reshape(-1)[2:].float()
    assert torch.equal(local[:4], want)
    assert torch.equal(local[4:], torch.full((5,), -1.0)), "padding changed"


@st.composite
def fused_parts(draw: st.DrawFn) -> tuple[int, list[tuple[str, tuple[int, ...], Box]]]:
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    other = [draw(st.integers(1, 4)) for _ in range(ndim)]
    parts = []
    for i in range(draw(st.integers(1, 3))):
        shape = list(other)
        shape[dim] = draw(st.integers(1, 6))
        shape_t = tuple(shape)
        b = draw(box_in(shape_t, nonempty=True))
        # every part's box spans the same extent in the non-fused dims
        b = Box(
            tuple(o if d == dim else 0 for d, o in enumerate(b.offsets)),
            tuple(s if d == dim else other[d] for d, s in enumerate(b.sizes)),
        )
        parts.append((f"p{i}", shape_t, b))
    return dim, parts


@examples
@given(fused_parts())
def test_fused_pieces_are_the_parts_concatenated_along_dim(
    fp: tuple[int, list[tuple[str, tuple[int, ...], Box]]],
) -> None:
    dim, parts = fp
    local = torch.cat([global_values(n, s)[mask_slices(b)] for n, s, b in parts], dim=dim)
    leaf = Fused(local, dim, [(n, s, b.offsets, b.sizes) for n, s, b in parts])
    pieces = describe({"model": {"fused": leaf}}, 0, 1).pieces
    assert [p.name for p in pieces] == [f"model/{n}" for n, _, _ in parts]
    for p, (n, s, b) in zip(pieces, parts, strict=True):
        assert p.box == b and p.global_shape == s
        assert torch.equal(p.view, global_values(n, s)[mask_slices(b)])
        assert p.view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


@examples
@given(shape_and_boxes(1, nonempty=True), st.integers(0, 3), st.integers(1, 4))
def test_shard_piece_is_its_box_with_its_replica(
    sab: tuple[Any, ...], replica: int, extra: int
) -> None:
    shape, b = sab
    local = global_values("w", shape)[mask_slices(b)]
    replicas = replica + extra
    (p,) = describe({"w": Shard(local, shape, b.offsets, replica, replicas)}, 0, 1).pieces
    assert (p.name, p.global_shape, p.box, p.replica, p.replicas) == (
        "w",
        shape,
        b,
        replica,
        replicas,
    )
    assert p.view is local or torch.equal(p.view, local)


@examples
@given(st.integers(1, 8), st.data())
def test_plain_tensor_is_replicated_and_exactly_one_rank_writes_it(
    world: int, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(["w", "model/x", "optim/exp_avg/layers.0.w"]))
    writers = []
    for rank in range(world):
        (p,) = describe({"a": {name: torch.zeros(2)}}, rank, world).pieces
        assert (p.replica, p.replicas) == (rank, world)
        writers.append(p.is_writer)
    assert sum(writers) == 1


@pytest.mark.parametrize(
    "leaf,message",
    [
        (Shard(torch.zeros(2, 2), (3, 3), (2, 0)), "exceeds global shape"),
        (FlatShard(torch.zeros(2, 2), [("w", (4,))], 0), "must be 1-D"),
        (Fused(torch.zeros(5, 2), 0, [("a", (2, 2), (0, 0), (2, 2))]), "parts cover 2 of 5"),
    ],
)
def test_describe_rejects_leaves_inconsistent_with_their_boxes(leaf: Any, message: str) -> None:
    with pytest.raises(StateMismatch, match=message):
        describe({"x": leaf}, 0, 1)


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A grid tiling of a shape (what saves write), then some of its tiles dropped and some
    arbitrary boxes added (holes, and replicas that overlap the tiles in part)."""
    shape = draw(shapes)
    cuts = [sorted(set(draw(st.lists(st.integers(1, max(1, s - 1)), max_size=2))) - {s})
            for s in shape]
    edges = [[0, *c, s] for c, s in zip(cuts, shape, strict=True)]
    boxes = [Box(tuple(e[i] for e, i in zip(edges, idx, strict=True)),
                 tuple(e[i + 1] - e[i] for e, i in zip(edges, idx, strict=True)))
             for idx in itertools.product(*(range(len(e) - 1) for e in edges))]
    boxes = [b for b in boxes if b.numel]
    drop = draw(st.lists(st.integers(0, len(boxes) - 1), max_size=2))
    extra = draw(st.lists(box_in(shape), max_size=2))
    return shape, [b for i, b in enumerate(boxes) if i not in drop] + extra


@given(tilings())
@examples
def test_find_hole_names_uncovered_elements_exactly_when_there_are_some(
    case: tuple[tuple[int, ...], list[Box]],
) -> None:
    shape, boxes = case
    covered = torch.zeros(shape, dtype=torch.bool)
    for b in boxes:
        covered |= mask(shape, b)
    hole = find_hole(Box.whole(shape), boxes)
    if bool(covered.all()):
        assert hole is None
    else:
        assert hole is not None and hole.numel > 0
        assert not mask(shape, hole)[covered].any()  # none of the hole is covered
