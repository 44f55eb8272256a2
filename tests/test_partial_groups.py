"""Ranks of one attempt that one process writes at the same time share a frame table
(``ckptd.writer.partial_groups``, the node agent's group write): eight ranks, each a
Checkpointer of its own in a thread of this process, save through the same ``Groups``; the
first rank's table write is held until the seven others queue behind it."""

from __future__ import annotations

import threading

import pytest
import torch
from agent_procs import wait_until

import ckptd
from ckptd import catalog
from ckptd.storage.local import LocalStorage
from ckptd.writer import executor, partial_groups
from ckptd.writer import job as job_module

W = 8


class _HeldTable(LocalStorage):
    """The first frame table written waits for ``release``; ``fail``: every table fails."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.tables: list[str] = []
        self.fail = False
        self._lock = threading.Lock()

    def write_file(self, path, parts, gate=None):  # type: ignore[no-untyped-def]
        if path.endswith(".frames"):
            with self._lock:
                self.tables.append(path)
                first = len(self.tables) == 1
            if first:
                assert self.release.wait(60)
            if self.fail:
                raise OSError(28, "No space left on device", path)
        return super().write_file(path, parts, gate)


def _state(rank: int) -> dict[str, object]:
    return {f"w{i}": ckptd.Shard(torch.full((4, 8), float(10 * rank + i)), (4 * W, 8),
                                 (4 * rank, 0)) for i in range(3)}


def _save_all(root: str, storage: _HeldTable, groups: partial_groups.Groups,
              monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    """Every rank's save of step 1, each in its own thread; the first table held until the
    seven other ranks queue behind it. What each rank's save raised (None: committed)."""
    real_run = job_module.run

    def run(*a, **k):  # type: ignore[no-untyped-def]
        return real_run(*a, **k, groups=groups)

    monkeypatch.setattr(executor, "run", run)
    out: list[BaseException | None] = [None] * W

    def rank(r: int) -> None:
        try:
            with ckptd.Checkpointer(root, rank=r, world_size=W, run_id="g", agent=False,
                                    storage=storage) as c:
                c.save(_state(r), step=1)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    wait_until(lambda: (sum(len(q) for q in groups._queues.values()) == W - 1
                        or any(e is not None for e in out)), 60,
               "seven ranks to queue behind the first")
    assert out == [None] * W, out  # (none failed before its table)
    storage.release.set()
    for t in threads:
        t.join(120)
    return out


def test_the_ranks_that_queue_behind_a_write_share_one_table_and_load_back(
        tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    storage = _HeldTable(root)
    assert _save_all(root, storage, partial_groups.Groups(), monkeypatch) == [None] * W
    # the first rank alone, then one table for the seven behind it
    assert len(storage.tables) == 2
    m = catalog.read_manifest(LocalStorage(root), 1)
    tables = {ch.ref.table for e in m.tensors.values() for ch in e.chunks if ch.ref}
    assert {f"step-000000001/{t}" for t in tables} == set(storage.tables)
    with ckptd.Checkpointer(root, agent=False) as c:
        for r in range(W):  # every rank's slices of its table check out, each its own value
            got = {k: torch.zeros(4, 8) for k in ("w0", "w1", "w2")}
            c.load({k: ckptd.Shard(v, (4 * W, 8), (4 * r, 0)) for k, v in got.items()},
                   step=1)
            for i in range(3):
                assert torch.equal(got[f"w{i}"], torch.full((4, 8), float(10 * r + i)))


def test_a_failed_shared_table_fails_every_rank_of_its_group_and_commits_nothing(
        tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    storage = _HeldTable(root)
    storage.fail = True
    errors = _save_all(root, storage, partial_groups.Groups(), monkeypatch)
    # two writes failed: the first rank's, and the one its seven followers shared
    assert len(storage.tables) == 2
    assert all(e is not None and "No space left" in str(e) for e in errors), errors
    assert not LocalStorage(root).exists("step-000000001/manifest.json")
