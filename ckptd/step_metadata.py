"""What a committed step holds, as users see it (``Checkpointer.metadata``,
``ckptd.metadata``): its tensors' dtypes and global shapes, the world that saved it, its
``training=`` metadata, its size and time — read from the head of its manifest alone
(:func:`ckptd.catalog.read_head`), never its chunks or its data."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ckptd import dtypes
from ckptd.catalog import read_head
from ckptd.manifest import layout
from ckptd.storage import Storage

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorMetadata:
    """A saved tensor as :class:`StepMetadata` shows it: its dtype and global shape (whatever
    the sharding it was saved with).

    Attributes:
        dtype_name: the dtype's name in the format: ``"float32"``, ``"bfloat16"``, ...
        shape: the global shape.

    Example:
        import tempfile
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"w": torch.zeros(8, 4)}, step=1)
            w = ckpt.metadata(1).tensors["w"]
        assert (w.dtype_name, w.shape, w.dtype, w.nbytes) == ("float32", (8, 4),
                                                             torch.float32, 128)
    """

    dtype_name: str  #: the dtype's name in the format: ``"float32"``, ``"bfloat16"``, ...
    shape: tuple[int, ...]  #: the global shape

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch)."""
        return dtypes.torch_dtype(self.dtype_name)

    @property
    def nbytes(self) -> int:
        """The tensor's bytes in memory: its elements times the dtype's size."""
        return math.prod(self.shape) * dtypes.ITEMSIZE[self.dtype_name]


@dataclass(frozen=True)
class StepMetadata:
    """What a committed step holds, read from its manifest alone (no tensor data is read):
    ``Checkpointer.metadata(step)``. Read-only: the mappings cannot be changed.

    ``tensors``: every saved tensor by name (the state tree's path, ``"model/l0.w"``; a
    ``Local`` tensor of rank r as ``"__local__/r/<path>"``), its :class:`TensorMetadata`;
    ``world_size``: the number of ranks that saved it; ``training``: the ``training=`` dict of
    its save (lists as tuples); ``nbytes``: the bytes of its tensor data before compression
    (each stored chunk once); ``created``: when its last rank finished writing (``time.time()``
    seconds), the moment just before the commit.

    Attributes:
        step: the step number.
        url: the step's directory.
        world_size: the number of ranks that saved it.
        tensors: name -> :class:`TensorMetadata`.
        training: the ``training=`` dict of its save.
        nbytes: its tensor bytes before compression.
        created: when its last rank finished writing.

    Example:
        import tempfile
        import time
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ckpt.save({"w": torch.zeros(4), "b": torch.zeros(2)}, step=7,
                      training={"epoch": 1})
            meta = ckpt.metadata()
        assert meta.step == 7 and sorted(meta.tensors) == ["b", "w"]
        assert meta.nbytes == 24 and meta.training == {"epoch": 1}
        assert meta.created <= time.time()
    """

    step: int
    url: str  #: the step's directory
    world_size: int
    tensors: Mapping[str, TensorMetadata]
    training: Mapping[str, Any]
    nbytes: int
    created: float


def step_metadata(storage: Storage, step: int) -> StepMetadata:
    """:class:`StepMetadata` of committed ``step``: its manifest read, nothing else."""
    got = read_head(storage, step)
    tensors = {n: TensorMetadata(d, tuple(shape)) for n, (d, shape) in got.tensors.items()}
    return StepMetadata(step, f"{storage.url}/{layout.step_dir(step)}", got.world_size,
                        MappingProxyType(tensors), _frozen(got.training), got.nbytes,
                        got.created)


def _frozen(value: Any) -> Any:
    """A read-only copy of decoded JSON: mappings as mapping proxies, lists as tuples."""
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


__all__ = ["StepMetadata", "TensorMetadata", "step_metadata"]
