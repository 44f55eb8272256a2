"""A Checkpointer is cheap to construct: the root is opened (the run id agreed, the node agent
joined, the root claimed and the previous owner's complete attempts committed) by the first call
that needs it, or by ``open()`` / ``with``; once, whichever threads and ranks get there."""

from __future__ import annotations

import os
import threading

import multirank
import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd.manifest import layout as L
from ckptd.storage.base import Storage
from ckptd.storage.local import LocalStorage

_METHODS = sorted(n for n, v in vars(Storage).items() if callable(v) and not n.startswith("_"))


class CountingStorage(LocalStorage):
    """The local backend, recording every call of the storage contract."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []
        self._calls_lock = threading.Lock()


def _counted(name: str):  # type: ignore[no-untyped-def]
    def call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with self._calls_lock:
            self.calls.append((name, str(args[0]) if args else ""))
        return getattr(LocalStorage, name)(self, *args, **kwargs)

    return call


for _name in _METHODS:
    setattr(CountingStorage, _name, _counted(_name))


def _w(v: float) -> dict:
    return {"w": torch.full((4,), float(v))}


def _owner(root: str) -> str:
    with open(os.path.join(root, L.OWNER)) as f:
        return f.read()


@pytest.fixture
def left_behind(tmp_path) -> str:
    """A root whose owner ("first") committed step 1 and died after every share of step 2 was
    durable, before committing it."""
    root = str(tmp_path / "root")
    with ckptd.Checkpointer(root, rank=0, world_size=1, run_id="first", keep_last=0,
                            agent=False) as c:
        c.save(_w(1), step=1)
        c.save(_w(2), step=2)
    os.remove(os.path.join(root, L.manifest_path(2)))
    return root


@pytest.mark.parametrize("first_use", ["latest_step", "load", "save", "open", "with"])
def test_constructing_touches_no_storage_and_the_first_use_finishes_the_previous_owner(
        left_behind, first_use):
    root = left_behind
    storage = CountingStorage(root)
    c = ckptd.Checkpointer(root, rank=0, world_size=1, run_id="second", keep_last=0,
                           storage=storage)
    assert storage.calls == []
    assert not os.path.exists(os.path.join(root, L.manifest_path(2)))
    assert '"first"' in _owner(root)
    try:
        if first_use == "latest_step":
            assert c.latest_step() == 2
        elif first_use == "load":
            dst = _w(0)
            assert c.load(dst).step == 2 and torch.equal(dst["w"], torch.full((4,), 2.0))
        elif first_use == "save":
            c.save(_w(3), step=3)
        elif first_use == "open":
            assert c.open() is c
        else:
            with c as opened:
                assert opened is c
    finally:
        c.close()
    # exactly as a constructor that opened at once did: step 2 committed in the previous
    # owner's name, then the root taken over
    assert os.path.exists(os.path.join(root, L.manifest_path(2)))
    assert '"second"' in _owner(root)
    assert [p for op, p in storage.calls if op == "put_atomic" and p == L.OWNER] == [L.OWNER]
    with ckptd.Checkpointer(root, read_only=True) as reader:
        assert reader.latest_step() == (3 if first_use == "save" else 2)


def test_open_from_many_threads_at_once_opens_once(left_behind):
    storage = CountingStorage(left_behind)
    c = ckptd.Checkpointer(left_behind, rank=0, world_size=1, run_id="second",
                           storage=storage)
    assert storage.calls == []
    start = threading.Barrier(8)
    seen: list[int | None] = []

    def first_use() -> None:
        start.wait()
        seen.append(c.latest_step())

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.close()
    assert seen == [2] * 8  # every thread saw the previous owner's attempt committed
    assert [p for op, p in storage.calls if op == "put_atomic" and p == L.OWNER] == [L.OWNER]


def test_an_open_that_failed_raises_again_and_does_not_retry(tmp_path):
    class Unclaimable(CountingStorage):
        def put_atomic(self, path: str, data: bytes) -> None:
            if path == L.OWNER:
                raise ckptd.StorageError(f"{path}: read-only file system (EROFS)")
            super().put_atomic(path, data)

    storage = Unclaimable(str(tmp_path))
    c = ckptd.Checkpointer(str(tmp_path), rank=0, world_size=1, storage=storage)
    with pytest.raises(ckptd.StorageError, match="EROFS"):
        c.latest_step()
    claims = len(storage.calls)
    with pytest.raises(ckptd.CkptdError, match="could not open its root: .*EROFS"):
        c.save(_w(1), step=1)
    assert len(storage.calls) == claims
    c.close()


def test_a_checkpointer_starts_no_agent_until_its_first_use(tmp_path, agents):
    c = ckptd.Checkpointer(str(tmp_path), rank=0, world_size=1, agent=True)
    try:
        with pytest.raises(FileNotFoundError):
            agents.pid()  # none ever started
        c.save(_w(1), step=1)
        assert c.executor == "agent"
        assert agents.pid() > 0
    finally:
        c.close()


def _first_calls_differ(rank: int, world: int, root: str) -> str:
    c = ckptd.Checkpointer(root, keep_last=0, agent=False)
    if rank == 0:
        assert c.latest_step() is None  # opens: the same collective as rank 1's save makes
    c.save(_w(rank), step=1)
    if rank == 0:  # a reader on one rank alone: nothing of it is collective
        with ckptd.Checkpointer(root, read_only=True) as reader:
            assert reader.latest_step() == 1
    dist.barrier()
    c.close()
    return c.run_id


def test_ranks_whose_first_calls_differ_open_together_and_a_lone_reader_opens_alone(tmp_path):
    ids = multirank.run(_first_calls_differ, 2, str(tmp_path), timeout=60)
    assert ids[0] == ids[1]
