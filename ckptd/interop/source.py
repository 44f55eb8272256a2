"""Reading a committed ckptd checkpoint box by box: what the exporters stand on.

This is the only module of ``ckptd.interop`` that calls the reshard loader, and it calls only
``ckptd.loader.load.load_into``: an exporter asks for boxes of logical tensors, each with the
tensor (or view) to fill, and the loader plans, reads (ranged, parallel), verifies checksums and
decodes. Memory is the caller's destinations plus the loader's read buffers for those boxes, so
asking for bounded :func:`row_slabs` bounds the memory of a whole export by a constant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ckptd import catalog, config
from ckptd.errors import CkptdError
from ckptd.loader.load import load_into
from ckptd.manifest import Manifest, layout
from ckptd.regions import Box
from ckptd.sharding import LOCAL_PREFIX, Described, Piece
from ckptd.storage import Storage

# Bytes of a tensor read and written at a time by the exporters (whole rows). An export holds
# about three slabs at once — the one being read, the loader's read buffers for it, the previous
# one still in the writer's hands — plus a cast copy with a dtype change. 8 MiB is the loader's
# read unit (ckptd.config unit_bytes), large enough for sequential disk speed.
SLAB_BYTES = 8 << 20


@dataclass(frozen=True)
class Checkpoint:
    storage: Storage
    step: int
    manifest: Manifest

    @property
    def url(self) -> str:
        return f"{self.storage.url}/{layout.step_dir(self.step)}"

    def tensor_names(self) -> list[str]:
        """Logical tensors, without the per-rank ``Local`` ones."""
        return sorted(n for n in self.manifest.tensors if not n.startswith(f"{LOCAL_PREFIX}/"))


def open_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """``ROOT/step-000000042`` (that step) or ``ROOT`` (its newest committed step)."""
    return Checkpoint(*catalog.open_step(url, storage_options))


T = TypeVar("T")


def by_budget(items: Iterable[T], nbytes: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """``items`` in order, in batches of at most ``budget`` bytes (an item larger than the
    budget is a batch of its own)."""
    batch: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if batch and size + n > budget:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def row_slabs(shape: tuple[int, ...], itemsize: int, slab_bytes: int = SLAB_BYTES) -> Iterator[Box]:
    """``shape``'s whole box cut along dim 0 into slabs of at most ``slab_bytes`` (whole rows; a
    row larger than that is a slab of its own). Each slab is contiguous in the row-major order."""
    if not shape:
        yield Box((), ())
        return
    row = math.prod(shape[1:]) * itemsize
    per = max(1, slab_bytes // max(row, 1))
    for a in range(0, shape[0], per):
        n = min(per, shape[0] - a)
        yield Box((a,) + (0,) * (len(shape) - 1), (n, *shape[1:]))


def slabs(box: Box, itemsize: int, slab_bytes: int = SLAB_BYTES) -> list[Box]:
    """``box`` cut along its dim 0 like :func:`row_slabs`."""
    if not box.sizes:
        return [box]
    return [b.shift(box.offsets) for b in row_slabs(box.sizes, itemsize, slab_bytes)]


class BoxReader:
    """Fills destination tensors with boxes of logical tensors of one checkpoint.

    Runs in one process: the loader agrees with its peers when ``torch.distributed`` is
    initialised, and an export has none.
    """

    def __init__(self, ckpt: Checkpoint, threads: int | None = None) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise CkptdError(
                f"{ckpt.url}: exporting runs in one process, but torch.distributed is "
                f"initialised with {dist.get_world_size()} ranks; export from a separate process "
                "(the `ckptd export` command) or after destroy_process_group()"
            )
        self.ckpt = ckpt
        self.nbytes_read = 0
        self._pool = ThreadPoolExecutor(threads or config.io_threads(), "ckptd-export")

    def read(self, requests: Sequence[tuple[str, Box, torch.Tensor]]) -> None:
        """Fill each ``(name, box, destination)``; ``destination`` has ``box.sizes``."""
        m = self.ckpt.manifest
        pieces = [
            Piece(name, m.tensors[name].shape, m.tensors[name].dtype, box, dst)
            for name, box, dst in requests
        ]
        self.nbytes_read += load_into(
            self.ckpt.storage,
            layout.step_dir(self.ckpt.step),
            m,
            Described(pieces=pieces),
            rank=0,
            world_size=1,
            strict=False,
            pool=self._pool,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> BoxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def disjoint_boxes(boxes: Sequence[Box]) -> list[Box]:
    """The union of ``boxes`` as disjoint boxes, in order (replicated chunks may overlap; most
    formats, DCP's among them, want each element once)."""
    out: list[Box] = []
    for b in boxes:
        parts = [b] if b.numel else []
        for seen in out:
            parts = [q for p in parts for q in p.subtract(seen)]
        out.extend(parts)
    return out
