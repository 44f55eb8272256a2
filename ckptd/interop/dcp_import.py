"""``ckptd import-dcp``: a torch.distributed.checkpoint directory -> a committed ckptd checkpoint.

One process writes the checkpoint as a world of one rank, through the same writer a save uses
(``RankWriter``: pack, stage, encode, checksum, write, partial manifest) and the same commit
(``coordinate``: merge, coverage check, atomic ``manifest.json``). Every DCP chunk becomes one
ckptd chunk with the same box, so a later ckptd load reads only what it needs, as from DCP.

Memory: DCP chunks are read in batches of at most the load budget
(``CKPTD_LOAD_BUDGET_BYTES``) and each batch is staged once before it is written, so the peak is
about two batches (one when a single DCP item is larger than the budget: it is read whole).

Objects (non-tensors) become JSON values named as ckptd names the leaves of the same state tree
(a tuple ``betas`` -> ``.../betas/0``, ``.../betas/1``); objects that are not JSON-able are
skipped and listed in the report.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptd import config
from ckptd.errors import CkptdError, StateMismatch
from ckptd.interop.dcp import read_chunks, read_objects
from ckptd.interop.dcp_format import DcpChunk, DcpTensor, read_index
from ckptd.manifest import Chunk, TensorEntry, codecs, dtype_name, layout
from ckptd.sharding import Piece
from ckptd.storage import open_storage
from ckptd.writer import commit
from ckptd.writer.pipeline import RankWriter, Share, plan_rounds, stage, stored_bytes
from ckptd.writer.staging import StagingPool


@dataclass(frozen=True)
class DcpImport:
    url: str
    step: int
    tensors: int
    values: int
    nbytes: int  # stored bytes written
    skipped: list[str] = field(default_factory=list)  # objects that are not JSON-able


def json_leaves(name: str, obj: Any) -> dict[str, Any]:
    """``obj`` as ckptd value leaves under ``name`` (how ``ckptd.sharding.walk`` names them:
    non-empty lists, tuples and dicts are containers); raises TypeError if not JSON-able."""
    if isinstance(obj, (list, tuple)) and obj:
        return {k: v for i, x in enumerate(obj) for k, v in json_leaves(f"{name}/{i}", x).items()}
    if isinstance(obj, dict) and obj:
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("dict with non-string keys")
        return {k: v for key, x in obj.items() for k, v in json_leaves(f"{name}/{key}", x).items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {name: obj}
    if isinstance(obj, (list, tuple, dict)):  # empty: a leaf, as in walk()
        return {name: type(obj)() if not isinstance(obj, tuple) else []}
    raise TypeError(f"a {type(obj).__name__}")


def import_dcp(
    src: str,
    dest: str,
    *,
    trust: bool = False,
    step: int | None = None,
    compression: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> DcpImport:
    """Convert the DCP directory ``src`` into a committed step under the ckptd root ``dest``.

    ``dest`` must not be a ckptd root yet: the import becomes its owner, which would make a job
    writing there fail. ``step`` defaults to the checkpoint's top-level ``step`` value when it is
    an int, else 0. ``trust=True`` is required (DCP metadata is a pickle).
    """
    source = open_storage(src, storage_options)
    index = read_index(source, trust=trust)
    storage = open_storage(dest, storage_options)
    codec, level = codecs.parse_compression(compression)
    threads = config.io_threads()
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptd-import") as pool:
        objects = read_objects(source, list(index.objects.values()), pool)
        values: dict[str, Any] = {}
        skipped: list[str] = []
        for name, obj in sorted(objects.items()):
            try:
                values.update(json.loads(json.dumps(json_leaves(name, obj))))
            except (TypeError, ValueError):
                skipped.append(name)
        if step is None:
            top = objects.get("step")
            step = top if isinstance(top, int) and not isinstance(top, bool) else 0
        if storage.exists(layout.OWNER):  # claiming it would make a job writing there fail
            raise CkptdError(
                f"{storage.url}: already a ckptd root ({layout.OWNER}); import into a new root, "
                "then point ckptd.init at it"
            )
        declared: dict[str, TensorEntry] = {}
        for name, t in sorted(index.tensors.items()):
            try:
                dtype_name(t.dtype)
            except ValueError as e:
                raise StateMismatch(f"{index.url}: {name}: {e}") from e
            declared[name] = TensorEntry(t.dtype, t.shape)
        run_id = uuid.uuid4().hex[:12]
        share = Share(step, f"{run_id}-000001", 0, 1, declared, values=values)
        commit.claim(storage, run_id)
        writer = RankWriter(storage, pool, StagingPool(1), codec, level)
        chunks: list[tuple[str, Chunk]] = []
        files = 0
        try:
            for batch in _batches(list(index.tensors.values()), config.get().load_budget_bytes):
                data = read_chunks(source, batch, pool)
                pieces = [Piece(t.name, t.shape, t.dtype, c.box, data[c.item]) for t, c in batch]
                for rnd in plan_rounds(pieces, threads, None):
                    arena = writer.pool.acquire(rnd.nbytes)
                    try:
                        stage(arena.buffer, rnd.plans)
                        chunks += writer.write_round(share, arena, rnd, files)
                    finally:
                        writer.pool.release(arena)
                    files += len(rnd.plans)
                if progress is not None:
                    progress(sum(c.item.length for _, c in batch))
                del data, pieces
            writer.write_partial(share, chunks)
        except BaseException:
            writer.discard(share, files)
            raise
        commit.coordinate(storage, step, share.attempt, 1, run_id)
    return DcpImport(
        f"{storage.url}/{layout.step_dir(step)}",
        step,
        len(declared),
        len(values),
        stored_bytes(chunks),
        skipped,
    )


def _batches(tensors: list[DcpTensor], budget: int) -> list[list[tuple[DcpTensor, DcpChunk]]]:
    out: list[list[tuple[DcpTensor, DcpChunk]]] = [[]]
    size = 0
    for t in sorted(tensors, key=lambda t: t.name):
        for c in t.chunks:
            n = math.prod(c.box.sizes) * t.itemsize
            if out[-1] and size + n > budget:
                out.append([])
                size = 0
            out[-1].append((t, c))
            size += n
    return [b for b in out if b]
