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
from ckptd.manifest.envelope import check_manifest_size
from ckptd.manifest.frames import HEADER, MAGIC, FrameRef, FrameTable, parse_slice
from ckptd.manifest.lead import PREFIX_BYTES, Lead, lead, parts
from ckptd.manifest.parse import Head, decode, head
from ckptd.storage import Storage, open_storage
from ckptd.storage.base import ReadSession

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
    """A committed step: its number, the generation that committed it and its attempt."""

    step: int
    generation: int
    attempt: str

    @property
    def order(self) -> tuple[int, int]:
        return (self.generation, self.step)


def all_steps(storage: Storage) -> list[int]:
    """Every step directory, committed or not, by number."""
    return sorted(s for s in map(layout.parse_step_dir, storage.list_dir("")) if s is not None)


def _where(storage: Storage, step: int) -> str:
    return f"{storage.url}/{layout.manifest_path(step)}"


def read_raw(storage: Storage, step: int) -> bytes:
    try:
        return storage.read_bytes(layout.manifest_path(step))
    except FileNotFoundError:
        raise CheckpointNotFound(f"{_where(storage, step)}: no committed step {step}") from None


def read_manifest(storage: Storage, step: int) -> Manifest:
    return decode_manifest(storage, step, read_raw(storage, step))


def decode_manifest(storage: Storage, step: int, raw: bytes,
                    file: ManifestFile | None = None) -> Manifest:
    """``step``'s manifest from ``raw``, the bytes of its ``manifest.json`` (read here or by
    another rank): its digest checked, its frame tables read from ``storage`` when asked.
    With ``file``, ``raw`` may be the head alone (:meth:`ManifestFile.head`): the entries
    are then read from ``file`` as they are used, each checked against its digest."""
    where = _where(storage, step)
    manifest = decode(raw, where, FrameSource(
        storage, layout.step_dir(step), f"{storage.url}/{layout.step_dir(step)}"),
        read=file.read if file is not None else None)
    _check_step(manifest.step, step, where)
    return manifest


class ManifestFile:
    """``step``'s ``manifest.json`` as a load reads it: opened once (on first use, held until
    :meth:`close`), its head read (:meth:`head`) and then the byte ranges of the entries the
    load decodes (:meth:`read`). A manifest of format 4 or older, or one whose lead is not in
    the first :data:`PREFIX_BYTES`, is read whole instead (``docs/format.md``, *Integrity*)."""

    def __init__(self, storage: Storage, step: int) -> None:
        self.storage, self.step = storage, step
        self.path, self.where = layout.manifest_path(step), _where(storage, step)
        self._session: ReadSession | None = None
        self._closed = False
        self._lock = threading.Lock()

    def _open(self) -> ReadSession:
        with self._lock:
            if self._session is None:
                try:
                    self._session = self.storage.open_read([self.path])
                except FileNotFoundError:
                    raise CheckpointNotFound(f"{self.where}: no committed step {self.step}"
                                             ) from None
            return self._session

    @property
    def size(self) -> int:
        return self._open().sizes[self.path]

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of ``(offset, length)`` ranges of the file (EOFError past its end)."""
        if self._closed:  # an entry first used after the load: read it on its own
            return [bytes(b) for b in self.storage.read_ranges(self.path, ranges)]
        session = self._open()
        try:
            return [bytes(session.read(self.path, offset, length)) for offset, length in ranges]
        except FileNotFoundError:  # an object store's object deleted since it was opened
            raise CheckpointNotFound(f"{self.where}: removed while it was being read") from None

    def head(self) -> bytes:
        """The manifest's head — the whole file where it has no head of its own — as
        :func:`decode_manifest` takes it: its first :data:`PREFIX_BYTES` (the lead says where
        the head ends), then the rest of the head; nothing is checked but the lead."""
        size = self.size
        check_manifest_size(size, self.where)
        try:
            prefix = self.read([(0, min(size, PREFIX_BYTES))])[0]
            split = parts(prefix, self.where)
            if split is None:  # read whole: its digest says whether it is all there
                return prefix + self.read([(len(prefix), size - len(prefix))])[0]
            if split.head + split.tail != size:
                raise CorruptCheckpoint(f"{self.where}: {size} bytes, its lead says "
                                        f"{split.head + split.tail} (truncated or extended)")
            if split.head <= len(prefix):
                return prefix[: split.head]
            return prefix + self.read([(len(prefix), split.head - len(prefix))])[0]
        except EOFError as e:  # shrunk while it was read
            raise CorruptCheckpoint(f"{self.where}: truncated ({e})") from None

    def close(self) -> None:
        with self._lock:
            session, self._session, self._closed = self._session, None, True
        if session is not None:
            session.close()

    def __enter__(self) -> ManifestFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_head(storage: Storage, step: int) -> Head:
    """What ``ckptd ls`` and ``history`` show of ``step`` (the whole file read and its digest
    checked; no chunk decoded, no torch)."""
    where = _where(storage, step)
    got = head(read_raw(storage, step), where)
    _check_step(got.step, step, where)
    return got


def _check_step(said: Any, step: int, where: str) -> None:
    """A manifest is the step of its directory: one moved or copied into another step's
    directory (its seal is still whole) is refused, not loaded as that step."""
    if said != step or isinstance(said, bool):
        raise CorruptCheckpoint(f"{where}: the manifest is of step {said!r}, in the directory "
                                f"of step {step}")


def read_lead(storage: Storage, step: int, *, sealed: bool = True) -> Lead | Head:
    """What ``step``'s manifest names (step, attempt, generation): from its lead, its first
    :data:`PREFIX_BYTES` (one ranged read), or from its head where those bytes are not a lead
    (formats 1 and 2), or with ``sealed`` not a sealed one (written before the lead seal).
    CheckpointNotFound when there is no manifest; the step is not compared with ``step``."""
    path = layout.manifest_path(step)
    try:
        prefix = bytes(storage.read_ranges(path, [(0, PREFIX_BYTES)])[0])
    except FileNotFoundError:
        raise CheckpointNotFound(f"{_where(storage, step)}: no committed step {step}") from None
    except EOFError:  # a manifest shorter than the prefix
        prefix = b""
    found = lead(prefix, _where(storage, step))
    if found is None or (sealed and found.generation is None):
        return head(read_raw(storage, step), _where(storage, step))
    return found


def read_committed(storage: Storage, step: int) -> Committed:
    """Whether ``step`` is committed (CheckpointNotFound if not), by which generation and
    attempt: from its manifest's sealed lead, or its head (:func:`read_lead`)."""
    found = read_lead(storage, step)
    _check_step(found.step, step, _where(storage, step))
    assert found.generation is not None
    return Committed(step, found.generation, found.attempt)


def committed(storage: Storage) -> list[Committed]:
    """The committed steps, oldest first in commit order ``(generation, step)``, each read
    from its lead (:func:`read_committed`). A damaged lead or head raises
    :class:`CorruptCheckpoint` naming the manifest: skipping it could silently make an older
    step the newest (a manifest damaged past its lead is refused by whatever reads the rest).

    A listed step without a manifest is in flight, or was removed by retention after a newer
    commit: when no listed step is committed but some had no manifest, the root is listed
    again, once, so that a reader racing retention is not told there is no step at all."""
    listed = all_steps(storage)
    found, missing = _read_committed(storage, listed)
    if missing and not found:
        found, _ = _read_committed(storage, [s for s in all_steps(storage) if s not in listed])
    return sorted(found, key=lambda c: c.order)


def _read_committed(storage: Storage, steps: list[int]) -> tuple[list[Committed], bool]:
    """The committed ones of ``steps``, and whether some had no manifest."""
    found, missing = [], False
    for step in steps:
        try:
            found.append(read_committed(storage, step))
        except CheckpointNotFound:
            missing = True
    return found, missing


def committed_steps(storage: Storage) -> list[int]:
    """Committed step numbers, by number (for listings; use :func:`newest` for "latest")."""
    return sorted(c.step for c in committed(storage))


def newest(storage: Storage) -> Committed | None:
    found = committed(storage)
    return found[-1] if found else None


def newest_step(storage: Storage) -> int:
    """The newest committed step (CheckpointNotFound when there is none)."""
    last = newest(storage)
    if last is None:
        raise CheckpointNotFound(f"{storage.url}: no committed checkpoint")
    return last.step


def split_step_url(url: str) -> tuple[str, int | None]:
    """``ROOT/step-000000042`` -> (ROOT, 42); ``ROOT`` -> (ROOT, None: the newest committed)."""
    root, _, name = url.rstrip("/").rpartition("/")
    step = layout.parse_step_dir(name)
    if step is not None and root:
        return root, step
    return url.rstrip("/") or url, None


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Storage, int]:
    """The storage and step of a committed checkpoint named by ``url`` (a step directory, or a
    root meaning its newest committed step)."""
    root, step = split_step_url(url)
    storage = open_storage(root, storage_options)
    return storage, newest_step(storage) if step is None else step


def open_step(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Storage, int, Manifest]:
    """:func:`open_url`, and the step's manifest."""
    storage, step = open_url(url, storage_options)
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
