"""Host memory in the shape of a tensor, without torch: what the offline reshard moves.

The load planner, the reader and the writer were written for torch tensors: they view pieces of
an arena (``arena[a:b].view(dtype).view(shape)``), narrow them, copy into them and hand their
addresses to ``memmove``. ``ckptd reshard`` only moves bytes, and ``import torch`` alone is ~220
MiB of resident memory, most of a 256 MiB target. :class:`HostArray` is a numpy array with the
part of the tensor interface those modules use, so the same planner, reader and writer run on it
unchanged: its dtype is the format's name (``"bfloat16"``), its elements numpy's unsigned
integers of that width (:func:`ckptd.dtypes.host_dtype`), which is all a byte-exact copy needs.
Nothing here converts values; a HostArray never meets a tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np

from ckptd import dtypes


class _Device(NamedTuple):
    type: str


_CPU = _Device("cpu")


class HostArray:
    """A CPU array of ``dtype`` (a format dtype name) over a numpy array of that item size."""

    __slots__ = ("a", "dtype")

    is_cuda = False
    device = _CPU

    def __init__(self, a: np.ndarray[Any, Any], dtype: str) -> None:
        self.a, self.dtype = a, dtype

    @staticmethod
    def empty(sizes: tuple[int, ...], dtype: str) -> HostArray:
        return HostArray(np.empty(sizes, dtypes.host_dtype(dtype)), dtype)

    @staticmethod
    def meta(sizes: tuple[int, ...], dtype: str) -> HostArray:
        """Shape and size without memory (one element, broadcast): for planning."""
        return HostArray(np.broadcast_to(np.empty((), dtypes.host_dtype(dtype)), sizes), dtype)

    @staticmethod
    def bytes(n: int, align: int = 4096) -> HostArray:
        """``n`` bytes (uint8), uninitialised, starting at a multiple of ``align``."""
        raw = np.empty(n + align, np.uint8)
        shift = -raw.ctypes.data % align
        return HostArray(raw[shift : shift + n], "uint8")

    @staticmethod
    def over(buf: Any) -> HostArray:
        """uint8 over ``buf`` (bytes-like), without a copy."""
        return HostArray(np.frombuffer(buf, np.uint8), "uint8")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.a.shape)

    def numel(self) -> int:
        return self.a.size

    def element_size(self) -> int:
        return self.a.itemsize

    def dim(self) -> int:
        return self.a.ndim

    def is_contiguous(self) -> bool:
        return bool(self.a.flags.c_contiguous)

    def data_ptr(self) -> int:
        return int(self.a.ctypes.data)

    def storage_offset(self) -> int:
        """0: numpy reinterprets bytes at any address, so a dtype view never needs realigning
        (the one use of a tensor's storage offset here; the realigning ``clone`` is never
        reached)."""
        return 0

    def numpy(self) -> np.ndarray[Any, Any]:
        return self.a

    def detach(self) -> HostArray:
        return self

    def reshape(self, *sizes: Any) -> HostArray:
        return HostArray(self.a.reshape(*sizes), self.dtype)

    def view(self, what: Any) -> HostArray:
        """A dtype name reinterprets the last dimension; a shape reshapes (``Tensor.view``)."""
        if isinstance(what, str):
            return HostArray(self.a.view(dtypes.host_dtype(what)), what)
        return HostArray(self.a.reshape(what), self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> HostArray:
        index = [slice(None)] * self.a.ndim
        index[dim] = slice(start, start + length)
        return HostArray(self.a[tuple(index)], self.dtype)

    def __getitem__(self, index: Any) -> HostArray:
        out = self.a[index]
        if not isinstance(out, np.ndarray):  # numpy gives a scalar for a whole 0-d index
            out = self.a[(*index, ...) if isinstance(index, tuple) else (index, ...)]
        return HostArray(out, self.dtype)

    def copy_(self, src: HostArray, non_blocking: bool = False) -> HostArray:
        np.copyto(self.a, src.a, casting="no")
        return self

    def __repr__(self) -> str:
        return f"HostArray({self.dtype}, {list(self.shape)})"


def no_grad(t: Any) -> Any:
    """The context for copying into ``t``: ``torch.no_grad()`` for a tensor, nothing for a
    HostArray (which has no autograd, and no torch to import)."""
    if isinstance(t, HostArray):
        return contextlib.nullcontext()
    import torch

    return torch.no_grad()


def flat_bytes(t: Any) -> Any:
    """A flat uint8 view of ``t`` (contiguous; a tensor or a HostArray)."""
    flat = t.detach().reshape(-1)
    if isinstance(flat, HostArray):
        return flat.view("uint8")
    import torch

    return flat.view(torch.uint8)
