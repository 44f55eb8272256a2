"""A starting layout file inferred from a checkpoint's names and shapes (``ckptd layout``).

The names' module paths are matched against the conventions of Megatron, Hugging Face
(LLaMA, GPT-2, BLOOM/NeoX) and torchtitan: vocabulary embeddings and LM heads split rows
(``tp_dim 0``), column-parallel projections (q/k/v, gate/up, fc1) split rows, row-parallel ones
(o, down, fc2) split columns, fused QKV / gate-up are split part by part, norms and anything
unrecognised are replicated. Every rule carries a note saying why; the result is a draft to
review, not a guess to trust (it cannot know, e.g., GQA head counts or vocabulary padding).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ckptd.loader.layout_file import LayoutSpec, Pipeline, Rule, Zero, ZeroGroup
from ckptd.manifest import Manifest
from ckptd.sharding import LOCAL_PREFIX

# layer-index regex -> glob of the layer tensors (for the ZeRO member order)
LAYER_PATTERNS = {r"layers\.(\d+)\.": "*layers.*", r"(?:^|[./])h\.(\d+)\.": "*h.*",
                  r"blocks\.(\d+)\.": "*blocks.*", r"layer\.(\d+)\.": "*layer.*"}
_VOCAB = re.compile(r"(embed_tokens|embed\b|embedding|wte|tok_embeddings|word_embeddings|"
                    r"lm_head|^output\b)")
_FIRST = re.compile(r"(embed|wte|wpe|tok_embeddings|word_embeddings|position)")
_NORM = re.compile(r"(norm|\bln|layernorm|rmsnorm)")
_QKV = re.compile(r"(qkv|query_key_value|c_attn|wqkv)")
_GATE_UP = re.compile(r"(gate_up|w13)")
_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|q|k|v|wq|wk|wv|query|key|value|gate_proj|up_proj|"
                     r"gate|up|fc1|w1|w3|c_fc|dense_h_to_4h|fc_in)\.")
_ROW = re.compile(r"\.(o_proj|out_proj|o|wo|dense|dense_4h_to_h|down_proj|down|fc2|w2|c_proj|"
                  r"fc_out)\.")


def _fqn(name: str, ndim: int) -> tuple[str, bool]:
    """The module path a logical name belongs to, and whether it is per-parameter state below
    it (``optim/state/<fqn>/exp_avg``, as ``get_state_dict`` names optimizer state). A 0-d entry
    of that state (Adam's ``step``) keeps its own name: it is never split."""
    parts = name.split("/")
    dotted = [i for i, p in enumerate(parts) if "." in p]
    if ndim > 0 and dotted and dotted[-1] < len(parts) - 1:
        return parts[dotted[-1]], True
    return parts[-1], False


def _norm_fqn(fqn: str, layer: str | None) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn) if layer else fqn


def _glob(name: str, fqn: str, below: bool) -> str:
    if below:
        return f"*/{fqn}/*"
    return f"*/{fqn}" if "/" in name else fqn


def _group_key(name: str) -> str:
    """ZeRO group of a name: its path with the module path (a component with dots) as ``*``,
    so every parameter's ``optim/state/<fqn>/exp_avg`` falls in one ``optim/state/*/exp_avg``
    group instead of a group per parameter."""
    parts = name.split("/")[:-1] or [""]
    if "." in parts[-1] or len(name.split("/")) > 2 and any("." in p for p in parts):
        parts = ["*" if "." in p else p for p in parts]
        return "/".join(parts) + "/*"
    return (name.rpartition("/")[0] + "/*") if "/" in name else "*"


def source_writers(manifest: Manifest) -> int:
    """How many ranks wrote the checkpoint's source: an import of DCP records its writers
    (``import-dcp`` writes as one rank, keeping each writer's chunk as one chunk)."""
    imported = manifest.training.get("imported")
    ranks = imported.get("ranks") if isinstance(imported, dict) else None
    return ranks if isinstance(ranks, int) and ranks > 0 else manifest.world_size


def _by_ranks(manifest: Manifest, name: str) -> bool:
    """Whether ``name`` was saved in pieces of different ranks (different boxes)."""
    chunks = manifest.tensors[name].chunks
    if len({c.box for c in chunks}) < 2:
        return False
    return len({c.rank for c in chunks}) >= 2 or (manifest.world_size == 1
                                                  and source_writers(manifest) > 1)


def _dim0_sharded(manifest: Manifest, names: list[str]) -> bool:
    """Whether every tensor of ``names`` was saved sharded along dim 0 only, by several ranks:
    the shape of FSDP2 / DTensor ``Shard(0)`` on the data-parallel mesh."""
    for n in names:
        entry = manifest.tensors[n]
        if len(entry.shape) == 0:
            return False
        boxes = {c.box for c in entry.chunks}
        if not _by_ranks(manifest, n):
            return False
        if any(b.offsets[1:] != (0,) * (len(b.offsets) - 1) or b.sizes[1:] != entry.shape[1:]
               for b in boxes):
            return False
    return bool(names)


def propose_zero(manifest: Manifest) -> tuple[int | None, str]:
    """The ZeRO stage the checkpoint's own layout shows, and why, in one line (None: it cannot
    tell). Parameters and optimizer state saved sharded over ranks: 3 (FSDP2's dim-0 shards are
    the layout :func:`infer_layout` keeps for stage 0, see :func:`is_fsdp2`); only the optimizer
    state: 1 (2 differs from 1 in gradients, which no checkpoint holds); nothing sharded: 0.
    Optimizer state is what a top-level key naming an optimizer holds."""
    names = [n for n, t in manifest.tensors.items()
             if not n.startswith(LOCAL_PREFIX + "/") and len(t.shape) > 0]
    optim = [n for n in names if "optim" in n.split("/")[0].lower()]
    params = [n for n in names if n not in set(optim)]
    ranks = source_writers(manifest)
    p = sum(_by_ranks(manifest, n) for n in params)
    o = sum(_by_ranks(manifest, n) for n in optim)
    if p == o == 0:
        return 0, "every tensor was saved whole (replicated, or by one rank)"
    if p == len(params) and o == len(optim):
        how = "along dim 0 (FSDP2)" if is_fsdp2(manifest) else "(ZeRO 3)"
        return 3, f"parameters and optimizer state were saved sharded {how} over {ranks} ranks"
    if p == 0 and o == len(optim):
        return 1, (f"the optimizer state was saved sharded over {ranks} ranks, the parameters "
                   "whole (ZeRO 1; 2 differs only in gradients, which a checkpoint does not hold)")
    return None, (f"{p} of {len(params)} parameter tensors and {o} of {len(optim)} optimizer "
                  "tensors were saved sharded")


def is_fsdp2(manifest: Manifest) -> bool:
    """Whether every tensor but 0-d ones was saved as dim-0 shards of several ranks."""
    names = [n for n, t in manifest.tensors.items()
             if not n.startswith(LOCAL_PREFIX + "/") and len(t.shape) > 0]
    return _dim0_sharded(manifest, names)


def detect_layer_pattern(names: list[str]) -> str | None:
    counts = {p: sum(1 for n in names if re.search(p, n)) for p in LAYER_PATTERNS}
    best = max(counts, key=lambda p: counts[p])
    return best if counts[best] else None


@dataclass
class _Split:
    note: str
    tp_dim: int | None = None
    split: str = "even"
    fused: tuple[int, ...] | None = None

    @property
    def replicated(self) -> bool:
        return self.tp_dim is None


def _classify(fqn: str, shapes: list[tuple[int, ...]], tp: int) -> _Split:
    """How the tensors of one normalised name are split, and why."""
    low, ndim = "." + fqn.lower(), len(shapes[0])
    is_bias = low.endswith(".bias")
    if ndim == 0 or (_NORM.search(low) and ndim == 1):
        return _Split("norm or scalar: replicated")
    if _VOCAB.search(low) and ndim == 2:
        return _even(_Split("vocabulary-parallel: rows split over TP", 0), shapes, tp,
                     " (Megatron pads instead: split = 'padded', divisible_by = N)")
    if _FIRST.search(low):
        return _Split("position embedding: replicated")
    fused = _QKV.search(low) or _GATE_UP.search(low)
    parts = 3 if _QKV.search(low) else 2
    if fused and (ndim == 2 or is_bias) and shapes[0][0] % parts == 0:
        part = shapes[0][0] // parts
        out = _Split(f"fused {'q/k/v' if parts == 3 else 'gate/up'}: each part split over TP",
                     0, fused=(part,) * parts)
        if parts == 3 and ndim == 2 and shapes[0][0] != 3 * shapes[0][1]:
            out.note += "; check the part sizes (grouped-query attention has smaller k/v)"
        return _even(out, [(part,)], tp, "")
    if _COLUMN.search(low + ".") or (fused and ndim == 2):
        return _even(_Split("column-parallel: output rows split over TP", 0), shapes, tp, "")
    if _ROW.search(low + "."):
        if is_bias or ndim == 1:
            return _Split("row-parallel bias: replicated")
        return _even(_Split("row-parallel: input columns split over TP", 1), shapes, tp, "")
    return _Split("role not recognised: replicated (review)")


def _even(split: _Split, shapes: list[tuple[int, ...]], tp: int, hint: str) -> _Split:
    """Fall back to torch.chunk rounding when the split dimension does not divide by ``tp``."""
    dim = split.tp_dim or 0
    bad = [s[dim] for s in shapes if s[dim] % tp]
    if bad:
        split.split = "chunk"
        split.note += f"; {bad[0]} does not divide by tp {tp}: torch.chunk rounding{hint}"
    return split


def infer_layout(manifest: Manifest, tp: int = 1, pp: int = 1, zero: int = 0,
                 source: str = "<inferred>") -> LayoutSpec:
    names = sorted(n for n in manifest.tensors if not n.startswith(LOCAL_PREFIX + "/"))
    layer = detect_layer_pattern(names)
    by_fqn: dict[str, list[str]] = {}
    globs: dict[str, set[str]] = {}
    for n in names:
        fqn, below = _fqn(n, len(manifest.tensors[n].shape))
        key = _norm_fqn(fqn, layer)
        by_fqn.setdefault(key, []).append(n)
        globs.setdefault(key, set()).add(_glob(n, key, below))
    # FSDP2 (DTensor Shard(0) over data parallelism): keep sharding along dim 0 over DP,
    # unless the optimizer state is to go into ZeRO flat buffers (which exclude it)
    fsdp = zero == 0 and tp == 1
    rules = []
    first: list[str] = []
    last: list[str] = []
    # 0-d entries (Adam's step) first: the first matching rule decides, and `*/<fqn>/*` of the
    # parameter's rule would match them too
    def scalars_first(item: tuple[str, list[str]]) -> tuple[bool, str]:
        return (any(manifest.tensors[n].shape for n in item[1]), item[0])

    for i, (key, members) in enumerate(sorted(by_fqn.items(), key=scalars_first), 1):
        shapes = [manifest.tensors[n].shape for n in members]
        c = _classify(key, shapes, tp)
        dp_dim = 0 if fsdp and not c.fused and _dim0_sharded(manifest, members) else None
        note = c.note
        if dp_dim is not None:
            note = (note.replace(": replicated", ": not split over TP") + "; sharded along dim 0 "
                    "over data parallelism (FSDP2 / DTensor Shard(0))")
        match = tuple(sorted(globs[key]))
        rules.append(Rule(i, match, tp_dim=c.tp_dim, split=c.split, fused=c.fused,
                          dp_dim=dp_dim, replicated=c.replicated and dp_dim is None,
                          note=note))
        if layer is None or not re.search(layer, members[0]):
            (first if _FIRST.search(key.lower()) else last).extend(match)
    prefixes = Counter(_group_key(n) for n in names)
    groups = tuple(
        ZeroGroup((p,), "params" if p.split("/")[0] in ("model", "module", "params", "param", "*")
                  else "optimizer")
        for p in sorted(prefixes))
    layer_glob = (LAYER_PATTERNS[layer],) if layer is not None else ()
    return LayoutSpec(
        rules=tuple(rules), tp=tp, pp=pp,
        pipeline=Pipeline(layer=layer or Pipeline.layer, first=tuple(first), last=tuple(last)),
        zero=Zero(stage=zero, groups=groups, order=tuple(first) + layer_glob),
        source=source)
