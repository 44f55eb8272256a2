"""Applying a layout to a checkpoint: for each rank of a target world, the boxes of logical
tensors it will hold — exactly the pieces its training state will describe, so that an offline
reshard can pack each rank's data contiguously.

Per tensor: the first matching rule gives its TP split (``even`` must divide; ``chunk`` is
``torch.chunk``/DTensor rounding; ``padded`` is Megatron's vocabulary padding, each TP rank
holding ``ceil(n / (divisible_by * tp)) * divisible_by`` rows, the padding unsaved); ``fused``
splits each part separately; ``dp_dim`` shards over DP first (a DTensor mesh ``(dp, tp)``).
Tensors of a ZeRO flat-buffer group are instead concatenated per (group, pipeline stage, TP rank,
bucket) — each rank's TP boxes, in the group's member order — padded to a multiple of
``dp * align`` elements and split evenly over DP, as :class:`ckptd.FlatShard` describes.
Per-rank tensors (``__local__/<r>/...``) stay with rank ``r`` (``r mod world`` beyond it).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ckptd import dtypes
from ckptd.loader.layout_file import LayoutError, LayoutSpec, Rule, ZeroGroup
from ckptd.manifest import Manifest
from ckptd.regions import Box, flat_to_boxes
from ckptd.sharding import LOCAL_PREFIX


@dataclass(frozen=True)
class Target:
    """``box`` of logical tensor ``name`` (global ``shape``, ``dtype`` by its format name), held
    by one rank. ``frame_bytes``: the frame size to write it with (0: the writer's framing; the
    offline reshard frames a box it coalesced from several ranks' at their boundaries)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    box: Box
    frame_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.box.numel * dtypes.ITEMSIZE[self.dtype]


@dataclass
class Assignment:
    world: int
    tp: int
    dp: int
    pp: int
    ranks: list[list[Target]]


def matches(name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def natural_key(s: str) -> tuple[object, ...]:
    return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", s) if t)


def coords(spec: LayoutSpec, rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """``{"tp": t, "dp": d, "pp": p}`` of ``rank`` (``spec.order`` lists axes fastest first)."""
    out = {}
    for axis in spec.order:
        out[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return out


def split_dim(size: int, n: int, i: int, mode: str, divisible_by: int = 1) -> tuple[int, int]:
    """``(offset, size)`` of part ``i`` of ``n`` of a dimension of ``size`` (``mode`` as in the
    module docstring); raises ValueError when ``even`` does not divide."""
    if mode == "even":
        if size % n:
            raise ValueError(f"does not divide by {n}")
        return i * (size // n), size // n
    if mode == "chunk":
        c = -(-size // n)
        start = min(i * c, size)
        return start, max(0, min(c, size - start))
    per = -(-size // (divisible_by * n)) * divisible_by
    lo, hi = min(i * per, size), min((i + 1) * per, size)
    return lo, hi - lo


def _cut(box: Box, dim: int, offset: int, size: int) -> Box:
    """Part ``[offset, offset + size)`` of ``box`` along ``dim`` (inside it: ``split_dim``)."""
    o, s, e = list(box.offsets), list(box.sizes), list(box.ends)
    o[dim] += offset
    s[dim] = size
    e[dim] = o[dim] + size
    return Box._of(tuple(o), tuple(s), tuple(e))


class Resolver:
    """One layout applied to one checkpoint for one world size (validated on construction)."""

    def __init__(self, spec: LayoutSpec, manifest: Manifest, world: int) -> None:
        self.spec, self.manifest, self.world = spec, manifest, world
        src = spec.source
        if world < 1 or world % (spec.tp * spec.pp):
            raise LayoutError(f"layout {src}: world size {world} is not a multiple of tp {spec.tp}"
                              f" x pp {spec.pp}")
        self.dp = world // (spec.tp * spec.pp)
        self.sizes = {"tp": spec.tp, "dp": self.dp, "pp": spec.pp}
        self._num_layers: int | None = None
        self._rules: dict[str, Rule | None] = {}
        self._boxes: dict[tuple[str, int, int], list[Box]] = {}
        self._whole: dict[str, Box] = {}
        self._members: dict[tuple[int, int], list[str]] = {}
        self.names = sorted((n for n in manifest.tensors if not n.startswith(LOCAL_PREFIX + "/")),
                            key=natural_key)
        missing = [n for n in self.names if self._rule_or_none(n) is None]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise LayoutError(
                f"layout {src}: no rule matches {', '.join(missing[:5])}{more}: add a [[rule]] "
                "whose match covers them (e.g. match = '*', replicated = true, last)")
        self.stage = {n: self._stage(n) for n in self.names}
        self.group = {n: self._group(n) for n in self.names}
        for n in self.names:  # validate every split now: errors before any work
            rule = self.rule(n)
            for dim in (rule.dp_dim, rule.tp_dim):
                if dim is not None and dim >= len(manifest.tensors[n].shape):
                    raise LayoutError(f"layout {src}: {n} {list(manifest.tensors[n].shape)}: "
                                      f"{rule.describe()}: the tensor has no dim {dim}")
            # a DP split on another dim leaves the TP split the same for every DP rank
            dps = self.dp if rule.dp_dim is not None and rule.dp_dim == rule.tp_dim else 1
            for t in range(spec.tp):
                for d in range(dps):
                    self.tp_boxes(n, t, d)

    # -- per tensor
    def _rule_or_none(self, name: str) -> Rule | None:
        if name not in self._rules:
            self._rules[name] = next((r for r in self.spec.rules if matches(name, r.match)), None)
        return self._rules[name]

    def rule(self, name: str) -> Rule:
        r = self._rule_or_none(name)
        assert r is not None  # checked in __init__
        return r

    def _stage(self, name: str) -> int:
        spec, pipe = self.spec, self.spec.pipeline
        if spec.pp == 1:
            return 0
        m = re.search(pipe.layer, name)
        if m is None:
            if matches(name, pipe.first):
                return 0
            if matches(name, pipe.last):
                return spec.pp - 1
            raise LayoutError(
                f"layout {spec.source}: {name}: no pipeline stage: it has no layer index "
                f"(pattern {pipe.layer!r}) and matches neither pipeline.first nor pipeline.last")
        layer = int(m.group(1))
        if pipe.stages is not None:
            if len(pipe.stages) != spec.pp:
                raise LayoutError(f"layout {spec.source}: pipeline.stages lists "
                                  f"{len(pipe.stages)} stages, pp is {spec.pp}")
            bound = 0
            for s, n in enumerate(pipe.stages):
                bound += n
                if layer < bound:
                    return s
            raise LayoutError(f"layout {spec.source}: {name}: layer {layer} is beyond the "
                              f"{bound} layers of pipeline.stages")
        return layer * spec.pp // self.num_layers()

    def num_layers(self) -> int:
        if self.spec.pipeline.num_layers is not None:
            return self.spec.pipeline.num_layers
        if self._num_layers is None:
            found = [re.search(self.spec.pipeline.layer, n) for n in self.names]
            self._num_layers = 1 + max((int(m.group(1)) for m in found if m), default=0)
        return self._num_layers

    def _group(self, name: str) -> int | None:
        z = self.spec.zero
        for i, g in enumerate(z.groups):
            if matches(name, g.match) and _flat(g, z.stage):
                if self.rule(name).dp_dim is not None:
                    raise LayoutError(f"layout {self.spec.source}: {name}: "
                                      f"{self.rule(name).describe()}: dp_dim cannot be combined "
                                      f"with ZeRO flat-buffer group {i + 1}")
                return i
        return None

    def tp_boxes(self, name: str, t: int, d: int = 0) -> list[Box]:
        """The boxes of ``name`` TP rank ``t`` (and, with dp_dim, DP rank ``d``) holds."""
        rule = self._rules[name]
        assert rule is not None  # checked in __init__
        if rule.dp_dim is None:
            d = 0
        key = (name, t, d)
        boxes = self._boxes.get(key)
        if boxes is None:
            if rule.dp_dim is not None and self._tp_whole(rule):
                self._dp_slices(name, rule.dp_dim, t)  # every DP rank's at once
                return self._boxes[key]
            boxes = self._boxes[key] = self._tp_boxes(name, t, d)
        return boxes

    def _tp_whole(self, rule: Rule) -> bool:
        """Whether TP leaves the tensor whole (no split, or one part)."""
        return rule.tp_dim is None or rule.replicated or (self.spec.tp == 1 and rule.fused is None)

    def _dp_slices(self, name: str, dim: int, t: int) -> None:
        """The boxes of every DP rank of a tensor split on ``dim`` alone (what ``_tp_boxes``
        gives for each): one loop per tensor, not a call chain per (tensor, rank) — an FSDP2
        checkpoint at 1024 ranks has ~120,000 of them."""
        whole = Box.whole(self.manifest.tensors[name].shape)
        o, s, e = list(whole.offsets), list(whole.sizes), list(whole.ends)
        for d in range(self.dp):
            o[dim], s[dim] = split_dim(whole.sizes[dim], self.dp, d, "chunk")
            e[dim] = o[dim] + s[dim]
            self._boxes[(name, t, d)] = [Box._of(tuple(o), tuple(s), tuple(e))]

    def _tp_boxes(self, name: str, t: int, d: int) -> list[Box]:
        entry, rule, spec = self.manifest.tensors[name], self.rule(name), self.spec
        box = self._whole.get(name) or self._whole.setdefault(name, Box.whole(entry.shape))

        def fail(dim: int, size: int, n: int, axis: str, why: str) -> LayoutError:
            return LayoutError(f"layout {spec.source}: {name} {list(entry.shape)}: "
                               f"{rule.describe()}: dim {dim} of size {size} {why} by {axis} {n}")

        if rule.dp_dim is not None:
            off, size = split_dim(box.sizes[rule.dp_dim], self.dp, d, "chunk")
            box = _cut(box, rule.dp_dim, off, size)
        dim, n = rule.tp_dim, spec.tp
        if dim is None or self._tp_whole(rule):
            return [box]
        parts = [(0, box.sizes[dim])]
        if rule.fused is not None:
            if sum(rule.fused) != box.sizes[dim]:
                raise fail(dim, box.sizes[dim], sum(rule.fused), "fused parts summing to",
                           "is not matched")
            starts = [sum(rule.fused[:i]) for i in range(len(rule.fused))]
            parts = list(zip(starts, rule.fused, strict=True))
        out = []
        for start, size in parts:
            try:
                off, sz = split_dim(size, n, t, rule.split, rule.divisible_by)
            except ValueError:
                why = "does not divide" if rule.fused is None else "(a fused part) does not divide"
                raise fail(dim, size, n, "tp", why) from None
            out.append(_cut(box, dim, start + off, sz))
        return out

    # -- per rank
    def rank_targets(self, rank: int) -> list[Target]:
        c = coords(self.spec, rank, self.sizes)
        out: list[Target] = []
        groups: set[tuple[int, int]] = set()
        for n in self.names:
            if self.stage[n] != c["pp"]:
                continue
            g = self.group[n]
            if g is not None:
                groups.add((g, c["pp"]))
                continue
            e = self.manifest.tensors[n]
            out += [Target(n, e.shape, e.dtype_name, b) for b in self.tp_boxes(n, c["tp"], c["dp"])
                    if b.numel]
        for g, stage in sorted(groups):
            for bucket in range(self.spec.zero.buckets):
                out += self._flat_targets(g, stage, c["tp"], bucket, c["dp"])
        for n, e in self.manifest.tensors.items():
            if n.startswith(LOCAL_PREFIX + "/"):
                owner = int(n.split("/")[1])
                if owner % self.world == rank:
                    out.append(Target(n, e.shape, e.dtype_name, Box.whole(e.shape)))
        return out

    def _flat_targets(self, g: int, stage: int, t: int, bucket: int, d: int) -> list[Target]:
        z = self.spec.zero
        if (g, stage) not in self._members:
            members = [n for n in self.names if self.group[n] == g and self.stage[n] == stage]
            members.sort(key=lambda n: (_order_index(n, z.order), natural_key(n)))
            self._members[(g, stage)] = members
        members = self._members[(g, stage)]
        k = z.buckets
        chosen = members[bucket * len(members) // k : (bucket + 1) * len(members) // k]
        boxes = [(n, b) for n in chosen for b in self.tp_boxes(n, t)]
        total = sum(b.numel for _, b in boxes)
        quantum = self.dp * z.align
        per = -(-total // quantum) * quantum // self.dp
        lo, hi = d * per, (d + 1) * per
        out, cursor = [], 0
        for n, b in boxes:
            m_lo, m_hi = cursor, cursor + b.numel
            cursor = m_hi
            a, e = max(lo, m_lo), min(hi, m_hi)
            if a >= e:
                continue
            entry = self.manifest.tensors[n]
            out += [Target(n, entry.shape, entry.dtype_name, bx.shift(b.offsets))
                    for bx in flat_to_boxes(b.sizes, a - m_lo, e - m_lo)]
        return out

    def assignment(self) -> Assignment:
        return Assignment(self.world, self.spec.tp, self.dp, self.spec.pp,
                          [self.rank_targets(r) for r in range(self.world)])


def _flat(group: ZeroGroup, stage: int) -> bool:
    return stage >= 3 if group.kind == "params" else stage >= 1


def _order_index(name: str, order: tuple[str, ...]) -> int:
    return next((i for i, g in enumerate(order) if fnmatch.fnmatchcase(name, g)), len(order))


def resolve(spec: LayoutSpec, manifest: Manifest, world: int) -> Assignment:
    """Every target rank's pieces; raises LayoutError naming the tensor and the rule."""
    return Resolver(spec, manifest, world).assignment()
