"""The manifest: schema, on-storage layout, merging rank partials and the coverage check."""

from ckptd.manifest.merge import find_hole, merge
from ckptd.manifest.schema import (
    CHECKSUM,
    VERSION,
    Chunk,
    Frame,
    Manifest,
    TensorEntry,
    decode,
    dtype_from_name,
    dtype_name,
)

__all__ = [
    "CHECKSUM",
    "VERSION",
    "Chunk",
    "Frame",
    "Manifest",
    "TensorEntry",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "find_hole",
    "merge",
]
