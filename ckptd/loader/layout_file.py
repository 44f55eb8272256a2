"""Layout files: how a target world holds the logical tensors, without the model code.

A layout file (TOML or JSON, documented in ``docs/layouts.md``) has:

- ``[parallel]``: ``tp``, ``pp`` and the rank ``order`` (axes fastest first; DP is what is left
  of the world size);
- ``[[rule]]``: the first rule whose ``match`` glob(s) match a logical name says how it is split
  over TP (``tp_dim``, ``split``, ``divisible_by``, ``fused`` part sizes) or that it is
  ``replicated``; ``dp_dim`` shards it over DP too (FSDP2 / DTensor ``Shard`` on the DP mesh
  dimension);
- ``[pipeline]``: the stage of a tensor from the layer index in its name, or ``first``/``last``;
- ``[zero]``: the ZeRO stage, and the flat-buffer groups (``[[zero.group]]``), their member
  ``order``, ``buckets`` and DP-shard ``align`` ment (padding).

This module parses and writes the file; :mod:`ckptd.loader.targets` applies it to a checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptd.errors import CkptdError

VERSION = 1
AXES = ("tp", "dp", "pp")
SPLITS = ("even", "chunk", "padded")


class LayoutError(CkptdError, ValueError):
    """A layout file is malformed, or does not fit the checkpoint (names the tensor and rule)."""


@dataclass(frozen=True)
class Rule:
    index: int  # 1-based position among the file's rules, for messages
    match: tuple[str, ...]
    tp_dim: int | None = None
    split: str = "even"
    divisible_by: int = 1
    fused: tuple[int, ...] | None = None
    dp_dim: int | None = None
    replicated: bool = False
    note: str = ""

    def describe(self) -> str:
        globs = list(self.match) if len(self.match) > 1 else self.match[0]
        what = [f"match {globs!r}"]
        if self.tp_dim is not None:
            what.append(f"tp_dim {self.tp_dim}")
        if self.dp_dim is not None:
            what.append(f"dp_dim {self.dp_dim}")
        return f"rule {self.index} ({', '.join(what)})"


@dataclass(frozen=True)
class Pipeline:
    layer: str = r"layers\.(\d+)\."
    num_layers: int | None = None
    stages: tuple[int, ...] | None = None  # layers per stage; default: layer * pp // num_layers
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()


@dataclass(frozen=True)
class ZeroGroup:
    match: tuple[str, ...]
    kind: str = "optimizer"  # "optimizer": flat at stage >= 1; "params": at stage 3


@dataclass(frozen=True)
class Zero:
    stage: int = 0
    align: int = 1
    buckets: int = 1
    order: tuple[str, ...] = ()
    groups: tuple[ZeroGroup, ...] = ()


@dataclass(frozen=True)
class LayoutSpec:
    rules: tuple[Rule, ...] = ()
    tp: int = 1
    pp: int = 1
    order: tuple[str, ...] = AXES
    pipeline: Pipeline = field(default_factory=Pipeline)
    zero: Zero = field(default_factory=Zero)
    source: str = "<layout>"

    def with_parallel(self, tp: int | None = None, pp: int | None = None,
                      zero: int | None = None) -> LayoutSpec:
        """Command-line ``--tp/--pp/--zero`` override the file."""
        z = self.zero if zero is None else replace(self.zero, stage=_stage(zero, self.source))
        return replace(self, tp=self.tp if tp is None else _positive(tp, "tp", self.source),
                       pp=self.pp if pp is None else _positive(pp, "pp", self.source), zero=z)

    def to_doc(self) -> dict[str, Any]:
        rules = []
        for r in self.rules:
            d: dict[str, Any] = {"match": list(r.match) if len(r.match) > 1 else r.match[0]}
            if r.note:
                d["note"] = r.note
            if r.replicated:
                d["replicated"] = True
            for k in ("tp_dim", "dp_dim"):
                if getattr(r, k) is not None:
                    d[k] = getattr(r, k)
            if r.split != "even":
                d["split"] = r.split
            if r.divisible_by != 1:
                d["divisible_by"] = r.divisible_by
            if r.fused is not None:
                d["fused"] = list(r.fused)
            rules.append(d)
        p = self.pipeline
        pipe: dict[str, Any] = {"layer": p.layer, "first": list(p.first), "last": list(p.last)}
        if p.num_layers is not None:
            pipe["num_layers"] = p.num_layers
        if p.stages is not None:
            pipe["stages"] = list(p.stages)
        z = self.zero
        return {"version": VERSION,
                "parallel": {"tp": self.tp, "pp": self.pp, "order": list(self.order)},
                "pipeline": pipe,
                "zero": {"stage": z.stage, "align": z.align, "buckets": z.buckets,
                         "order": list(z.order),
                         "group": [{"match": list(g.match), "kind": g.kind} for g in z.groups]},
                "rule": rules}


# ----------------------------------------------------------------------------- parsing
def read_layout(path: str) -> LayoutSpec:
    """Parse a layout file (``.toml`` or ``.json``; otherwise tried as TOML, then JSON)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise LayoutError(f"layout {path}: cannot read ({e.strerror or e})") from e
    return parse_layout(raw.decode("utf-8", errors="replace"), os.path.basename(path),
                        fmt="json" if path.endswith(".json") else
                        "toml" if path.endswith(".toml") else None)


def parse_layout(text: str, source: str = "<layout>", fmt: str | None = None) -> LayoutSpec:
    doc: Any = None
    if fmt in (None, "json") and text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise LayoutError(f"layout {source}: not valid JSON ({e})") from e
    else:
        toml = _toml_module(source)
        try:
            doc = toml.loads(text)
        except toml.TOMLDecodeError as e:
            raise LayoutError(f"layout {source}: not valid TOML ({e})") from e
    return from_doc(doc, source)


def _toml_module(source: str) -> Any:
    import importlib

    for name in ("tomllib", "tomli"):  # tomli: the same parser on Python 3.10
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    raise LayoutError(f"layout {source}: TOML needs Python 3.11+ or `pip install tomli`; "
                      "or write the layout as JSON")


def _keys(d: Any, allowed: Sequence[str], where: str, source: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise LayoutError(f"layout {source}: {where} must be a table, got {d!r}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise LayoutError(f"layout {source}: {where}: unknown key(s) {unknown}; known: "
                          f"{sorted(allowed)}")
    return d


def _globs(v: Any, where: str, source: str) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(s, str) for s in items):
        raise LayoutError(f"layout {source}: {where}: match must be a glob or a list of globs, "
                          f"got {v!r}")
    return tuple(items)


def _int(v: Any, where: str, source: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise LayoutError(f"layout {source}: {where} must be an integer >= {lo}, got {v!r}")
    return v


def _positive(v: Any, where: str, source: str) -> int:
    return _int(v, where, source, 1)


def _stage(v: Any, source: str) -> int:
    if isinstance(v, bool) or v not in (0, 1, 2, 3):
        raise LayoutError(f"layout {source}: ZeRO stage must be 0, 1, 2 or 3, got {v!r}")
    return int(v)


def _rule(i: int, d: Any, source: str) -> Rule:
    where = f"rule {i}"
    d = _keys(d, ("match", "tp_dim", "split", "divisible_by", "fused", "dp_dim", "replicated",
                  "note"), where, source)
    if "match" not in d:
        raise LayoutError(f"layout {source}: {where} has no match")
    rule = Rule(i, _globs(d["match"], where, source))
    where = rule.describe()
    tp_dim = None if d.get("tp_dim") is None else _int(d["tp_dim"], f"{where}: tp_dim", source)
    dp_dim = None if d.get("dp_dim") is None else _int(d["dp_dim"], f"{where}: dp_dim", source)
    split = d.get("split", "even")
    if split not in SPLITS:
        raise LayoutError(f"layout {source}: {where}: split must be one of {list(SPLITS)}, "
                          f"got {split!r}")
    fused = d.get("fused")
    if fused is not None:
        if not isinstance(fused, list) or not fused:
            raise LayoutError(f"layout {source}: {where}: fused must be a list of part sizes")
        fused = tuple(_positive(s, f"{where}: fused part", source) for s in fused)
        if tp_dim is None:
            raise LayoutError(f"layout {source}: {where}: fused parts need a tp_dim")
    replicated = d.get("replicated", False)
    if not isinstance(replicated, bool):
        raise LayoutError(f"layout {source}: {where}: replicated must be true or false")
    if replicated and (tp_dim is not None or dp_dim is not None):
        raise LayoutError(f"layout {source}: {where}: replicated excludes tp_dim and dp_dim")
    if fused is not None and dp_dim is not None:
        raise LayoutError(f"layout {source}: {where}: fused parts cannot be combined with dp_dim")
    return replace(rule, tp_dim=tp_dim, dp_dim=dp_dim, split=split, fused=fused,
                   divisible_by=_positive(d.get("divisible_by", 1), f"{where}: divisible_by",
                                          source),
                   replicated=replicated, note=str(d.get("note", "")))


def from_doc(doc: Any, source: str = "<layout>") -> LayoutSpec:
    d = _keys(doc, ("version", "parallel", "rule", "pipeline", "zero"), "the file", source)
    version = d.get("version", VERSION)
    if version != VERSION:
        raise LayoutError(f"layout {source}: version {version!r} is not supported ({VERSION})")
    par = _keys(d.get("parallel", {}), ("tp", "pp", "order"), "[parallel]", source)
    order = tuple(par.get("order", AXES))
    if sorted(order) != sorted(AXES):
        raise LayoutError(f"layout {source}: [parallel] order must list {list(AXES)} once each, "
                          f"got {list(order)}")
    rules_raw = d.get("rule", [])
    if not isinstance(rules_raw, list):
        raise LayoutError(f"layout {source}: rule must be an array of tables ([[rule]])")
    pipe = _keys(d.get("pipeline", {}), ("layer", "num_layers", "stages", "first", "last"),
                 "[pipeline]", source)
    stages = pipe.get("stages")
    zero = _keys(d.get("zero", {}), ("stage", "align", "buckets", "order", "group"), "[zero]",
                 source)
    groups = []
    for i, g in enumerate(zero.get("group", []), 1):
        g = _keys(g, ("match", "kind"), f"zero group {i}", source)
        kind = g.get("kind", "optimizer")
        if kind not in ("optimizer", "params"):
            raise LayoutError(f"layout {source}: zero group {i}: kind must be 'optimizer' or "
                              f"'params', got {kind!r}")
        groups.append(ZeroGroup(_globs(g.get("match"), f"zero group {i}", source), kind))
    import re

    try:
        re.compile(str(pipe.get("layer", Pipeline.layer)))
    except re.error as e:
        raise LayoutError(f"layout {source}: [pipeline] layer is not a regex ({e})") from e
    return LayoutSpec(
        rules=tuple(_rule(i, r, source) for i, r in enumerate(rules_raw, 1)),
        tp=_positive(par.get("tp", 1), "[parallel] tp", source),
        pp=_positive(par.get("pp", 1), "[parallel] pp", source),
        order=order,
        pipeline=Pipeline(
            layer=str(pipe.get("layer", Pipeline.layer)),
            num_layers=None if pipe.get("num_layers") is None
            else _positive(pipe["num_layers"], "[pipeline] num_layers", source),
            stages=None if stages is None
            else tuple(_int(s, "[pipeline] stages", source) for s in stages),
            first=tuple(pipe.get("first", ())), last=tuple(pipe.get("last", ()))),
        zero=Zero(stage=_stage(zero.get("stage", 0), source),
                  align=_positive(zero.get("align", 1), "[zero] align", source),
                  buckets=_positive(zero.get("buckets", 1), "[zero] buckets", source),
                  order=tuple(zero.get("order", ())), groups=tuple(groups)),
        source=source)


# ----------------------------------------------------------------------------- writing
def dumps(spec: LayoutSpec, fmt: str = "toml", header: str = "") -> str:
    """The layout as TOML (with each rule's note as a comment) or JSON."""
    doc = spec.to_doc()
    if fmt == "json":
        return json.dumps(doc, indent=1) + "\n"
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"version = {VERSION}", "", "[parallel]"]
    lines += [f"{k} = {_toml(v)}" for k, v in doc["parallel"].items()]
    for table in ("pipeline", "zero"):
        lines += ["", f"[{table}]"]
        lines += [f"{k} = {_toml(v)}" for k, v in doc[table].items() if k != "group"]
    for g in doc["zero"]["group"]:
        lines += ["", "[[zero.group]]"] + [f"{k} = {_toml(v)}" for k, v in g.items()]
    for r in doc["rule"]:
        lines += [""] + [f"# {n}" for n in r.pop("note", "").splitlines()] + ["[[rule]]"]
        lines += [f"{k} = {_toml(v)}" for k, v in r.items()]
    return "\n".join(lines) + "\n"


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return "'" + v + "'" if "'" not in v and "\n" not in v else json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
