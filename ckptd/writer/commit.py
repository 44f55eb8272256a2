"""The commit: merging partials into ``manifest.json``, waiting for it, finalising, retention.

No collectives: the coordinator learns that every rank is done by finding their partial
manifests on storage, and the other ranks learn that the step is committed by finding the
manifest (of *their* attempt) — or a ``FAILED`` marker with the coordinator's reason.

Waiting is polling, paced per backend (:class:`~ckptd.writer.poller.Poller`): a filesystem
is polled every 1-50 ms, an object store every 50 ms-1 s (``ckptd.config``: ``poll_*`` and
``remote_poll_*``), because there every poll is a billed, rate-limited request. Whatever the
backend, a wait ends at ``commit_timeout_s``. The coordinator makes one LIST per poll, every
other rank two GETs (manifest, FAILED marker).

Nothing here reads ``latest``: it is advisory (a crash between the manifest and the pointer, or
an object store, may leave it stale). The newest committed step is found by listing the step
directories and checking their manifests (:func:`committed_steps`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ckptd import config, gcpause
from ckptd.catalog import Owner, all_steps, committed, read_lead, read_owner
from ckptd.errors import CheckpointNotFound, CkptdError, CorruptCheckpoint, ForeignWriter
from ckptd.manifest import Manifest, decode, layout, merge
from ckptd.manifest.envelope import open_doc
from ckptd.storage import Storage
from ckptd.writer import exiting, own_partials
from ckptd.writer.failures import failure_of, record_failure
from ckptd.writer.group_store import GroupStore
from ckptd.writer.poller import Poller

log = logging.getLogger("ckptd")

def attempt_run(attempt: str) -> str:
    """The run id inside an attempt id (``<run>-<seq>``)."""
    return attempt.rpartition("-")[0] or attempt


def read_partials(storage: Storage, step: int, attempt: str) -> list[Manifest]:
    d = layout.partials_dir(step, attempt)
    return [_read_partial(storage, f"{d}/{n}") for n in storage.list_dir(d)
            if layout.is_partial(n)]


def _read_partial(storage: Storage, path: str) -> Manifest:
    return decode(storage.read_bytes(path), path, eager=True)


# ----------------------------------------------------------------------------- the commit
def commit_partials(storage: Storage, partials: list[Manifest], run_id: str | None, *,
                    generation: int, overwrite: bool = False, keep_copies: bool = False,
                    **fields: Any) -> Manifest:
    """The one merge-then-commit, for every writer of a step: a save's coordinator (whichever
    executor runs it), ``ckptd finalize`` and a new owner's takeover, the offline reshard and
    the DCP import. Merge the partials (coverage, agreement: :func:`ckptd.manifest.merge`;
    ``keep_copies``: every rank's copy of a replicated box), stamp the owner's ``generation``
    (and ``fields`` of the manifest a writer sets itself: the reshard's training metadata),
    then :func:`commit`."""
    with gcpause.paused():  # a thousand partials' objects: see ckptd/gcpause.py
        manifest = replace(merge(partials, keep_copies=keep_copies), generation=generation,
                           **fields)
        commit(storage, manifest, run_id, overwrite=overwrite)
    return manifest


def commit(
    storage: Storage, manifest: Manifest, run_id: str | None, *, overwrite: bool = False
) -> None:
    """The one commit, for saves, finalisation, offline reshard and imports: check that
    ``run_id`` still owns the root (None: a root from before ``owner.json``), refuse to replace
    a committed step (unless ``overwrite``), write ``manifest.json`` atomically, then the
    advisory ``latest``.

    Once the manifest is written the step is committed whatever follows: a failure to move
    ``latest`` or to remove a replaced attempt's files is a warning, never an error."""
    step = manifest.step
    if run_id is not None:
        check_owner(storage, run_id)
    path = layout.manifest_path(step)
    if not overwrite:
        try:
            old: Any = open_doc(storage.read_bytes(path), path).get("attempt")
        except FileNotFoundError:
            old = None
        except CorruptCheckpoint:  # a damaged commit is still a commit: do not replace it
            old = manifest.attempt
        if old is not None and old != manifest.attempt:
            raise CkptdError(
                f"{storage.url}/{layout.step_dir(step)}: step {step} is already committed (attempt "
                f"{old}); a committed step is immutable: save another step number, or "
                "pass overwrite=True to replace it"
            )
    storage.put_atomic(path, manifest.encode())
    try:
        storage.put_visible(layout.LATEST, layout.step_dir(step).encode())  # advisory
    except OSError as e:
        log.warning("ckptd: step %d is committed, but the advisory %s was not moved: %s",
                    step, layout.LATEST, e)
    if overwrite:
        remove_other_attempts(storage, step, manifest.attempt)


def remove_other_attempts(storage: Storage, step: int, keep: str) -> None:
    """Best effort: the files and partials of every attempt of ``step`` other than ``keep``."""
    for sub in ("data", "ranks"):
        for attempt in storage.list_dir(f"{layout.step_dir(step)}/{sub}"):
            if attempt != keep:
                try:
                    storage.remove(f"{layout.step_dir(step)}/{sub}/{attempt}")
                except OSError as e:
                    log.warning("ckptd: could not remove attempt %s of step %d: %s",
                                attempt, step, e)


def coordinate(
    storage: Storage,
    step: int,
    attempt: str,
    world_size: int,
    run_id: str,
    *,
    generation: int = 0,
    overwrite: bool = False,
    signals: GroupStore | None = None,
    give_up: Callable[[list[int]], str | None] | None = None,
    timeout_s: float | None = None,
) -> None:
    """Wait for every rank's partial of ``attempt``, merge them, commit. A rank's failure record
    fails the step at once, naming that rank; so does ``give_up(missing ranks)`` returning why
    their shares cannot come (the node agent's: :mod:`ckptd.agent.orphans`). On failure, leave
    a FAILED marker (so the other ranks stop waiting) and raise; ``latest`` is untouched.
    ``timeout_s``: how long to wait for the partials (default ``commit_timeout_s``)."""
    signals = signals or GroupStore(None)
    committed = False
    timeout_s = config.get().commit_timeout_s if timeout_s is None else timeout_s
    d = layout.partials_dir(step, attempt)
    try:
        with storage.watch([d]) as watch:
            partials = _wait_partials(
                storage, step, attempt, world_size, signals, give_up,
                Poller(storage, timeout_s, coordinating=True, watch=watch), timeout_s)
        commit_partials(storage, partials, run_id, generation=generation, overwrite=overwrite)
        committed = True
        signals.publish_committed(attempt)
    except BaseException as e:
        if not committed:
            # a rank's failure is already published; anything else is the commit's own
            record_failure(storage, signals, step, attempt, 0, e, share=False)
        raise


def _wait_partials(storage: Storage, step: int, attempt: str, world_size: int,
                   signals: GroupStore, give_up: Callable[[list[int]], str | None] | None,
                   poller: Poller, timeout_s: float) -> list[Manifest]:
    """Every rank's partial of ``attempt``, decoded, once all are present (in the order of
    :func:`read_partials`); a failure raised. Each is read and decoded in the poll that finds
    it, while the others are still being written: once the last one appears, only it is left
    to read. (A partial appears whole, by a rename, as the last act of its rank's share, in a
    directory of this attempt alone: the one found is the one a read after the last would
    find.)"""
    d = layout.partials_dir(step, attempt)
    decoded: dict[str, Manifest] = {}
    while True:
        names = storage.list_dir(d)
        failure = failure_of(storage, step, attempt, poller.signals(signals), names)
        if failure is not None:
            raise failure
        present = [n for n in names if layout.is_partial(n)]
        for name in present:
            if name not in decoded:
                path = f"{d}/{name}"
                with gcpause.paused():  # its objects hold no cycles (see ckptd/gcpause.py)
                    decoded[name] = (own_partials.take(storage, path)
                                     or _read_partial(storage, path))
        if len(present) >= world_size:
            return [decoded[n] for n in present]
        missing = sorted(set(range(world_size)) - {int(n[:-5]) for n in present})
        why = give_up(missing) if give_up is not None else None
        if why is not None:
            raise CkptdError(f"step {step}: ranks {missing} had not finished their share: "
                             f"{why}; not committed")
        if not poller.wait():
            if poller.abandoned:
                raise exiting.Abandoned(
                    f"step {step}: ranks {missing} had not finished their share; stopped "
                    f"waiting: {exiting.reason()}; not committed")
            raise CkptdError(
                f"step {step}: ranks {missing} did not finish their share within "
                f"{timeout_s:.0f}s; not committed"
            )


def wait_committed(
    storage: Storage, step: int, attempt: str, signals: GroupStore | None = None
) -> None:
    """Block until the coordinator committed ``attempt`` (or raise its reason). Each poll asks
    the store, then whether the manifest or the FAILED marker exists — through the storage's
    probe where it has one (a filesystem: one ``stat`` each, no walk) — and reads only what
    appeared. Where the storage's watch is complete (a local filesystem: the rename of the
    manifest is what wakes the wait) storage is asked first, and the store only after a pause
    the watch did not end (:meth:`Poller.signals`): the store's answer would cost a request to
    the coordinator's process, which is busy finishing the commit just then.

    The watch is on the step's directory alone, woken by the manifest: the FAILED marker's
    directory holds every rank's partial, and watching it woke every waiting process once per
    partial of every save. A failure is learnt at the next poll (the store's, and storage's
    marker), on a long wait up to ``config.poll_watched_idle_max_s`` later."""
    signals = signals or GroupStore(None)
    paths = [layout.manifest_path(step), layout.failed_path(step, attempt)]
    with storage.probe(paths) as probe, \
            storage.watch([layout.step_dir(step)], [layout.MANIFEST]) as watch:
        poller = Poller(storage, config.get().commit_timeout_s, watch=watch)
        storage_first = watch is not None and watch.complete
        while True:
            store = poller.signals(signals)
            if not storage_first and store.committed(attempt):
                return
            manifest, failed = probe() if probe is not None else (True, True)
            if manifest and _attempt_at(storage, step) == attempt:
                return
            if storage_first and store.committed(attempt):
                return
            error = failure_of(storage, step, attempt, store, read=failed)
            if error is not None:
                raise error
            if not poller.wait():
                if poller.abandoned:
                    raise exiting.Abandoned(
                        f"step {step}: not committed yet; stopped waiting: {exiting.reason()}; "
                        "this rank's share is in place: it commits if the coordinator gets "
                        "every share")
                raise CkptdError(
                    f"step {step}: no commit after {config.get().commit_timeout_s:.0f}s "
                    "(coordinator dead?)"
                )


def _attempt_at(storage: Storage, step: int) -> str | None:
    """The attempt that ``step``'s manifest commits (None: none yet, or unreadable), from its
    lead: one ranged GET of its first bytes (not exists + GET: on an object store `exists`
    costs up to two requests); the whole head only when they are not in the writer's form."""
    try:
        got = read_lead(storage, step, sealed=False)
    except (CheckpointNotFound, CorruptCheckpoint):  # not yet, removed, or damaged
        return None
    return got.attempt if got.step == step else None


# ----------------------------------------------------------------------------- ownership
def claim(storage: Storage, run_id: str) -> int:
    """Make ``run_id`` the owner of the root and return its generation; a job still writing
    under an older owner fails its next commit with ForeignWriter instead of mixing its steps
    into ours.

    Before taking over, the outgoing owner's complete attempts that its coordinator did not
    live to commit are committed in its name (:func:`recover`): a restarted job then resumes
    from the newest state its predecessor made durable. The same run id again (a caller's id
    reused across restarts: ``CKPTD_RUN_ID``, a scheduler's job id) keeps its generation and
    recovers its earlier incarnation's attempts in the same way."""
    prev = read_owner(storage)
    if prev is not None:
        which = "an earlier incarnation of this run" if prev.run == run_id else "the previous run"
        for step in recover(storage, prev):
            log.warning("ckptd: committed step %d of %s (%s), whose coordinator stopped after "
                        "every rank's share was durable", step, which, prev.run)
        if prev.run == run_id:
            return prev.generation
    generation = (prev.generation if prev is not None else 0) + 1
    storage.put_atomic(layout.OWNER, Owner(run_id, generation, time.time()).encode())
    return generation


def check_owner(storage: Storage, run_id: str) -> None:
    owner = read_owner(storage)
    if owner is not None and owner.run != run_id:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.since))
        raise ForeignWriter(
            f"{storage.url}: owned by run {owner.run} since {since}, not this run "
            f"{run_id}: another job (or a newer world) writes here; this save is abandoned"
        )


def finalize(storage: Storage, step: int) -> Manifest | None:
    """Commit ``step`` from the newest complete attempt of the root's current owner, applying
    the coordinator's rules: every rank's partial present, no failure marker or record, full
    coverage, the owner unchanged. None when no attempt qualifies. Used by ``ckptd finalize``;
    loads and ``latest_step()`` never commit anything."""
    path = layout.manifest_path(step)
    try:
        return decode(storage.read_bytes(path), path)
    except FileNotFoundError:
        pass
    owner = read_owner(storage)
    if owner is None:  # a root from before owner.json: any complete attempt
        return _finalize_as(storage, step, None, 0)
    return _finalize_as(storage, step, owner.run, owner.generation)


def recover(storage: Storage, owner: Owner) -> list[int]:
    """Commit ``owner``'s complete, unfailed attempts of steps after its newest commit."""
    mine = [c.step for c in committed(storage) if c.generation == owner.generation]
    after = max(mine, default=-1)
    done = []
    for step in all_steps(storage):
        if step > after and not storage.exists(layout.manifest_path(step)):
            try:
                if _finalize_as(storage, step, owner.run, owner.generation) is not None:
                    done.append(step)
            except CkptdError as e:
                log.warning("ckptd: step %d of run %s cannot be committed: %s",
                            step, owner.run, e)
    return done


def _finalize_as(
    storage: Storage, step: int, run: str | None, generation: int
) -> Manifest | None:
    """Commit ``step`` from the newest complete, unfailed attempt of ``run`` (None: any)."""
    best: list[Manifest] | None = None
    for attempt in storage.list_dir(f"{layout.step_dir(step)}/ranks"):
        if run is not None and attempt_run(attempt) != run:
            continue  # another job's attempt: never commit it into this owner's root
        names = storage.list_dir(layout.partials_dir(step, attempt))
        if layout.FAILED in names or any(layout.is_rank_failure(n) for n in names):
            continue
        partials = read_partials(storage, step, attempt)
        if not partials or len(partials) != partials[0].world_size:
            continue
        if best is None or max(p.created for p in partials) > max(p.created for p in best):
            best = partials
    if best is None:
        return None
    return commit_partials(storage, best, run, generation=generation)
