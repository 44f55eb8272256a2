"""The commit: merging partials into ``manifest.json``, waiting for it, finalising, retention.

No collectives: the coordinator learns that every rank is done by finding their partial
manifests on storage, and the other ranks learn that the step is committed by finding the
manifest (of *their* attempt) — or a ``FAILED`` marker with the coordinator's reason.

Waiting is polling, paced per backend (:class:`Poller`): a filesystem is polled every 1-50 ms,
an object store every 50 ms-1 s (``ckptd.config``: ``poll_*`` and ``remote_poll_*``), because
there every poll is a billed, rate-limited request. Whatever the backend, a wait ends at
``commit_timeout_s``. The coordinator makes one LIST per poll, every other rank two GETs
(manifest, FAILED marker).

Nothing here reads ``latest``: it is advisory (a crash between the manifest and the pointer, or
an object store, may leave it stale). The newest committed step is found by listing the step
directories and checking their manifests (:func:`committed_steps`).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from ckptd import config, errors
from ckptd.errors import CheckpointNotFound, CkptdError, CorruptCheckpoint, ForeignWriter
from ckptd.manifest import Manifest, decode, merge
from ckptd.manifest import layout as L
from ckptd.storage import Storage, open_storage
from ckptd.storage.base import poll_interval

_jitter = random.Random()


class Poller:
    """Pauses between polls of ``storage`` until ``timeout_s`` has passed.

    The first pause is the storage's first interval (:func:`ckptd.storage.base.poll_interval`);
    each next one doubles, up to the storage's longest. Every pause is drawn uniformly in [½, 1]
    of the current interval, so ranks that started waiting together do not poll in lockstep, and
    none ends past the deadline. Bounded both ways: at most ``longest`` between two polls, and
    at most about ``2 + log2(longest / first) + 2 * timeout_s / longest`` polls in all.
    """

    def __init__(self, storage: Storage, timeout_s: float) -> None:
        self.first, self.longest = poll_interval(storage)
        self.interval = self.first
        self.deadline = time.monotonic() + timeout_s
        self.polls = 0

    def wait(self) -> bool:
        """Pause before the next poll; False (without pausing) once the deadline has passed."""
        now = time.monotonic()
        if now >= self.deadline:
            return False
        time.sleep(min(self.interval * _jitter.uniform(0.5, 1.0), self.deadline - now))
        self.interval = min(self.interval * 2, self.longest)
        self.polls += 1
        return True


def read_partials(storage: Storage, step: int, attempt: str) -> list[Manifest]:
    d = L.partials_dir(step, attempt)
    out = []
    for name in storage.list_dir(d):
        if name.endswith(".json"):
            out.append(decode(storage.read_bytes(f"{d}/{name}"), f"{d}/{name}"))
    return out


def _failed_error(storage: Storage, step: int, attempt: str) -> CkptdError | None:
    """The coordinator's error, re-created with its ckptd class so every rank raises the same."""
    try:
        raw = storage.read_bytes(L.failed_path(step, attempt))
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        kind, message = str(doc["type"]), str(doc["message"])
    except (ValueError, KeyError, TypeError):
        kind, message = "CkptdError", raw.decode(errors="replace")
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, CkptdError)):
        cls, message = CkptdError, f"{kind}: {message}"
    return cls(f"step {step} was not committed: {message}")


def coordinate(storage: Storage, step: int, attempt: str, world_size: int, run_id: str) -> Manifest:
    """Wait for every rank's partial of ``attempt``, merge them, commit. On failure, leave a
    FAILED marker (so the other ranks stop waiting) and raise; ``latest`` is untouched."""
    try:
        poller = Poller(storage, config.get().commit_timeout_s)
        d = L.partials_dir(step, attempt)
        while True:
            present = [n for n in storage.list_dir(d) if n.endswith(".json")]
            if len(present) >= world_size:
                break
            if not poller.wait():
                have = sorted(int(n[:-5]) for n in present)
                missing = sorted(set(range(world_size)) - set(have))
                raise CkptdError(
                    f"step {step}: ranks {missing} did not finish their share within "
                    f"{config.get().commit_timeout_s:.0f}s; not committed"
                )
        manifest = merge(read_partials(storage, step, attempt))
        check_owner(storage, run_id)
        storage.put_atomic(L.manifest_path(step), manifest.encode())
        storage.put_atomic(L.LATEST, L.step_dir(step).encode())
        return manifest
    except BaseException as e:
        try:
            doc = {"type": type(e).__name__, "message": str(e)}
            storage.put_atomic(L.failed_path(step, attempt), json.dumps(doc).encode())
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        raise


def wait_committed(storage: Storage, step: int, attempt: str) -> Manifest:
    """Block until the coordinator committed ``attempt`` (or raise its reason)."""
    poller = Poller(storage, config.get().commit_timeout_s)
    path = L.manifest_path(step)
    while True:
        try:  # one GET (not exists + GET: on an object store `exists` costs up to two requests)
            m: Manifest | None = decode(storage.read_bytes(path), path)
        except (FileNotFoundError, CorruptCheckpoint):
            m = None  # not yet, or replaced under our feet by retention/another commit
        if m is not None and m.attempt == attempt:
            return m
        error = _failed_error(storage, step, attempt)
        if error is not None:
            raise error
        if not poller.wait():
            raise CkptdError(
                f"step {step}: no commit after {config.get().commit_timeout_s:.0f}s "
                "(coordinator dead?)"
            )


def claim(storage: Storage, run_id: str) -> None:
    """Make ``run_id`` the owner of the root; a job still writing under an older owner will
    fail its next commit with ForeignWriter instead of mixing its steps into ours."""
    storage.put_atomic(L.OWNER, json.dumps({"run": run_id, "since": time.time()}).encode())


def check_owner(storage: Storage, run_id: str) -> None:
    try:
        owner = json.loads(storage.read_bytes(L.OWNER))
    except FileNotFoundError:
        return
    except ValueError as e:
        raise CorruptCheckpoint(f"{L.OWNER}: unreadable ({e})") from e
    if owner.get("run") != run_id:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        raise ForeignWriter(
            f"{storage.url}: owned by run {owner.get('run')} since {since}, not this run "
            f"{run_id}: another job (or a newer world) writes here; this save is abandoned"
        )


def committed_steps(storage: Storage) -> list[int]:
    steps = []
    for name in storage.list_dir(""):
        step = L.parse_step_dir(name)
        if step is not None and storage.exists(f"{name}/{L.MANIFEST}"):
            steps.append(step)
    return sorted(steps)


def all_steps(storage: Storage) -> list[int]:
    return sorted(s for s in map(L.parse_step_dir, storage.list_dir("")) if s is not None)


def finalize(storage: Storage, step: int) -> Manifest | None:
    """Commit ``step`` from the newest attempt whose partials are complete, if any."""
    if storage.exists(L.manifest_path(step)):
        return decode(storage.read_bytes(L.manifest_path(step)), L.manifest_path(step))
    best: Manifest | None = None
    for attempt in storage.list_dir(f"{L.step_dir(step)}/ranks"):
        if storage.exists(L.failed_path(step, attempt)):
            continue
        partials = read_partials(storage, step, attempt)
        if not partials or len(partials) != partials[0].world_size:
            continue
        m = merge(partials)
        if best is None or m.created > best.created:
            best = m
    if best is None:
        return None
    storage.put_atomic(L.manifest_path(step), best.encode())
    storage.put_atomic(L.LATEST, L.step_dir(step).encode())
    return best


def apply_retention(storage: Storage, keep_last: int) -> list[int]:
    """Remove committed steps beyond the newest ``keep_last`` (never the newest one)."""
    steps = committed_steps(storage)
    doomed = steps[: max(0, len(steps) - max(1, keep_last))]
    for s in doomed:
        storage.remove(L.manifest_path(s))  # uncommit first: readers never see a half-deleted step
        storage.remove(L.step_dir(s))
    return doomed


def incomplete_steps(storage: Storage) -> list[int]:
    """Steps without a manifest that are older than the newest commit: no save can commit them
    any more (a rank's saves run one after another, so by the time a newer step is committed an
    older one has committed or failed), so their objects are garbage."""
    committed = committed_steps(storage)
    if not committed:
        return []
    newest = committed[-1]
    return [s for s in all_steps(storage) if s < newest and s not in committed]


def gc_incomplete(storage: Storage) -> list[int]:
    """Remove step directories without a manifest that are older than the newest commit."""
    doomed = incomplete_steps(storage)
    for s in doomed:
        storage.remove(L.step_dir(s))
    return doomed


@dataclass
class GcReport:
    removed_committed: list[int] = field(default_factory=list)
    removed_incomplete: list[int] = field(default_factory=list)
    aborted_uploads: int = 0


def collect_garbage(
    storage: Storage, *, keep_last: int = 0, upload_min_age_s: float | None = None
) -> GcReport:
    """``ckptd gc``: retention (``keep_last`` > 0), incomplete steps, and on object stores the
    multipart uploads that failed saves left behind (invisible, but billed).

    Uploads under steps older than the newest commit and without a manifest are aborted whatever
    their age (such a step may show no object at all: an outage mid-upload leaves only uploads);
    anywhere else under the root only those at least ``upload_min_age_s`` old (default:
    ``config.gc_upload_min_age_s`` or twice ``commit_timeout_s``, whichever is longer), which
    must exceed ``commit_timeout_s`` so that an upload of a save that may still commit is never
    aborted. Backends without uploads (no ``abort_incomplete_uploads``) skip that part.
    """
    cfg = config.get()
    min_age = (
        max(cfg.gc_upload_min_age_s, 2 * cfg.commit_timeout_s)
        if upload_min_age_s is None
        else float(upload_min_age_s)
    )
    if min_age <= cfg.commit_timeout_s:
        raise ValueError(
            f"upload min age {min_age:g}s must exceed the commit timeout "
            f"({cfg.commit_timeout_s:g}s): a younger upload may belong to a save still in flight"
        )
    report = GcReport()
    if keep_last > 0:
        report.removed_committed = apply_retention(storage, keep_last)
    abort = getattr(storage, "abort_incomplete_uploads", None)
    listed = getattr(storage, "incomplete_uploads", None)
    committed = committed_steps(storage)
    dead: list[int] = []
    if committed:
        steps = set(all_steps(storage))
        if listed is not None:  # also steps that hold nothing but uploads
            for path, _age in listed(""):
                s = L.parse_step_dir(path.split("/", 1)[0])
                if s is not None:
                    steps.add(s)
        dead = sorted(s for s in steps if s < committed[-1] and s not in committed)
    for s in dead:
        if abort is not None:
            report.aborted_uploads += int(abort(L.step_dir(s), min_age_s=0.0))
        storage.remove(L.step_dir(s))
    report.removed_incomplete = dead
    if abort is not None:
        report.aborted_uploads += int(abort("", min_age_s=min_age))
    return report


def split_step_url(url: str) -> tuple[str, int | None]:
    """``ROOT/step-000000042`` -> (ROOT, 42); ``ROOT`` -> (ROOT, None: the newest committed)."""
    head, _, tail = url.rstrip("/").rpartition("/")
    step = L.parse_step_dir(tail)
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
        steps = committed_steps(storage)
        if not steps:
            raise CheckpointNotFound(f"{storage.url}: no committed checkpoint")
        step = steps[-1]
    path = L.manifest_path(step)
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{storage.url}/{path}: no committed step {step}") from None
    return storage, step, decode(raw, f"{storage.url}/{path}")

