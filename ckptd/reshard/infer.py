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

from ckptd.manifest import Manifest
from ckptd.reshard.layout_file import LayoutSpec, Pipeline, Rule, Zero, ZeroGroup
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


def _norm_fqn(name: str, layer: str | None) -> str:
    fqn = name.rpartition("/")[2]
    return re.sub(r"\.\d+\.", ".*.", fqn) if layer else fqn


def _glob(name: str, fqn: str) -> str:
    return f"*/{fqn}" if "/" in name else fqn


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
    for n in names:
        by_fqn.setdefault(_glob(n, _norm_fqn(n, layer)), []).append(n)
    rules = []
    first: list[str] = []
    last: list[str] = []
    for i, (glob, members) in enumerate(sorted(by_fqn.items()), 1):
        shapes = [manifest.tensors[n].shape for n in members]
        c = _classify(glob.rpartition("/")[2], shapes, tp)
        rules.append(Rule(i, (glob,), tp_dim=c.tp_dim, split=c.split, fused=c.fused,
                          replicated=c.replicated, note=c.note))
        if layer is None or not re.search(layer, members[0]):
            (first if _FIRST.search(glob.lower()) else last).append(glob)
    prefixes = Counter(n.rpartition("/")[0] for n in names)
    groups = tuple(
        ZeroGroup((f"{p}/*" if p else "*",),
                  "params" if p.split("/")[0] in ("model", "module", "params", "param", "")
                  else "optimizer")
        for p in sorted(prefixes))
    layer_glob = (LAYER_PATTERNS[layer],) if layer is not None else ()
    return LayoutSpec(
        rules=tuple(rules), tp=tp, pp=pp,
        pipeline=Pipeline(layer=layer or Pipeline.layer, first=tuple(first), last=tuple(last)),
        zero=Zero(stage=zero, groups=groups, order=tuple(first) + layer_glob),
        source=source)
