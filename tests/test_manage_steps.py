"""The manager surface: list, inspect and delete steps, retention policies (across a restart),
and the save policy (issue 36, item 2)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import multirank
import pytest
import torch

import ckptd
from ckptd.errors import CheckpointNotFound, CkptdError
from ckptd.storage.local import LocalStorage
from ckptd.writer import retention

if TYPE_CHECKING:
    from ckptd.policies import Candidate


def _steps_on_disk(root) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*"))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(value)),
            "b": torch.arange(6, dtype=torch.int32).view(2, 3)}


# --------------------------------------------------------------------------- steps, delete


def test_steps_lists_committed_steps_ascending_and_delete_removes_one(tmp_path):
    with ckptd.Checkpointer(str(tmp_path), keep_last=0) as c:
        assert c.steps() == []
        for s in (30, 10, 20):
            c.save(_state(s), step=s)
        assert c.steps() == [10, 20, 30]
        assert c.latest_step() == 30
        assert c.delete(10) is True
        assert c.steps() == [20, 30] and _steps_on_disk(tmp_path) == [20, 30]
        assert c.delete(10) is False  # already gone: not an error
        assert c.delete(99) is False  # never saved
        assert c.delete(30) is True and c.latest_step() == 20
        dst = _state(0.0)
        c.load(dst)
        assert torch.equal(dst["w"], _state(20)["w"])


def test_module_functions_manage_the_default_checkpointer(tmp_path):
    ckptd.init(str(tmp_path), keep_last=0)
    try:
        ckptd.save(_state(1.0), step=1, training={"loss": 0.5})
        ckptd.save(_state(2.0), step=2)
        assert ckptd.steps() == [1, 2]
        assert ckptd.metadata(1).training == {"loss": 0.5}
        assert ckptd.metadata().step == 2
        assert ckptd.delete(1) is True and ckptd.steps() == [2]
    finally:
        ckptd.checkpointer.default().close()
        ckptd.checkpointer.set_default(None)


def test_delete_after_retention_removed_the_step_is_no_error(tmp_path):
    with ckptd.Checkpointer(str(tmp_path), keep_last=0) as c:
        for s in (1, 2, 3):
            c.save(_state(s), step=s)
        # the retention of another writer of the root removes step 1 ...
        assert retention.apply_retention(LocalStorage(str(tmp_path)), 2) == [1]
        # ... and the caller deletes it too, and retention again after the delete
        assert c.delete(1) is False
        assert c.delete(2) is True
        assert retention.apply_retention(LocalStorage(str(tmp_path)), 1) == []
        assert c.steps() == [3]


class Gated(LocalStorage):
    """Data file writes wait until ``release`` is set: a save stays in flight."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def write_file(self, path, parts, gate=None):  # type: ignore[no-untyped-def]
        if "/data/" in path:
            assert self.release.wait(60)
        return super().write_file(path, parts, gate)


def test_delete_refuses_a_step_with_a_save_in_flight_and_a_read_only_checkpointer(tmp_path):
    storage = Gated(str(tmp_path))
    with ckptd.Checkpointer(str(tmp_path), storage=storage, keep_last=0) as c:
        storage.release.set()
        c.save(_state(1.0), step=1)
        storage.release.clear()
        handle = c.save_async(_state(2.0), step=2)
        try:
            with pytest.raises(CkptdError, match=r"step-000000002: a save of step 2 is in "
                                                 r"flight"):
                c.delete(2)
        finally:
            storage.release.set()
        handle.result()
        assert c.delete(2) is True
    with ckptd.Checkpointer(str(tmp_path), read_only=True) as reader:
        with pytest.raises(CkptdError, match="read-only"):
            reader.delete(1)
        assert reader.steps() == [1]


class DeleteOnFirstDataRead(LocalStorage):
    """A reader's storage: just before the load reads its first data file, another
    Checkpointer on the root deletes the step being loaded."""

    def __init__(self, root: str, deleter: ckptd.Checkpointer, step: int) -> None:
        super().__init__(root)
        self.deleter, self.step, self.fired = deleter, step, False

    def _fire(self, path: str) -> None:
        if "/data/" in path and not self.fired:
            self.fired = True
            assert self.deleter.delete(self.step) is True

    def open_read(self, paths: Sequence[str]):  # type: ignore[no-untyped-def]
        for p in paths:
            self._fire(p)
        return super().open_read(paths)

    def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
        self._fire(path)
        return super().read_ranges(path, ranges)


def test_a_load_of_a_step_deleted_under_it_fails_with_one_line_and_leaves_the_destination(
        tmp_path):
    root = str(tmp_path)
    with ckptd.Checkpointer(root, keep_last=0) as writer:
        writer.save(_state(1.0), step=1)
        writer.save(_state(2.0), step=2)
        storage = DeleteOnFirstDataRead(root, writer, 1)
        dst = _state(0.0)
        with ckptd.Checkpointer(root, storage=storage, read_only=True) as reader:
            with pytest.raises(CheckpointNotFound) as err:
                reader.load(dst, step=1)
        assert storage.fired
        assert "\n" not in str(err.value)
        assert "step-000000001: removed while it was being read" in str(err.value)
        assert torch.equal(dst["w"], torch.zeros(64))
        assert writer.steps() == [2]


# --------------------------------------------------------------------------- metadata


class RecordingReads(LocalStorage):
    """Records every path read (whole, ranged, or through a read session)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.read: list[str] = []

    def read_bytes(self, path):  # type: ignore[no-untyped-def]
        self.read.append(path)
        return super().read_bytes(path)

    def read_ranges(self, path, ranges):  # type: ignore[no-untyped-def]
        self.read.append(path)
        return super().read_ranges(path, ranges)

    def open_read(self, paths):  # type: ignore[no-untyped-def]
        self.read.extend(paths)
        return super().open_read(paths)


def test_metadata_shows_tensors_world_training_and_sizes_reading_only_the_manifest(tmp_path):
    state = {"model": {"w": torch.randn(8, 4), "emb": torch.zeros(3, dtype=torch.bfloat16)},
             "step": 7}
    with ckptd.Checkpointer(str(tmp_path), compression="zstd:1") as c:
        c.save(state, step=7, training={"loss": 1.25, "lr": [0.1, 0.01]})
    storage = RecordingReads(str(tmp_path))
    with ckptd.Checkpointer(str(tmp_path), storage=storage, read_only=True) as reader:
        storage.read.clear()
        meta = reader.metadata()
        again = reader.metadata(7)
    assert storage.read and all(p.endswith("/manifest.json") for p in storage.read), storage.read
    assert meta == again
    assert isinstance(meta, ckptd.StepMetadata)
    assert meta.step == 7 and meta.world_size == 1
    assert meta.url.endswith("/step-000000007")
    assert dict(meta.tensors) == {
        "model/w": ckptd.TensorMetadata("float32", (8, 4)),
        "model/emb": ckptd.TensorMetadata("bfloat16", (3,)),
    }
    assert meta.tensors["model/emb"].dtype == torch.bfloat16
    assert meta.tensors["model/w"].nbytes == 8 * 4 * 4
    assert meta.nbytes == 8 * 4 * 4 + 3 * 2  # before compression
    assert meta.training["loss"] == 1.25 and meta.training["lr"] == (0.1, 0.01)
    assert meta.created > 0
    # a read-only view
    with pytest.raises(TypeError):
        meta.training["loss"] = 0.0  # type: ignore[index]
    with pytest.raises(TypeError):
        meta.tensors["x"] = meta.tensors["model/w"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        meta.step = 8  # type: ignore[misc]


def test_metadata_of_a_missing_step_says_so(tmp_path):
    with ckptd.Checkpointer(str(tmp_path)) as c:
        with pytest.raises(CheckpointNotFound, match="no committed checkpoint"):
            c.metadata()
        c.save(_state(1.0), step=1)
        with pytest.raises(CheckpointNotFound, match="no committed step 5"):
            c.metadata(5)


# --------------------------------------------------------------------------- retention


def _cands(*steps: int, **losses: float) -> list[Candidate]:
    from ckptd.policies import Candidate

    return [Candidate(s, {"loss": losses[f"s{s}"]} if f"s{s}" in losses else {}) for s in steps]


def test_retention_policies_decide_and_compose():
    from ckptd.policies import from_json

    steps = _cands(50, 100, 150, 200, 250)
    assert ckptd.KeepLast(2).keep(steps) == {200, 250}
    assert ckptd.KeepEvery(100).keep(steps) == {100, 200}
    assert (ckptd.KeepLast(2) | ckptd.KeepEvery(100)).keep(steps) == {100, 200, 250}
    scored = _cands(1, 2, 3, 4, 5, s1=3.0, s2=1.0, s3=float("nan"), s4=2.0)
    assert ckptd.KeepBest(2, "loss").keep(scored) == {2, 4}
    assert ckptd.KeepBest(2, "loss", mode="max").keep(scored) == {1, 4}
    tied = _cands(1, 2, 3, s1=1.0, s2=1.0, s3=1.0)
    assert ckptd.KeepBest(1, "loss").keep(tied) == {3}  # the newer of equals
    policy = ckptd.KeepAny(ckptd.KeepLast(1), ckptd.KeepEvery(10) | ckptd.KeepBest(2, "loss"))
    assert len(policy.policies) == 3 and policy.metrics == {"loss"}
    assert from_json(policy.to_json()) == policy
    for bad in (lambda: ckptd.KeepLast(0), lambda: ckptd.KeepEvery(-1),
                lambda: ckptd.KeepBest(1, "loss", mode="lowest"), lambda: ckptd.KeepBest(1, "")):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="not both"):
        ckptd.Checkpointer("/nonexistent/root", keep_last=2, retention=ckptd.KeepLast(3))


def test_keep_the_last_two_and_every_100th_step_holds_across_a_restart(tmp_path):
    policy = ckptd.KeepLast(2) | ckptd.KeepEvery(100)
    with ckptd.Checkpointer(str(tmp_path), retention=policy, run_id="first") as c:
        assert c.retention == policy
        for s in (50, 100, 150, 200, 250):
            c.save(_state(s), step=s)
    assert _steps_on_disk(tmp_path) == [100, 200, 250]
    with ckptd.Checkpointer(str(tmp_path), retention=policy, run_id="second") as c:
        for s in (300, 350):
            c.save(_state(s), step=s)
    assert _steps_on_disk(tmp_path) == [100, 200, 300, 350]


def test_keep_the_best_two_by_loss_holds_across_a_restart(tmp_path):
    policy = ckptd.KeepBest(2, "loss")
    with ckptd.Checkpointer(str(tmp_path), retention=policy, run_id="first") as c:
        for s, loss in ((1, 4.0), (2, 1.0), (3, 3.0), (4, 2.0)):
            c.save(_state(s), step=s, training={"loss": loss})
    # the best two (2, 4); the newest (4) is always kept
    assert _steps_on_disk(tmp_path) == [2, 4]
    # a new process: the losses of steps 2 and 4 come from their manifests
    with ckptd.Checkpointer(str(tmp_path), retention=policy, run_id="second") as c:
        c.save(_state(5), step=5, training={"loss": 1.5})
        c.save(_state(6), step=6, training={"loss": 5.0})
        c.save(_state(7), step=7)  # no loss: kept while newest only
        c.save(_state(8), step=8, training={"loss": 9.0})
    assert _steps_on_disk(tmp_path) == [2, 5, 8]


def test_keep_last_stays_a_shorthand_and_zero_keeps_every_step(tmp_path):
    with ckptd.Checkpointer(str(tmp_path / "a"), keep_last=2) as c:
        assert c.retention == ckptd.KeepLast(2)
        for s in range(4):
            c.save(_state(s), step=s)
    assert _steps_on_disk(tmp_path / "a") == [2, 3]
    with ckptd.Checkpointer(str(tmp_path / "b"), keep_last=0) as c:
        assert c.retention is None
        for s in range(4):
            c.save(_state(s), step=s)
    assert _steps_on_disk(tmp_path / "b") == [0, 1, 2, 3]
    with ckptd.Checkpointer(str(tmp_path / "c")) as c:
        assert c.retention == ckptd.KeepLast(3)


def test_the_agent_job_carries_the_retention_policy():
    from ckptd.agent import jobs
    from ckptd.writer.job import CommitParams

    policy = ckptd.KeepLast(2) | ckptd.KeepBest(1, "loss", mode="max")
    doc = {"run_id": "r", "generation": 1, "overwrite": False, "incarnation": "r"}
    assert jobs._retention({**doc, "keep_last": 0, "retention": policy.to_json()}) == policy
    assert jobs._retention({**doc, "keep_last": 4}) == ckptd.KeepLast(4)  # an older trainer
    assert jobs._retention({**doc, "keep_last": 0}) is None
    with pytest.raises(CkptdError, match="agent job: not a retention policy"):
        jobs._retention({**doc, "keep_last": 0, "retention": {"last": 1, "x": 2}})
    assert CommitParams("r", 1, False, policy, "r").retention == policy


# --------------------------------------------------------------------------- save policy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_save_every_n_steps_or_t_seconds(monkeypatch):
    from ckptd.elastic import save_policy

    clock = Clock()
    monkeypatch.setattr(save_policy, "time", clock)
    policy = ckptd.SaveEvery(steps=100, seconds=60, on_preemption=False)
    due = []
    for step in range(1, 301):
        clock.now += 1.0  # one second a step
        if policy.should_save(step):
            due.append(step)
    # every 60 s from the first call (step 1), and the clock restarts at every save
    assert due == [61, 100, 160, 200, 260, 300]
    with pytest.raises(ValueError):
        ckptd.SaveEvery(steps=0)
    with pytest.raises(ValueError):
        ckptd.SaveEvery(on_preemption=False)


@pytest.mark.usefixtures("clean_sigterm")
def test_save_every_saves_once_on_preemption():
    policy = ckptd.SaveEvery(steps=100)  # installs the SIGTERM handler
    assert [s for s in range(1, 6) if policy.should_save(s)] == []
    os.kill(os.getpid(), signal.SIGTERM)  # handled before os.kill returns (main thread)
    assert [s for s in range(6, 12) if policy.should_save(s)] == [6]
    assert ckptd.preempted()
    assert policy.should_save(100)


def test_checkpointer_should_save_asks_its_policy_and_never_resaves_its_last_step(tmp_path):
    with ckptd.Checkpointer(str(tmp_path), keep_last=0) as c:
        with pytest.raises(CkptdError, match="save_policy=ckptd.SaveEvery"):
            c.should_save(1)
    policy = ckptd.SaveEvery(steps=2, on_preemption=False)
    with ckptd.Checkpointer(str(tmp_path), save_policy=policy) as c:
        saved = []
        for step in range(1, 6):
            if c.should_save(step):
                c.save(_state(step), step=step)
                saved.append(step)
        assert saved == [2, 4] and c.steps() == [2, 4]
    with ckptd.Checkpointer(str(tmp_path), save_policy=policy) as c:
        c.load(_state(0.0))  # resume at step 4
        assert [s for s in range(4, 7) if c.should_save(s)] == [6]


def _ranks_agree(rank: int, world: int) -> list[int]:
    from ckptd.elastic import save_policy

    clock = Clock()
    save_policy.time = clock  # type: ignore[assignment]  # (this process only)
    policy = ckptd.SaveEvery(seconds=25, on_preemption=True)
    due = []
    for step in range(1, 13):
        if rank == 1:  # only rank 1's clock moves; only rank 1 is preempted, at step 9
            clock.now += 10.0
            if step == 9:
                os.kill(os.getpid(), signal.SIGTERM)
        if policy.should_save(step):
            due.append(step)
    return due


def test_save_every_gives_every_rank_the_same_answer_from_one_ranks_clock_and_signal():
    # rank 1 is due by its clock at steps 4 and 7 (10 s a step, 25 s from the first call or
    # the last save), by its SIGTERM at step 9 (once), then by its clock at 12; rank 0 saw
    # neither, and saves the same steps
    assert multirank.run(_ranks_agree, 2) == [[4, 7, 9, 12], [4, 7, 9, 12]]


def test_delete_leaves_a_step_that_is_not_committed_alone(tmp_path):
    with ckptd.Checkpointer(str(tmp_path), keep_last=0) as c:
        c.save(_state(1.0), step=1)
    # another writer's save of step 2, under way: its files but no manifest yet
    (tmp_path / "step-000000002" / "data" / "other-000001").mkdir(parents=True)
    (tmp_path / "step-000000002" / "data" / "other-000001" / "r00000-0.bin").write_bytes(b"x")
    with ckptd.Checkpointer(str(tmp_path), keep_last=0) as c:
        assert c.delete(2) is False
        assert c.steps() == [1]
    assert (tmp_path / "step-000000002" / "data" / "other-000001" / "r00000-0.bin").exists()
