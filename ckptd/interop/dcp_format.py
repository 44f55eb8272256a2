"""A torch.distributed.checkpoint (DCP) directory on storage, read without DCP's planner.

DCP's ``FileSystemWriter`` leaves::

    DIR/.metadata          pickle of ``Metadata``: per flattened key (FQN) a TensorStorageMetadata
                           (dtype, global size, chunks = boxes) or a BytesStorageMetadata (any
                           object); ``storage_data`` maps MetadataIndex(fqn, chunk offsets) ->
                           _StorageInfo(relative_path, offset, length, transform_descriptors);
                           ``planner_data`` maps each FQN to the path of keys it was flattened from
    DIR/__<rank>_<n>.distcp  the items back to back; each item is ``torch.save`` of one chunk (or
                           of the object), optionally through stream transforms (zstd)

**Trust.** ``.metadata`` is a pickle, and unpickling runs whatever code the file names, so it is
read only with ``trust=True``; otherwise :class:`UntrustedPickle` says why. Tensor items are read
with ``torch.load(weights_only=True)`` (no code runs); object items (ints, lists, ...) too, falling
back to a full unpickle only for objects that need it — the caller has trusted the checkpoint.

A logical tensor's ckptd name is its flattening path joined with ``/`` (``('model', 'w')`` ->
``model/w``), which is what ckptd names the same leaf of the same state tree.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import posixpath
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, cast

import torch

from ckptd.errors import CheckpointNotFound, CkptdError, CorruptCheckpoint
from ckptd.manifest import layout
from ckptd.regions import Box
from ckptd.storage import Storage

METADATA = layout.DCP_METADATA


class UntrustedPickle(CkptdError, PermissionError):
    """Reading the source would unpickle a file, and the caller did not pass ``trust=True``."""


@dataclass(frozen=True)
class Item:
    """One ``torch.save`` d item: ``length`` bytes at ``offset`` of ``file`` (relative)."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpChunk:
    box: Box
    item: Item


@dataclass(frozen=True)
class DcpTensor:
    name: str  # ckptd logical name
    fqn: str  # DCP's flattened key
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class DcpObject:
    name: str
    fqn: str
    item: Item


@dataclass(frozen=True)
class DcpIndex:
    """What a DCP directory holds, by ckptd logical name."""

    url: str
    tensors: dict[str, DcpTensor]
    objects: dict[str, DcpObject]


def is_dcp(storage: Storage) -> bool:
    """A directory written by ``torch.distributed.checkpoint.save`` (it has ``.metadata``)."""
    return storage.exists(METADATA)


def logical_name(fqn: str, path: Any) -> str:
    if isinstance(path, (tuple, list)) and path:
        return "/".join(str(p) for p in path)
    return fqn


def read_index(storage: Storage, *, trust: bool) -> DcpIndex:
    """Unpickle and validate ``.metadata``; every defect is a one-line error naming the file."""
    where = f"{storage.url}/{METADATA}"
    if not is_dcp(storage):
        raise CheckpointNotFound(
            f"{storage.url}: not a torch.distributed.checkpoint directory (no {METADATA})"
        )
    if not trust:
        raise UntrustedPickle(
            f"{where}: DCP metadata is a Python pickle, and unpickling can run any code the file "
            "names; pass trust=True (CLI: --trust) only for a checkpoint whose writer you trust"
        )
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (classes the pickle names)
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    try:
        md = pickle.loads(storage.read_bytes(METADATA))  # trusted by the caller, see above
    except FileNotFoundError:
        raise CheckpointNotFound(f"{where}: vanished while reading") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CorruptCheckpoint(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from e
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpoint(f"{where}: holds a {type(md).__name__}, not DCP Metadata")
    storage_data = md.storage_data if isinstance(md.storage_data, dict) else {}
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}

    def item(fqn: str, index: Any) -> Item:
        info = storage_data.get(index)
        if info is None:
            raise CorruptCheckpoint(f"{where}: {fqn}: no storage entry for {index}")
        try:
            path, offset, length = str(info.relative_path), int(info.offset), int(info.length)
            transforms = tuple(str(t) for t in (getattr(info, "transform_descriptors", None) or ()))
        except (AttributeError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(f"{where}: {fqn}: malformed storage entry ({e})") from e
        norm = posixpath.normpath(path)
        if path.startswith("/") or "://" in path or norm.startswith("..") or offset < 0:
            raise CorruptCheckpoint(f"{where}: {fqn}: item {path!r} escapes the directory")
        return Item(norm, offset, length, transforms)

    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, DcpObject] = {}
    for fqn, meta in md.state_dict_metadata.items():
        name = logical_name(str(fqn), planner.get(fqn))
        if name in tensors or name in objects:
            raise CorruptCheckpoint(f"{where}: two keys are both named {name}")
        if isinstance(meta, TensorStorageMetadata):
            try:
                shape = tuple(int(s) for s in meta.size)
                whole = Box.whole(shape)
                chunks = []
                for c in meta.chunks:
                    box = Box(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                    if not whole.contains(box):
                        raise ValueError(f"chunk {box} outside shape {shape}")
                    chunks.append(DcpChunk(box, item(fqn, MetadataIndex(fqn, c.offsets))))
                dtype = meta.properties.dtype
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"dtype {dtype!r}")
            except (AttributeError, TypeError, ValueError) as e:
                raise CorruptCheckpoint(f"{where}: {fqn}: malformed tensor entry ({e})") from e
            tensors[name] = DcpTensor(name, str(fqn), dtype, shape, tuple(chunks))
        elif isinstance(meta, BytesStorageMetadata):
            objects[name] = DcpObject(name, str(fqn), item(fqn, MetadataIndex(fqn)))
        else:
            raise CorruptCheckpoint(f"{where}: {fqn}: unknown entry {type(meta).__name__}")
    return DcpIndex(storage.url, tensors, objects)


class _View(io.RawIOBase):
    """A read-only seekable file over a buffer, so ``torch.load`` reads without a copy."""

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self._buf = memoryview(buf).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._buf) - self._pos))
        out[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n


def _untransform(blob: bytes | bytearray | memoryview, it: Item, where: str) -> IO[bytes]:
    if not it.transforms:
        return cast(IO[bytes], _View(blob))
    try:  # DCP's own (experimental) registry: descriptors name extensions like "stream.zstd/1"
        from torch.distributed.checkpoint._extension import (
            ExtensionRegistry,
            StreamTransformExtension,
        )

        stream: IO[bytes] = io.BytesIO(blob)
        for ex in ExtensionRegistry().from_descriptor_list(list(it.transforms)):
            if isinstance(ex, StreamTransformExtension):
                stream = ex.transform_from(stream)
        return io.BytesIO(stream.read())
    except Exception as e:  # noqa: BLE001 - unknown extension or undecodable stream
        raise CorruptCheckpoint(
            f"{where}: item at byte {it.offset} does not decode through {list(it.transforms)} "
            f"({type(e).__name__}: {e})"
        ) from e


@contextlib.contextmanager
def _unloadable(what: str) -> Iterator[None]:
    """``torch.load`` failures (of many kinds) as one CorruptCheckpoint: ``what (Kind: first
    line of the message)``."""
    try:
        yield
    except CorruptCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds
        first = str(e).splitlines()[0] if str(e) else ""
        raise CorruptCheckpoint(f"{what} ({type(e).__name__}: {first})") from e


def decode_tensor(
    blob: bytes | bytearray | memoryview, t: DcpTensor, c: DcpChunk, where: str
) -> torch.Tensor:
    name = t.name
    with _unloadable(f"{where}: {name}: item at byte {c.item.offset} is not a saved tensor"):
        out = torch.load(_untransform(blob, c.item, where), map_location="cpu", weights_only=True)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != c.box.sizes or out.dtype != t.dtype:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out)
        raise CorruptCheckpoint(
            f"{where}: {name}: item at byte {c.item.offset} holds {got}, metadata says "
            f"{t.dtype} {c.box.sizes}"
        )
    return out


def decode_object(blob: bytes | bytearray | memoryview, o: DcpObject, where: str) -> Any:
    with _unloadable(f"{where}: {o.name}: item at byte {o.item.offset} does not load"):
        try:
            return torch.load(_untransform(blob, o.item, where), weights_only=True)
        except pickle.UnpicklingError:  # more than weights_only allows; the caller trusted it
            return torch.load(_untransform(blob, o.item, where), weights_only=False)


def fetch(
    storage: Storage,
    items: Sequence[Item],
    pool: ThreadPoolExecutor,
) -> dict[Item, bytes | bytearray | memoryview]:
    """The stored bytes of each item: ranged reads grouped by file, files in parallel."""
    by_file: dict[str, list[Item]] = {}
    for it in dict.fromkeys(items):
        by_file.setdefault(it.file, []).append(it)

    def one(file: str, its: list[Item]) -> list[tuple[Item, Any]]:
        where = f"{storage.url}/{file}"
        try:
            blobs = storage.read_ranges(file, [(i.offset, i.length) for i in its])
        except FileNotFoundError as e:
            raise CorruptCheckpoint(f"{where}: data file missing") from e
        except EOFError as e:
            raise CorruptCheckpoint(f"{where}: data file truncated ({e})") from e
        return list(zip(its, blobs, strict=True))

    futures = [pool.submit(one, f, its) for f, its in sorted(by_file.items())]
    out: dict[Item, Any] = {}
    error: BaseException | None = None
    for fut in futures:
        try:
            out.update(fut.result())
        except BaseException as e:  # noqa: BLE001 - raise the first once all stopped
            error = error or e
    if error is not None:
        raise error
    return out
