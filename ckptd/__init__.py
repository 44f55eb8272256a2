"""ckptd: world-size-agnostic, non-stalling checkpoints for elastic distributed PyTorch training.

The public surface is exactly ``__all__`` (see API.md); everything else is private.
"""

from ckptd import elastic
from ckptd.api import init, latest_step, load, save, save_async, wait
from ckptd.checkpointer import Checkpointer, LoadResult
from ckptd.elastic.preemption import on_preemption, preempted
from ckptd.errors import CkptdError, CorruptCheckpoint, StateMismatch
from ckptd.sharding import FlatShard, Fused, Local, Shard
from ckptd.writer.handle import SaveHandle, SaveResult

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "CkptdError",
    "CorruptCheckpoint",
    "FlatShard",
    "Fused",
    "Local",
    "LoadResult",
    "SaveHandle",
    "SaveResult",
    "Shard",
    "StateMismatch",
    "elastic",
    "init",
    "latest_step",
    "load",
    "on_preemption",
    "preempted",
    "save",
    "save_async",
    "wait",
]
