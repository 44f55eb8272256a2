"""The on-disk format: the manifest's schema (``schema``), its envelope (digest, size limit,
strict JSON: ``envelope``), reading it back (``parse``; a chunk's row: ``rows``; the checks of
fields they share: ``fields``), frame tables (``frames``), frame codecs
and checksums (``codecs``), merging rank partials and the coverage check (``merge``) and where
things live under a root (``layout``).

No I/O here: bytes in, records out (``ckptd.catalog`` reads them from storage). Nothing here
imports torch (dtypes are kept by name, ``ckptd.dtypes``; a ``TensorEntry``'s ``dtype`` imports
it when asked for). Names are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CHECKSUM": "ckptd.manifest.schema",
    "VERSION": "ckptd.manifest.envelope",
    "Chunk": "ckptd.manifest.schema",
    "Frame": "ckptd.manifest.frames",
    "FrameRef": "ckptd.manifest.frames",
    "FrameTable": "ckptd.manifest.frames",
    "Manifest": "ckptd.manifest.schema",
    "TensorEntry": "ckptd.manifest.schema",
    "decode": "ckptd.manifest.parse",
    "dtype_from_name": "ckptd.manifest.schema",
    "dtype_name": "ckptd.manifest.schema",
    "find_hole": "ckptd.manifest.merge",
    "merge": "ckptd.manifest.merge",
}

__all__ = [
    "CHECKSUM",
    "Chunk",
    "Frame",
    "FrameRef",
    "FrameTable",
    "Manifest",
    "TensorEntry",
    "VERSION",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "find_hole",
    "merge",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd.manifest' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    # every name of that module at once: importing ckptd.manifest.merge sets this package's
    # attribute "merge" to the submodule, which would hide the function of that name
    for export, where in _EXPORTS.items():
        if where == module:
            globals()[export] = getattr(loaded, export)
    return globals()[name]


if TYPE_CHECKING:
    from ckptd.manifest.envelope import VERSION
    from ckptd.manifest.frames import Frame, FrameRef, FrameTable
    from ckptd.manifest.merge import find_hole, merge
    from ckptd.manifest.parse import decode
    from ckptd.manifest.schema import (
        CHECKSUM,
        Chunk,
        Manifest,
        TensorEntry,
        dtype_from_name,
        dtype_name,
    )
