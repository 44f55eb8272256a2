"""``ckptd import-dcp``: a torch.distributed.checkpoint directory -> a committed ckptd checkpoint.

One process writes the checkpoint as a world of one rank, through the same writer a save uses
(``RankWriter``: pack, stage, encode, checksum, write, partial manifest) and the same commit
(``coordinate``: merge, coverage check, atomic ``manifest.json``). Every DCP chunk becomes one
ckptd chunk with the same box, so a later ckptd load reads only what it needs, as from DCP.

Memory: DCP chunks are read in batches of at most the load budget
(``CKPTD_LOAD_BUDGET_BYTES``) and each batch is staged once before it is written, so the peak is
about two batches (one when a single DCP item is larger than the budget: it is read whole).

Objects (non-tensors) become values named as ckptd names the leaves of the same state tree
(a tuple ``betas`` -> ``.../betas/0``, ``.../betas/1``, recorded as a tuple); ``bytes`` (a
dataloader's pickled state) stay bytes; other objects (instances of classes) are skipped and
listed in the report.

The step: ``step=``, else the directory's name (``step-1000``, as torchtitan names them), else a
``train_state/step`` value (torchtitan's), else a top-level ``step`` value, else 0; the report
says which (``step_from``).
"""

from __future__ import annotations

import math
import posixpath
import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptd import config
from ckptd.errors import CkptdError, StateMismatch
from ckptd.interop.dcp import read_chunks, read_objects
from ckptd.interop.dcp_format import DcpChunk, DcpTensor, read_index
from ckptd.interop.objects import leaves
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
    skipped: list[str] = field(default_factory=list)  # objects a value cannot hold
    step_from: str = ""  # where the step number came from


_STEP_DIR = re.compile(r"step[-_]?(\d+)")
STEP_VALUES = ("train_state/step", "step")  # torchtitan's, then a plain top-level one


def step_of(src: str, values: dict[str, Any], step: int | None) -> tuple[int, str]:
    """The step of an imported checkpoint and where it came from (see the module's doc)."""
    if step is not None:
        return step, "--step"
    found = _STEP_DIR.fullmatch(posixpath.basename(src.rstrip("/")))
    if found:
        return int(found.group(1)), f"the directory name {found.group(0)}"
    for name in STEP_VALUES:
        v = values.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v, f"the value {name}"
    return 0, "nothing (no --step, no step-N directory name, no step value)"


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
    writing there fail. ``step`` defaults to the number in the directory's name (``step-1000``),
    else a ``train_state/step`` or top-level ``step`` value, else 0 (``DcpImport.step_from``
    says which). ``trust=True`` is required (DCP metadata is a pickle).
    """
    source = open_storage(src, storage_options)
    index = read_index(source, trust=trust)
    storage = open_storage(dest, storage_options)
    codec, level = codecs.parse_compression(compression)
    threads = config.io_threads()
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptd-import") as pool:
        objects = read_objects(source, list(index.objects.values()), pool)
        values: dict[str, Any] = {}
        tuples: set[str] = set()
        skipped: list[str] = []
        for name, obj in sorted(objects.items()):
            try:
                found: set[str] = set()
                values.update(leaves(name, obj, found))
                tuples |= found
            except TypeError:
                skipped.append(name)
        step, step_from = step_of(src, values, step)
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
        share = Share(step, f"{run_id}-000001", 0, 1, declared, values=values,
                      tuples=frozenset(tuples),
                      training={"imported": {"format": "dcp", "ranks": _writers(index)}})
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
        step_from,
    )


def _writers(index: Any) -> int:
    """How many ranks wrote the DCP checkpoint: DCP's FileSystemWriter names each rank's files
    ``__<rank>_<n>.distcp``; other writers count one per data file."""
    files = {c.item.file for t in index.tensors.values() for c in t.chunks}
    ranks = {m.group(1) if (m := _WRITER.match(posixpath.basename(f))) else f for f in files}
    return max(1, len(ranks))


_WRITER = re.compile(r"__(\d+)_\d+\.distcp$")


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
