"""Fetching planned reads: ranged reads grouped by file, in parallel threads; every frame's
checksum verified on exactly the bytes read; frames decoded."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ckptd.errors import CorruptCheckpoint
from ckptd.reshard.plan import Read
from ckptd.storage import Storage
from ckptd.writer import codecs


def _decode_read(read: Read, stored: bytes, where: str) -> bytes | bytearray | memoryview:
    chunk = read.chunk
    if len(stored) != read.length:
        raise CorruptCheckpoint(f"{where}: {read.tensor}: short read ({len(stored)} of {read.length} bytes)")
    out: list[bytes | bytearray | memoryview] = []
    view = memoryview(stored)
    pos = 0
    for i in range(read.frame_lo, read.frame_hi):
        frame = chunk.frames[i]
        data = view[pos : pos + frame.stored]
        pos += frame.stored
        if codecs.checksum(data) != frame.checksum:
            raise CorruptCheckpoint(
                f"{where}: {read.tensor}: checksum mismatch in frame {i} of the chunk at byte "
                f"{chunk.offset} (box {chunk.box.to_json()})"
            )
        raw_len = min(chunk.frame_bytes, chunk.length - i * chunk.frame_bytes)
        try:
            out.append(codecs.decode(data, chunk.codec, raw_len, read.itemsize))
        except Exception as e:  # zstd errors have no common base class
            raise CorruptCheckpoint(f"{where}: {read.tensor}: frame {i} does not decode ({e})") from e
    if chunk.codec == codecs.RAW:
        return view
    return b"".join(out)


def as_uint8(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without copying (read-only buffers are only ever read)."""
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we only read it
        return torch.frombuffer(buf, dtype=torch.uint8)


def fetch(
    storage: Storage, step_dir: str, reads: Sequence[Read], pool: ThreadPoolExecutor
) -> dict[int, torch.Tensor]:
    """Decoded bytes (as uint8 tensors) of each read, keyed by ``id(read)``."""
    by_file: dict[str, list[Read]] = {}
    for r in reads:
        by_file.setdefault(r.chunk.file, []).append(r)

    def one_file(file: str, rs: list[Read]) -> list[tuple[int, torch.Tensor]]:
        where = f"{step_dir}/{file}"
        try:
            blobs = storage.read_ranges(where, [(r.start, r.length) for r in rs])
        except FileNotFoundError as e:
            raise CorruptCheckpoint(f"{where}: {rs[0].tensor}: data file missing") from e
        except EOFError as e:
            raise CorruptCheckpoint(f"{where}: {rs[0].tensor}: data file truncated ({e})") from e
        out = []
        for r, blob in zip(rs, blobs, strict=True):
            raw = _decode_read(r, blob, where)
            out.append((id(r), as_uint8(raw)))
        return out

    futures = [pool.submit(one_file, f, rs) for f, rs in by_file.items()]
    result: dict[int, torch.Tensor] = {}
    error: BaseException | None = None
    for fut in futures:
        try:
            result.update(fut.result())
        except BaseException as e:  # noqa: BLE001 - raise the first after all stop
            error = error or e
    if error is not None:
        raise error
    return result
