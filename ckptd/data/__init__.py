"""The data position as part of the checkpoint: a global sample order that any world size
continues exactly (:mod:`ckptd.data.order`, its shuffles in :mod:`ckptd.data.permutation`), the
per-rank micro-batches drawn from it (:mod:`ckptd.data.sampler`), and which order serves which
positions across a change of the data (:mod:`ckptd.data.stream`). ``docs/data.md`` is the
guide."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# imported on first use: the orders and their records are torch-free (``ckptd history`` reads
# them without torch); the sampler is a torch ``Sampler``
_EXPORTS = {
    "DataMismatch": "ckptd.data.order",
    "GlobalOrder": "ckptd.data.order",
    "ShardedOrder": "ckptd.data.order",
    "StreamOrder": "ckptd.data.order",
    "check_spec": "ckptd.data.order",
    "GlobalBatchSampler": "ckptd.data.sampler",
    "micro_batch_positions": "ckptd.data.sampler",
}

__all__ = ["DataMismatch", "GlobalBatchSampler", "GlobalOrder", "ShardedOrder", "StreamOrder",
           "check_spec", "micro_batch_positions"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ckptd.data.order import DataMismatch, GlobalOrder, ShardedOrder, StreamOrder, check_spec
    from ckptd.data.sampler import GlobalBatchSampler, micro_batch_positions
