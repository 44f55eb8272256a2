"""Retention, deleting a step, and garbage collection (``ckptd gc``).

Retention removes the whole committed steps that the root's policy (:mod:`ckptd.policies`;
``keep_last=N`` is ``KeepLast(N)``) does not keep, never the newest in commit order
(:mod:`ckptd.catalog`). It and ``Checkpointer.delete`` remove a step the same way,
:func:`remove_step`: the manifest first, so that a reader never takes a half-removed step for
a committed one (``ckptd.loader.reader``: a load that loses its files says the step was
removed), then the files; removing a step twice, or one that another remover is removing, is
not an error. Garbage collection removes every attempt that no committed manifest names and
that can never commit any more:

- an attempt with a FAILED marker or a rank's failure record;
- an attempt of a run that no longer owns the root (``owner.json``): the commit refuses it, and
  its complete attempts were committed when the new owner took over, if they could be;
- an attempt of the owner that is not newer than the owner's newest committed attempt: a rank's
  saves run one after another, so once attempt N is committed, every earlier attempt of that run
  has committed or failed on every rank (attempt ids are ``<run>-<sequence>``).

So no clock is involved for files: an attempt of the owner newer than its newest commit may be
in flight, or complete and waiting for the next owner to commit it, and is kept. On object
stores, uploads under a removed attempt are aborted whatever their age; other uploads only when
older than ``upload_min_age_s`` (an upload is invisible to listings, so it has no attempt to
judge by until it completes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptd import config
from ckptd.catalog import Committed, Owner, all_steps, committed, read_head, read_owner
from ckptd.errors import CheckpointNotFound
from ckptd.manifest import layout
from ckptd.policies import Candidate, KeepLast, Retention
from ckptd.storage import Storage
from ckptd.storage.base import as_storage
from ckptd.writer.commit import attempt_run

log = logging.getLogger("ckptd")


def remove_step(storage: Storage, step: int) -> bool:
    """Remove committed ``step``: uncommit it (its manifest goes first: readers never see a
    half-removed step as committed), then its files. False, and nothing touched, when it is
    not committed: already removed or being removed by another caller (not an error), or a
    save still in flight (its files are not ours to remove; ``ckptd gc`` judges those)."""
    if not storage.exists(layout.manifest_path(step)):
        return False
    storage.remove(layout.manifest_path(step))
    storage.remove(layout.step_dir(step))
    return True


Metrics = dict[tuple[int, str], Mapping[str, Any]]  # (step, attempt) -> its training metadata


def apply_retention(storage: Storage, policy: Retention | int,
                    known: Metrics | None = None) -> list[int]:
    """Remove the committed steps ``policy`` does not keep (an int: ``KeepLast``), never the
    newest one in commit order, whatever the step numbers say. A policy that reads metrics
    reads them from the steps' manifests (``known``: those already read, by step and attempt,
    updated here), so it decides the same after a restart."""
    if isinstance(policy, int):
        policy = KeepLast(max(1, policy))
    steps = committed(storage)
    if len(steps) <= 1:
        return []
    found = _candidates(storage, steps, policy, {} if known is None else known)
    kept = policy.keep(found) | {steps[-1].step}
    doomed = [c.step for c in steps if c.step not in kept]
    for s in doomed:
        remove_step(storage, s)
    return doomed


def _candidates(storage: Storage, steps: list[Committed], policy: Retention,
                known: Metrics) -> list[Candidate]:
    """``steps`` as the policy sees them: with their training metadata when it reads some
    (each manifest's head read once: ``known``)."""
    if not policy.metrics:
        return [Candidate(c.step, {}) for c in steps]
    out = []
    for c in steps:
        key = (c.step, c.attempt)
        if key not in known:
            try:
                known[key] = read_head(storage, c.step).training
            except CheckpointNotFound:  # removed meanwhile (Checkpointer.delete)
                continue
        out.append(Candidate(c.step, known[key]))
    live = {(c.step, c.attempt) for c in steps}
    for key in [k for k in known if k not in live]:
        del known[key]
    return out


class Owed:
    """Retention owed after a commit, run off the commit's path: a thread of its own starts it
    as soon as the commit is written (:meth:`owe`), and the writer's next save waits for it
    before its files (:meth:`settle`), so the disk holds no more than one step beyond what the
    policy keeps while a save is written; the writer's close waits for it too. Neither the
    commit that owes it nor the handle of that save waits for it, and no failure of it fails a
    save: it is logged, and the next commit owes it again. The metrics a policy reads from the
    manifests (``KeepBest``) are remembered between runs (``_known``).

    The thread stays for the next commit while commits come (it ends after :data:`IDLE_S`
    without one): starting a thread per commit made the commit wait until the new thread was
    scheduled, on a busy host the longest step between the manifest and the handle."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: tuple[Storage, Retention] | None = None  # owed, not yet taken up
        self._busy = False  # the thread applies one now
        self._worker: threading.Thread | None = None
        self._known: Metrics = {}  # only the thread touches it

    def owe(self, storage: Storage, policy: Retention | None) -> None:
        """After a commit: retention is due (None: every step is kept); it starts now, in the
        background."""
        if policy is None:
            return
        self.settle()  # (one at a time: a commit owes it after the previous one was settled)
        with self._cond:
            self._due = (storage, policy)
            if self._worker is not None and self._worker.is_alive():
                self._cond.notify_all()
                return
            self._worker = threading.Thread(target=self._work, name="ckptd-retention",
                                            daemon=True)
            self._worker.start()

    def settle(self) -> None:
        """Wait for the retention owed, if it still runs (the next save needs its space)."""
        with self._cond:
            while self._due is not None or self._busy:
                self._cond.wait()

    def _work(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while True:
                if not self._cond.wait_for(lambda: self._due is not None, IDLE_S):
                    if self._worker is me:
                        self._worker = None  # the next owe starts another
                    return
                assert self._due is not None
                (storage, policy), self._due, self._busy = self._due, None, True
                self._cond.release()
                try:
                    _retain(storage, policy, self._known)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._cond.notify_all()


# how long the retention thread waits for the next commit before it ends
IDLE_S = 30.0


def _retain(storage: Storage, policy: Retention, known: Metrics) -> None:
    try:
        apply_retention(storage, policy, known)
    except Exception as e:  # noqa: BLE001 - best effort: the step it follows is committed
        log.warning("ckptd: retention under %s failed: %s: %s", storage.url,
                    type(e).__name__, e)


@dataclass
class GcReport:
    removed_committed: list[int] = field(default_factory=list)  # by retention
    removed_incomplete: list[int] = field(default_factory=list)  # whole uncommitted steps
    removed_attempts: list[str] = field(default_factory=list)  # dead attempts in kept steps
    aborted_uploads: int = 0


def _seq(attempt: str) -> int:
    tail = attempt.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


class _Judge:
    """Which uncommitted attempts are dead (see the module docstring)."""

    def __init__(self, storage: Storage, owner: Owner | None, commits: dict[int, str]) -> None:
        self.storage = storage
        self.owner = owner
        self.newest_step = max(commits, default=-1)
        mine = [a for a in commits.values() if owner is not None and attempt_run(a) == owner.run]
        self.newest_seq = max(map(_seq, mine), default=-1)

    def dead(self, step: int, attempt: str) -> bool:
        names = self.storage.list_dir(layout.partials_dir(step, attempt))
        if layout.FAILED in names or any(layout.is_rank_failure(n) for n in names):
            return True
        if self.owner is None:  # a root from before owner.json
            return step < self.newest_step
        if attempt_run(attempt) != self.owner.run:
            return True
        return _seq(attempt) <= self.newest_seq


def collect_garbage(
    storage: Storage, *, keep_last: int = 0, upload_min_age_s: float | None = None
) -> GcReport:
    """``ckptd gc``: retention (``keep_last`` > 0), then every dead attempt, then (object
    stores) abandoned uploads. ``upload_min_age_s`` defaults to ``config.gc_upload_min_age_s``
    or twice ``commit_timeout_s``, whichever is longer, and must exceed ``commit_timeout_s``."""
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
    uploads = storage = as_storage(storage)  # (a user's own object: with the defaults)
    commits = {c.step: c.attempt for c in committed(storage)}
    judge = _Judge(storage, read_owner(storage), commits)

    attempts: dict[int, set[str]] = {s: set() for s in all_steps(storage)}
    for s in attempts:
        for sub in ("data", "ranks"):
            attempts[s].update(storage.list_dir(f"{layout.step_dir(s)}/{sub}"))
    # an outage mid-upload can leave a step with nothing but uploads
    for path, _age in uploads.incomplete_uploads(""):
        parts = path.split("/")
        step = layout.parse_step_dir(parts[0])
        if step is not None and len(parts) > 2 and parts[1] == "data":
            attempts.setdefault(step, set()).add(parts[2])

    for step in sorted(attempts):
        keep = commits.get(step)
        dead = sorted(a for a in attempts[step] if a != keep and judge.dead(step, a))
        if keep is None and len(dead) == len(attempts[step]):
            report.aborted_uploads += uploads.abort_incomplete_uploads(layout.step_dir(step))
            storage.remove(layout.step_dir(step))
            report.removed_incomplete.append(step)
            continue
        for a in dead:
            for sub in ("data", "ranks"):
                where = f"{layout.step_dir(step)}/{sub}/{a}"
                report.aborted_uploads += uploads.abort_incomplete_uploads(where)
                storage.remove(where)
            report.removed_attempts.append(f"{layout.step_dir(step)}/{a}")
    report.aborted_uploads += uploads.abort_incomplete_uploads("", min_age_s=min_age)
    return report
