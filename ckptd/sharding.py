"""Leaves of the state tree and how each becomes *pieces*: views of local memory tied to boxes
of logical tensors in global coordinates.

Every leaf kind of the public contract reduces to :class:`Piece` s:

- a plain ``torch.Tensor``: the whole logical tensor, replicated on every rank;
- a ``DTensor``: the box its mesh coordinate and placements select (``Shard(d)`` with torch's
  uneven ``chunk`` split, ``Replicate``; several mesh dims may shard one tensor dim);
- :class:`Shard`: an n-d box at given offsets;
- :class:`FlatShard`: a slice of a padded ZeRO-style flat buffer; each member it overlaps yields
  the boxes of :func:`ckptd.regions.flat_to_boxes` (padding yields nothing);
- :class:`Fused`: boxes of several logical tensors concatenated along one dimension.

Names of a ``FlatShard``'s members and a ``Fused`` 's parts are relative to the container that
holds the leaf: the leaf stands in for its members, whose names are siblings of its key.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptd.errors import StateMismatch
from ckptd.leaves import (
    LOCAL_PREFIX,
    Described,
    FlatShard,
    Fused,
    Local,
    Piece,
    Shape,
    Shard,
    Slot,
    local_name,
)
from ckptd.regions import Box, flat_to_boxes

if TYPE_CHECKING:
    pass

def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _is_dtensor(x: object) -> bool:
    # No DTensor can exist before its module is imported; importing it here would add ~1 s to
    # the first save's stall.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def _is_json_scalar(x: object) -> bool:
    return x is None or isinstance(x, (bool, int, float, str, bytes))


def _sequences(tree: Any, prefix: str, slot: Slot | None, out: Described) -> None:
    """Record the non-empty lists and tuples under ``tree`` that hold no tensor or leaf (their
    elements are values), with where each sits, so a load can give tuples back."""
    import torch

    if isinstance(tree, Mapping):
        for k, v in tree.items():
            _sequences(v, _join(prefix, str(k)),
                       Slot(tree, k) if isinstance(tree, dict) else None, out)
    elif isinstance(tree, (list, tuple)) and tree:
        if prefix and not any(isinstance(v, (torch.Tensor, Local, Shard, FlatShard, Fused))
                              or _is_dtensor(v) for v in tree):
            out.sequences[prefix] = (tree, slot)
        for i, v in enumerate(tree):
            _sequences(v, _join(prefix, str(i)),
                       Slot(tree, i) if isinstance(tree, list) else None, out)


def walk(
    tree: Any, prefix: str = ""
) -> Iterator[tuple[str, Any, dict[Any, Any] | list[Any] | None, Any]]:
    """Yield ``(path, leaf, container, key)`` for every leaf; empty containers are leaves."""
    items: Iterator[tuple[Any, Any]]
    if isinstance(tree, Mapping):
        items = iter(tree.items())
    elif isinstance(tree, (list, tuple)):
        items = iter(enumerate(tree))
    else:
        raise TypeError("walk() needs a dict or list at the top")
    for key, value in items:
        path = _join(prefix, str(key))
        if isinstance(value, (Mapping, list, tuple)) and len(value) > 0:
            yield from walk(value, path)
        else:
            container = tree if isinstance(tree, (dict, list)) else None
            yield path, value, container, key


def describe(state: Any, rank: int, world_size: int) -> Described:
    """Turn a state tree into pieces, JSON values and per-rank values."""
    import torch

    out = Described()
    for path, leaf, container, key in walk(state):
        parent = path.rpartition("/")[0]
        slot = Slot(container, key) if container is not None else None
        if isinstance(leaf, Local):
            if isinstance(leaf.value, torch.Tensor):
                t = leaf.value
                out.pieces.append(
                    Piece(
                        local_name(rank, path),
                        tuple(t.shape),
                        t.dtype,
                        Box.whole(tuple(t.shape)),
                        t,
                    )
                )
            else:
                _check_json(path, leaf.value, local=True)
            out.locals[path] = leaf.value
            if slot is not None:
                out.local_slots[path] = slot
        elif _is_dtensor(leaf):
            out.pieces.append(_dtensor_piece(path, leaf))
        elif isinstance(leaf, torch.Tensor):
            out.pieces.append(
                Piece(
                    path,
                    tuple(leaf.shape),
                    leaf.dtype,
                    Box.whole(tuple(leaf.shape)),
                    leaf,
                    replica=rank,
                    replicas=world_size,
                )
            )
        elif isinstance(leaf, Shard):
            out.pieces.append(_shard_piece(path, leaf))
        elif isinstance(leaf, FlatShard):
            out.pieces.extend(_flat_pieces(parent, path, leaf))
        elif isinstance(leaf, Fused):
            out.pieces.extend(_fused_pieces(parent, path, leaf))
        else:
            _check_json(path, leaf)
            out.values[path] = leaf
            if slot is not None:
                out.slots[path] = slot
    _check_unique(out.pieces)
    if out.values:
        _sequences(state, "", None, out)
    return out


def put_values(described: Described, values: Mapping[str, Any], saved_tuples: Iterable[str],
               ) -> None:
    """Replace the state's values by the saved ``values``. Tuples hold values too: a tuple of
    the state gets the saved elements (a new tuple of its type in its parent), and a list that
    was saved as a tuple (``saved_tuples``) becomes one."""
    for key, slot in described.slots.items():
        if key in values:
            slot.container[slot.key] = values[key]
    saved = frozenset(saved_tuples)
    rebuilt: dict[str, Any] = {}  # tuples inside tuples: built first, put in by their parent
    for path in sorted(described.sequences, key=lambda p: p.count("/"), reverse=True):
        seq, where = described.sequences[path]
        if isinstance(seq, list) and path not in saved:
            continue  # filled in place through the slots
        items = [rebuilt.get(f"{path}/{i}", values.get(f"{path}/{i}", x))
                 for i, x in enumerate(seq)]
        new = type(seq)(*items) if hasattr(seq, "_fields") else tuple(items)  # a namedtuple
        if where is not None:
            where.container[where.key] = new
        else:
            rebuilt[path] = new


def _check_json(path: str, value: Any, local: bool = False) -> None:
    if _is_json_scalar(value):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(f"{path}/{i}", v, local)
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise StateMismatch(f"{path}: dict key {k!r} is not a string; not JSON-able")
            _check_json(f"{path}/{k}", v, local)
        return
    if local:
        raise StateMismatch(
            f"{path}: a {type(value).__name__} inside ckptd.Local is neither a tensor, bytes "
            "nor JSON-able; convert it (to a dict of numbers, or to bytes you decode yourself)"
        )
    raise StateMismatch(
        f"{path}: a {type(value).__name__} is neither a tensor, a ckptd leaf, bytes nor "
        "JSON-able; convert it (to a dict of numbers, or to bytes you decode yourself), and "
        "wrap a value that differs by rank in ckptd.Local"
    )


def _check_unique(pieces: list[Piece]) -> None:
    """Two leaves of one rank must not claim overlapping parts of one logical tensor."""
    by_name: dict[str, list[Piece]] = {}
    for p in pieces:
        by_name.setdefault(p.name, []).append(p)
    for name, ps in by_name.items():
        shapes = {p.global_shape for p in ps}
        dtypes = {p.dtype for p in ps}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise StateMismatch(
                f"{name}: described with different global shapes {sorted(shapes)} or dtypes "
                f"{sorted(map(str, dtypes))} by leaves of the same rank"
            )


def _tuple(name: str, what: str, seq: Sequence[int]) -> Shape:
    try:
        return tuple(map(int, seq))
    except TypeError as e:
        raise StateMismatch(f"{name}: {what} must be a sequence of ints, got {seq!r}") from e


# The boxes _checked_box validated, by its exact inputs (a Box is immutable): a state saved every
# few steps describes the same boxes each time. Bounded, emptied when full, at ~2 MB: a small
# state's are the ones worth keeping (its describe is the save's fixed cost); a large state's
# would hold tens of MB in every process for microseconds a leaf.
_BOXES: dict[tuple[Shape, Shape, Shape], Box] = {}
_BOXES_MAX = 1 << 12


def _checked_box(name: str, global_shape: Shape, offsets: Shape, sizes: Shape) -> Box:
    key = (global_shape, offsets, sizes)
    box = _BOXES.get(key)
    if box is None:
        box = _new_box(name, global_shape, offsets, sizes)
        if len(_BOXES) >= _BOXES_MAX:
            _BOXES.clear()
        _BOXES[key] = box
    return box


def _new_box(name: str, global_shape: Shape, offsets: Shape, sizes: Shape) -> Box:
    if not (len(global_shape) == len(offsets) == len(sizes)):
        raise StateMismatch(
            f"{name}: rank mismatch: global shape {global_shape}, offsets {offsets}, sizes {sizes}"
        )
    box = Box(offsets, sizes)
    if not Box.whole(global_shape).contains(box):
        raise StateMismatch(
            f"{name}: box at offsets {offsets} of sizes {sizes} exceeds global shape {global_shape}"
        )
    return box


def _shard_piece(path: str, leaf: Shard) -> Piece:
    gshape = _tuple(path, "global_shape", leaf.global_shape)
    offsets = _tuple(path, "offsets", leaf.offsets)
    box = _checked_box(path, gshape, offsets, tuple(leaf.local.shape))
    return Piece(path, gshape, leaf.local.dtype, box, leaf.local, leaf.replica, leaf.replicas)


def _member_list(path: str, members: Any) -> list[tuple[str, Shape, Box]]:
    items: list[Any]
    if isinstance(members, Mapping):
        items = [(k, v) for k, v in members.items()]
    else:
        items = list(members)
    out = []
    for m in items:
        if len(m) == 2:
            name, gshape = m[0], _tuple(path, "member shape", m[1])
            box = Box.whole(gshape)
        elif len(m) == 4:
            name, gshape = m[0], _tuple(path, "member shape", m[1])
            box = _checked_box(
                f"{path}:{m[0]}", gshape, _tuple(path, "offsets", m[2]), _tuple(path, "sizes", m[3])
            )
        else:
            raise StateMismatch(
                f"{path}: a member is (name, global_shape) or (name, global_shape, offsets, "
                f"sizes), got {m!r}"
            )
        out.append((str(name), gshape, box))
    return out


def _flat_pieces(parent: str, path: str, leaf: FlatShard) -> list[Piece]:
    local = leaf.local
    if local.dim() != 1:
        raise StateMismatch(f"{path}: FlatShard.local must be 1-D, got shape {tuple(local.shape)}")
    lo, hi = leaf.start, leaf.start + local.numel()
    if lo < 0:
        raise StateMismatch(f"{path}: FlatShard.start must be >= 0, got {lo}")
    pieces = []
    cursor = 0
    for name, gshape, mbox in _member_list(path, leaf.members):
        m_lo, m_hi = cursor, cursor + mbox.numel
        cursor = m_hi
        a, b = max(lo, m_lo), min(hi, m_hi)
        if a >= b:
            continue
        offset_in_local = a - lo
        for bx in flat_to_boxes(mbox.sizes, a - m_lo, b - m_lo):
            n = bx.numel
            view = local[offset_in_local : offset_in_local + n].view(bx.sizes)
            offset_in_local += n
            pieces.append(
                Piece(
                    _join(parent, name),
                    gshape,
                    local.dtype,
                    bx.shift(mbox.offsets),
                    view,
                    leaf.replica,
                    leaf.replicas,
                )
            )
    return pieces


def _fused_pieces(parent: str, path: str, leaf: Fused) -> list[Piece]:
    local, dim = leaf.local, leaf.dim
    if not -local.dim() <= dim < local.dim():
        raise StateMismatch(f"{path}: Fused.dim {dim} out of range for a {local.dim()}-d tensor")
    dim %= local.dim()
    pieces, cursor = [], 0
    for part in leaf.parts:
        if len(part) != 4:
            raise StateMismatch(
                f"{path}: a part is (name, global_shape, offsets, sizes), got {part!r}"
            )
        name = f"{parent}/{part[0]}" if parent else str(part[0])
        gshape = _tuple(name, "global_shape", part[1])
        box = _checked_box(
            name, gshape, _tuple(name, "offsets", part[2]), _tuple(name, "sizes", part[3])
        )
        view = local.narrow(dim, cursor, box.sizes[dim])
        if tuple(view.shape) != box.sizes:
            raise StateMismatch(
                f"{name}: part sizes {box.sizes} do not match the fused tensor's slice "
                f"{tuple(view.shape)} along dim {dim}"
            )
        cursor += box.sizes[dim]
        pieces.append(Piece(name, gshape, local.dtype, box, view, leaf.replica, leaf.replicas))
    if cursor != local.shape[dim]:
        raise StateMismatch(
            f"{path}: parts cover {cursor} of {local.shape[dim]} along dim {dim} "
            "of the fused tensor"
        )
    return pieces


def _dtensor_piece(path: str, dt: Any) -> Piece:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    gshape = tuple(dt.shape)
    local = dt.to_local()
    if coord is None:  # this rank is not part of the mesh: it holds nothing
        return Piece(
            path, gshape, dt.dtype, Box((0,) * len(gshape), (0,) * len(gshape)), local, 0, 1
        )
    offsets = [0] * len(gshape)
    sizes = list(gshape)
    replica, replicas = 0, 1
    for mesh_dim, placement in enumerate(dt.placements):
        n, c = mesh.size(mesh_dim), coord[mesh_dim]
        if isinstance(placement, DShard):
            d = placement.dim % len(gshape)
            chunk = math.ceil(sizes[d] / n) if sizes[d] else 0
            start = min(c * chunk, sizes[d])
            size = max(0, min(chunk, sizes[d] - start))
            offsets[d] += start
            sizes[d] = size
        elif isinstance(placement, Replicate):
            replica += c * replicas
            replicas *= n
        else:
            raise StateMismatch(
                f"{path}: DTensor placement {placement} cannot be saved; reduce it first "
                "(Partial values are not a checkpointable state)"
            )
    box = Box(tuple(offsets), tuple(sizes))
    if tuple(local.shape) != box.sizes:
        raise StateMismatch(
            f"{path}: DTensor local shape {tuple(local.shape)} does not match the box {box.sizes} "
            f"its placements {dt.placements} imply"
        )
    return Piece(path, gshape, dt.dtype, box, local, replica, replicas)


__all__ = [
    # the leaves and pieces (ckptd.leaves), named here too: what a state describes to
    "LOCAL_PREFIX", "Described", "FlatShard", "Fused", "Local", "Piece", "Shape", "Shard", "Slot",
    "describe", "local_name", "put_values", "walk",
]
