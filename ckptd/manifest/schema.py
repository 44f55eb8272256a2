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
import posixpath
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.errors import CorruptCheckpoint
from ckptd.regions import Box

FORMAT = "ckptd"
VERSION = 1
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
    says how each frame is stored (``raw``, ``zstd`` or ``zstd-planes``, see ``writer/codecs``).
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
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=True).encode()


def decode(raw: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; any defect raises :class:`CorruptCheckpoint` naming
    ``where`` (the file) and, where it applies, the logical tensor."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"{where}: not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{where}: not a ckptd manifest (no 'format': 'ckptd')")
    version = doc.get("version")
    if not isinstance(version, int):
        raise CorruptCheckpoint(f"{where}: missing format version")
    if version > VERSION:
        raise CorruptCheckpoint(
            f"{where}: format version {version} is newer than this ckptd understands "
            f"({VERSION}); upgrade ckptd to read it"
        )
    if doc.get("checksum") != CHECKSUM:
        raise CorruptCheckpoint(f"{where}: unsupported checksum algorithm {doc.get('checksum')!r}")
    try:
        tensors = {name: _tensor(name, t, where) for name, t in doc["tensors"].items()}
        return Manifest(
            step=_int(doc["step"]),
            attempt=str(doc["attempt"]),
            world_size=_int(doc["world_size"]),
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
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpoint(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
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
    ):
        raise CorruptCheckpoint(
            f"{where}: {tensor}: chunk file {path!r} escapes the checkpoint directory"
        )
    return path


def _tensor(name: str, t: dict[str, Any], where: str) -> TensorEntry:
    dtype = dtype_from_name(t["dtype"], f"{where}: {name}")
    shape = tuple(_int(s) for s in t["shape"])
    whole = Box.whole(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    chunks = []
    for c in t["chunks"]:
        box = Box.from_json(c["box"])
        if not whole.contains(box):
            raise CorruptCheckpoint(f"{where}: {name}: chunk box {c['box']} outside shape {shape}")
        length = _int(c["length"])
        if length != box.numel * itemsize:
            raise CorruptCheckpoint(
                f"{where}: {name}: chunk of {box.numel} elements claims {length} bytes"
            )
        frames = tuple(Frame(_int(f[0]), str(f[1])) for f in c["frames"])
        frame_bytes = _int(c["frame_bytes"])
        if frame_bytes <= 0 or frame_bytes % itemsize or len(frames) != -(-length // frame_bytes):
            raise CorruptCheckpoint(f"{where}: {name}: chunk frames do not match its length")
        chunks.append(
            Chunk(
                box=box,
                file=_safe_relpath(c["file"], where, name),
                offset=_int(c["offset"]),
                length=length,
                codec=str(c["codec"]),
                frame_bytes=frame_bytes,
                frames=frames,
                rank=_int(c["rank"]),
            )
        )
    return TensorEntry(dtype, shape, tuple(chunks))
