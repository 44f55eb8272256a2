"""Loading a committed step into any destination layout.

Order of work, chosen so that a failed load leaves every destination tensor untouched:

1. **check** — every destination tensor exists in the checkpoint with the same global shape and
   dtype, every destination value key exists (``strict``), and no saved tensor is left unasked
   (``strict``; across ranks when ``torch.distributed`` is initialised). All ranks learn every
   rank's problems, so all raise together.
2. **read + verify** — the planned frames are fetched in parallel and their checksums verified.
   When they fit the load budget they are kept; otherwise this pass only verifies (streaming, in
   budget-sized batches) and step 4 reads them again (usually from the page cache).
3. **agree** — with ``torch.distributed`` initialised, ranks exchange their read errors, so that
   either every rank copies or none does.
4. **copy** — intersections are copied view to view into the destination; then JSON values and
   per-rank values are replaced in their containers.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptd import config
from ckptd.errors import CorruptCheckpoint, StateMismatch
from ckptd.manifest import Manifest
from ckptd.regions import copy_region
from ckptd.reshard.plan import Read, ReadPlan, plan_reads, source_view
from ckptd.reshard.reader import fetch
from ckptd.sharding import LOCAL_PREFIX, Described, Piece, local_name
from ckptd.storage import Storage


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _gather(obj: Any) -> list[Any]:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _summary(problems: list[str], limit: int = 8) -> str:
    more = f"; ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def check(manifest: Manifest, described: Described, rank: int, strict: bool,
          world_size: int) -> list[Piece]:
    """The destination pieces to fill; raises StateMismatch before anything is touched."""
    problems: list[str] = []
    pieces: list[Piece] = []
    for p in described.pieces:
        entry = manifest.tensors.get(p.name)
        if entry is None:
            if p.name.startswith(f"{LOCAL_PREFIX}/"):
                continue  # a rank the saved world did not have keeps its per-rank value
            if strict:
                problems.append(f"{p.name}: missing from the checkpoint")
            continue
        if entry.shape != p.global_shape:
            problems.append(
                f"{p.name}: saved shape {entry.shape}, destination {p.global_shape}"
            )
        elif entry.dtype != p.dtype:
            problems.append(f"{p.name}: saved dtype {entry.dtype}, destination {p.dtype}")
        else:
            pieces.append(p)
    if strict:
        for key in described.values:
            if key not in manifest.values:
                problems.append(f"{key}: value missing from the checkpoint")
    asked = {p.name for p in described.pieces if not p.name.startswith(f"{LOCAL_PREFIX}/")}
    gathered = _gather((sorted(asked), problems))
    problems = [f"rank {r}: {msg}" if len(gathered) > 1 else msg
                for r, (_, probs) in enumerate(gathered) for msg in probs]
    if strict and (len(gathered) > 1 or world_size == 1):
        everyone = set().union(*(set(names) for names, _ in gathered))
        unasked = sorted(n for n in manifest.tensors
                         if n not in everyone and not n.startswith(f"{LOCAL_PREFIX}/"))
        problems += [f"{n}: saved but not in the destination state (strict=True)" for n in unasked]
    if problems:
        raise StateMismatch(f"step {manifest.step}: {_summary(problems)}")
    return pieces


def _batches(reads: list[Read], budget: int) -> Iterator[list[Read]]:
    batch: list[Read] = []
    size = 0
    for r in reads:
        if batch and size + r.raw_length > budget:
            yield batch
            batch, size = [], 0
        batch.append(r)
        size += r.raw_length
    if batch:
        yield batch


def _agree(error: BaseException | None) -> None:
    messages = _gather(None if error is None else str(error))
    if error is not None:
        raise error
    for r, m in enumerate(messages):
        if m is not None:
            raise CorruptCheckpoint(f"load aborted on every rank: rank {r} failed: {m}")


def _copy(plan: ReadPlan, data: dict[int, torch.Tensor], reads: set[int]) -> None:
    with torch.no_grad():
        for c in plan.copies:
            if id(c.read) not in reads:
                continue
            raw = data[id(c.read)]
            src = source_view(c.read, raw.view(c.piece.dtype), c.region)
            copy_region(c.region, src, c.region, c.piece.view, c.piece.box)


def load_into(
    storage: Storage,
    step_dir: str,
    manifest: Manifest,
    described: Described,
    *,
    rank: int,
    world_size: int,
    strict: bool,
    pool: ThreadPoolExecutor,
) -> int:
    """Fill ``described``'s destination from ``manifest``; returns the stored bytes read."""
    pieces = check(manifest, described, rank, strict, world_size)
    plan = plan_reads(manifest, pieces)
    budget = config.get().load_budget_bytes
    total_raw = sum(r.raw_length for r in plan.reads)
    nbytes = 0
    error: BaseException | None = None
    kept: dict[int, torch.Tensor] = {}
    try:
        if total_raw <= budget:
            kept = fetch(storage, step_dir, plan.reads, pool)
        else:
            for batch in _batches(plan.reads, budget):  # verify-only pass
                fetch(storage, step_dir, batch, pool)
        nbytes += plan.stored_bytes
    except Exception as e:  # noqa: BLE001 - every rank must reach _agree, or peers hang
        error = e
    _agree(error)
    if kept:
        _copy(plan, kept, set(kept))
    elif total_raw:
        for batch in _batches(plan.reads, budget):
            data = fetch(storage, step_dir, batch, pool)
            nbytes += sum(r.length for r in batch)
            _copy(plan, data, set(data))
    _replace_values(manifest, described, rank)
    return nbytes


def _replace_values(manifest: Manifest, described: Described, rank: int) -> None:
    for key, slot in described.slots.items():
        if key in manifest.values:
            slot.container[slot.key] = manifest.values[key]
    saved_locals = manifest.locals.get(str(rank), {})
    for key, slot in described.local_slots.items():
        if key in saved_locals:
            from ckptd.sharding import Local

            slot.container[slot.key] = Local(saved_locals[key])


__all__ = ["load_into", "check", "local_name"]
