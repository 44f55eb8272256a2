"""``ckptd export --format dcp``: a ckptd checkpoint as a torch.distributed.checkpoint directory.

Written from one process, without ``torch.distributed``: the output is what
``FileSystemWriter`` would leave (``.metadata`` + ``__0_0.distcp``), and
``torch.distributed.checkpoint.load`` reads it into any layout (DTensors on any mesh, plain
tensors), because DCP reshards on load by chunk boxes just as ckptd does.

- **Chunks.** Each logical tensor's saved chunks, made disjoint (replicated copies overlap in
  ckptd; DCP wants each element once) and cut into row slabs of at most ``SLAB_BYTES``. DCP
  readers load an item whole, so the slabs also bound what a DCP load of this export holds.
- **Streaming.** Items are read a slab batch at a time through the ckptd loader, ``torch.save`` d
  and streamed into one data file; peak memory is a few slabs, whatever the checkpoint size.
- **Values.** Values become DCP objects keyed like DCP's own flattening: a tuple
  (``optim/param_groups/0/betas/0``, ``.../1``) becomes one tuple object
  (``optim.param_groups.0.betas``), a list of scalars one list, bytes stay bytes, as
  ``dcp.save`` stores them. ``Local`` values go where DCP keeps per-rank keys
  (:func:`dcp_objects`); ``Local`` tensors have no DCP counterpart and are left out (counted
  in the report).
- **Names.** DCP keys are the ckptd names with ``/`` -> ``.`` (``model/layers.0.w`` ->
  ``model.layers.0.w``), i.e. what DCP's flattening gives for the same state tree.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import CkptdError
from ckptd.interop.objects import fold, leaves
from ckptd.interop.source import (
    SLAB_BYTES,
    BoxReader,
    by_budget,
    disjoint_boxes,
    open_checkpoint,
    slabs,
)
from ckptd.manifest import Manifest
from ckptd.regions import Box
from ckptd.sharding import LOCAL_PREFIX
from ckptd.storage import open_storage

DATA_FILE = "__0_0.distcp"
_RELEASED = torch.empty(0)
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION in torch 2.13


@dataclass(frozen=True)
class DcpExport:
    url: str
    step: int
    tensors: int
    items: int
    nbytes: int  # bytes of the data file
    skipped_locals: int


def dcp_objects(manifest: Manifest) -> tuple[dict[str, Any], int]:
    """The DCP objects of a checkpoint's values, and how many per-rank values were left out.

    Values fold back into the objects ``dcp.save`` keeps (``objects.fold``: tuples as tuples,
    lists of scalars whole). ``Local`` values are written where DCP keeps a rank's own keys: each
    rank's value split into leaves (``dataloader/dp_rank_1``, ``dataloader/world_size``), one
    object per leaf name that every rank holding it agrees on; a name whose value differs by
    rank, or that a global value or tensor already has, has no DCP place and is left out."""
    tuples = set(manifest.tuples)
    per_name: dict[str, list[Any]] = {}
    for rank in sorted(manifest.locals, key=int):
        for name, value in manifest.locals[rank].items():
            found: set[str] = set()
            try:
                split = leaves(name, value, found)
            except TypeError:
                continue
            tuples |= found
            for leaf, v in split.items():
                per_name.setdefault(leaf, []).append(v)
    taken = set(manifest.values) | set(manifest.tensors)
    values = dict(manifest.values)
    skipped = 0
    for leaf, vs in per_name.items():
        same = all(type(v) is type(vs[0]) and v == vs[0] for v in vs)
        if same and leaf not in taken and not any(leaf.startswith(f"{t}/") for t in taken):
            values[leaf] = vs[0]
        else:
            skipped += 1
    skipped += sum(1 for n in manifest.tensors if n.startswith(f"{LOCAL_PREFIX}/"))
    return fold(values, tuples), skipped


def _paths_with_lists(names: list[str]) -> dict[str, tuple[str | int, ...]]:
    """Path components that index lists (children exactly 0..n-1) become ints, so DCP's
    ``set_element`` rebuilds lists where the saved state had lists."""
    kids: dict[str, set[str]] = {}
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            kids.setdefault("/".join(parts[:i]), set()).add(parts[i])
    listy = {p for p, ks in kids.items() if ks == {str(i) for i in range(len(ks))}}
    out: dict[str, tuple[str | int, ...]] = {}
    for name in names:
        parts = name.split("/")
        out[name] = tuple(
            int(c) if i and "/".join(parts[:i]) in listy else c for i, c in enumerate(parts)
        )
    return out


def export_dcp(
    ckpt_url: str,
    out: str,
    *,
    storage_options: dict[str, Any] | None = None,
    slab_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> DcpExport:
    """Write the checkpoint at ``ckpt_url`` (``ROOT`` or ``ROOT/step-N``) as a DCP directory."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    ckpt = open_checkpoint(ckpt_url, storage_options)
    slab = slab_bytes or SLAB_BYTES
    names = ckpt.tensor_names()
    values, skipped = dcp_objects(ckpt.manifest)
    paths = _paths_with_lists(names + sorted(values))
    key: dict[str, str] = {}  # ckptd name -> DCP key
    for name in names + sorted(values):
        key[name] = ".".join(map(str, paths[name]))
    if len(set(key.values())) < len(key):
        clash = sorted(n for n in key if list(key.values()).count(key[n]) > 1)
        raise CkptdError(f"{ckpt.url}: {clash} would share a DCP key ('/' becomes '.')")
    plan: list[tuple[str, Box]] = []
    meta: dict[str, Any] = {}
    for name in names:
        entry = ckpt.manifest.tensors[name]
        itemsize = entry.dtype.itemsize
        boxes = [
            b
            for whole in disjoint_boxes([c.box for c in entry.chunks])
            for b in slabs(whole, itemsize, slab)
        ]
        meta[key[name]] = TensorStorageMetadata(
            TensorProperties(dtype=entry.dtype),
            torch.Size(entry.shape),
            [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes],
        )
        plan += [(name, b) for b in boxes]
    for name in values:
        meta[key[name]] = BytesStorageMetadata()
    storage_data: dict[Any, Any] = {}
    written = [0]

    def record(index: Any, item: _Parts) -> list[bytes]:
        storage_data[index] = _StorageInfo(DATA_FILE, written[0], item.nbytes)
        written[0] += item.nbytes
        if progress is not None:
            progress(item.nbytes)
        return item.parts

    def items(reader: BoxReader) -> Iterator[bytes]:
        itemsize = {n: e.dtype.itemsize
                    for n, e in ckpt.manifest.tensors.items()}
        for batch in by_budget(plan, lambda nb: nb[1].numel * itemsize[nb[0]], slab):
            dsts = [torch.empty(b.sizes, dtype=ckpt.manifest.tensors[n].dtype) for n, b in batch]
            reader.read([(n, b, d) for (n, b), d in zip(batch, dsts, strict=True)])
            for i, (name, box) in enumerate(batch):
                item = _saved(dsts[i])
                dsts[i] = _RELEASED  # saved: its bytes are in the item now
                yield from record(MetadataIndex(key[name], torch.Size(box.offsets)), item)
                del item
            del dsts
        for name, value in sorted(values.items()):
            yield from record(MetadataIndex(key[name]), _saved(value))

    storage = open_storage(out, storage_options)
    with BoxReader(ckpt) as reader:
        storage.write_file(DATA_FILE, items(reader))
    metadata = Metadata(
        state_dict_metadata=meta,
        planner_data={key[n]: p for n, p in paths.items()},
        storage_data=storage_data,
        storage_meta=StorageMeta(),
        version=DCP_VERSION,
    )
    storage.put_atomic(".metadata", pickle.dumps(metadata))
    return DcpExport(
        storage.url, ckpt.step, len(names), len(plan) + len(values), written[0], skipped
    )


class _Parts:
    """What ``torch.save`` writes, kept as the parts it wrote: a growing BytesIO would copy the
    storage again on every doubling (and leave the allocator holding the old blocks)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.nbytes = 0

    def write(self, data: Any) -> int:
        part = bytes(data)  # the writer may reuse its buffer after the call
        self.parts.append(part)
        self.nbytes += len(part)
        return len(part)

    def flush(self) -> None:
        pass


def _saved(obj: Any) -> _Parts:
    """One item as ``FileSystemWriter`` writes it: ``torch.save`` of the tensor or object."""
    out = _Parts()
    torch.save(obj, out)  # type: ignore[arg-type]  # a write()-only file is all it needs
    return out
