"""Writing one rank's data files from a staged arena (runs in background threads)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptd import config
from ckptd.buffers import Buffer
from ckptd.manifest import Chunk, FrameTable, codecs
from ckptd.regions import Box
from ckptd.storage import Storage
from ckptd.storage.base import Gate
from ckptd.writer.pack import FilePlan

if TYPE_CHECKING:
    import torch

    from ckptd.hostarray import HostArray

ChunkList = list[tuple[str, Chunk]]


def _frames_of(view: memoryview, frame_bytes: int) -> Iterator[memoryview]:
    for i in range(0, len(view), frame_bytes):
        yield view[i : i + frame_bytes]


@dataclass(frozen=True)
class Framing:
    """How a save cuts its chunks into frames (``ckptd.config``'s ``frame_bytes``,
    ``min_frame_bytes``, ``frames_per_chunk``): the saving process's settings, carried by a job
    the node agent writes (the agent's own would make another checkpoint)."""

    frame_bytes: int
    min_frame_bytes: int
    frames_per_chunk: int

    @classmethod
    def current(cls) -> Framing:
        cfg = config.get()
        return cls(cfg.frame_bytes, cfg.min_frame_bytes, cfg.frames_per_chunk)


def frame_size(nbytes: int, itemsize: int, framing: Framing) -> int:
    """The frame size of a chunk of ``nbytes``: ``frame_bytes``, halved while the chunk has
    fewer than ``frames_per_chunk`` frames, down to ``min_frame_bytes``; always a multiple of
    ``itemsize``."""
    size = framing.frame_bytes
    while (size // 2 >= framing.min_frame_bytes and size * framing.frames_per_chunk > nbytes
           and size % (2 * itemsize) == 0):
        size //= 2
    return size


def write_file(
    storage: Storage,
    step_dir: str,
    rel_path: str,
    arena: torch.Tensor | HostArray,
    plan: FilePlan,
    codec: str,
    level: int,
    framing: Framing,
    rank: int,
    gate: Gate | None = None,
) -> ChunkList:
    """Write one data file; return the chunks it holds (with their frames' checksums).
    ``gate``: the storage's, before each block it writes (the node agent's pace and stop)."""
    mem = memoryview(arena.numpy()).cast("B")  # type: ignore[arg-type]
    chunks: ChunkList = []
    if codec == codecs.RAW:
        # The arena range is the file image: checksum frames in place, then one big write. The
        # frame tables of all the file's chunks are made as one array (an offline reshard
        # writes tens of thousands of one-frame chunks).
        pairs: list[int] = []
        cuts = [0]
        frame_sizes = []
        for s in plan.slots:
            raw = mem[s.offset : s.offset + s.nbytes]
            fb = s.piece.frame_bytes or frame_size(s.nbytes, s.piece.view.element_size(), framing)
            for f in _frames_of(raw, fb):
                pairs += (len(f), codecs.checksum_int(f))
            cuts.append(len(pairs) // 2)
            frame_sizes.append(fb)
        tables = FrameTable.split(pairs, cuts)
        for s, fb, frames in zip(plan.slots, frame_sizes, tables, strict=True):
            chunks.append((s.piece.name, _chunk(s.piece.box, rel_path, s.offset - plan.start,
                                                s.nbytes, codec, fb, frames, rank)))
        storage.write_file(f"{step_dir}/{rel_path}", [mem[plan.start : plan.end]], gate)
        return chunks

    parts: list[Buffer] = []
    cursor = 0
    for s in plan.slots:
        raw = mem[s.offset : s.offset + s.nbytes]
        itemsize = s.piece.view.element_size()
        fb = s.piece.frame_bytes or frame_size(s.nbytes, itemsize, framing)
        start = cursor
        encoded: list[tuple[int, int]] = []
        for f in _frames_of(raw, fb):
            stored = codecs.encode(f, codec, itemsize, level)
            encoded.append((len(stored), codecs.checksum_int(stored)))
            parts.append(stored)
            cursor += len(stored)
        chunks.append(
            (
                s.piece.name,
                _chunk(
                    s.piece.box, rel_path, start, s.nbytes, codec, fb, FrameTable.of(encoded),
                    rank,
                ),
            )
        )
    storage.write_file(f"{step_dir}/{rel_path}", parts, gate)
    return chunks


def _chunk(
    box: Box,
    file: str,
    offset: int,
    length: int,
    codec: str,
    frame_bytes: int,
    frames: FrameTable,
    rank: int,
) -> Chunk:
    return Chunk(
        box=box,
        file=file,
        offset=offset,
        length=length,
        codec=codec,
        frame_bytes=frame_bytes,
        frames=frames,
        rank=rank,
    )


def gather(futures: list[Future[ChunkList]]) -> ChunkList:
    """Every file's chunks; the first error is raised after all files stopped."""
    out: ChunkList = []
    error: BaseException | None = None
    for f in futures:
        try:
            out.extend(f.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others finish
            error = error or e
    if error is not None:
        raise error
    return out
