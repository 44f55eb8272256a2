"""A small transformer's training state, and how each parallel layout holds it.

The single-process :func:`reference` holds every logical tensor whole:
``model/<fqn>``, ``optim/exp_avg/<fqn>`` and ``optim/exp_avg_sq/<fqn>`` for every parameter
``<fqn>`` of a 2-layer decoder (vocab 13, hidden 8, 2 heads, ffn 20). :func:`build_state` gives
one rank's state tree under a :class:`Layout` (data-, tensor-, pipeline-parallel sizes and ZeRO
stage), using every leaf kind the way real trainers hold their tensors:

- vocab-parallel embedding / LM head: a padded local tensor (vocab padded to a multiple of
  ``VOCAB_DIVISIBLE_BY * tp``) whose valid rows are a ``Shard``; padding rows are not logical;
- fused QKV and gate/up: ``Fused`` along dim 0, each part split by heads / ffn rows under TP;
- attention out and down projection: row-parallel ``Shard`` (dim 1);
- norms: replicated across TP (and DP): a plain tensor where every rank holds it, otherwise a
  ``Shard`` with ``replica`` / ``replicas`` so that exactly one copy is written;
- ZeRO-1: the Adam state in padded flat buffers (``FlatShard``) split across DP; ZeRO-3: the
  parameters too. Under TP each TP rank's buffer holds its TP boxes *and* the whole norms, so a
  norm sits at different offsets in each TP rank's buffer and the DP split cuts it differently;
- DTensor layouts: every tensor a DTensor on a (dp, tp) mesh, some split unevenly, some sharded
  on both mesh dims (needs an initialised process group: only inside ``multirank.run``);
- ``Local``: an RNG-state-like uint8 tensor and a JSON dict per rank; JSON ``step`` values.

:func:`build_state` returns the tree and the *buffers*: every local tensor whole, padding
included, so a test can check that a load left the padding alone.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.regions import Box
from ckptd.sharding import FlatShard, Fused, Local, Shard

VOCAB, HIDDEN, HEADS, LAYERS, FFN = 13, 8, 2, 2, 20
VOCAB_DIVISIBLE_BY = 4  # vocab padded to a multiple of this times tp (Megatron's rule)
STEP, OPTIM_STEP = 7, 6
SOURCE_PADDING = 777.0  # padding of a state that is saved: must never reach a checkpoint
SENTINEL = float("nan")  # every element of a destination before a load
PREFIXES = ("model", "optim/exp_avg", "optim/exp_avg_sq")


@dataclass(frozen=True)
class Layout:
    """How ranks hold the state. Rank order: tp fastest, then dp, then pp (Megatron's)."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # 0: all replicated over DP; 1: Adam state in flat shards; 3: params too
    buckets: int = 1  # flat buffers per pipeline stage (ZeRO only)
    dict_members: bool = False  # FlatShard members as a {name: shape} dict (needs tp == 1)
    dtensor: bool = False  # every tensor a DTensor on a (dp, tp) mesh; needs a process group
    flat_align: int = 16  # each DP shard of a flat buffer is a multiple of this many elements
    col_major: bool = False  # 2-d weights stored transposed (GPT-2 Conv1D style): leaves are
    # non-contiguous views, so saving stages and loading copies through strided views

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of ``rank``."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp


# Adding a layout is one line.
LAYOUTS: dict[str, Layout] = {
    lay.name: lay
    for lay in [
        Layout("single"),
        Layout("dp2", dp=2),
        Layout("dp2_zero1", dp=2, zero=1),
        # flat_align=5: the DP split cuts layers.1.attn_norm at 7 in TP rank 0's buffer, at 6 in
        # TP rank 1's (whose vocab shard is 3 rows shorter): partially overlapping copies
        Layout("tp2_dp2_zero1", dp=2, tp=2, zero=1, flat_align=5),
        Layout("dp2_zero3", dp=2, zero=3, buckets=2),
        Layout("dp3_zero1", dp=3, zero=1, dict_members=True),
        Layout("tp2", tp=2),
        Layout("pp2", pp=2),
        Layout("dp2_tp2", dp=2, tp=2),
        Layout("dp2_tp2_col_major", dp=2, tp=2, col_major=True),
        Layout("tp2_pp2", tp=2, pp=2),
        Layout("dp2_tp2_pp2", dp=2, tp=2, pp=2),
        Layout("tp2_pp2_dp2_zero3", dp=2, tp=2, pp=2, zero=3),
        Layout("tp2_dp3_zero3", dp=3, tp=2, zero=3, buckets=3),
        Layout("dtensor_dp2_tp2", dp=2, tp=2, dtensor=True),
        Layout("dtensor_dp3", dp=3, dtensor=True),
    ]
}


@dataclass(frozen=True)
class Param:
    fqn: str
    shape: tuple[int, ...]
    split: str  # under TP: "vocab" (rows, padded), "column" (dim 0), "row" (dim 1), "replicated"
    layer: int | None  # None: embed (first stage) or final norm / LM head (last stage)
    fuse: str | None = None  # the Fused leaf this parameter is a part of


def _params() -> list[Param]:
    out = [Param("embed.weight", (VOCAB, HIDDEN), "vocab", None)]
    for i in range(LAYERS):
        pre = f"layers.{i}"
        out += [
            Param(f"{pre}.attn_norm.weight", (HIDDEN,), "replicated", i),
            *(
                Param(
                    f"{pre}.attn.{x}.weight",
                    (HIDDEN, HIDDEN),
                    "column",
                    i,
                    f"{pre}.attn.qkv.weight",
                )
                for x in "qkv"
            ),
            Param(f"{pre}.attn.o.weight", (HIDDEN, HIDDEN), "row", i),
            Param(f"{pre}.mlp_norm.weight", (HIDDEN,), "replicated", i),
            *(
                Param(
                    f"{pre}.mlp.{x}.weight", (FFN, HIDDEN), "column", i, f"{pre}.mlp.gate_up.weight"
                )
                for x in ("gate", "up")
            ),
            Param(f"{pre}.mlp.down.weight", (HIDDEN, FFN), "row", i),
        ]
    out += [
        Param("norm_f.weight", (HIDDEN,), "replicated", None),
        Param("lm_head.weight", (VOCAB, HIDDEN), "vocab", None),
    ]
    return out


PARAMS = _params()


def stage_of(p: Param, pp: int) -> int:
    if p.layer is not None:
        return p.layer * pp // LAYERS
    return 0 if p.fqn == "embed.weight" else pp - 1


def logical_names() -> list[str]:
    return [f"{prefix}/{p.fqn}" for prefix in PREFIXES for p in PARAMS]


def reference() -> dict[str, torch.Tensor]:
    """Every logical tensor, whole: distinct deterministic float32 values per tensor."""
    out = {}
    for name in logical_names():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        shape = next(p.shape for p in PARAMS if name.endswith("/" + p.fqn))
        t = torch.randn(shape, generator=g)
        out[name] = t * t if "exp_avg_sq" in name else t
    return out


def rng_state(rank: int) -> torch.Tensor:
    """What rank ``rank`` keeps as its ``Local`` RNG state (a CPU generator's uint8 state)."""
    return torch.Generator().manual_seed(1000 + rank).get_state()


def data_position(rank: int) -> dict[str, int]:
    """What rank ``rank`` keeps as its ``Local`` JSON value (a data-loader position)."""
    return {"rank": rank, "consumed": 100 + rank}


BLANK_DATA_POSITION = {"rank": -1, "consumed": -1}


def tp_box(p: Param, tp: int, t: int) -> tuple[Box, tuple[int, ...]]:
    """The box of ``p`` TP rank ``t`` holds, and the shape of its local tensor (padding included:
    the valid part is the leading ``box.sizes`` of it)."""
    rows, cols = (p.shape + (1,))[:2]
    if p.split == "replicated" or (tp == 1 and p.split != "vocab"):
        return Box.whole(p.shape), p.shape
    if p.split == "vocab":
        per = math.ceil(VOCAB / (VOCAB_DIVISIBLE_BY * tp)) * VOCAB_DIVISIBLE_BY
        lo, hi = min(t * per, rows), min((t + 1) * per, rows)
        return Box((lo, 0), (hi - lo, cols)), (per, cols)
    if p.split == "column":
        n = rows // tp
        return Box((t * n, 0), (n, cols)), (n, cols)
    if p.split == "row":
        n = cols // tp
        return Box((0, t * n), (rows, n)), (rows, n)
    raise ValueError(p.split)


@dataclass
class RankState:
    state: dict[str, Any]
    # leaf path -> the whole local tensor behind the leaf, padding included
    buffers: dict[str, torch.Tensor]


def build_state(
    layout: Layout,
    rank: int,
    reference: dict[str, torch.Tensor] | None,
    padding: float = SOURCE_PADDING,
) -> RankState:
    """Rank ``rank``'s state under ``layout``.

    With ``reference``: its values, padding set to ``padding``, JSON/``Local`` values as saved.
    Without: a destination for a load, every element ``SENTINEL`` and blank JSON/``Local`` values.
    """
    if layout.dtensor:
        return _build_dtensor_state(layout, rank, reference)
    pp_rank, dp_rank, t = layout.coords(rank)
    params = [p for p in PARAMS if stage_of(p, layout.pp) == pp_rank]
    b = _Builder(layout, dp_rank, t, reference, padding)
    state: dict[str, Any] = {"model": {}, "optim": {"exp_avg": {}, "exp_avg_sq": {}}}
    for prefix in PREFIXES:
        container = state
        for key in prefix.split("/"):
            container = container[key]
        flat = layout.zero == 3 or (layout.zero == 1 and prefix != "model")
        if flat:
            b.flat_leaves(prefix, params, container)
        else:
            b.leaves(prefix, params, container)
    state["optim"]["step"] = OPTIM_STEP if reference is not None else 0
    _add_rank_values(state, b.buffers, rank, reference is not None, layout)
    return RankState(state, b.buffers)


def _add_rank_values(
    state: dict[str, Any], buffers: dict[str, torch.Tensor], rank: int, full: bool, layout: Layout
) -> None:
    rng = rng_state(rank) if full else torch.zeros_like(rng_state(rank))
    state["rng"] = Local(rng)
    buffers["rng"] = rng
    state["data"] = Local(dict(data_position(rank) if full else BLANK_DATA_POSITION))
    state["step"] = STEP if full else 0
    state["meta"] = {"layout": layout.name if full else "", "lr": 3e-4 if full else 0.0}


class _Builder:
    def __init__(
        self,
        layout: Layout,
        dp_rank: int,
        t: int,
        reference: dict[str, torch.Tensor] | None,
        padding: float,
    ):
        self.layout, self.dp_rank, self.t = layout, dp_rank, t
        self.reference, self.padding = reference, padding
        self.buffers: dict[str, torch.Tensor] = {}

    def values(self, name: str, box: Box) -> torch.Tensor:
        if self.reference is None:
            return torch.full(box.sizes, SENTINEL)
        return self.reference[name][box.within(Box.whole(tuple(self.reference[name].shape)))]

    def storage_order(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, or under ``col_major`` the same values in a transposed storage."""
        return t.t().contiguous().t() if self.layout.col_major and t.dim() == 2 else t

    def local(self, name: str, p: Param) -> tuple[torch.Tensor, Box]:
        """A fresh padded local tensor for TP rank ``t`` and the box its leading part holds."""
        box, local_shape = tp_box(p, self.layout.tp, self.t)
        pad = SENTINEL if self.reference is None else self.padding
        out = torch.full(local_shape, pad)
        out[tuple(slice(0, s) for s in box.sizes)] = self.values(name, box)
        return out, box

    def leaves(self, prefix: str, params: list[Param], container: dict[str, Any]) -> None:
        """Unflattened leaves: replicated over DP (and over TP for norms)."""
        lay, dp_rank, t = self.layout, self.dp_rank, self.t
        fused: dict[str, list[Param]] = {}
        for p in params:
            if p.fuse is not None:
                fused.setdefault(p.fuse, []).append(p)
                continue
            name = f"{prefix}/{p.fqn}"
            local, box = self.local(name, p)
            if p.split in ("row", "column"):
                local = self.storage_order(local)
            self.buffers[name] = local
            if p.split == "vocab":
                valid = local.narrow(0, 0, box.sizes[0])
                container[p.fqn] = Shard(valid, p.shape, box.offsets, dp_rank, lay.dp)
            elif (p.split == "replicated" and lay.pp == 1) or lay.tp == lay.pp == 1:
                container[p.fqn] = local  # every rank holds it: a plain tensor
            elif p.split == "replicated":
                container[p.fqn] = Shard(
                    local, p.shape, box.offsets, dp_rank * lay.tp + t, lay.dp * lay.tp
                )
            else:
                container[p.fqn] = Shard(local, p.shape, box.offsets, dp_rank, lay.dp)
        for key, group in fused.items():
            locals_, parts = [], []
            for p in group:
                name = f"{prefix}/{p.fqn}"
                local, box = self.local(name, p)
                locals_.append(local)
                parts.append((p.fqn, p.shape, box.offsets, box.sizes))
            local = self.storage_order(torch.cat(locals_, dim=0))
            self.buffers[f"{prefix}/{key}"] = local
            container[key] = Fused(local, 0, parts, dp_rank, lay.dp)

    def flat_leaves(self, prefix: str, params: list[Param], container: dict[str, Any]) -> None:
        """ZeRO: the stage's TP-local boxes in ``buckets`` flat buffers, split over DP."""
        lay = self.layout
        n = lay.buckets
        groups = [params[i * len(params) // n : (i + 1) * len(params) // n] for i in range(n)]
        for i, group in enumerate(groups):
            members: list[Any] = []
            chunks = []
            for p in group:
                name = f"{prefix}/{p.fqn}"
                box, _ = tp_box(p, lay.tp, self.t)
                if box == Box.whole(p.shape):
                    members.append((p.fqn, p.shape))
                else:
                    members.append((p.fqn, p.shape, box.offsets, box.sizes))
                chunks.append(self.values(name, box).reshape(-1))
            total = sum(c.numel() for c in chunks)
            quantum = lay.dp * lay.flat_align
            padded = math.ceil(total / quantum) * quantum
            pad = SENTINEL if self.reference is None else self.padding
            full = torch.cat([*chunks, torch.full((padded - total,), pad)])
            per = padded // lay.dp
            start = self.dp_rank * per
            local = full[start : start + per].clone()
            key = "flat" if n == 1 else f"flat{i}"
            self.buffers[f"{prefix}/{key}"] = local
            if lay.dict_members:
                if any(len(m) != 2 for m in members):
                    raise ValueError(f"{lay.name}: dict members need whole tensors (tp == 1)")
                container[key] = FlatShard(local, {m[0]: m[1] for m in members}, start)
            else:
                container[key] = FlatShard(local, members, start)


# --- DTensor layouts ----------------------------------------------------------------------------


# Placements on the (dp, tp) mesh, by TP split kind; some are uneven (13 vocab rows over 2) and
# some shard on both mesh dims (FSDP2 + TP). Norms are replicated on both.
def _dtensor_placements(p: Param) -> tuple[Any, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    if p.fqn == "lm_head.weight":
        return DShard(0), DShard(0)  # 13 rows: dp 7/6, then tp 4/3 and 3/3
    if p.fqn.endswith("mlp.down.weight"):
        return DShard(0), DShard(1)
    return {
        "vocab": (Replicate(), DShard(0)),  # 13 rows over tp: 7/6
        "column": (Replicate(), DShard(0)),
        "row": (Replicate(), DShard(1)),
        "replicated": (Replicate(), Replicate()),
    }[p.split]


_meshes: dict[tuple[int, int], Any] = {}


def _mesh(dp: int, tp: int) -> Any:
    """One mesh per shape and process: creating one makes process groups (collectively)."""
    from torch.distributed.device_mesh import init_device_mesh

    if (dp, tp) not in _meshes:
        _meshes[(dp, tp)] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return _meshes[(dp, tp)]


def _build_dtensor_state(
    layout: Layout, rank: int, reference: dict[str, torch.Tensor] | None
) -> RankState:
    from torch.distributed.tensor import distribute_tensor

    if layout.pp != 1 or layout.zero:
        raise ValueError(f"{layout.name}: DTensor layouts are (dp, tp) meshes without ZeRO/PP")
    mesh = _mesh(layout.dp, layout.tp)
    state: dict[str, Any] = {"model": {}, "optim": {"exp_avg": {}, "exp_avg_sq": {}}}
    buffers: dict[str, torch.Tensor] = {}
    for prefix in PREFIXES:
        container = state
        for key in prefix.split("/"):
            container = container[key]
        for p in PARAMS:
            name = f"{prefix}/{p.fqn}"
            full = reference[name] if reference is not None else torch.full(p.shape, SENTINEL)
            # src_data_rank=None: every rank holds the full value, so no communication
            dt = distribute_tensor(full, mesh, _dtensor_placements(p), src_data_rank=None)
            container[p.fqn] = dt
            buffers[name] = dt.to_local()
    state["optim"]["step"] = OPTIM_STEP if reference is not None else 0
    _add_rank_values(state, buffers, rank, reference is not None, layout)
    return RankState(state, buffers)
