"""Who may commit what, and in which order: commit order over step numbers, no commits by
readers, a rank's failure known everywhere at once, an advisory `latest`, immutable steps."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import resource
import signal
import threading
import time

import multirank
import pytest
import torch
from faulty_storage import FailAfterBytes, KillAtOp

import ckptd
from ckptd import catalog, config
from ckptd.errors import CkptdError, ForeignWriter, StorageError
from ckptd.manifest import layout as L
from ckptd.storage.local import LocalStorage
from ckptd.writer import commit as C
from ckptd.writer import retention


def _w(v: float, n: int = 4) -> dict:
    return {"w": torch.full((n,), float(v))}


def _load_w(root: str, n: int = 4, **kw) -> tuple[int, torch.Tensor]:
    dst = {"w": torch.zeros(n)}
    with ckptd.Checkpointer(root, read_only=True) as c:
        step = c.load(dst, **kw).step
    return step, dst["w"]


# ----------------------------------------------------------------------------- commit order
def test_a_new_run_with_a_fresh_step_counter_keeps_its_steps_and_is_latest(tmp_path):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="old", keep_last=3) as old:
        for s in (998, 999, 1000):
            old.save(_w(s), step=s)
    with ckptd.Checkpointer(root, run_id="new", keep_last=3) as new:
        for s in (1, 2, 3):
            new.save(_w(s), step=s)
            # the step just reported committed is still there, and it is the newest
            assert os.path.exists(tmp_path / L.manifest_path(s))
            assert new.latest_step() == s
    assert catalog.committed_steps(LocalStorage(root)) == [1, 2, 3]  # the old run's rotated
    step, w = _load_w(root)
    assert step == 3 and torch.equal(w, torch.full((4,), 3.0))


def test_retention_orders_by_owner_generation_then_step(tmp_path):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="a", keep_last=0) as a:
        a.save(_w(10), step=10)
    with ckptd.Checkpointer(root, run_id="b", keep_last=0) as b:
        b.save(_w(2), step=2)
    with ckptd.Checkpointer(root, run_id="c", keep_last=2) as c:
        c.save(_w(5), step=5)  # order: a/10, b/2, c/5 -> keep b/2 and c/5
    storage = LocalStorage(root)
    assert [(x.generation, x.step) for x in catalog.committed(storage)] == [(2, 2), (3, 5)]
    assert catalog.read_owner(storage) == catalog.Owner("c", 3, catalog.read_owner(storage).since)


# ----------------------------------------------------------------------------- no reader commits
def _uncommit(root: str, step: int) -> None:
    """What a coordinator that died after every partial was durable leaves behind."""
    os.remove(os.path.join(root, L.manifest_path(step)))


class _MarkerFails(LocalStorage):
    """Once ``full``, the FAILED marker cannot be written (a disk that filled up)."""

    full = False

    def put_atomic(self, path: str, data: bytes) -> None:
        if self.full and path.endswith(L.FAILED):
            raise StorageError(f"{path}: disk full (ENOSPC)")
        super().put_atomic(path, data)


def test_a_reader_never_commits_a_foreign_jobs_complete_attempt(tmp_path):
    root = str(tmp_path)
    disk = _MarkerFails(root)  # (a storage object: job a saves in process)
    a = ckptd.Checkpointer(root, run_id="job-a", keep_last=0, storage=disk)
    a.save(_w(1), step=1)
    b = ckptd.Checkpointer(root, run_id="job-b", keep_last=0).open()  # takes the root over
    b.save(_w(2), step=2)
    # job a's step 3: complete, its coordinator refused, and the FAILED marker it writes lost
    # (so its share stays, as a coordinator's that died would)
    disk.full = True
    with pytest.raises(ForeignWriter):
        a.save(_w(666), step=3)
    attempt = next(iter(os.listdir(tmp_path / L.step_dir(3) / "ranks")))
    assert os.listdir(tmp_path / L.partials_dir(3, attempt)) == ["00000.json"]
    with ckptd.Checkpointer(root, read_only=True) as tool:
        for _ in range(3):
            assert tool.latest_step() == 2
    assert C.finalize(LocalStorage(root), 3) is None  # not the owner's attempt
    assert not os.path.exists(tmp_path / L.manifest_path(3))
    dst = _w(0)
    assert b.load(dst).step == 2 and torch.equal(dst["w"], torch.full((4,), 2.0))
    a.close()
    b.close()


class _ManifestAndMarkerFail(LocalStorage):
    """A disk that fills up right at the commit: the manifest and the FAILED marker fail."""

    def put_atomic(self, path: str, data: bytes) -> None:
        if path.endswith((L.MANIFEST, L.FAILED)):
            raise StorageError(f"{path}: disk full (ENOSPC)")
        super().put_atomic(path, data)


def test_a_save_whose_commit_failed_is_not_committed_by_the_next_reader(tmp_path):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="j") as c:
        c.save(_w(1), step=1)
    c = ckptd.Checkpointer(root, run_id="j", storage=_ManifestAndMarkerFail(root))
    with pytest.raises(StorageError, match="disk full"):
        c.save(_w(2), step=2)
    c.close()
    with ckptd.Checkpointer(root, read_only=True) as reader:
        assert reader.latest_step() == 1
    step, w = _load_w(root)
    assert step == 1 and torch.equal(w, torch.full((4,), 1.0))
    assert not os.path.exists(tmp_path / L.manifest_path(2))


@pytest.mark.parametrize("restart_id", ["restarted", "first"], ids=["new-id", "same-id"])
def test_a_new_owner_commits_its_predecessors_last_complete_step_when_it_takes_over(
    tmp_path, restart_id
):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="first", keep_last=0) as c:
        c.save(_w(1), step=1)
        c.save(_w(2), step=2)
    _uncommit(root, 2)  # its coordinator died after every share was durable
    with ckptd.Checkpointer(root, read_only=True) as reader:
        assert reader.latest_step() == 1  # a reader commits nothing
    # a writer takes over: a new run, or the same run id again (a requeued job)
    with ckptd.Checkpointer(root, run_id=restart_id) as c:
        assert c.latest_step() == 2
        dst = _w(0)
        assert c.load(dst).step == 2 and torch.equal(dst["w"], torch.full((4,), 2.0))


# ----------------------------------------------------------------------------- failures
def _fsize_limited_rank(rank: int, world: int, root: str, bad_rank: int) -> tuple[str, float]:
    """Each rank saves its half of a 4 MiB tensor; ``bad_rank`` cannot write files > 64 KiB."""
    torch.set_num_threads(1)
    if rank == bad_rank:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    n = 1 << 20
    # in process whatever the suite's executor: the fault is this process's own file-size limit
    ck = ckptd.Checkpointer(root, keep_last=0, agent=False)
    state = {"w": ckptd.Shard(torch.full((n // world,), float(rank)), (n,), (rank * n // world,))}
    t0 = time.monotonic()
    try:
        ck.save(state, step=1)
    except CkptdError as e:
        return str(e), time.monotonic() - t0
    finally:
        ck.close()  # the error was raised once, above: close() does not raise it again
    return "committed", time.monotonic() - t0


@pytest.mark.parametrize("bad_rank", [1, 0], ids=["a-non-coordinator", "the-coordinator"])
def test_one_ranks_failed_write_reaches_every_rank_in_seconds_naming_it(tmp_path, bad_rank):
    # The default commit timeout is 600 s: an answer in well under a minute can only come from
    # the failure being published, not from a timeout.
    assert config.get().commit_timeout_s >= 600
    out = multirank.run(_fsize_limited_rank, 2, str(tmp_path), bad_rank, timeout=240)
    bad_message, _ = out[bad_rank]
    good_message, good_s = out[1 - bad_rank]
    data = f"{tmp_path}/{L.step_dir(1)}/data/"
    assert bad_message.startswith(data) and bad_message.endswith(": File too large")
    assert good_message == (
        f"step 1 was not committed: rank {bad_rank} failed: StorageError: {bad_message}"
    )
    assert good_s < 60, good_s
    assert not os.path.exists(tmp_path / L.manifest_path(1))


def test_a_corrupt_partial_fails_the_step_before_the_other_ranks_finish(tmp_path):
    """The coordinator decodes each partial as it finds it: a malformed one fails the attempt
    (and its FAILED marker stops the other ranks' waits) while a rank is still writing."""
    st = LocalStorage(str(tmp_path))
    attempt = "job-000001"
    with ckptd.Checkpointer(str(tmp_path / "src"), run_id="job") as c:
        c.save(_w(1.0), step=1)
        good = LocalStorage(str(tmp_path / "src"))
        name = next(n for n in good.list_dir(L.partials_dir(1, c.read_manifest(1).attempt))
                    if L.is_partial(n))
        raw = good.read_bytes(f"{L.partials_dir(1, c.read_manifest(1).attempt)}/{name}")
    st.put_atomic(L.partial_path(1, attempt, 0), raw)
    st.put_atomic(L.partial_path(1, attempt, 1), b'{"not": "a partial"')  # rank 2: not yet
    with pytest.raises(ckptd.CorruptCheckpoint, match="00001.json"):
        C.coordinate(st, 1, attempt, 3, "job", timeout_s=5.0)
    assert L.FAILED in st.list_dir(L.partials_dir(1, attempt))
    assert not st.exists(L.manifest_path(1))


def test_a_failed_share_is_visible_through_storage_alone(tmp_path):
    """No process group (no store): the failure record on storage carries it."""
    root = str(tmp_path)
    ranks = [
        ckptd.Checkpointer(
            root, rank=r, world_size=2, run_id="sim", keep_last=0,
            storage=FailAfterBytes(root, 1000, errno.ENOSPC) if r == 1 else None,
        )
        for r in range(2)
    ]
    t0 = time.monotonic()
    handles = [
        c.save_async({"w": ckptd.Shard(torch.ones(1 << 16), (1 << 17,), (r << 16,))}, step=4)
        for r, c in enumerate(ranks)
    ]
    with pytest.raises(StorageError, match="disk full"):
        handles[1].result(timeout=120)
    with pytest.raises(StorageError) as err:
        handles[0].result(timeout=120)
    assert time.monotonic() - t0 < 60
    assert str(err.value).startswith("step 4 was not committed: rank 1 failed: StorageError: ")
    assert "disk full (ENOSPC)" in str(err.value)
    attempt = os.listdir(tmp_path / L.step_dir(4) / "ranks")[0]
    assert os.path.exists(tmp_path / L.rank_failed_path(4, attempt, 1))
    for c in ranks:
        c.close()  # (the save thread cleans up after it delivered the error)
    # the step failed for good: rank 0's share, written and in no commit's reach, is removed
    # at once (it would otherwise fill the disk the next save needs)
    data = tmp_path / L.step_dir(4) / "data" / attempt
    assert not os.path.exists(data) or os.listdir(data) == []
    assert not os.path.exists(tmp_path / L.partial_path(4, attempt, 0))


# ----------------------------------------------------------------------------- a reused run id
class _HoldPartial(LocalStorage):
    """Holds rank 0's partial manifest until ``go``: a save in flight, its data written."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reached, self.go = threading.Event(), threading.Event()

    def put_atomic(self, path: str, data: bytes) -> None:
        if "/ranks/" in path and path.endswith(".json"):
            self.reached.set()
            assert self.go.wait(60)
        super().put_atomic(path, data)


def test_a_restart_that_reuses_its_run_id_keeps_its_save_in_flight_from_gc(tmp_path):
    """A scheduler's job id as run id, the same after a requeue: the restart's attempts must
    not look older than its predecessor's, or ``ckptd gc`` removes a save in flight."""
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="job-42", keep_last=0) as first:
        for s in (1, 2, 3):
            first.save(_w(s), step=s)
    held = _HoldPartial(root)
    again = ckptd.Checkpointer(root, run_id="job-42", storage=held, keep_last=0)
    try:
        h = again.save_async(_w(4), step=4)
        assert held.reached.wait(60)
        report = retention.collect_garbage(LocalStorage(root))
    finally:
        held.go.set()
    assert h.result().step == 4
    again.close()
    assert report.removed_incomplete == [] and report.removed_attempts == [], report
    attempts = [catalog.read_manifest(LocalStorage(root), s).attempt for s in (3, 4)]
    assert attempts[0] != attempts[1] and retention._seq(attempts[1]) > retention._seq(attempts[0])
    step, w = _load_w(root)
    assert step == 4 and torch.equal(w, torch.full((4,), 4.0))


def _reuse_run_id(rank: int, world: int, root: str) -> list[str]:
    attempts = []
    for incarnation in range(2):  # the same run id twice, as after a requeue
        with ckptd.Checkpointer(root, run_id="job-7", keep_last=0) as c:
            r = c.save({"w": ckptd.Shard(torch.full((4,), float(incarnation)), (8,), (4 * rank,))},
                       step=incarnation + 1)
            attempts.append(c.read_manifest(r.step).attempt)
    return attempts


def test_ranks_agree_on_new_attempt_names_when_a_run_id_is_reused(tmp_path):
    a, b = multirank.run(_reuse_run_id, 2, str(tmp_path), timeout=180)
    assert a == b, "every rank's share in the same attempt (else nothing commits)"
    assert a[0] != a[1] and retention._seq(a[1]) > retention._seq(a[0])


# ----------------------------------------------------------------------------- latest, immutability
class _LatestFails(LocalStorage):
    def put_atomic(self, path: str, data: bytes) -> None:
        if path == L.LATEST:
            raise StorageError(f"{path}: disk full (ENOSPC)")
        super().put_atomic(path, data)


def test_a_step_is_committed_even_when_the_advisory_latest_cannot_be_written(tmp_path, caplog):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="j", storage=_LatestFails(root)) as c:
        result = c.save(_w(7), step=7)
    assert result.step == 7
    assert "advisory latest was not moved" in caplog.text
    attempt = os.listdir(tmp_path / L.step_dir(7) / "ranks")[0]
    assert not os.path.exists(tmp_path / L.failed_path(7, attempt))
    assert _load_w(root)[0] == 7


def test_saving_a_committed_step_again_is_an_error_on_every_rank_unless_overwrite(tmp_path):
    root = str(tmp_path)
    ranks = [ckptd.Checkpointer(root, rank=r, world_size=2, run_id="j") for r in range(2)]

    def save(v: float, **kw):
        hs = [c.save_async({"w": ckptd.Shard(torch.full((2,), v), (4,), (2 * r,))}, step=5, **kw)
              for r, c in enumerate(ranks)]
        return hs

    for h in save(1.0):
        h.result()
    for h in save(2.0):
        with pytest.raises(CkptdError, match=r"step 5 is already committed .*immutable.*"
                                             r"overwrite=True"):
            h.result()
    assert _load_w(root)[1].tolist() == [1.0] * 4
    for h in save(3.0, overwrite=True):
        h.result()
    assert _load_w(root)[1].tolist() == [3.0] * 4
    step_dir = tmp_path / L.step_dir(5)
    manifest_attempt = catalog.read_manifest(LocalStorage(root), 5).attempt
    assert os.listdir(step_dir / "data") == [manifest_attempt]  # the old attempts' files went
    assert os.listdir(step_dir / "ranks") == [manifest_attempt]
    for c in ranks:
        c.close()


# ----------------------------------------------------------------------------- gc
def _killed_save(root: str, kill_at: int) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    with config.override(min_file_bytes=1 << 14):
        c = ckptd.Checkpointer(root, run_id="killed", storage=KillAtOp(root, kill_at), threads=2)
        c.save({"w": torch.ones(1 << 18)}, step=2)


def _files(root) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    }


def test_gc_removes_what_no_manifest_names_and_no_save_can_still_commit(tmp_path):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, run_id="first", keep_last=0) as c:
        c.save({"w": torch.zeros(1 << 18)}, step=1)
    # a save SIGKILLed in the middle of its data file: its bytes stay in step 2's directory
    p = mp.get_context("fork").Process(target=_killed_save, args=(root, 2))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    leaked = {f for f in _files(root) if "/killed-" in f}
    assert leaked and all(f.startswith(L.step_dir(2)) for f in leaked)
    with ckptd.Checkpointer(root, run_id="second", keep_last=0) as c:
        c.save({"w": torch.full((1 << 18,), 2.0)}, step=2)  # commits step 2 beside the leak
        c.save({"w": torch.full((1 << 18,), 3.0)}, step=3)
        failing = ckptd.Checkpointer(root, run_id="second", keep_last=0,
                                     storage=FailAfterBytes(root, 1000, errno.ENOSPC))
        with pytest.raises(StorageError):
            failing.save({"w": torch.full((1 << 18,), 4.0)}, step=4)  # the newest step fails
        failing.close()
    assert os.path.isdir(tmp_path / L.step_dir(4))
    storage = LocalStorage(root)
    named = {
        f"{L.step_dir(s)}/{f}"
        for s in (1, 2, 3)
        for t in catalog.read_manifest(storage, s).tensors.values()
        for c in t.chunks
        for f in (c.file, c.ref.table)
    }
    report = retention.collect_garbage(storage)
    assert report.removed_incomplete == [4]
    assert [a.split("/")[0] for a in report.removed_attempts] == [L.step_dir(2)]
    left = {f for f in _files(root) if "/data/" in f}
    assert left == named  # every data file (and frame table) left is one a manifest names
    for s in (1, 2, 3):
        dst = {"w": torch.zeros(1 << 18)}
        with ckptd.Checkpointer(root, read_only=True) as r:
            r.load(dst, step=s)
        assert torch.equal(dst["w"], torch.full((1 << 18,), float(s if s > 1 else 0)))
