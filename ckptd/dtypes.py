"""The element types of the ckptd format, by name, without importing torch.

A manifest names each tensor's dtype (``"bfloat16"``). Saving and loading work with torch
dtypes (:func:`torch_dtype`); what only moves bytes — the offline reshard — needs the item
size alone, and works in numpy arrays of the same width
(:func:`host_dtype`), so that it runs without torch in the process (``import torch`` alone is
~220 MiB of resident memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# Unsigned integers of the same width: numpy has no bfloat16 or float8, and moving bytes needs
# only the width (complex128, 16 bytes, as an opaque 16-byte item)
_HOST = {name: np.dtype(f"u{size}" if size <= 8 else f"V{size}") for name, size in ITEMSIZE.items()}


def name_of(dtype: torch.dtype | str) -> str:
    """The format's name of ``dtype`` (a torch dtype or a name); ValueError when the format
    has none."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} is not supported by the ckptd format")
    return name


def torch_dtype(name: str) -> torch.dtype:
    import torch

    out: torch.dtype = getattr(torch, name)
    return out


def host_dtype(name: str) -> np.dtype[Any]:
    """A numpy dtype of the same item size, to move ``name``'s bytes unchanged."""
    return _HOST[name]
