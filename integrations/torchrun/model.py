"""A tiny decoder-only transformer (pre-LN GPT), written functionally over a dict of parameter
tensors so that the parameters can be views into a ZeRO flat buffer (``zero.py``).

Tensor parallelism (Megatron-style, ``tp`` ranks): q/k/v and the first MLP layer are split by
output rows (column-parallel), the attention output and second MLP layer by input columns
(row-parallel, followed by an all-reduce); embeddings, norms and the biases after an all-reduce
are replicated. :func:`param_specs` lists every logical tensor with the box a TP rank holds.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 64
    seq_len: int = 16
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    ffn: int = 64


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # of this TP rank's box
    sizes: tuple[int, ...]
    init: str  # "normal", "zeros", "ones"


def param_specs(cfg: Config, tp: int = 1, tp_rank: int = 0) -> list[ParamSpec]:
    """Every parameter, in flat-buffer order, with this TP rank's box."""
    if cfg.heads % tp or cfg.ffn % tp:
        raise ValueError(f"heads {cfg.heads} and ffn {cfg.ffn} must be divisible by tp={tp}")
    d, f = cfg.hidden, cfg.ffn
    specs: list[ParamSpec] = []

    def add(name: str, shape: tuple[int, ...], init: str, split: int | None = None) -> None:
        offsets, sizes = [0] * len(shape), list(shape)
        if split is not None and tp > 1:
            sizes[split] = shape[split] // tp
            offsets[split] = tp_rank * sizes[split]
        specs.append(ParamSpec(name, shape, tuple(offsets), tuple(sizes), init))

    add("tok_emb", (cfg.vocab_size, d), "normal")
    add("pos_emb", (cfg.seq_len, d), "normal")
    for i in range(cfg.layers):
        p = f"layers.{i}."
        add(p + "ln1.weight", (d,), "ones")
        add(p + "ln1.bias", (d,), "zeros")
        for w in ("q", "k", "v"):
            add(p + f"attn.{w}.weight", (d, d), "normal", split=0)
        add(p + "attn.o.weight", (d, d), "normal", split=1)
        add(p + "attn.o.bias", (d,), "zeros")
        add(p + "ln2.weight", (d,), "ones")
        add(p + "ln2.bias", (d,), "zeros")
        add(p + "mlp.fc1.weight", (f, d), "normal", split=0)
        add(p + "mlp.fc1.bias", (f,), "zeros", split=0)
        add(p + "mlp.fc2.weight", (d, f), "normal", split=1)
        add(p + "mlp.fc2.bias", (d,), "zeros")
    add("ln_f.weight", (d,), "ones")
    add("ln_f.bias", (d,), "zeros")
    return specs


def num_parameters(cfg: Config) -> int:
    return sum(math.prod(s.global_shape) for s in param_specs(cfg))


def init_value(spec: ParamSpec, seed: int) -> torch.Tensor:
    """This rank's box of the deterministic initial value (the same logical tensor in every
    layout: it is drawn whole, from a generator seeded by the name, then sliced)."""
    if spec.init == "ones":
        full = torch.ones(spec.global_shape)
    elif spec.init == "zeros":
        full = torch.zeros(spec.global_shape)
    else:
        g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(spec.name.encode()))
        full = torch.randn(spec.global_shape, generator=g) * 0.02
    box = tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.sizes, strict=True))
    return full[box].clone()


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over the TP group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def forward(p: dict[str, torch.Tensor], idx: torch.Tensor, targets: torch.Tensor, cfg: Config,
            tp: int = 1, tp_group: Any = None) -> torch.Tensor:
    """Per-sample mean cross-entropy, shape ``(batch,)``."""
    b, t = idx.shape
    local_heads = cfg.heads // tp
    hd = cfg.hidden // cfg.heads

    def enter(x: torch.Tensor) -> torch.Tensor:
        return _CopyToTP.apply(x, tp_group) if tp > 1 else x  # type: ignore[no-any-return]

    def leave(x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(x, tp_group) if tp > 1 else x  # type: ignore[no-any-return]

    x = p["tok_emb"][idx] + p["pos_emb"][:t]
    for i in range(cfg.layers):
        q = f"layers.{i}."
        h = enter(F.layer_norm(x, (cfg.hidden,), p[q + "ln1.weight"], p[q + "ln1.bias"]))
        qkv = [(h @ p[q + f"attn.{w}.weight"].T).view(b, t, local_heads, hd).transpose(1, 2)
               for w in ("q", "k", "v")]
        a = F.scaled_dot_product_attention(*qkv, is_causal=True)
        a = a.transpose(1, 2).reshape(b, t, local_heads * hd)
        x = x + leave(a @ p[q + "attn.o.weight"].T) + p[q + "attn.o.bias"]
        h = enter(F.layer_norm(x, (cfg.hidden,), p[q + "ln2.weight"], p[q + "ln2.bias"]))
        u = F.gelu(h @ p[q + "mlp.fc1.weight"].T + p[q + "mlp.fc1.bias"])
        x = x + leave(u @ p[q + "mlp.fc2.weight"].T) + p[q + "mlp.fc2.bias"]
    x = F.layer_norm(x, (cfg.hidden,), p["ln_f.weight"], p["ln_f.bias"])
    logits = x @ p["tok_emb"].T
    loss = F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1), reduction="none")
    return loss.view(b, t).mean(dim=1)
