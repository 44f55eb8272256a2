"""The leaves a state tree may hold besides plain tensors and DTensors (:class:`Shard`,
:class:`FlatShard`, :class:`Fused`, :class:`Local`), and what :mod:`ckptd.sharding` turns every
leaf into: :class:`Piece` s, views of local memory tied to boxes of logical tensors in global
coordinates, gathered with a state's values in a :class:`Described`."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from ckptd.hostarray import HostArray
from ckptd.regions import Box

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]


@dataclass
class Shard:
    """``local`` is the n-d box of the logical tensor at ``offsets``.

    ``replica`` is this copy's index among identical copies of the same box; ``replicas`` (how
    many copies exist, when known) lets ckptd spread the writing of replicated boxes across the
    copies instead of always writing copy 0.

    Args:
        local: this rank's box of the tensor (written on save, filled on load).
        global_shape: the logical tensor's full shape.
        offsets: where ``local`` starts in it, per dimension.
        replica: this copy's index among identical copies (0: the first).
        replicas: how many identical copies exist (1: not known; copy 0 writes).

    Example:
        import tempfile
        import torch
        import ckptd

        full = torch.arange(8.0).reshape(4, 2)
        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"w": full}, step=1)
            rows = torch.zeros(2, 2)  # this rank holds rows 2 and 3
            ckpt.load({"w": ckptd.Shard(rows, (4, 2), (2, 0))})
        assert torch.equal(rows, full[2:])
    """

    local: torch.Tensor
    global_shape: Sequence[int]
    offsets: Sequence[int]
    replica: int = 0
    replicas: int = 1


Member = Union[tuple[str, Sequence[int]], tuple[str, Sequence[int], Sequence[int], Sequence[int]]]


@dataclass
class FlatShard:
    """``local`` (1-D) holds elements ``[start, start + local.numel())`` of a flat buffer that is
    the concatenation of ``members``, each flattened row-major, then padding.

    A member is ``(name, global_shape)`` for a whole logical tensor or
    ``(name, global_shape, offsets, sizes)`` for a box of one (a tensor-parallel shard inside a
    ZeRO buffer); a dict ``name -> global_shape`` is accepted for whole tensors. Member names
    are relative to the leaf's container.

    Args:
        local: this rank's 1-D slice of the flat buffer.
        members: the buffer's tensors in order, as above.
        start: the index in the flat buffer of ``local[0]``.
        replica: this copy's index among identical copies (0: the first).
        replicas: how many identical copies exist (1: not known; copy 0 writes).

    Example:
        import tempfile
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"w": torch.ones(2, 2), "b": torch.full((2,), 2.0)}, step=1)
            buffer = torch.zeros(3)  # flat elements 3..5: the last of w, then b
            flat = ckptd.FlatShard(buffer, [("w", (2, 2)), ("b", (2,))], start=3)
            ckpt.load({"buffer": flat})
        assert buffer.tolist() == [1.0, 2.0, 2.0]
    """

    local: torch.Tensor
    members: Sequence[Member] | Mapping[str, Sequence[int]]
    start: int
    replica: int = 0
    replicas: int = 1


@dataclass
class Fused:
    """``local`` is the concatenation along ``dim`` of boxes of several logical tensors;
    ``parts`` are ``(name, global_shape, offsets, sizes)`` in order (fused QKV, gate/up).

    Args:
        local: the concatenated boxes.
        dim: the dimension along which they are concatenated.
        parts: ``(name, global_shape, offsets, sizes)`` of each box, in order; names are
            relative to the leaf's container.
        replica: this copy's index among identical copies (0: the first).
        replicas: how many identical copies exist (1: not known; copy 0 writes).

    Example:
        import tempfile
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"q": torch.ones(2, 3), "k": torch.full((2, 3), 2.0)}, step=1)
            qk = torch.zeros(4, 3)
            parts = [("q", (2, 3), (0, 0), (2, 3)), ("k", (2, 3), (0, 0), (2, 3))]
            ckpt.load({"qk": ckptd.Fused(qk, 0, parts)})
        assert qk[2:].eq(2.0).all()
    """

    local: torch.Tensor
    dim: int
    parts: Sequence[tuple[str, Sequence[int], Sequence[int], Sequence[int]]]
    replica: int = 0
    replicas: int = 1


@dataclass
class Local:
    """A per-rank value (a tensor, or a JSON-able value in which ``bytes`` and tuples may
    appear), saved per rank.

    On load, rank ``r`` receives what rank ``r`` saved: bytes come back as the same bytes (ckptd
    never unpickles them), tuples as tuples. A rank that did not exist in the saved world keeps
    its current value (policy ``"keep"``).

    Args:
        value: this rank's value.

    Example:
        import tempfile
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"rng": ckptd.Local(b"rank-0 state")}, step=1)
            state = {"rng": ckptd.Local(b"")}
            ckpt.load(state)
        assert state["rng"] == ckptd.Local(b"rank-0 state")
    """

    value: Any


LOCAL_PREFIX = "__local__"


def local_name(rank: int, name: str) -> str:
    return f"{LOCAL_PREFIX}/{rank}/{name}"


@dataclass
class Piece:
    """A view of local memory that holds ``box`` of logical tensor ``name``."""

    name: str
    global_shape: Shape
    dtype: torch.dtype | str  # a format dtype name with a HostArray view (ckptd.hostarray)
    box: Box
    view: torch.Tensor | HostArray
    replica: int = 0
    replicas: int = 1
    frame_bytes: int = 0  # the frame size a writer uses for it (0: its framing's)

    @property
    def tensor(self) -> torch.Tensor:
        """``view`` as a tensor: every piece of a save or a load (the offline reshard's are
        HostArrays, and never reach code that asks for this)."""
        if isinstance(self.view, HostArray):
            raise TypeError(f"{self.name}: a HostArray piece where a tensor is needed")
        return self.view

    def writer_copy(self) -> int:
        """Which copy among identical ones writes this piece: a stable hash spreads the work."""
        if self.replicas <= 1:
            return 0
        key = f"{self.name}|{self.box.offsets}|{self.box.sizes}".encode()
        return zlib.crc32(key) % self.replicas

    @property
    def is_writer(self) -> bool:
        return self.replica == self.writer_copy()


@dataclass
class Slot:
    """Where a non-tensor leaf lives, so that a load can replace it in its container."""

    container: dict[Any, Any] | list[Any]
    key: Any


@dataclass
class Described:
    pieces: list[Piece] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, Slot] = field(default_factory=dict)
    # name -> JSON value or tensor; tensors also appear in ``pieces`` under local_name(rank, name)
    locals: dict[str, Any] = field(default_factory=dict)
    local_slots: dict[str, Slot] = field(default_factory=dict)
    # non-empty lists and tuples holding values: path -> (the sequence, its slot in its parent;
    # None when the parent is a tuple or the state itself)
    sequences: dict[str, tuple[list[Any] | tuple[Any, ...], Slot | None]] = field(
        default_factory=dict)

    @property
    def tuples(self) -> frozenset[str]:
        """Paths of the tuples among ``sequences`` (the manifest records them)."""
        return frozenset(p for p, (s, _) in self.sequences.items() if isinstance(s, tuple))

    def tensor_names(self) -> set[str]:
        return {p.name for p in self.pieces}


__all__ = ["LOCAL_PREFIX", "Described", "FlatShard", "Fused", "Local", "Piece", "Shape", "Shard",
           "Slot", "local_name"]
