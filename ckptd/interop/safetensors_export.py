"""``ckptd export --format safetensors``: consolidated Hugging Face shards from any checkpoint.

Output, in the layout ``transformers`` loads (``from_pretrained`` on the directory)::

    OUT/model-00001-of-00003.safetensors    whole tensors, consolidated from every saved chunk
    OUT/model.safetensors.index.json        {"metadata": {"total_size": N}, "weight_map": {...}}

- **Names.** The logical names picked by ``select`` (globs, default all), with ``strip_prefix``
  removed and the remaining ``/`` turned into ``.`` (``model/model.layers.0.q_proj.weight`` with
  ``strip_prefix="model/"`` -> ``model.layers.0.q_proj.weight``).
- **Fused parts.** ckptd stores the parts of a ``Fused`` leaf (q, k, v) as separate logical
  tensors, and that is what is written by default. A :class:`FuseRule` (CLI
  ``--fuse 'T=A,B,C[@DIM]'``, output names, ``*`` matching the same text in all) writes the
  concatenation of the parts along ``DIM`` as one tensor ``T`` instead.
- **Streaming.** A file's header is computed from the manifest (shapes are known), then each
  tensor is read and written in row slabs of at most ``SLAB_BYTES`` straight into the file: peak
  memory is a few slabs (``source.SLAB_BYTES``), whatever the size of the tensors or model.
- **dtype** casts floating-point tensors only (integer and bool buffers keep theirs).
- **Shards** hold tensors in name order, a new file when the next tensor would pass
  ``max_shard_size`` (a larger tensor gets a file of its own), like ``save_pretrained``.
"""

from __future__ import annotations

import fnmatch
import json
import re
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.config import parse_size
from ckptd.errors import CkptdError, StateMismatch
from ckptd.interop import hf_names
from ckptd.interop.hf_names import Rename
from ckptd.interop.source import SLAB_BYTES, BoxReader, Checkpoint, open_checkpoint, row_slabs
from ckptd.regions import Box
from ckptd.storage import Storage, open_storage

INDEX = "model.safetensors.index.json"
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class FuseRule:
    """Write ``parts`` (output names) concatenated along ``dim`` as one tensor ``target``.
    ``*`` matches any text, the same in the target and every part."""

    target: str
    parts: tuple[str, ...]
    dim: int = 0

    @staticmethod
    def parse(spec: str) -> FuseRule:
        """``TARGET=PART,PART[,...][@DIM]``."""
        target, eq, rest = spec.partition("=")
        dim = 0
        if "@" in rest:
            rest, _, d = rest.rpartition("@")
            if not d.lstrip("-").isdigit():
                raise ValueError(f"fuse rule {spec!r}: @{d} is not a dimension")
            dim = int(d)
        parts = tuple(p.strip() for p in rest.split(",") if p.strip())
        if not eq or not target.strip() or len(parts) < 2:
            raise ValueError(f"fuse rule {spec!r}: want TARGET=PART,PART[,...][@DIM]")
        return FuseRule(target.strip(), parts, dim)


@dataclass
class _Tensor:
    """One output tensor: the concatenation of ``parts`` (logical names, shapes) along ``dim``."""

    name: str
    parts: list[tuple[str, tuple[int, ...]]]
    dim: int
    src: torch.dtype
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        first = list(self.parts[0][1])
        if len(self.parts) > 1:
            first[self.dim] = sum(s[self.dim] for _, s in self.parts)
        return tuple(first)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class SafetensorsExport:
    url: str
    step: int
    files: list[str]
    tensors: int
    total_size: int
    nbytes_read: int
    stripped: int = 0  # names that lost wrapper segments (_orig_mod, module, ...)
    renamed: int = 0  # names the rename hook changed
    config: bool = False  # config.json written


def _rule_regex(pattern: str) -> re.Pattern[str]:
    return re.compile("(.+?)".join(re.escape(p) for p in pattern.split("*")))


def _fill(pattern: str, groups: Sequence[str]) -> str:
    pieces = pattern.split("*")
    if len(pieces) - 1 != len(groups):
        raise ValueError(f"fuse pattern {pattern!r}: want {len(groups)} '*'")
    return pieces[0] + "".join(g + p for g, p in zip(groups, pieces[1:], strict=True))


def plan_tensors(
    ckpt: Checkpoint,
    select: Sequence[str] | None,
    strip_prefix: str,
    dtype: torch.dtype | None,
    fuse: Sequence[FuseRule],
    out_name: Callable[[str], str] = lambda n: n,
) -> list[_Tensor]:
    """The output tensors, in name order; every naming problem is an error before any write.
    ``out_name`` maps a name after ``strip_prefix`` (wrapper segments, the rename hook)."""
    patterns = list(select) if select else ["*"]
    chosen = [n for n in ckpt.tensor_names() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not chosen:
        raise StateMismatch(f"{ckpt.url}: no logical tensor matches {patterns}")
    by_out: dict[str, _Tensor] = {}
    for logical in chosen:
        entry = ckpt.manifest.tensors[logical]
        name = out_name(logical.removeprefix(strip_prefix).replace("/", "."))
        if name in by_out:
            raise StateMismatch(f"{logical} and {by_out[name].parts[0][0]} both become {name}")
        if entry.dtype not in _ST_DTYPES:
            raise StateMismatch(f"{logical}: dtype {entry.dtype} has no safetensors equivalent")
        out = dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype
        by_out[name] = _Tensor(name, [(logical, entry.shape)], 0, entry.dtype, out)
    for rule in fuse:
        regex = _rule_regex(rule.parts[0])
        matches = [m for m in map(regex.fullmatch, sorted(by_out)) if m is not None]
        if not matches:
            raise StateMismatch(
                f"fuse rule {rule.target}: no output tensor is named {rule.parts[0]}"
            )
        for m in matches:
            if m.string not in by_out:  # already taken by an earlier group of this rule
                continue
            names = [_fill(p, m.groups()) for p in rule.parts]
            target = _fill(rule.target, m.groups())
            missing = [n for n in names if n not in by_out or len(by_out[n].parts) > 1]
            if missing:
                raise StateMismatch(f"fuse {target}: parts {missing} are not (unfused) outputs")
            parts = [by_out.pop(n) for n in names]
            shapes = [p.parts[0][1] for p in parts]
            if target in by_out:
                raise StateMismatch(f"fuse {target}: the name is already an output tensor")
            ndim = len(shapes[0])
            ok = -ndim <= rule.dim < ndim and all(len(s) == ndim for s in shapes)
            if ok:
                dim = rule.dim % ndim
                ok = all(
                    s[:dim] + s[dim + 1 :] == shapes[0][:dim] + shapes[0][dim + 1 :] for s in shapes
                )
            if not ok or len({p.src for p in parts}) > 1:
                raise StateMismatch(
                    f"fuse {target}: parts {names} of shapes {shapes} "
                    f"({sorted({str(p.src) for p in parts})}) do not concatenate along {rule.dim}"
                )
            by_out[target] = _Tensor(
                target, [p.parts[0] for p in parts], rule.dim % ndim, parts[0].src, parts[0].dtype
            )
    return [by_out[n] for n in sorted(by_out)]


def _requests(t: _Tensor, slab: Box, dst: torch.Tensor) -> list[tuple[str, Box, torch.Tensor]]:
    """What to read to fill output rows ``slab`` of ``t`` into ``dst``."""
    if len(t.parts) == 1:
        return [(t.parts[0][0], slab, dst)]
    out = []
    a, n = slab.offsets[0], slab.sizes[0]
    at = 0
    for name, shape in t.parts:
        if t.dim == 0:  # parts stacked by rows: those crossing [a, a + n)
            lo, hi = max(a, at), min(a + n, at + shape[0])
            if lo < hi:
                box = Box((lo - at,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:]))
                out.append((name, box, dst.narrow(0, lo - a, hi - lo)))
        else:  # side by side: every part's rows [a, a + n)
            box = Box((a,) + (0,) * (len(shape) - 1), (n, *shape[1:]))
            out.append((name, box, dst.narrow(t.dim, at, shape[t.dim])))
        at += shape[t.dim]
    return out


def _bytes(t: torch.Tensor) -> memoryview:
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _header(tensors: list[_Tensor]) -> bytes:
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in tensors:
        doc[t.name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + t.nbytes],
        }
        at += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def export_safetensors(
    ckpt_url: str,
    out: str,
    *,
    select: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    max_shard_size: int | str = "50GB",
    dtype: str | torch.dtype | None = None,
    fuse: Sequence[FuseRule | str] | Mapping[str, Sequence[str]] = (),
    storage_options: dict[str, Any] | None = None,
    slab_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    config: str | Mapping[str, Any] | None = None,
    config_from: str | None = None,
    no_config: bool = False,
    keep_wrappers: bool = False,
    rename: Rename | None = None,
    overwrite: bool = False,
) -> SafetensorsExport:
    """Write ``ckpt_url`` (``ROOT`` or ``ROOT/step-N``) as safetensors shards + index in ``out``.

    ``config`` (a config.json file or dict) or ``config_from`` (a model directory) gives the
    ``config.json`` to write; without either the export is refused unless ``no_config``.
    ``select`` defaults to the model's tensors (``hf_names.model_selection``; ``strip_prefix``
    then defaults to what it strips); wrapper segments (``_orig_mod``, ``module``, ...) are
    removed unless ``keep_wrappers``; ``rename`` maps each output name. A non-empty ``out`` is
    refused unless ``overwrite`` (which removes the shards and index found there first).

    >>> export_safetensors("ckpts/run1", "hf", config_from="base-model",
    ...                    dtype="bf16")  # doctest: +SKIP
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise CkptdError("safetensors export needs a little-endian host")
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: want one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype.lower()]
    rules = (
        [FuseRule(t, tuple(p)) for t, p in fuse.items()]
        if isinstance(fuse, Mapping)
        else [r if isinstance(r, FuseRule) else FuseRule.parse(r) for r in fuse]
    )
    limit = parse_size(max_shard_size)
    config_doc = hf_names.config_bytes(config, config_from, no_config)
    hook = hf_names.rename_function(rename)
    ckpt = open_checkpoint(ckpt_url, storage_options)
    if select is None:
        select, default_strip = hf_names.model_selection(ckpt.tensor_names())
        strip_prefix = default_strip if strip_prefix is None else strip_prefix
    counts = {"stripped": 0, "renamed": 0}

    def names(name: str) -> str:
        bare = name if keep_wrappers else hf_names.strip_wrappers(name)
        counts["stripped"] += bare != name
        new = hook(bare)
        counts["renamed"] += new != bare
        return new

    tensors = plan_tensors(ckpt, select, strip_prefix or "", dtype, rules, names)
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    storage = open_storage(out, storage_options)
    _clear(storage, overwrite)
    slab = slab_bytes or SLAB_BYTES

    def content(shard: list[_Tensor], reader: BoxReader) -> Iterator[memoryview | bytes]:
        yield _header(shard)
        for t in shard:
            itemsize = t.src.itemsize
            for box in row_slabs(t.shape, itemsize, slab):
                dst = torch.empty(box.sizes, dtype=t.src)
                reader.read(_requests(t, box, dst))
                out = dst.to(t.dtype) if t.dtype != t.src else dst
                del dst  # a cast's source goes before the write, not after
                if progress is not None:
                    progress(out.numel() * out.element_size())
                yield _bytes(out)
                del out

    with BoxReader(ckpt) as reader:
        for shard, file in zip(shards, files, strict=True):
            storage.write_file(file, content(shard, reader))
        nbytes_read = reader.nbytes_read
    total = sum(t.nbytes for t in tensors)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {t.name: f for shard, f in zip(shards, files, strict=True) for t in shard},
    }
    if config_doc is not None:
        storage.put_atomic(hf_names.CONFIG, config_doc)
    storage.put_atomic(INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return SafetensorsExport(storage.url, ckpt.step, files, len(tensors), total, nbytes_read,
                             counts["stripped"], counts["renamed"], config_doc is not None)


def _clear(storage: Storage, overwrite: bool) -> None:
    """A non-empty output is refused (stale shards would sit beside the new ones), unless
    ``overwrite``: then the shards, index and config of an earlier export are removed."""
    try:
        present = storage.list_dir("")
    except FileNotFoundError:
        return
    if not present:
        return
    if not overwrite:
        raise CkptdError(f"{storage.url}: not empty ({len(present)} entries, e.g. "
                         f"{sorted(present)[0]}); export into a new directory, or pass "
                         "--overwrite to replace an earlier export")
    ours = [p for p in present if p in (INDEX, hf_names.CONFIG)
            or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", p)]
    for p in ours:
        storage.remove(p)
