"""Which samples each data-parallel rank reads: a function of the stream position and the
batch settings of the current world, nothing else.

An optimizer step consumes the next ``global_batch = dp_size × micro_batch × grad_accum``
positions of the global stream (:mod:`ckptd.data.order`). Micro-step ``m`` of data-parallel
rank ``r`` reads positions ``consumed + (m × dp_size + r) × micro_batch`` onwards, so over every
rank and micro-step a step reads exactly ``[consumed, consumed + global_batch)``. A restart on
another world starts from the saved ``consumed`` with the re-planned settings: the union of what
the new ranks read continues the stream where it stopped, across epoch boundaries too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from ckptd.data.order import Order


def micro_batch_positions(consumed: int, micro_step: int, dp_rank: int, dp_size: int,
                          micro_batch: int) -> range:
    """Stream positions rank ``dp_rank`` reads in micro-step ``micro_step`` of the optimizer
    step that starts at position ``consumed``:
    ``consumed + (micro_step * dp_size + dp_rank) * micro_batch`` on, ``micro_batch`` of them.

    Args:
        consumed: the stream position the optimizer step starts at.
        micro_step: the micro-step within the optimizer step (0 or more).
        dp_rank: this rank's data-parallel rank.
        dp_size: the number of data-parallel ranks.
        micro_batch: samples per micro-batch (at least 1).

    Returns:
        A ``range`` of stream positions.

    Raises:
        ValueError: the arguments name no micro-batch (a rank outside ``dp_size``, ...).

    Example:
        from ckptd.data import micro_batch_positions

        assert micro_batch_positions(100, 1, 0, 2, 4) == range(108, 112)
    """
    if not (0 <= dp_rank < dp_size and micro_step >= 0 and micro_batch >= 1 and consumed >= 0):
        raise ValueError(f"no micro-batch for rank {dp_rank} of {dp_size}, micro-step "
                         f"{micro_step}, micro-batch {micro_batch}, position {consumed}")
    start = consumed + (micro_step * dp_size + dp_rank) * micro_batch
    return range(start, start + micro_batch)


class GlobalBatchSampler(Sampler[list[Any]]):
    """A ``batch_sampler`` for :class:`torch.utils.data.DataLoader`: this rank's micro-batches,
    ``grad_accum`` per optimizer step, from stream position ``consumed`` on, for ``steps``
    optimizer steps (None: without end). Each batch is a list of ``order.index(p)`` (sample
    indices; ``(shard, offset)`` pairs for a sharded order).

    The sampler holds no progress of its own: the run's consumed-samples count is saved with
    the checkpoint, and a resume builds a new sampler from it (``ElasticRun.batch_sampler``).
    A DataLoader's prefetching therefore never moves the saved position.

    Args:
        order: the global order (:class:`~ckptd.data.GlobalOrder`,
            :class:`~ckptd.data.ShardedOrder`).
        consumed: the stream position to start from (the samples consumed so far).
        dp_rank: this rank's data-parallel rank.
        dp_size: the number of data-parallel ranks.
        micro_batch: samples per micro-batch.
        grad_accum: micro-batches per optimizer step (at least 1).
        steps: optimizer steps to yield; None: without end (then it has no ``len()``).

    Raises:
        ValueError: the settings name no micro-batch, or ``grad_accum`` < 1, ``steps`` < 0.

    Example:
        import torch
        from ckptd.data import GlobalBatchSampler, GlobalOrder

        dataset = torch.arange(100) * 10
        sampler = GlobalBatchSampler(GlobalOrder(100, seed=0), consumed=0, dp_rank=0,
                                     dp_size=2, micro_batch=4, grad_accum=2, steps=3)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        assert len(list(loader)) == len(sampler) == 6 and sampler.global_batch == 16
    """

    def __init__(self, order: Order, *, consumed: int, dp_rank: int, dp_size: int,
                 micro_batch: int, grad_accum: int, steps: int | None = None) -> None:
        micro_batch_positions(consumed, 0, dp_rank, dp_size, micro_batch)  # validates
        if grad_accum < 1 or (steps is not None and steps < 0):
            raise ValueError(f"grad_accum must be >= 1 and steps >= 0, got {grad_accum}, {steps}")
        self.order, self.consumed = order, consumed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch, self.grad_accum, self.steps = micro_batch, grad_accum, steps

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: ``dp_size * micro_batch * grad_accum``."""
        return self.dp_size * self.micro_batch * self.grad_accum

    def __iter__(self) -> Iterator[list[Any]]:
        step = 0
        while self.steps is None or step < self.steps:
            at = self.consumed + step * self.global_batch
            for micro in range(self.grad_accum):
                yield [self.order.index(p) for p in micro_batch_positions(
                    at, micro, self.dp_rank, self.dp_size, self.micro_batch)]
            step += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("a GlobalBatchSampler without steps has no length")
        return self.steps * self.grad_accum
