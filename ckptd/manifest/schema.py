"""On-disk records: the manifest of a committed step and the partial manifest of one rank.

The bytes on disk are the contract (documented in ``docs/format.md``); these frozen dataclasses
only give them types. Everything is JSON — never pickle — so reading a checkpoint cannot run code.

Commit rule: a step exists iff ``<step>/manifest.json`` exists. It is written last, after every
data file and every rank's partial manifest is durable, with one atomic step (temp file + rename
on a filesystem, a single PUT on an object store); readers ignore everything a manifest does not
name.
"""

from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import codecs
from ckptd.manifest.envelope import FORMAT, MAX_INT, VERSION, open_doc, seal
from ckptd.regions import Box

CHECKSUM = "xxh3_64"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by the ckptd format")
    return name


def dtype_from_name(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CorruptCheckpoint(f"{where}: unknown dtype {name!r}") from None


@dataclass(frozen=True)
class Frame:
    """A checksummed (and, when compressed, independently decodable) unit of a chunk."""

    stored: int  # bytes on storage
    checksum: str  # hex digest of the stored bytes

    def to_json(self) -> list[Any]:
        return [self.stored, self.checksum]


@dataclass(frozen=True)
class Chunk:
    """``box`` of a logical tensor, stored row-major at ``file[offset : offset + length]``.

    The raw bytes are split into frames of ``frame_bytes`` (the last one shorter); ``codec``
    says how each frame is stored (``raw``, ``zstd`` or ``zstd-planes``, see ``manifest/codecs``).
    """

    box: Box
    file: str
    offset: int
    length: int
    codec: str
    frame_bytes: int
    frames: tuple[Frame, ...]
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {
            "box": self.box.to_json(),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "codec": self.codec,
            "frame_bytes": self.frame_bytes,
            "frames": [f.to_json() for f in self.frames],
            "rank": self.rank,
        }


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in self.chunks],
        }


@dataclass(frozen=True)
class Manifest:
    """A committed step (``manifest.json``) or one rank's share of it (a partial)."""

    step: int
    attempt: str
    world_size: int
    created: float
    tensors: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    locals: dict[str, dict[str, Any]] = field(default_factory=dict)  # rank (str) -> name -> value
    training: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None  # set on partials only
    generation: int = 0  # the committing run's generation (owner.json); 0 before generations

    @property
    def nbytes(self) -> int:
        return sum(c.length for t in self.tensors.values() for c in t.chunks)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "checksum": CHECKSUM,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "created": self.created,
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
            "values": self.values,
            "locals": self.locals,
            "training": self.training,
        }
        if self.rank is not None:
            out["rank"] = self.rank
        else:
            out["generation"] = self.generation
        return out

    def encode(self) -> bytes:
        """The file's bytes: compact JSON whose first key is its own digest (see
        :func:`seal`)."""
        return seal(json.dumps(self.to_json(), separators=(",", ":"), allow_nan=True).encode())


def decode(raw: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; any defect raises :class:`CorruptCheckpoint` naming
    ``where`` (the file) and, where it applies, the logical tensor."""
    doc = open_doc(raw, where)
    try:
        if not isinstance(doc["tensors"], dict):
            raise TypeError("'tensors' is not an object")
        tensors = {name: _tensor(name, t, where) for name, t in doc["tensors"].items()}
        return Manifest(
            step=_int(doc["step"]),
            attempt=_name(doc["attempt"]),
            world_size=_int(doc["world_size"], lo=1),
            created=float(doc["created"]),
            tensors=tensors,
            values=dict(doc.get("values", {})),
            locals={str(k): dict(v) for k, v in doc.get("locals", {}).items()},
            training=dict(doc.get("training", {})),
            rank=_int(doc["rank"]) if "rank" in doc else None,
            generation=_int(doc.get("generation", 0)),
        )
    except CorruptCheckpoint:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CorruptCheckpoint(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e


def _int(v: Any, lo: int = 0, hi: int = MAX_INT) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{v} is outside [{lo}, {hi}]")
    return v


def _name(v: Any) -> str:
    if not isinstance(v, str) or not v or "\0" in v or "/" in v:
        raise ValueError(f"not a valid name: {v!r}")
    return v


def _safe_relpath(path: Any, where: str, tensor: str) -> str:
    """Data paths are relative and stay inside the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise CorruptCheckpoint(f"{where}: {tensor}: chunk file {path!r} is not a path")
    norm = posixpath.normpath(path)
    if (
        path.startswith("/")
        or "\\" in path
        or "://" in path
        or norm.startswith("..")
        or norm != path
        or not norm.startswith("data/")
        or any(ord(ch) < 32 for ch in path)  # NUL and control characters
    ):
        raise CorruptCheckpoint(
            f"{where}: {tensor}: chunk file {path!r} escapes the checkpoint directory"
        )
    return path


def _tensor(name: str, t: dict[str, Any], where: str) -> TensorEntry:
    if not name or "\0" in name:
        raise CorruptCheckpoint(f"{where}: tensor name {name!r} is not valid")
    dtype = dtype_from_name(t["dtype"], f"{where}: {name}")
    shape = tuple(_int(s) for s in t["shape"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize > MAX_INT:
        raise CorruptCheckpoint(f"{where}: {name}: shape {list(shape)} is impossibly large")
    whole = Box.whole(shape)
    chunks = []
    for c in t["chunks"]:
        try:
            chunks.append(_chunk(c, whole, itemsize))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise CorruptCheckpoint(
                f"{where}: {name}: malformed chunk ({type(e).__name__}: {e})"
            ) from e
    for c in chunks:
        _safe_relpath(c.file, where, name)
    return TensorEntry(dtype, shape, tuple(chunks))


def _chunk(c: dict[str, Any], whole: Box, itemsize: int) -> Chunk:
    """One chunk, its frame table validated completely: a reader may then trust that the frames
    tile the chunk (raw frames have exactly their raw length) and stay inside 2^62 bytes."""
    raw_box = c["box"]
    if not (isinstance(raw_box, list) and len(raw_box) == 2):
        raise ValueError(f"a box is [offsets, sizes], got {raw_box!r}")
    box = Box(tuple(_int(v) for v in raw_box[0]), tuple(_int(v) for v in raw_box[1]))
    if box.ndim != whole.ndim or not whole.contains(box):
        raise ValueError(f"box {raw_box} outside shape {list(whole.sizes)}")
    length = _int(c["length"])
    if length != box.numel * itemsize:
        raise ValueError(f"a chunk of {box.numel} elements claims {length} bytes")
    codec = c["codec"]
    if codec not in codecs.CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    frame_bytes = _int(c["frame_bytes"], lo=1)
    if frame_bytes % itemsize:
        raise ValueError(f"frame size {frame_bytes} is not a multiple of the item size")
    table = c["frames"]
    if not isinstance(table, list) or len(table) != -(-length // frame_bytes):
        raise ValueError(
            f"{len(table) if isinstance(table, list) else table!r} frames for {length} bytes in "
            f"frames of {frame_bytes}"
        )
    frames = []
    for i, f in enumerate(table):
        if not (isinstance(f, list) and len(f) == 2 and isinstance(f[1], str)
                and len(f[1]) == 16):
            raise ValueError(f"frame {i} is not [stored bytes, 16-hex-digit checksum]: {f!r}")
        raw_len = min(frame_bytes, length - i * frame_bytes)
        stored = _int(f[0], lo=1, hi=2 * raw_len + 4096)
        if codec == codecs.RAW and stored != raw_len:
            raise ValueError(f"raw frame {i} stores {stored} bytes for {raw_len}")
        frames.append(Frame(stored, f[1]))
    offset = _int(c["offset"])
    _int(offset + sum(f.stored for f in frames))
    return Chunk(
        box=box,
        file=c["file"] if isinstance(c["file"], str) else "",
        offset=offset,
        length=length,
        codec=codec,
        frame_bytes=frame_bytes,
        frames=tuple(frames),
        rank=_int(c["rank"]),
    )
