"""The step catalog: which steps under a root are committed, which one is the newest, and
opening one — its manifest and its frame tables (:class:`FrameSource`). Read-only: nothing here
writes (committing is ``ckptd.writer.commit``'s). The format (``ckptd.manifest``) does no I/O;
this module reads it from storage.

**Commit order, not step numbers.** A root can hold steps of several runs: a fine-tune into a
reused directory, or a restart that renumbers, saves steps 1, 2, 3 beside an older run's
998-1000. Each run that writes a root takes it over with a larger *generation* in
``owner.json``, and every manifest records the generation of the run that committed it. The
order of committed steps is ``(generation, step)``: a newer owner's steps come after an older
owner's whatever their numbers, and within one owner the step number decides. "Latest" is the
last in that order, for ``latest_step()``, ``load()``, ``ckptd ls/inspect ROOT`` and retention
alike. Manifests written before generations existed count as generation 0.

``latest`` (the pointer file) is advisory and never read here: the catalog lists the step
directories and reads their manifests.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd.errors import CheckpointNotFound, CorruptCheckpoint
from ckptd.manifest import layout
from ckptd.manifest.envelope import open_doc
from ckptd.manifest.frames import HEADER, MAGIC, FrameRef, FrameTable, parse_slice
from ckptd.storage import Storage, open_storage

if TYPE_CHECKING:
    from ckptd.manifest.schema import Manifest


@dataclass(frozen=True)
class Owner:
    """``owner.json``: the run that writes the root now, and its generation."""

    run: str
    generation: int
    since: float

    def encode(self) -> bytes:
        return json.dumps(
            {"run": self.run, "generation": self.generation, "since": self.since}
        ).encode()


def read_owner(storage: Storage) -> Owner | None:
    try:
        raw = storage.read_bytes(layout.OWNER)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        generation = doc.get("generation", 0)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise ValueError(f"generation {generation!r}")
        return Owner(str(doc["run"]), generation, float(doc.get("since", 0.0)))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpoint(f"{storage.url}/{layout.OWNER}: unreadable ({e})") from e


@dataclass(frozen=True)
class Committed:
    step: int
    generation: int

    @property
    def order(self) -> tuple[int, int]:
        return (self.generation, self.step)


def all_steps(storage: Storage) -> list[int]:
    """Every step directory, committed or not, by number."""
    return sorted(s for s in map(layout.parse_step_dir, storage.list_dir("")) if s is not None)


def read_raw(storage: Storage, step: int) -> bytes:
    path = layout.manifest_path(step)
    try:
        return storage.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{storage.url}/{path}: no committed step {step}") from None


def read_manifest(storage: Storage, step: int) -> Manifest:
    from ckptd.manifest.parse import decode  # the tensors: only what loads them needs it

    raw = read_raw(storage, step)
    where = f"{storage.url}/{layout.manifest_path(step)}"
    manifest = decode(raw, where, FrameSource(storage, layout.step_dir(step),
                                              f"{storage.url}/{layout.step_dir(step)}"))
    _check_step(manifest.step, step, where)
    return manifest


def read_doc(storage: Storage, step: int) -> dict[str, Any]:
    """The manifest as checked JSON (size, digest, format; no tensors decoded, no torch)."""
    where = f"{storage.url}/{layout.manifest_path(step)}"
    doc = open_doc(read_raw(storage, step), where)
    _check_step(doc.get("step"), step, where)
    return doc


def _check_step(said: Any, step: int, where: str) -> None:
    """A manifest is the step of its directory: one moved or copied into another step's
    directory (its seal is still whole) is refused, not loaded as that step."""
    if said != step or isinstance(said, bool):
        raise CorruptCheckpoint(f"{where}: the manifest is of step {said!r}, in the directory "
                                f"of step {step}")


def doc_shapes(doc: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor's global shape, from a manifest's head (format 3: its index)."""
    if "index" in doc:
        return {n: tuple(e[1]) for n, e in doc["index"].items()}
    return {n: tuple(t["shape"]) for n, t in doc["tensors"].items()}


def doc_nbytes(doc: dict[str, Any]) -> int:
    """The bytes of every chunk (raw, replicas included), from a manifest's head."""
    if "index" in doc:
        return int(doc["nbytes"])
    return sum(int(c["length"]) for t in doc["tensors"].values() for c in t["chunks"])


def committed(storage: Storage) -> list[Committed]:
    """The committed steps, oldest first in commit order ``(generation, step)``. A damaged
    manifest raises :class:`CorruptCheckpoint` naming it: skipping it could silently make an
    older step the newest."""
    out = []
    for step in all_steps(storage):
        try:
            doc = read_doc(storage, step)
        except CheckpointNotFound:
            continue
        generation = doc.get("generation", 0)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise CorruptCheckpoint(
                f"{storage.url}/{layout.manifest_path(step)}: generation {generation!r} is "
                "not valid"
            )
        out.append(Committed(step, generation))
    return sorted(out, key=lambda c: c.order)


def committed_steps(storage: Storage) -> list[int]:
    """Committed step numbers, by number (for listings; use :func:`newest` for "latest")."""
    return sorted(c.step for c in committed(storage))


def newest(storage: Storage) -> Committed | None:
    found = committed(storage)
    return found[-1] if found else None


def split_step_url(url: str) -> tuple[str, int | None]:
    """``ROOT/step-000000042`` -> (ROOT, 42); ``ROOT`` -> (ROOT, None: the newest committed)."""
    head, _, tail = url.rstrip("/").rpartition("/")
    step = layout.parse_step_dir(tail)
    if step is not None and head:
        return head, step
    return url.rstrip("/") or url, None


def open_step(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Storage, int, Manifest]:
    """The storage, step and manifest of a committed checkpoint named by ``url`` (a step
    directory, or a root meaning its newest committed step)."""
    root, step = split_step_url(url)
    storage = open_storage(root, storage_options)
    if step is None:
        last = newest(storage)
        if last is None:
            raise CheckpointNotFound(f"{storage.url}: no committed checkpoint")
        step = last.step
    return storage, step, read_manifest(storage, step)


class FrameSource:
    """Where a decoded manifest's frame tables are: ``storage``, under ``step_dir``. Reads the
    slices of the chunks a reader asks for, one request per table file, each slice checked
    against its digest and its chunk, and keeps them (a load plans some pieces twice)."""

    def __init__(self, storage: Storage, step_dir: str, where: str) -> None:
        self.storage, self.step_dir, self.where = storage, step_dir, where
        self.fetched_frames = 0  # frames read from table files (tests: a load reads its own)
        self._cache: dict[FrameRef, FrameTable] = {}
        self._lock = threading.Lock()

    def tables(self, refs: Sequence[tuple[str, FrameRef]]) -> list[FrameTable]:
        """The frames of each ``(tensor, ref)``, in order."""
        with self._lock:
            missing = [(n, r) for n, r in refs if r not in self._cache]
        by_table: dict[str, list[tuple[str, FrameRef]]] = {}
        for n, r in dict.fromkeys(missing):
            by_table.setdefault(r.table, []).append((n, r))
        for table, items in sorted(by_table.items()):
            path = f"{self.step_dir}/{table}"
            where = f"{self.where}/{table}"
            try:
                head, *bodies = self.storage.read_ranges(
                    path, [(0, HEADER)] + [r.byte_range for _, r in items])
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{where}: {items[0][0]}: frame table missing") from None
            except EOFError as e:
                raise CorruptCheckpoint(
                    f"{where}: {items[0][0]}: frame table truncated ({e})") from None
            if bytes(head[:8]) != MAGIC:
                raise CorruptCheckpoint(f"{where}: not a ckptd frame table")
            got = {}
            for (name, ref), body in zip(items, bodies, strict=True):
                got[ref] = parse_slice(body, ref, f"{where}: {name}")
            with self._lock:
                self._cache.update(got)
                self.fetched_frames += sum(len(t) for t in got.values())
        with self._lock:
            return [self._cache[r] for _, r in refs]
