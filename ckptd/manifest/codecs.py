"""Frame codecs and checksums.

A chunk's raw bytes are cut into frames of ``frame_bytes``; each frame is stored on its own
(``raw``: as is; ``zstd``: one zstd frame; ``zstd-planes``: the frame's bytes regrouped into
byte planes — byte 0 of every element, then byte 1, ... — and then one zstd frame). Each stored
frame carries a checksum of its *stored* bytes, so a reader verifies exactly what it read and a
partial read only ever touches, verifies and decodes the frames it needs.

Byte planes help floating-point data: the sign/exponent plane compresses, mantissa planes are
noise, so grouping them raises zstd's ratio on float tensors.

Checksum: xxh3-64, the fastest of the candidates on one core by about 2x (the figures:
``benchmarks/checksum.py`` and ``benchmarks/README.md``, *Figures the code relies on*).
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash
import zstandard

from ckptd.buffers import Buffer

RAW = "raw"
ZSTD = "zstd"
ZSTD_PLANES = "zstd-planes"
CODECS = (RAW, ZSTD, ZSTD_PLANES)


def checksum(data: Buffer) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def checksum_int(data: Buffer) -> int:
    """:func:`checksum` as the integer a frame table stores."""
    return xxhash.xxh3_64_intdigest(data)


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]  # type: ignore[no-any-return]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d  # type: ignore[no-any-return]


def _planes(raw: Buffer, itemsize: int, inverse: bool) -> bytes:
    """Regroup bytes into planes (byte 0 of every element, then byte 1, ...) or back (numpy's
    strided copy: two to four times faster than torch's here; benchmarks/planes.py)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    n = a.size // itemsize
    shape = (itemsize, n) if inverse else (n, itemsize)
    return np.ascontiguousarray(a.reshape(shape).T).tobytes()


def encode(raw: Buffer, codec: str, itemsize: int, level: int = 1) -> Buffer:
    """The stored form of one frame."""
    if codec == RAW:
        return raw
    if codec == ZSTD:
        return _compressor(level).compress(raw)
    if codec == ZSTD_PLANES:
        planar = _planes(raw, itemsize, inverse=False) if itemsize > 1 else raw
        return _compressor(level).compress(planar)
    raise ValueError(f"unknown codec {codec!r}")


def decode(stored: Buffer, codec: str, raw_len: int, itemsize: int) -> Buffer:
    """Inverse of :func:`encode`; ``raw_len`` is the frame's raw length."""
    if codec == RAW:
        return stored
    out = _decompressor().decompress(stored, max_output_size=raw_len)
    if len(out) != raw_len:
        raise ValueError(f"frame decodes to {len(out)} bytes, expected {raw_len}")
    if codec == ZSTD_PLANES and itemsize > 1:
        return _planes(out, itemsize, inverse=True)
    return out


def parse_compression(spec: str | None) -> tuple[str, int]:
    """``None`` -> raw; ``"zstd"`` / ``"zstd:LEVEL"`` -> byte planes + zstd at that level.

    The default level is 1: on float data it was both ~2x faster than level 3 and compressed
    no worse (only the sign/exponent plane compresses; benchmarks/README.md)."""
    if spec is None or spec in ("none", RAW):
        return RAW, 0
    name, _, level = spec.partition(":")
    if name != "zstd":
        raise ValueError(f"compression must be None or 'zstd[:LEVEL]', got {spec!r}")
    return ZSTD_PLANES, int(level) if level else 1
