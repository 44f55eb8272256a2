"""S3 transfer tuning (:class:`S3Transfer`): part sizes, concurrency and the retry policy of
:class:`ckptd.storage.s3_storage.S3Storage`. The defaults are explained in docs/storage.md
("Tuning"); every field can be set by ``CKPTD_S3_<FIELD>``."""

from __future__ import annotations

import dataclasses

from ckptd import config

S3_PROTOCOLS = ("s3", "s3a")


@dataclasses.dataclass(frozen=True)
class S3Transfer:
    """S3 transfer tuning; the defaults are explained in docs/storage.md ("Tuning")."""

    # Upload part size. S3 requires >= 5 MiB for every part but the last. 16 MiB amortises
    # per-request overhead (~10-30 ms on S3) while keeping buffered memory bounded.
    part_bytes: int = 16 << 20
    # An object of known size up to `single_put_parts` x `part_bytes` (128 MiB) is one PUT, not
    # a multipart upload (S3 takes up to 5 GB in one PUT). Data files of a rank under ~1 GiB
    # (>= 64 MiB each, `min_file_bytes`) are then 1 request instead of 2 + size/part_bytes, and
    # there is no CompleteMultipartUpload to wait for; the bandwidth comes from the files written
    # in parallel. docs/storage.md, "Tuning saves to S3", has the measurements. 1: only an
    # object that fits one part is a PUT.
    single_put_parts: int = 8
    # Ranged-GET unit: a read range is fetched by max(1, length // read_part_bytes) concurrent
    # GETs of equal size. 64 MiB: docs/storage.md, "Tuning loads from S3", has the measurements.
    read_part_bytes: int = 64 << 20
    # Requests in flight per storage object (all threads together); also bounds upload buffers:
    # at most `concurrency` x `part_bytes` (16 x 16 MiB = 256 MiB) of bodies are held at once.
    # One S3 connection carries ~50-100 MB/s, so 16 connections approach the NIC of a typical
    # training node.
    concurrency: int = 16
    # Attempts per request (first try included), and the backoff: before retry n a uniformly random
    # wait in [0, min(max_delay_s, base_delay_s * 2**(n-1))] ("full jitter"). With the defaults a
    # request gives up after ~13 s of waiting on average, 25 s at most.
    max_attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 20.0

    def __post_init__(self) -> None:
        counts = (self.part_bytes, self.read_part_bytes, self.single_put_parts, self.concurrency,
                  self.max_attempts)
        if min(counts) <= 0:
            raise ValueError(f"S3Transfer: sizes and counts must be positive: {self}")

    @classmethod
    def from_env(cls) -> S3Transfer:
        """Defaults, overridden by ``CKPTD_S3_<FIELD>`` environment variables (upper case), the
        same convention as :mod:`ckptd.config`; used when no ``transfer`` is given."""
        return cls(**config.env_fields(cls, "CKPTD_S3"))
