"""The commit: merging partials into ``manifest.json``, waiting for it, finalising, retention.

No collectives: the coordinator learns that every rank is done by finding their partial
manifests on storage, and the other ranks learn that the step is committed by finding the
manifest (of *their* attempt) — or a ``FAILED`` marker with the coordinator's reason.
"""

from __future__ import annotations

import json
import time

from ckptd import config, errors
from ckptd.errors import CkptdError, CorruptCheckpoint, ForeignWriter
from ckptd.manifest import Manifest, decode, merge
from ckptd.manifest import layout as L
from ckptd.storage import Storage


def _poll(deadline: float, delay: float) -> float:
    if time.monotonic() > deadline:
        raise TimeoutError
    time.sleep(delay)
    return min(delay * 2, config.get().poll_max_s)


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
        deadline = time.monotonic() + config.get().commit_timeout_s
        delay = config.get().poll_min_s
        d = L.partials_dir(step, attempt)
        while True:
            present = [n for n in storage.list_dir(d) if n.endswith(".json")]
            if len(present) >= world_size:
                break
            try:
                delay = _poll(deadline, delay)
            except TimeoutError:
                have = sorted(int(n[:-5]) for n in present)
                missing = sorted(set(range(world_size)) - set(have))
                raise CkptdError(
                    f"step {step}: ranks {missing} did not finish their share within "
                    f"{config.get().commit_timeout_s:.0f}s; not committed"
                ) from None
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
    deadline = time.monotonic() + config.get().commit_timeout_s
    delay = config.get().poll_min_s
    path = L.manifest_path(step)
    while True:
        if storage.exists(path):
            try:
                m = decode(storage.read_bytes(path), path)
            except (FileNotFoundError, CorruptCheckpoint):
                m = None  # replaced under our feet by retention/another commit: look again
            if m is not None and m.attempt == attempt:
                return m
        error = _failed_error(storage, step, attempt)
        if error is not None:
            raise error
        try:
            delay = _poll(deadline, delay)
        except TimeoutError:
            raise CkptdError(
                f"step {step}: no commit after {config.get().commit_timeout_s:.0f}s "
                "(coordinator dead?)"
            ) from None


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


def gc_incomplete(storage: Storage) -> list[int]:
    """Remove step directories without a manifest that are older than the newest commit."""
    committed = committed_steps(storage)
    if not committed:
        return []
    newest = committed[-1]
    doomed = [s for s in all_steps(storage) if s < newest and s not in committed]
    for s in doomed:
        storage.remove(L.step_dir(s))
    return doomed
