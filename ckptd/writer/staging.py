"""Staging: the one copy that blocks the caller.

Each writer piece is copied into a host *arena*, at the same offset it will have in its data
file, so the arena is the image of the rank's files and the background writer sends it to
storage without another copy. Arenas are allocated once (sized by the first save, grown only if
a later save is larger) and reused: a copy into reused memory runs at memcpy speed, into fresh
memory it is page-fault bound, several times slower (``benchmarks/README.md``).

On CUDA, arenas are pinned and the copies run on a side stream; ``stage`` synchronises that
stream before returning, so "staged" always means "the source may now be modified".
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd.hostarray import HostArray

if TYPE_CHECKING:
    import torch

ALIGN = 4096


def _aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes`` whose data pointer is ALIGN-aligned (O_DIRECT)."""
    import torch

    raw = torch.zeros(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes]


@dataclass
class Arena:
    buffer: torch.Tensor | HostArray  # uint8, aligned
    in_use: bool = False

    @property
    def tensor(self) -> torch.Tensor:
        """``buffer`` as a tensor: every arena of a save (the offline reshard's are HostArrays)."""
        if isinstance(self.buffer, HostArray):
            raise TypeError("a HostArray arena where a tensor is needed")
        return self.buffer

    @property
    def capacity(self) -> int:
        return self.buffer.numel()


class StagingPool:
    """At most ``slots`` arenas (one per in-flight save); ``allocations`` counts every
    allocation so tests can assert reuse without timing anything."""

    def __init__(self, slots: int = 1, pin: bool | None = None,
                 allocate: Callable[[int], torch.Tensor | HostArray] | None = None) -> None:
        """``allocate``: where arena memory comes from instead of this process's heap (the node
        agent's shared memory, page-aligned; host memory without torch for the offline
        reshard)."""
        self.slots = max(1, slots)
        if pin is None:
            import torch

            pin = torch.cuda.is_available()
        self.pin = pin
        self._allocate_with = allocate
        self.allocations = 0
        self._arenas: list[Arena] = []
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> Arena:
        """A free arena of at least ``nbytes``; blocks while every slot is in flight."""
        with self._cond:
            while True:
                free = [a for a in self._arenas if not a.in_use]
                fits = [a for a in free if a.capacity >= nbytes]
                if fits:
                    arena = min(fits, key=lambda a: a.capacity)
                    break
                if len(self._arenas) < self.slots:
                    arena = Arena(self._allocate(nbytes))
                    self._arenas.append(arena)
                    break
                if free:  # grow the smallest free arena
                    arena = min(free, key=lambda a: a.capacity)
                    arena.buffer = self._allocate(nbytes)
                    break
                self._cond.wait()
            arena.in_use = True
            return arena

    def release(self, arena: Arena) -> None:
        with self._cond:
            arena.in_use = False
            self._cond.notify_all()

    def release_buffer(self, data_ptr: int) -> None:
        """Release the arena whose buffer starts at ``data_ptr`` (one the node agent held)."""
        with self._cond:
            for a in self._arenas:
                if a.buffer.data_ptr() == data_ptr:
                    a.in_use = False
            self._cond.notify_all()

    def _allocate(self, nbytes: int) -> torch.Tensor | HostArray:
        self.allocations += 1
        if self._allocate_with is not None:
            return self._allocate_with(max(nbytes, ALIGN))
        return _aligned_empty(max(nbytes, ALIGN), self.pin)

    @property
    def nbytes(self) -> int:
        return sum(a.capacity for a in self._arenas)


def copy_into(arena: Any, offset: int, src: Any) -> None:
    """Copy ``src`` (any strides, any device) into ``arena[offset:]`` row-major: two tensors, or
    two HostArrays (the offline reshard's).

    A contiguous CPU source is copied with one ``memmove`` (it releases the GIL): torch's
    ``copy_`` splits every call over its intra-op threads, and with hundreds of pieces on a busy
    2-core host each call waits for the other thread to be scheduled (measured: 0.66-2.5 s for a
    2 GiB state vs 0.16-0.19 s single-threaded; see benchmarks/README.md).
    """
    n = src.numel() * src.element_size()
    if n == 0:
        return
    if not src.is_cuda and src.is_contiguous() and src.device.type == "cpu":
        ctypes.memmove(arena.data_ptr() + offset, src.data_ptr(), n)
        return
    dst = arena[offset : offset + n].view(src.dtype).view(src.shape)
    dst.copy_(src, non_blocking=src.is_cuda)

