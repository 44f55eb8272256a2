"""``compression="auto"``: compress only when it makes the save durable sooner.

Compression pays when the storage is slower than the compressor: a local disk usually takes
bytes faster than zstd compresses them on one core, so local saves stay raw, while a slow object
store gains the compression ratio (the measured figures: ``benchmarks/README.md``).

The decision uses bandwidths measured on this rank's own saves: the storage write bandwidth of
every raw save, and the compressor's throughput and ratio on a small sample of the staged bytes
(taken in the background after a raw save, so it costs the training nothing). Estimated time to
durable, per byte::

    raw        = 1 / W
    compressed = max(1 / (Z * threads), 1 / (W * ratio))   (compression overlaps the writes)

and zstd is chosen when it is at least 10 % faster. The first save is always raw (it measures W).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ckptd.manifest import codecs

log = logging.getLogger("ckptd")

SAMPLE_BYTES = 4 << 20
GAIN = 0.9  # compress only if it saves at least 10 %


@dataclass
class AutoCodec:
    threads: int
    level: int = 1
    write_bps: float | None = None  # storage write bandwidth, bytes/s (EMA)
    zstd_bps: float | None = None  # compressor throughput per thread, bytes/s
    ratio: float | None = None  # raw / compressed on the sample

    def choose(self) -> str:
        if self.write_bps is None or self.zstd_bps is None or self.ratio is None:
            return codecs.RAW
        raw = 1.0 / self.write_bps
        compressed = max(1.0 / (self.zstd_bps * self.threads), 1.0 / (self.write_bps * self.ratio))
        return codecs.ZSTD_PLANES if compressed < GAIN * raw else codecs.RAW

    def observe_write(self, nbytes: int, seconds: float, codec: str) -> None:
        """Record a raw write's bandwidth (compressed writes do not measure the storage)."""
        if codec != codecs.RAW or nbytes < (1 << 20) or seconds <= 0:
            return
        bps = nbytes / seconds
        self.write_bps = bps if self.write_bps is None else 0.5 * self.write_bps + 0.5 * bps

    def observe_sample(self, raw: memoryview, itemsize: int) -> None:
        """Measure the compressor on (a prefix of) staged bytes."""
        sample = raw[: min(len(raw), SAMPLE_BYTES)]
        sample = sample[: len(sample) - len(sample) % max(itemsize, 1)]
        if len(sample) < 64 << 10:
            return
        t = time.perf_counter()
        stored = codecs.encode(sample, codecs.ZSTD_PLANES, itemsize, self.level)
        dt = max(time.perf_counter() - t, 1e-9)
        self.zstd_bps = len(sample) / dt
        self.ratio = len(sample) / max(1, len(stored))

    def observe_save(self, nbytes: int, seconds: float, codec: str,
                     slots: list[tuple[torch.Tensor, int, int]], arena: torch.Tensor) -> None:
        """A save's write bandwidth and, once, a compressor sample of its largest float slot
        (``slots``: ``(view, arena offset, nbytes)``)."""
        self.observe_write(nbytes, seconds, codec)
        best = largest_float_slot(slots)
        if best is not None and self.zstd_bps is None:
            offset, size, itemsize = best
            mem = memoryview(arena.numpy()).cast("B")  # type: ignore[arg-type]
            self.observe_sample(mem[offset : offset + size], itemsize)
        log.info(
            "ckptd: compression=auto: write %.2f GB/s, zstd %.2f GB/s/thread, ratio %.2f -> %s",
            (self.write_bps or 0) / 1e9, (self.zstd_bps or 0) / 1e9, self.ratio or 0,
            self.choose())


def largest_float_slot(slots: list[tuple[torch.Tensor, int, int]]) -> tuple[int, int, int] | None:
    """(offset, nbytes, itemsize) of the largest floating-point slot, the most typical sample."""
    best = None
    for view, offset, nbytes in slots:
        if view.is_floating_point() and (best is None or nbytes > best[1]):
            best = (offset, nbytes, view.element_size())
    return best
