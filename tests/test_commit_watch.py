"""The commit protocol's waits end when what they wait for appears, not a pause later: on a
filesystem a :class:`~ckptd.storage.watch.Watch` (inotify) cuts the pause between two polls
short. The tests make every pause two minutes long, so only the watch can end a wait in time."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time

import pytest
import torch

import ckptd
from ckptd import config
from ckptd.storage import watch
from ckptd.storage.local import LocalStorage

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's")

LONG = dict(poll_min_s=120.0, poll_max_s=120.0, poll_idle_max_s=120.0, commit_timeout_s=600.0)


def _later(fn) -> threading.Thread:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=fn)
    t.start()
    return t


def test_a_name_renamed_into_a_watched_directory_ends_the_wait(tmp_path):
    st = LocalStorage(str(tmp_path))
    st.put_atomic("d/first", b"1")
    with st.watch(["d", "missing"]) as w:
        assert w is not None
        assert not w.wait(0.05)  # nothing new since the watch began
        writer = _later(lambda: st.put_atomic("d/second", b"2"))
        assert w.wait(60.0)
        writer.join()
        # a temporary name (an atomic write's first half) is not news
        with open(tmp_path / "d" / "x.tmp-0123abcd", "wb"):
            pass
        assert not w.wait(0.1)
    with st.watch(["missing"]) as w:
        assert w is None  # nothing to watch: the waiter just polls


def test_two_waits_on_one_directory_each_see_the_change(tmp_path):
    st = LocalStorage(str(tmp_path))
    st.put_atomic("d/first", b"1")
    with st.watch(["d"]) as a, st.watch(["d"]) as b:
        assert a is not None and b is not None
        st.put_atomic("d/second", b"2")
        assert a.wait(60.0) and b.wait(60.0)
    with st.watch(["d"]) as c:  # the first two removed their watch; a third one still works
        assert c is not None
        st.put_atomic("d/third", b"3")
        assert c.wait(60.0)


def _child(root: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    st = LocalStorage(root)
    with st.watch(["d"]) as w:
        st.put_atomic("d/child", b"c")
        out.put(w is not None and w.wait(60.0))


def test_a_forked_child_watches_with_its_own_instance(tmp_path):
    st = LocalStorage(str(tmp_path))
    st.put_atomic("d/first", b"1")
    with st.watch(["d"]) as w:  # the parent's instance and reader thread exist
        assert w is not None
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        p = ctx.Process(target=_child, args=(str(tmp_path), out))
        p.start()
        assert out.get(timeout=120) is True
        p.join(timeout=120)
        assert p.exitcode == 0


def _two_ranks(root: str) -> list[ckptd.Checkpointer]:
    return [ckptd.Checkpointer(root, rank=r, world_size=2, run_id="job", agent=False)
            for r in range(2)]


def test_the_coordinator_and_a_waiting_rank_learn_at_once_with_two_minute_pauses(tmp_path):
    cs = _two_ranks(str(tmp_path))
    with config.override(**LONG):
        # rank 0 first: its commit waits for rank 1's partial; then rank 1 waits for the commit
        h0 = cs[0].save_async({"w": ckptd.Shard(torch.zeros(2), (4,), (0,))}, step=1)
        h1 = cs[1].save_async({"w": ckptd.Shard(torch.ones(2), (4,), (2,))}, step=1)
        h0.result(timeout=60)  # without the watch: a pause of 60-120 s, then TimeoutError
        h1.result(timeout=60)
    out = {"w": torch.full((4,), 7.0)}
    with ckptd.Checkpointer(str(tmp_path), agent=False) as ck:
        ck.load(out)
    assert torch.equal(out["w"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    for c in cs:
        c.close()


def test_without_inotify_the_waits_poll_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "_notifier", None)
    monkeypatch.setattr(watch, "_failed", True)  # as when the user's instances are used up
    st = LocalStorage(str(tmp_path))
    st.put_atomic("d/first", b"1")
    with st.watch(["d"]) as w:
        assert w is None
    cs = _two_ranks(str(tmp_path))
    with config.override(poll_min_s=0.001, poll_max_s=0.01):
        hs = [c.save_async({"w": ckptd.Shard(torch.full((2,), float(r)), (4,), (2 * r,))},
                           step=1) for r, c in enumerate(cs)]
        for h in hs:
            h.result(timeout=120)
    assert cs[0].latest_step() == 1
    for c in cs:
        c.close()
    assert os.path.exists(tmp_path / "step-000000001" / "manifest.json")


def test_a_watch_of_a_local_filesystem_is_complete_and_wake_all_ends_its_wait(tmp_path):
    st = LocalStorage(str(tmp_path))
    st.put_atomic("d/first", b"1")
    with open("/proc/self/mounts") as f:
        mounts = [line.split() for line in f]
    fs = max((m for m in mounts if str(tmp_path).startswith(m[1].rstrip("/") + "/")),
             key=lambda m: len(m[1]))[2]
    with st.watch(["d"]) as w:
        assert w is not None
        # every change of a local filesystem is this node's: the kernel reports each one
        assert w.complete == (fs in ("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs",
                                     "zfs", "overlay")), fs
        ended: list[bool] = []
        waiter = _later(lambda: ended.append(w.wait(120.0)))
        while waiter.is_alive():  # the process begins exiting: every paused wait checks now
            watch.wake_all()
            waiter.join(0.01)
        assert ended == [False]  # ended early, with nothing new


def test_a_watch_for_some_names_is_not_woken_by_others(tmp_path):
    st = LocalStorage(str(tmp_path))
    st.put_atomic("d/first", b"1")
    with st.watch(["d"], ["manifest.json", "FAILED"]) as named, st.watch(["d"]) as every:
        assert named is not None and every is not None
        st.put_atomic("d/00001.json", b"{}")  # another rank's partial
        assert every.wait(60.0)
        assert not named.wait(0.1)
        st.put_atomic("d/FAILED", b"{}")
        assert named.wait(60.0)


class _Complete:
    """A complete watch that records the pauses it is asked for (and reports nothing)."""

    complete = True

    def __init__(self) -> None:
        self.pauses: list[float] = []

    def wait(self, timeout_s: float) -> bool:
        self.pauses.append(timeout_s)
        return False


def test_with_a_complete_watch_the_first_pause_is_already_the_longest(tmp_path):
    """Every change wakes a complete watch: a poll on a timer can only find what the process
    group's store alone carries, so the waits do not start with the storage's 1 ms pauses."""
    from ckptd.writer.commit import Poller

    st = LocalStorage(str(tmp_path))
    with config.override(poll_min_s=0.001, poll_max_s=0.05):
        complete = _Complete()
        poller = Poller(st, 60.0, watch=complete)
        assert poller.wait()
        assert 0.025 <= complete.pauses[0] <= 0.05  # drawn in [1/2, 1] of the longest
        partial = _Complete()
        partial.complete = False  # a shared filesystem: another node's change is not seen
        poller = Poller(st, 60.0, watch=partial)
        assert poller.wait()
        assert partial.pauses[0] <= 0.001


class _CountedStore:
    """A real c10d TCPStore (127.0.0.1), counting the requests made to it."""

    def __init__(self) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
        self.calls: list[str] = []

    def __getattr__(self, op: str):  # type: ignore[no-untyped-def]
        self.calls.append(op)
        return getattr(self._store, op)


def test_with_a_complete_watch_a_commit_on_storage_is_learnt_without_asking_the_store(tmp_path):
    """A waiting rank woken by the manifest's rename checks storage first: the store's answer
    is a request to the coordinator's process, busy finishing that commit. Without a complete
    watch (an object store, a shared filesystem) the store is still asked first."""
    from ckptd.writer.commit import wait_committed
    from ckptd.writer.group_store import GroupStore

    root = str(tmp_path)
    with ckptd.Checkpointer(root, agent=False) as ck:
        ck.save({"w": torch.ones(3)}, step=1)
    st = LocalStorage(root)
    attempt = json.loads(st.read_bytes("step-000000001/manifest.json"))["attempt"]
    counted = _CountedStore()
    wait_committed(st, 1, attempt, GroupStore(counted))
    assert counted.calls == []
    monkeypatched = pytest.MonkeyPatch()
    monkeypatched.setattr(watch, "_notifier", None)
    monkeypatched.setattr(watch, "_failed", True)
    try:
        wait_committed(st, 1, attempt, GroupStore(counted))
    finally:
        monkeypatched.undo()
    assert counted.calls == ["check"]


def test_only_a_rename_reaches_the_reader_thread(tmp_path):
    """A file created in a watched directory (an atomic write's temporary, a data file) is not
    read as an event: only the rename that makes a name appear is."""
    st = LocalStorage(str(tmp_path))
    st.put_atomic("d/first", b"1")
    with st.watch(["d"]) as w:
        assert w is not None
        n = watch._get_existing()
        assert n is not None
        before = n.events
        for i in range(5):
            with open(tmp_path / "d" / f"made-{i}", "wb"):
                pass
        st.put_atomic("d/second", b"2")  # a temporary created, then renamed
        assert w.wait(60.0)
        assert n.events - before == 1  # events come in order: the created ones came first


def _uncommitted(tmp_path) -> tuple[LocalStorage, str, bytes, str]:  # type: ignore[no-untyped-def]
    """Step 1 saved, then its manifest removed (not committed yet, as far as a waiter can
    tell): the storage, the manifest's path and bytes, the attempt."""
    from ckptd.manifest import layout

    root = str(tmp_path)
    with ckptd.Checkpointer(root, agent=False) as ck:
        ck.save({"w": torch.ones(3)}, step=1)
    st = LocalStorage(root)
    path = layout.manifest_path(1)
    raw = st.read_bytes(path)
    os.remove(tmp_path / path)
    return st, path, raw, json.loads(raw)["attempt"]


def test_a_waiting_rank_is_not_woken_by_the_other_ranks_partials(tmp_path):
    """wait_committed watches the step's directory for the manifest; the partials' directory
    (where the coordinator's FAILED marker would be) takes every rank's partial, and each woke
    every waiting process."""
    from ckptd.manifest import layout
    from ckptd.writer.commit import wait_committed

    st, path, raw, attempt = _uncommitted(tmp_path)
    n = watch._get()
    assert n is not None
    before = n.events
    done: list[BaseException | None] = []

    def wait() -> None:
        try:
            wait_committed(st, 1, attempt)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            done.append(e)

    waiter = _later(wait)
    while not n._wds and waiter.is_alive():  # its watch is in place
        time.sleep(0.001)
    for r in range(1, 5):  # the other ranks' partials land beside the FAILED marker's place
        st.put_visible(f"{layout.partials_dir(1, attempt)}/{r:05d}.json", b"{}")
    st.put_atomic(path, raw)  # the commit
    waiter.join(60.0)
    assert done == [None]
    assert n.events - before <= 1  # the manifest's rename (before: 2 per partial, and 2)


def test_with_a_complete_watch_a_wait_woken_by_storage_asks_the_store_nothing(tmp_path):
    """A waiting rank whose wait the manifest's rename ends, and a coordinator whose waits the
    partials end, make no request to the process group's store (served by the coordinator's
    process): it carries only what storage could not take, asked after a pause the watch did
    not end."""
    from ckptd.writer.commit import coordinate, wait_committed
    from ckptd.writer.group_store import GroupStore

    st, path, raw, attempt = _uncommitted(tmp_path)
    n = watch._get()
    assert n is not None
    counted = _CountedStore()
    with config.override(**LONG):  # only the watch ends a pause in time
        waiter = _later(lambda: wait_committed(st, 1, attempt, GroupStore(counted)))
        while not n._wds and waiter.is_alive():  # its watch is in place
            time.sleep(0.001)
        st.put_atomic(path, raw)
        waiter.join(60.0)
        assert not waiter.is_alive()
        assert counted.calls == []
        # the coordinator: its partials are all there; it merges and commits (again)
        coordinate(st, 1, attempt, 1, attempt.rpartition("-")[0], signals=GroupStore(counted),
                   overwrite=True)
    assert counted.calls == ["set"]  # the commit published, nothing asked
