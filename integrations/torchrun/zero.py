"""ZeRO-style data parallelism over padded flat buffers, and how it is declared to ckptd.

All parameters of a rank live in one flat fp32 buffer (the concatenation of its parameters'
boxes, padded to a multiple of the data-parallel size ``W``); gradients and Adam's two moments
use the same layout. Rank ``r`` owns elements ``[r*S, (r+1)*S)`` (``S = padded / W``):

=====  =====================  ====================================  ===========================
stage  parameters (saved)     gradients                             Adam moments (saved)
=====  =====================  ====================================  ===========================
0      full, replicated       full; all-reduce per step             full, replicated
1      full, replicated       full; reduce-scatter per step         own shard
2      full, replicated       reduce-scatter after each micro-batch own shard
3      own shard (+ a full    full; reduce-scatter per step         own shard
       buffer gathered for
       compute)
=====  =====================  ====================================  ===========================

:meth:`FlatZero.state` describes the saved buffers as :class:`ckptd.FlatShard` leaves whose
members are the logical parameters (boxes of them under tensor parallelism), so a checkpoint
saved under any stage, world or TP degree loads into any other.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from model import ParamSpec, init_value

import ckptd

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FlatZero:
    def __init__(self, specs: list[ParamSpec], *, stage: int, dp_size: int, dp_rank: int,
                 dp_group: Any = None, seed: int = 0, betas: tuple[float, float] = (0.9, 0.98),
                 eps: float = 1e-8) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
        self.specs, self.stage = specs, stage
        self.world, self.rank, self.group = dp_size, dp_rank, dp_group
        self.betas, self.eps = betas, eps
        self.numel = sum(math.prod(s.sizes) for s in specs)
        self.shard = -(-self.numel // dp_size)
        self.padded = self.shard * dp_size
        lo, hi = dp_rank * self.shard, (dp_rank + 1) * self.shard
        self.params = torch.zeros(self.padded)  # the compute buffer (full in every stage)
        self.grads = torch.zeros(self.padded)
        self.views: dict[str, torch.Tensor] = {}
        self.offsets: list[tuple[int, int]] = []
        off = 0
        for s in specs:
            n = math.prod(s.sizes)
            self.params[off:off + n] = init_value(s, seed).reshape(-1)
            view = self.params[off:off + n].view(s.sizes)
            view.requires_grad_(True)
            self.views[s.name] = view
            self.offsets.append((off, n))
            off += n
        self.param_shard = self.params[lo:hi].clone() if stage == 3 else self.params[lo:hi]
        opt = self.padded if stage == 0 else self.shard
        self.exp_avg, self.exp_avg_sq = torch.zeros(opt), torch.zeros(opt)
        self.grad_shard = torch.zeros(self.shard) if stage >= 1 else None

    # --------------------------------------------------------------- the checkpoint contract
    def members(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        return [(s.name, s.global_shape, s.offsets, s.sizes) for s in self.specs]

    def _leaf(self, full: torch.Tensor, shard: torch.Tensor, sharded: bool) -> ckptd.FlatShard:
        if sharded:
            return ckptd.FlatShard(shard, self.members(), self.rank * self.shard)
        return ckptd.FlatShard(full, self.members(), 0, replica=self.rank, replicas=self.world)

    def state(self) -> dict[str, Any]:
        """The saved state: ``model/<param>`` and ``optim/exp_avg(_sq)/<param>``."""
        model = self._leaf(self.params, self.param_shard, self.stage == 3)
        optim = {k: {"flat": self._leaf(buf, buf, self.stage >= 1)}
                 for k, buf in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq))}
        return {"model": {"flat": model}, "optim": optim}

    def after_load(self) -> None:
        """Rebuild the compute buffer from the loaded shards (stage 3)."""
        if self.stage == 3:
            _all_gather(self.params, self.param_shard, group=self.group)

    # --------------------------------------------------------------- training
    def accumulate(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch into the flat gradient buffer."""
        views = list(self.views.values())
        grads = torch.autograd.grad(loss, views)
        for (off, n), g in zip(self.offsets, grads, strict=True):
            self.grads[off:off + n].add_(g.reshape(-1))
        if self.stage == 2:  # gradients are sharded as soon as they exist
            assert self.grad_shard is not None
            part = torch.empty(self.shard)
            _reduce_scatter(part, self.grads, group=self.group)
            self.grad_shard.add_(part)
            self.grads.zero_()

    @torch.no_grad()
    def step(self, lr: float, t: int) -> None:
        """Adam step ``t`` (1-based) on this rank's part, then re-assemble the parameters."""
        if self.stage == 0:
            dist.all_reduce(self.grads, group=self.group)
            grad, param = self.grads, self.params
        else:
            assert self.grad_shard is not None
            if self.stage != 2:
                _reduce_scatter(self.grad_shard, self.grads, group=self.group)
            grad, param = self.grad_shard, self.param_shard
        b1, b2 = self.betas
        self.exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (self.exp_avg_sq / (1 - b2 ** t)).sqrt_().add_(self.eps)
        param.addcdiv_(self.exp_avg, denom, value=-lr / (1 - b1 ** t))
        if self.stage >= 1:
            _all_gather(self.params, param.clone(), group=self.group)
        self.grads.zero_()
        if self.grad_shard is not None:
            self.grad_shard.zero_()
