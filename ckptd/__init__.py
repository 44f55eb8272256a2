"""ckptd: world-size-agnostic, non-stalling checkpoints for elastic distributed PyTorch training.

The public surface is exactly ``__all__`` (API.md's names, plus the three errors
``docs/api.md`` adds); everything else is private. Names are imported on first use, so that
``import ckptd`` (and the ``ckptd`` command's start-up, ``--help``, ``ls``, ``plan``) does not
pay for importing torch (seconds) until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptd._version import __version__ as __version__

_EXPORTS = {
    "close": "ckptd.api",
    "init": "ckptd.api",
    "latest_step": "ckptd.api",
    "load": "ckptd.api",
    "save": "ckptd.api",
    "save_async": "ckptd.api",
    "wait": "ckptd.api",
    "delete": "ckptd.api",
    "metadata": "ckptd.api",
    "should_save": "ckptd.api",
    "steps": "ckptd.api",
    "StepMetadata": "ckptd.step_metadata",
    "TensorMetadata": "ckptd.step_metadata",
    "SaveEvery": "ckptd.elastic.save_policy",
    "KeepAny": "ckptd.policies",
    "KeepBest": "ckptd.policies",
    "KeepEvery": "ckptd.policies",
    "KeepLast": "ckptd.policies",
    "Checkpointer": "ckptd.checkpointer",
    "LoadResult": "ckptd.loader.reader",
    "on_preemption": "ckptd.elastic.preemption",
    "reshard": "ckptd.elastic.reshard",
    "preempted": "ckptd.elastic.preemption",
    "CheckpointNotFound": "ckptd.errors",
    "CkptdError": "ckptd.errors",
    "CorruptCheckpoint": "ckptd.errors",
    "ForeignWriter": "ckptd.errors",
    "StateMismatch": "ckptd.errors",
    "StorageError": "ckptd.errors",
    "FlatShard": "ckptd.sharding",
    "Fused": "ckptd.sharding",
    "Local": "ckptd.sharding",
    "Shard": "ckptd.sharding",
    "Phase": "ckptd.writer.handle",
    "SaveHandle": "ckptd.writer.handle",
    "SaveResult": "ckptd.writer.handle",
}

__all__ = [
    "CheckpointNotFound",
    "Checkpointer",
    "CkptdError",
    "CorruptCheckpoint",
    "FlatShard",
    "ForeignWriter",
    "Fused",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LoadResult",
    "Local",
    "Phase",
    "SaveEvery",
    "SaveHandle",
    "SaveResult",
    "Shard",
    "StateMismatch",
    "StepMetadata",
    "StorageError",
    "TensorMetadata",
    "close",
    "delete",
    "elastic",
    "init",
    "latest_step",
    "load",
    "metadata",
    "on_preemption",
    "preempted",
    "reshard",
    "save",
    "save_async",
    "should_save",
    "steps",
    "wait",
]


def __getattr__(name: str) -> Any:
    if name == "elastic":
        return importlib.import_module("ckptd.elastic")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ckptd import elastic
    from ckptd.api import (
        close,
        delete,
        init,
        latest_step,
        load,
        metadata,
        save,
        save_async,
        should_save,
        steps,
        wait,
    )
    from ckptd.checkpointer import Checkpointer
    from ckptd.elastic.preemption import on_preemption, preempted
    from ckptd.elastic.reshard import reshard
    from ckptd.elastic.save_policy import SaveEvery
    from ckptd.errors import (
        CheckpointNotFound,
        CkptdError,
        CorruptCheckpoint,
        ForeignWriter,
        StateMismatch,
        StorageError,
    )
    from ckptd.loader.reader import LoadResult
    from ckptd.policies import KeepAny, KeepBest, KeepEvery, KeepLast
    from ckptd.sharding import FlatShard, Fused, Local, Shard
    from ckptd.step_metadata import StepMetadata, TensorMetadata
    from ckptd.writer.handle import Phase, SaveHandle, SaveResult
