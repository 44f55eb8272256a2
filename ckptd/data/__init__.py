"""The data position as part of the checkpoint: a global sample order that any world size
continues exactly (:mod:`ckptd.data.order`, its shuffles in :mod:`ckptd.data.permutation`), the
per-rank micro-batches drawn from it (:mod:`ckptd.data.sampler`), and which order serves which
positions across a change of the data (:mod:`ckptd.data.stream`). ``docs/data.md`` is the
guide."""

from ckptd.data.order import DataMismatch, GlobalOrder, ShardedOrder, StreamOrder, check_spec
from ckptd.data.sampler import GlobalBatchSampler, micro_batch_positions

__all__ = ["DataMismatch", "GlobalBatchSampler", "GlobalOrder", "ShardedOrder", "StreamOrder",
           "check_spec", "micro_batch_positions"]
