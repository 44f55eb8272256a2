"""A torch.distributed.checkpoint directory as the source of a ckptd load.

``load_dcp(state, "old/dcp/step-1000", trust=True)`` fills ``state`` — any ckptd state tree:
DTensors, ``Shard``, ``FlatShard``, ``Fused``, plain tensors, JSON values — from a checkpoint
that ``torch.distributed.checkpoint.save`` wrote on any number of ranks. Each rank reads only the
DCP items that overlap its pieces. Same guarantees as a ckptd load, in the same order:

1. **check** — metadata readable (and trusted), every destination tensor present with the same
   global shape and dtype, every destination value present (``strict``, the default), and
   with ``strict="exact"`` no saved tensor left unasked (across ranks when
   ``torch.distributed`` is initialised);
2. **read** — the needed items are fetched and decoded (within the load budget; beyond it they
   are decoded in batches and fetched again for the copy);
3. **agree** — with ``torch.distributed`` initialised, every rank learns every rank's error, so all
   raise the same error class together and nobody waits on a peer that gave up;
4. **copy** — only now is any destination element written.

DCP has no per-rank values: ``ckptd.Local`` leaves keep their current value. A value that DCP
stored as one list (``optim.param_groups.0.betas``) fills the ckptd leaves of its elements
(``optim/param_groups/0/betas/0``...).

:func:`load_from_dcp` is what ``Checkpointer.load`` calls (``source=`` or a DCP root).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptd import config
from ckptd.errors import CkptdError, StateMismatch
from ckptd.interop.dcp_format import (
    DcpChunk,
    DcpIndex,
    DcpObject,
    DcpTensor,
    Item,
    UntrustedPickle,
    decode_object,
    decode_tensor,
    fetch,
    is_dcp,
    read_index,
)
from ckptd.interop.source import by_budget
from ckptd.loader.load import Strict, aborted, agree, strictness
from ckptd.loader.reader import LoadResult
from ckptd.regions import Box, copy_region
from ckptd.sharding import LOCAL_PREFIX, Described, Piece, describe, put_values
from ckptd.storage import Storage, open_storage
from ckptd.world import fail_together, resolve_world

__all__ = ["is_dcp", "load_dcp", "load_from_dcp"]


@dataclass
class _Placement:
    piece: Piece
    region: Box
    tensor: DcpTensor
    chunk: DcpChunk


@dataclass
class _Plan:
    copies: list[_Placement]
    values: dict[str, tuple[str, list[str]]]  # destination key -> (DCP object name, sub-path)

    def items(self) -> list[tuple[DcpTensor, DcpChunk]]:
        seen: dict[Item, tuple[DcpTensor, DcpChunk]] = {}
        for c in self.copies:
            seen.setdefault(c.chunk.item, (c.tensor, c.chunk))
        return list(seen.values())


def _resolve_value(index: DcpIndex, key: str) -> tuple[str, list[str]] | None:
    """The DCP object holding destination value ``key``: itself, or a list it is inside of."""
    parts = key.split("/")
    for n in range(len(parts), 0, -1):
        name = "/".join(parts[:n])
        if name in index.objects:
            return name, parts[n:]
    return None


def _plan(index: DcpIndex, described: Described, strict: Strict) -> tuple[_Plan, list[str]]:
    missing_fails, _ = strictness(strict)
    problems: list[str] = []
    copies: list[_Placement] = []
    for p in described.pieces:
        if p.name.startswith(f"{LOCAL_PREFIX}/"):
            continue  # per-rank values: DCP has none, the destination keeps its own
        t = index.tensors.get(p.name)
        if t is None:
            if missing_fails:
                hint = " (it is a non-tensor object there)" if p.name in index.objects else ""
                problems.append(f"{p.name}: missing from the checkpoint{hint}")
            continue
        if t.shape != p.global_shape:
            problems.append(f"{p.name}: saved shape {t.shape}, destination {p.global_shape}")
            continue
        if t.dtype != p.dtype:
            problems.append(f"{p.name}: saved dtype {t.dtype}, destination {p.dtype}")
            continue
        remaining = [p.box] if p.box.numel else []
        for c in t.chunks:  # each element from the first chunk that holds it
            nxt: list[Box] = []
            for r in remaining:
                inter = r.intersect(c.box)
                if inter is None:
                    nxt.append(r)
                    continue
                copies.append(_Placement(p, inter, t, c))
                nxt.extend(r.subtract(inter))
            remaining = nxt
        if remaining:
            hole = remaining[0]
            problems.append(
                f"{p.name}: offsets {list(hole.offsets)} sizes {list(hole.sizes)} are in no "
                "saved chunk"
            )
    values: dict[str, tuple[str, list[str]]] = {}
    for key in described.values:
        found = _resolve_value(index, key)
        if found is not None:
            values[key] = found
        elif missing_fails:
            problems.append(f"{key}: value missing from the checkpoint")
    return _Plan(copies, values), problems


def read_chunks(
    storage: Storage, batch: list[tuple[DcpTensor, DcpChunk]], pool: ThreadPoolExecutor
) -> dict[Item, torch.Tensor]:
    """Fetch and decode chunks (each item is read whole: it is one ``torch.save``)."""
    blobs = fetch(storage, [c.item for _, c in batch], pool)
    return {
        c.item: decode_tensor(blobs[c.item], t, c, f"{storage.url}/{c.item.file}") for t, c in batch
    }


def read_objects(
    storage: Storage, objects: list[DcpObject], pool: ThreadPoolExecutor
) -> dict[str, Any]:
    blobs = fetch(storage, [o.item for o in objects], pool)
    return {
        o.name: decode_object(blobs[o.item], o, f"{storage.url}/{o.item.file}") for o in objects
    }


def _pick(obj: Any, sub: list[str], key: str) -> Any:
    for part in sub:
        try:
            obj = obj[int(part)] if isinstance(obj, (list, tuple)) else obj[part]
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise StateMismatch(f"{key}: not in the checkpoint's value ({e!r})") from e
    return obj


def _saved_tuples(index: DcpIndex, objects: dict[str, Any], described: Described) -> set[str]:
    """Which of the state's lists and tuples were saved as tuples (DCP keeps the object)."""
    out = set()
    for path in described.sequences:
        found = _resolve_value(index, path)
        if found is None or found[0] not in objects:
            continue
        obj = objects[found[0]]
        try:
            for part in found[1]:
                obj = obj[int(part)] if isinstance(obj, (list, tuple)) else obj[part]
        except (KeyError, IndexError, ValueError, TypeError):
            continue
        if isinstance(obj, tuple):
            out.add(path)
    return out


def load_dcp(
    state: Any,
    source: str | Storage,
    *,
    trust: bool = False,
    strict: Strict = True,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    threads: int | None = None,
) -> LoadResult:
    """Fill ``state`` in place from the DCP directory ``source`` (a path or fsspec URL).

    ``trust=True`` is required: DCP metadata is a pickle. ``LoadResult.step`` is the checkpoint's
    top-level ``step`` value when it is an int, else 0. ``strict`` as for
    :meth:`ckptd.Checkpointer.load`: what the destination asks for must be there (saved entries
    it does not ask for are left alone); ``"exact"``: both ways; False: skip what is missing.

    >>> load_dcp({"model": model.state_dict()}, "dcp/step-100", trust=True)  # doctest: +SKIP
    """
    storage = source if not isinstance(source, str) else open_storage(source, storage_options)
    rank, world_size = resolve_world(rank, world_size)
    with ThreadPoolExecutor(threads or config.io_threads(), thread_name_prefix="ckptd-dcp") as pool:
        return _load(storage, state, rank, world_size, strict, trust, pool)


def _check(
    storage: Storage, state: Any, rank: int, world_size: int, strict: Strict, trust: bool
) -> tuple[DcpIndex, Described, _Plan]:
    """Step 1 on every rank, the main loader's rules (:func:`ckptd.loader.load.agree`): the
    same error class on all ranks when any rank fails, then every rank's problems and, under
    ``strict="exact"``, the saved tensors no rank asks for (an O(T) union, not every rank's
    names)."""
    error: BaseException | None = None
    try:
        index = read_index(storage, trust=trust)
        described = describe(state, rank, world_size)
        plan, problems = _plan(index, described, strict)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = e
    fail_together(error, _remote)
    agree(sorted(index.tensors), {p.name for p in described.pieces}, problems, strict,
          world_size, storage.url)
    return index, described, plan


def _load(
    storage: Storage,
    state: Any,
    rank: int,
    world_size: int,
    strict: Strict,
    trust: bool,
    pool: ThreadPoolExecutor,
) -> LoadResult:
    index, described, plan = _check(storage, state, rank, world_size, strict, trust)
    items = plan.items()
    budget = config.get().load_budget_bytes
    total = sum(c.box.numel * t.itemsize for t, c in items)
    kept: dict[Item, torch.Tensor] = {}
    values: dict[str, Any] = {}
    tuples: set[str] = set()
    error: BaseException | None = None
    try:  # 2. read (and decode: that is what verifies a DCP item)
        wanted = sorted({n for n, _ in plan.values.values()})
        objects = read_objects(storage, [index.objects[n] for n in wanted], pool)
        values = {k: _pick(objects[n], sub, k) for k, (n, sub) in plan.values.items()}
        tuples = _saved_tuples(index, objects, described)
        if total <= budget:
            kept = read_chunks(storage, items, pool)
        else:
            for batch in by_budget(items, lambda tc: tc[1].box.numel * tc[0].itemsize, budget):
                read_chunks(storage, batch, pool)
    except Exception as e:  # noqa: BLE001 - every rank must reach _agree
        error = e
    fail_together(error, _remote)  # 3.
    nbytes = sum(c.item.length for _, c in items)
    with torch.no_grad():  # 4. copy
        if total <= budget:
            _copy(plan.copies, kept)
        else:
            for batch in by_budget(items, lambda tc: tc[1].box.numel * tc[0].itemsize, budget):
                _copy(plan.copies, read_chunks(storage, batch, pool))
                nbytes += sum(c.item.length for _, c in batch)
    put_values(described, values, tuples)
    step = values.get("step", 0)
    ok = isinstance(step, int) and not isinstance(step, bool)
    return LoadResult(step if ok else 0, storage.url, nbytes, {})


def _copy(copies: list[_Placement], data: dict[Item, torch.Tensor]) -> None:
    for c in copies:
        src = data.get(c.chunk.item)
        if src is not None:
            copy_region(c.region, src, c.chunk.box, c.piece.tensor, c.piece.box)


def _remote(rank: int, kind: str, message: str) -> CkptdError:
    return aborted(rank, kind, message, known=(UntrustedPickle,))


def load_from_dcp(
    storage: Storage,
    state: Any,
    *,
    source: str | None,
    step: int | None,
    strict: Strict,
    trust: bool,
    rank: int,
    world_size: int,
    threads: int,
) -> LoadResult | None:
    """The ``Checkpointer.load`` source plug-in (entry point ``ckptd.sources: dcp``): load
    from ``source`` (a DCP directory) or, without one, from ``storage`` (the Checkpointer's
    root) when that is a DCP directory; None means "not DCP, carry on"."""
    if source is None and not is_dcp(storage):
        return None
    if source is not None:
        storage = open_storage(source)
        if not is_dcp(storage):
            return None
    if step is not None:
        raise CkptdError(
            f"{storage.url}: a torch.distributed.checkpoint directory holds one checkpoint; "
            "step= does not apply to it"
        )
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptd-dcp") as pool:
        return _load(storage, state, rank, world_size, strict, trust, pool)
